"""Divergence flags in `polytrain compare` (issue 16.6): which rows, which cause, how shown."""

from __future__ import annotations

import csv
import json
import math

import pytest

from polytrain.compare.divergence import likely_causes, relative_difference
from polytrain.compare.runner import BackendResult, flag_divergence, format_table, write_results
from polytrain.errors import ConfigError


def result(backend, loss, val_loss=0.5, val_accuracy=0.8, framework="torch", **settings):
    return BackendResult(
        backend,
        losses=[2.0, loss],
        epoch_times_s=[1.0, 1.0],
        samples_per_s=[100.0, 100.0],
        val_loss=val_loss,
        val_accuracy=val_accuracy,
        framework=framework,
        settings={"use_fp16": False, **settings},
    )


def test_equal_results_are_not_flagged():
    results = [result("ddp", 1.0), result("horovod", 1.0), result("fsdp", 1.0 + 1e-7)]
    assert flag_divergence(results) == []
    assert [r.vs_reference() for r in results] == ["ref", "+0.0%", "+0.0%"]
    assert all(r.reference_backend == "ddp" and not r.diverges for r in results)


def test_clipping_is_named_as_the_likely_cause():
    ddp = result("ddp", 1.0)
    ds = result(
        "deepspeed",
        1.06,
        **{"backend_config.stage": 2, "backend_config.config.gradient_clipping": 1.0},
    )
    assert flag_divergence([ddp, ds]) == [ds]
    (div,) = ds.divergences
    assert (div.metric, div.reference_backend, div.value, div.reference) == (
        "final_loss",
        "ddp",
        1.06,
        1.0,
    )
    assert div.relative == pytest.approx(0.06)
    assert ds.divergence_note() == (
        "final loss 1.06 vs ddp 1 (+6.0%). likely cause: gradient clipping "
        "(backend_config.config.gradient_clipping=1.0)"
    )
    assert ds.vs_reference() == "+6.0% !"


@pytest.mark.parametrize(
    ("settings", "cause"),
    [
        ({"use_fp16": True}, "precision (use_fp16=True)"),
        ({"backend_config.compression": "fp16"}, "precision (backend_config.compression=fp16)"),
        (
            {"backend_config.config.bf16.enabled": True},
            "precision (backend_config.config.bf16.enabled=True)",
        ),
        ({"backend_config.op": "sum"}, "loss reduction (backend_config.op=sum)"),
    ],
)
def test_each_kind_of_setting_is_recognised(settings, cause):
    assert likely_causes({"use_fp16": False, **settings}) == [cause]


def test_default_settings_are_not_causes():
    defaults = {
        "use_fp16": False,
        "backend_config.compression": "none",
        "backend_config.op": "average",
        "backend_config.config.gradient_clipping": 0.0,
        "backend_config.mixed_precision": None,
        "backend_config.stage": 2,
    }
    assert likely_causes(defaults) == []
    ddp, other = result("ddp", 1.0), result("fairscale", 1.1, **defaults)
    flag_divergence([ddp, other])
    assert other.divergence_hint.startswith("usual causes: precision")
    assert (
        "gradient clipping" in other.divergence_hint and "loss reduction" in other.divergence_hint
    )


def test_tolerance_validation_metrics_and_failed_rows():
    failed = BackendResult("ddp", status="failed", reason="boom")
    ref, close = result("horovod", 1.0), result("fsdp", 1.015, val_accuracy=0.7)
    flag_divergence([failed, ref, close])
    assert close.reference_backend == "horovod"  # the first backend that ran
    assert [d.metric for d in close.divergences] == ["val_accuracy"]  # 1.5 % loss is within 2 %
    flag_divergence([failed, ref, close], tolerance=0.01)
    assert [d.metric for d in close.divergences] == ["final_loss", "val_accuracy"]
    assert failed.reference_backend is None and failed.vs_reference() == "-"
    with pytest.raises(ConfigError, match="tolerance must be a relative difference >= 0"):
        flag_divergence([ref], tolerance=-0.1)


def test_frameworks_are_compared_within_themselves_and_nan_is_flagged():
    ddp, mwms = result("ddp", 1.0), result("mwms", 1.5, framework="tensorflow")
    nan = result("horovod", math.nan)
    assert flag_divergence([ddp, mwms, nan]) == [nan]
    assert mwms.reference_backend == "mwms" and mwms.vs_reference() == "ref"
    assert nan.vs_reference() == "n/a !"
    assert relative_difference(0.0, 0.0) == 0.0 and math.isinf(relative_difference(1.0, 0.0))


def test_table_csv_and_json_mark_the_row(tmp_path):
    ddp = result("ddp", 1.0)
    hvd = result("horovod", 1.2, **{"backend_config.op": "sum"})
    flag_divergence([ddp, hvd])
    table = format_table([ddp, hvd])
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["backend", "status"] and "framework  vs ref" in lines[0]
    assert lines[3].startswith("horovod") and "+20.0% !" in lines[3]
    assert lines[-1] == (
        "! horovod: final loss 1.2 vs ddp 1 (+20.0%). likely cause: loss reduction "
        "(backend_config.op=sum)"
    )
    paths = write_results([ddp, hvd], tmp_path)
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [(r["backend"], r["framework"], r["diverges"]) for r in rows] == [
        ("ddp", "torch", "False"),
        ("horovod", "torch", "True"),
    ]
    assert "loss reduction" in rows[1]["divergence"]
    data = json.loads(paths["json"].read_text())
    assert data[1]["divergences"][0]["metric"] == "final_loss"
    assert data[1]["divergence_hint"].startswith("likely cause")
