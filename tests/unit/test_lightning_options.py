"""ray_lightning's options, without Ray: resources folding, DDP keyword arguments, init_hook, names."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from polytrain.backends.core.ddp_signature import ddp_parameters
from polytrain.backends.ddp.config import DDPConfig
from polytrain.backends.registry import get_backend
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.scaling import ScalingConfig


# ------------------------------------------------------------ ScalingConfig
def test_cpu_entry_sets_cpus_and_threads():
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 3, "accelerator": 1})
    assert scaling.num_cpus_per_worker == 3
    assert scaling.resources_per_worker == {"accelerator": 1}  # only custom resources stay
    assert scaling.worker_bundle() == {"CPU": 3.0, "accelerator": 1}
    from polytrain.backends.core.context import WorkerContext

    assert WorkerContext.from_scaling(scaling).num_cpus == 3  # the worker's torch threads


def test_gpu_entry_turns_gpu_use_on_and_off():
    on = ScalingConfig(num_workers=2, resources_per_worker={"GPU": 1})
    assert on.use_gpu is True and on.gpus_per_worker == 1.0
    assert on.worker_bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert on.resources_per_worker is None
    off = ScalingConfig(num_workers=2, resources_per_worker={"GPU": 0})
    assert off.use_gpu is False and off.gpus_per_worker == 0.0
    assert off.worker_bundle() == {"CPU": 1.0}


def test_num_gpus_per_worker_fractional_or_several():
    with pytest.warns(UserWarning, match="workers share GPUs"):
        half = ScalingConfig(num_workers=2, num_gpus_per_worker=0.5)
    assert half.use_gpu is True and half.worker_bundle() == {"CPU": 1.0, "GPU": 0.5}
    two = ScalingConfig(num_workers=2, num_gpus_per_worker=2)
    assert two.use_gpu is True and two.worker_bundle()["GPU"] == 2.0
    assert ScalingConfig(use_gpu=True).worker_bundle() == {"CPU": 1.0, "GPU": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ScalingConfig(num_workers=1, num_gpus_per_worker=0.5)  # one worker shares nothing
    # Turning use_gpu off again (a Tune trial key) leaves no GPU in the bundle.
    assert dataclasses.replace(ScalingConfig(use_gpu=True), use_gpu=False).worker_bundle() == {
        "CPU": 1.0
    }


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"num_cpus_per_worker": 2, "resources_per_worker": {"CPU": 3}}, "disagree"),
        ({"use_gpu": True, "resources_per_worker": {"GPU": 0}}, "use_gpu=True but"),
        ({"use_gpu": True, "num_gpus_per_worker": 0}, "use_gpu=True but"),
        ({"num_gpus_per_worker": 2, "resources_per_worker": {"GPU": 1}}, "disagree"),
        ({"resources_per_worker": {"CPU": -1}}, r"resources_per_worker\['CPU'\]"),
        ({"num_gpus_per_worker": -1}, "num_gpus_per_worker must be a number"),
        ({"resources_per_worker": ["CPU"]}, "must be a dict of Ray resource names"),
    ],
)
def test_conflicting_or_bad_resources_are_config_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        ScalingConfig(**values)


def test_same_value_twice_is_fine():
    scaling = ScalingConfig(num_cpus_per_worker=3, resources_per_worker={"CPU": 3})
    assert scaling.num_cpus_per_worker == 3
    assert ScalingConfig(num_gpus_per_worker=1, resources_per_worker={"GPU": 1}).use_gpu


# ------------------------------------------------------------ DDPConfig
def test_ddp_kwargs_pass_through_with_the_flags():
    config = DDPConfig(find_unused_parameters=True, ddp_kwargs={"bucket_cap_mb": 5})
    assert config.wrap_kwargs() == {"find_unused_parameters": True, "bucket_cap_mb": 5}
    assert DDPConfig().wrap_kwargs() == {}  # DDP's own defaults
    backend = get_backend("ddp", {"ddp_kwargs": {"static_graph": True, "init_sync": False}})
    assert backend.config.wrap_kwargs() == {"static_graph": True, "init_sync": False}


def test_unknown_ddp_kwarg_names_it_and_lists_the_valid_ones():
    with pytest.raises(
        ConfigTypeError, match=r"'bucket_cap'.*did you mean 'bucket_cap_mb'"
    ) as info:
        DDPConfig(ddp_kwargs={"bucket_cap": 5})
    assert "find_unused_parameters" in str(info.value)  # the valid ones are listed
    assert "bucket_cap_mb" in ddp_parameters()


@pytest.mark.parametrize("key", ["module", "device_ids", "output_device", "process_group"])
def test_ddp_kwargs_polytrain_sets_are_refused(key):
    with pytest.raises(ConfigTypeError, match=rf"'{key}' cannot be given: polytrain sets it"):
        DDPConfig(ddp_kwargs={key: None})


def test_flag_and_ddp_kwarg_for_the_same_option_conflict():
    with pytest.raises(ConfigError, match="set twice: find_unused_parameters=True"):
        DDPConfig(find_unused_parameters=True, ddp_kwargs={"find_unused_parameters": False})
    with pytest.raises(ConfigError, match="set twice: sync_buffers=False"):
        DDPConfig(sync_buffers=False, ddp_kwargs={"broadcast_buffers": True})
    with pytest.raises(ConfigTypeError, match="must be a dict"):
        DDPConfig(ddp_kwargs=[("bucket_cap_mb", 5)])
    with pytest.raises(ConfigTypeError, match="static_graph must be True, False or None"):
        DDPConfig(static_graph="yes")


# ------------------------------------------------------------ Lightning strategies
pl = pytest.importorskip("pytorch_lightning")


def test_strategy_passes_ddp_kwargs_to_the_ddp_backend():
    from polytrain.lightning import RayStrategy

    strategy = RayStrategy(num_workers=2, find_unused_parameters=True, bucket_cap_mb=5)
    assert strategy.backend.config.ddp_kwargs == {
        "find_unused_parameters": True,
        "bucket_cap_mb": 5,
    }
    merged = RayStrategy(bucket_cap_mb=5, backend_config={"ddp_kwargs": {"static_graph": True}})
    assert merged.backend.config.ddp_kwargs == {"static_graph": True, "bucket_cap_mb": 5}


def test_strategy_ddp_kwargs_errors():
    from polytrain.lightning import RayHorovodStrategy, RayStrategy

    with pytest.raises(ConfigTypeError, match=r"'bucket_cap'.*Valid ones.*RayStrategy's own"):
        RayStrategy(bucket_cap=5)
    with pytest.raises(TypeError, match=r"'num_worker' \(did you mean 'num_workers'\?\)"):
        RayStrategy(num_worker=2)
    with pytest.raises(TypeError, match="backend 'horovod' does not use"):
        RayHorovodStrategy(find_unused_parameters=True)
    with pytest.raises(ConfigError, match=r"\['bucket_cap_mb'\] given both"):
        RayStrategy(bucket_cap_mb=5, backend_config={"ddp_kwargs": {"bucket_cap_mb": 4}})
    with pytest.raises(ConfigError, match="set twice"):
        RayStrategy(find_unused_parameters=True, backend_config={"find_unused_parameters": False})
    with pytest.raises(ConfigTypeError, match="'process_group' cannot be given"):
        RayStrategy(process_group=None)


def test_strategy_resources_and_explicit_conflicts():
    from polytrain.lightning import RayStrategy

    strategy = RayStrategy(num_workers=2, resources_per_worker={"CPU": 2, "GPU": 0})
    assert strategy.num_cpus_per_worker == 2 and strategy.use_gpu is False
    assert strategy._context_template().num_cpus == 2
    assert RayStrategy(num_gpus_per_worker=2).use_gpu is True
    # An option given explicitly that the resources contradict: here it is known to be explicit.
    with pytest.raises(ConfigError, match=r"use_gpu=False disagrees with resources_per_worker"):
        RayStrategy(use_gpu=False, resources_per_worker={"GPU": 1})
    with pytest.raises(ConfigError, match="num_cpus_per_worker=1 disagrees"):
        RayStrategy(scaling_config={"num_cpus_per_worker": 1, "resources_per_worker": {"CPU": 3}})


def test_init_hook_must_be_callable():
    from polytrain.lightning import RayStrategy

    assert RayStrategy(init_hook=print).init_hook is print
    with pytest.raises(ConfigTypeError, match=r"init_hook=...\) must be a function.*got str"):
        RayStrategy(init_hook="print")


def test_ray_lightning_names():
    import polytrain.lightning as lightning
    from polytrain.tune import tune_resources

    assert lightning.HorovodRayStrategy is lightning.RayHorovodStrategy
    assert {"HorovodRayStrategy", "get_tune_resources", "TuneReportCheckpointCallback"} <= set(
        lightning.__all__
    )
    pytest.importorskip("ray.tune")
    plain = lightning.get_tune_resources(num_workers=2, num_cpus_per_worker=2, use_gpu=False)
    assert plain.bundles == tune_resources(num_workers=2, num_cpus_per_worker=2).bundles
    assert plain.bundles == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}]
    folded = lightning.get_tune_resources(2, resources_per_worker={"CPU": 3, "GPU": 1, "x": 1})
    assert folded.bundles[1:] == [{"CPU": 3.0, "GPU": 1.0, "x": 1}] * 2
    shared = lightning.get_tune_resources(1, num_gpus_per_worker=0.5)
    assert shared.bundles == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 0.5}]
    with pytest.raises(ConfigError, match="num_workers must be an int >= 1"):
        lightning.get_tune_resources(num_workers=0)


def test_tune_callbacks_arguments():
    from polytrain.lightning import TuneReportCallback, TuneReportCheckpointCallback

    callback = TuneReportCheckpointCallback(
        {"acc": "val_accuracy"}, "model.ckpt", "train_epoch_end"
    )
    assert callback._filename == "model.ckpt" and callback._on == ("train_epoch_end",)
    both = TuneReportCallback(on=["validation_end", "train_batch_end"])
    assert both._on == ("validation_end", "train_batch_end")
    with pytest.raises(ConfigError, match="on='epoch_end' is not supported"):
        TuneReportCheckpointCallback(on="epoch_end")
    with pytest.raises(ConfigError, match="filename must be a plain file name"):
        TuneReportCheckpointCallback(filename="dir/checkpoint")


def test_lightning_cli_accepts_ddp_kwargs_and_init_hook(monkeypatch):
    pytest.importorskip("jsonargparse")
    from pytorch_lightning.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["train.py"])

    from examples.lightning_mnist import DigitsClassifier, DigitsDataModule

    args = [
        "--trainer.strategy=polytrain.lightning.RayStrategy",
        "--trainer.strategy.num_workers=2",
        "--trainer.strategy.find_unused_parameters=true",
        "--trainer.strategy.bucket_cap_mb=10",
        "--trainer.strategy.resources_per_worker={CPU: 2}",
        "--trainer.strategy.init_hook=os.getpid",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
    ]
    cli = LightningCLI(
        DigitsClassifier, DigitsDataModule, run=False, args=args, seed_everything_default=False
    )
    strategy = cli.trainer.strategy
    assert strategy.num_workers == 2 and strategy.num_cpus_per_worker == 2
    # The CLI passes every DDP argument; those at DDP's defaults change nothing and are dropped.
    assert strategy.backend.config.ddp_kwargs == {
        "find_unused_parameters": True,
        "bucket_cap_mb": 10,
    }
    import os

    assert strategy.init_hook is os.getpid
    horovod = LightningCLI(
        DigitsClassifier,
        DigitsDataModule,
        run=False,
        seed_everything_default=False,
        args=[
            "--trainer.strategy=polytrain.lightning.HorovodRayStrategy",
            "--trainer.strategy.num_workers=2",
            "--trainer.logger=false",
        ],
    )
    assert horovod.trainer.strategy.backend.name == "horovod"
