"""polytrain.loggers (issue 16.1): each built-in logger writes with the real library, read back.

TensorBoard is read with tensorboard's EventAccumulator, MLflow with its client on
the local store, W&B from the offline run's record file, CSV with the csv module.
"""

from __future__ import annotations

import ast
import csv
import glob
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from polytrain.errors import ConfigError, ConfigTypeError, PolytrainError
from polytrain.loggers import (
    CSVLogger,
    Logger,
    LoggerError,
    LoggerSet,
    flatten_params,
    resolve_loggers,
    scalar_metrics,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

RUN_INFO = {
    "config": {"lr": 0.1, "batch_size": 64, "layers": [64, 10], "schedule": None},
    "backend": "ddp",
    "num_workers": 2,
    "framework": "torch",
}
TRAIN = [
    {"epoch": 0, "loss": 1.5, "num_samples": 1437, "samples_per_s": 900.0, "note": "x"},
    {"epoch": 1, "loss": 0.7, "num_samples": 1437, "samples_per_s": 950.0, "note": "x"},
]
VAL = [{"val_loss": 1.2, "val_accuracy": 0.6}, {"val_loss": 0.6, "val_accuracy": 0.85}]
STEPS = [23, 46]


def drive(loggers: LoggerSet) -> None:
    """What a trainer does: start once, train + validate twice, finish."""
    loggers.start(RUN_INFO)
    for epoch, (train, val, step) in enumerate(zip(TRAIN, VAL, STEPS, strict=True)):
        loggers.log_metrics(train, step=step, epoch=epoch, prefix="train")
        loggers.log_metrics(val, step=step, epoch=epoch, prefix="val")
    loggers.finish()


# ------------------------------------------------------------------- helpers
def test_scalar_metrics_names_and_filters():
    metrics = {"epoch": 3, "loss": 0.5, "val_loss": 0.4, "ok": True, "tag": "a", "n": 7}
    assert scalar_metrics(metrics, "train") == {
        "train/loss": 0.5,
        "train/val_loss": 0.4,
        "train/n": 7.0,
    }
    assert scalar_metrics({"val_loss": 0.4, "val_accuracy": 0.9}, "val") == {
        "val/loss": 0.4,
        "val/accuracy": 0.9,
    }


def test_flatten_params_gives_plain_values():
    flat = flatten_params(RUN_INFO)
    assert flat == {
        "config/lr": 0.1,
        "config/batch_size": 64,
        "config/layers": "[64, 10]",
        "config/schedule": "None",
        "backend": "ddp",
        "num_workers": 2,
        "framework": "torch",
    }


# ---------------------------------------------------------------- resolution
def test_resolve_names_instances_and_strings(tmp_path):
    mine = CSVLogger(tmp_path / "mine")
    loggers = resolve_loggers(["csv", mine, "tensorboard"], tmp_path)
    assert [type(lg).__name__ for lg in loggers] == ["CSVLogger", "CSVLogger", "TensorBoardLogger"]
    assert loggers[0].path == tmp_path / "metrics.csv" and loggers[1] is mine
    assert [lg.name for lg in resolve_loggers("csv, tensorboard", tmp_path)] == [
        "csv",
        "tensorboard",
    ]
    assert resolve_loggers(None, tmp_path) == [] and resolve_loggers([], tmp_path) == []
    assert not tmp_path.joinpath("tensorboard").exists()  # nothing written before start()


def test_resolve_rejects_bad_values(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"Unknown logger 'tensorbord'.*tensorboard, mlflow, wandb, csv.*Did you mean 'tensorboard'",
    ):
        resolve_loggers(["tensorbord"], tmp_path)
    with pytest.raises(ConfigError, match="more than once"):
        resolve_loggers("csv,csv", tmp_path)
    with pytest.raises(ConfigTypeError, match="int"):
        resolve_loggers(42, tmp_path)
    with pytest.raises(ConfigTypeError, match="neither a logger name"):
        resolve_loggers(["csv", 3.5], tmp_path)


class Recorder(Logger):
    name = "recorder"

    def __init__(self, fail_in: str | None = None):
        self.calls: list[tuple] = []
        self.fail_in = fail_in

    def start(self, run_info):
        self.calls.append(("start", run_info))
        if self.fail_in == "start":
            raise OSError("disk full")

    def log_metrics(self, metrics, step, epoch, prefix):
        self.calls.append(("log", prefix, step, epoch, metrics))

    def finish(self):
        self.calls.append(("finish",))
        if self.fail_in == "finish":
            raise OSError("connection lost")


def test_logger_set_drives_a_custom_logger_once_per_run():
    recorder = Recorder()
    loggers = LoggerSet([recorder])
    drive(loggers)
    loggers.start({"again": True})  # a second start does not record again
    loggers.finish()
    kinds = [c[0] for c in recorder.calls]
    assert kinds == ["start", "log", "log", "log", "log", "finish"]
    assert recorder.calls[0][1] == RUN_INFO
    assert recorder.calls[2] == ("log", "val", 23, 0, VAL[0])
    with pytest.raises(LoggerError, match="after finish"):
        loggers.log_metrics({"loss": 1.0}, step=1, epoch=0, prefix="train")


def test_logger_set_starts_on_first_log_and_reports_failures():
    recorder = Recorder()
    loggers = LoggerSet(recorder)
    loggers.log_metrics({"val_loss": 1.0}, step=0, epoch=0, prefix="val")
    assert recorder.calls[0] == ("start", {})
    with pytest.raises(
        LoggerError, match=r"Recorder \('recorder'\) failed in start\(\): OSError: disk full"
    ):
        LoggerSet([Recorder(fail_in="start")]).start(RUN_INFO)
    failing, other = Recorder(fail_in="finish"), Recorder()
    both = LoggerSet([failing, other])
    both.start(RUN_INFO)
    with pytest.raises(LoggerError, match="connection lost") as info:
        both.finish()
    assert isinstance(info.value, PolytrainError)
    assert other.calls[-1] == ("finish",)  # finished although the first one failed


# ------------------------------------------------------------------ built-ins
def test_csv_logger_writes_rows_and_hparams(tmp_path):
    drive(LoggerSet(["csv"], log_dir=tmp_path))
    with (tmp_path / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], r["epoch"]) for r in rows] == [
        ("23", "0"),
        ("23", "0"),
        ("46", "1"),
        ("46", "1"),
    ]
    assert float(rows[0]["train/loss"]) == 1.5 and rows[0]["val/loss"] == ""
    assert float(rows[3]["val/accuracy"]) == 0.85 and float(rows[2]["train/samples_per_s"]) == 950.0
    assert "train/note" not in rows[0]
    assert yaml.safe_load((tmp_path / "hparams.yaml").read_text())["config/lr"] == 0.1


def test_tensorboard_logger_writes_scalars_and_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    drive(LoggerSet(["tensorboard"], log_dir=tmp_path))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    assert scalars["train/loss"] == [(23, 1.5), (46, pytest.approx(0.7))]
    assert scalars["val/accuracy"] == [(23, pytest.approx(0.6)), (46, pytest.approx(0.85))]
    assert scalars["epoch"] == [(23, 0.0), (46, 1.0)]
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["config/lr"].number_value == pytest.approx(0.1)
    assert hparams["backend"].string_value == "ddp"
    assert hparams["num_workers"].number_value == 2


def test_mlflow_logger_writes_to_a_local_store(tmp_path):
    from mlflow.tracking import MlflowClient

    from polytrain.loggers import MLflowLogger

    logger = MLflowLogger(save_dir=tmp_path, run_name="digits-ddp")
    drive(LoggerSet([logger]))
    assert logger.tracking_uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    client = MlflowClient(tracking_uri=logger.tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "digits-ddp"
    assert run.data.params["config/lr"] == "0.1" and run.data.params["backend"] == "ddp"
    assert run.data.params["framework"] == "torch" and run.data.params["num_workers"] == "2"
    history = client.get_metric_history(logger.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(23, 1.5), (46, 0.7)]
    val = client.get_metric_history(logger.run_id, "val/accuracy")
    assert [(m.step, m.value) for m in val] == [(23, 0.6), (46, 0.85)]
    epochs = client.get_metric_history(logger.run_id, "epoch")
    assert sorted({(m.step, m.value) for m in epochs}) == [(23, 0.0), (46, 1.0)]


def _wandb_records(path: Path):
    """The records of a W&B run file (LevelDB log framing: 32 KiB blocks, 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def test_wandb_logger_offline_run(tmp_path, monkeypatch):
    import wandb

    from polytrain.loggers import WandbLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = WandbLogger(save_dir=tmp_path, name="digits-ddp")
    assert logger.mode == "offline"  # no key configured: never online by surprise
    try:
        drive(LoggerSet([logger]))
    finally:
        wandb.teardown()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config = [], {}
    for record in _wandb_records(Path(run_file)):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "run":
            assert record.run.display_name == "digits-ddp"
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    assert config["config"]["lr"] == 0.1 and config["backend"] == "ddp"
    assert config["num_workers"] == 2
    rows = [(h["_step"], h["epoch"], h["train/loss"], h["val/loss"]) for h in history]
    assert rows == [(23, 0, 1.5, 1.2), (46, 1, 0.7, 0.6)]


# ------------------------------------------------------------------- layering
def test_loggers_import_only_the_ground_floor_and_no_tracker_at_import():
    allowed = ("polytrain.errors", "polytrain.compat", "polytrain.loggers")
    for path in (REPO_ROOT / "polytrain" / "loggers").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("polytrain"):
                    assert name.startswith(allowed), f"{path.name} imports {name}"
    code = (
        "import sys, polytrain.loggers as l; l.resolve_loggers('csv,tensorboard,mlflow,wandb', '/tmp');"
        "print(sorted(m for m in ('mlflow', 'wandb', 'tensorboard', 'tensorboardX') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
