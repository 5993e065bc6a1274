"""Lightning 2.x strategies on Ray actors: every torch backend fits the same plain LightningModule."""

from __future__ import annotations

import pytest

pl = pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402

from examples.lightning_mnist import DigitsClassifier, DigitsDataModule  # noqa: E402
from polytrain.backends.registry import get_spec  # noqa: E402
from polytrain.errors import ConfigError, ConfigTypeError, WorkerError  # noqa: E402
from polytrain.launchers.scaling import ScalingConfig  # noqa: E402
from polytrain.lightning import (  # noqa: E402
    HorovodRayPlugin,
    RayDeepSpeedStrategy,
    RayHorovodStrategy,
    RayPlugin,
    RayShardedStrategy,
    RayStrategy,
)

# (id, strategy factory, registry name of the backend it must use)
STRATEGIES = [
    ("ddp", lambda: RayStrategy(num_workers=2, use_gpu=False), "ddp"),
    ("horovod", lambda: RayHorovodStrategy(num_workers=2), "horovod"),
    ("sharded", lambda: RayShardedStrategy(num_workers=2), "fairscale"),
    ("deepspeed", lambda: RayDeepSpeedStrategy(num_workers=2), "deepspeed"),
]


def _skip_unless_installed(backend: str) -> None:
    spec = get_spec(backend)
    if not spec.installed:
        pytest.skip(f"backend {backend!r} needs {spec.requires}, not installed here")


def _seed(monkeypatch) -> None:
    # seed_everything records the seed in PL_* variables (which the workers re-seed
    # from); monkeypatch removes them from the driver again after the test.
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    pl.seed_everything(0)


def _trainer(strategy: RayStrategy, root, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        default_root_dir=str(root),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.parametrize(
    "make_strategy, backend", [s[1:] for s in STRATEGIES], ids=[s[0] for s in STRATEGIES]
)
def test_strategy_fits_on_two_workers(
    make_strategy, backend, tmp_path, monkeypatch, ray_start_4_cpus, no_leftover_actors
):
    _skip_unless_installed(backend)
    strategy = make_strategy()
    assert strategy.backend.name == backend
    _seed(monkeypatch)
    model = DigitsClassifier(lr=0.05)
    data = DigitsDataModule(batch_size=32)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(strategy, tmp_path, max_epochs=2)

    trainer.fit(model, datamodule=data)

    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(initial[k], weights[k]) for k in initial), "driver weights unchanged"
    # The last checkpoint was written by rank 0 after the final epoch: the driver's
    # module must hold exactly those (consolidated) weights.
    best = trainer.checkpoint_callback.best_model_path
    assert best and best.startswith(str(tmp_path)) and "epoch=1" in best
    saved = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
    assert saved.keys() == weights.keys()
    for key, value in saved.items():
        assert torch.equal(value, weights[key]), f"{key} differs from rank 0's"
    val_accuracy = trainer.callback_metrics["val_accuracy"].item()
    assert val_accuracy > 0.8
    assert trainer.logged_metrics["val_accuracy"].item() == val_accuracy
    assert "train_loss" in trainer.callback_metrics
    assert trainer.current_epoch == 2
    assert trainer.global_step == 2 * 23  # 1437 samples / 2 workers / 32 per batch

    if backend != "ddp":
        return  # validate/test go through the same launcher for every backend: once is enough
    # validate() and test() after fit run on a fresh group of actors, with the
    # driver's (trained) module and the best checkpoint that rank 0 wrote.
    (validated,) = trainer.validate(model, datamodule=data)
    assert validated["val_accuracy"] == pytest.approx(val_accuracy)
    (tested,) = trainer.test(model, datamodule=data, ckpt_path="best")
    # The test set is the validation set: the best (= last) checkpoint scores the same.
    assert tested["test_accuracy"] == pytest.approx(val_accuracy, abs=1e-6)
    assert trainer.callback_metrics["test_accuracy"].item() == pytest.approx(val_accuracy)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


class _FailsOnRankOne(DigitsClassifier):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 1:
            raise RuntimeError("boom on rank 1")
        return super().training_step(batch, batch_idx)


def test_worker_exception_reaches_driver_with_rank(tmp_path, ray_start_4_cpus, no_leftover_actors):
    trainer = _trainer(RayStrategy(num_workers=2), tmp_path, max_epochs=1)
    with pytest.raises(WorkerError, match="boom on rank 1") as info:
        trainer.fit(_FailsOnRankOne(), datamodule=DigitsDataModule())
    assert info.value.rank == 1


def test_lightning_1x_plugin_spelling_explains_2x_strategy():
    with pytest.raises(TypeError, match=r"strategy=RayStrategy\(num_workers=2, use_gpu=False\)"):
        pl.Trainer(plugins=[RayPlugin(num_workers=2, use_gpu=False)])
    with pytest.raises(TypeError, match=r"Trainer\(strategy=RayHorovodStrategy"):
        HorovodRayPlugin(num_workers=2)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"num_workers must be an int >= 1.*got 0"):
        RayStrategy(num_workers=0)
    with pytest.raises(ValueError, match="Unknown backend 'mpi'"):
        RayStrategy(backend="mpi")
    with pytest.raises(TypeError, match="fixes the backend; got backend='ddp'"):
        RayHorovodStrategy(backend="ddp")


def test_scaling_config_like_the_trainers():
    flat = RayStrategy(num_workers=2, num_cpus_per_worker=2)
    nested = RayStrategy(scaling_config=ScalingConfig(num_workers=2, num_cpus_per_worker=2))
    mixed = RayHorovodStrategy(scaling_config={"num_workers": 2}, num_cpus_per_worker=2)
    for strategy in (flat, nested, mixed):
        assert strategy.scaling == flat.scaling
        assert strategy.num_workers == strategy.num_processes == 2
        assert strategy.num_cpus_per_worker == 2
        assert strategy._context_template().num_cpus == 2
    with pytest.raises(ConfigError, match=r"\['num_workers'\] given both"):
        RayStrategy(num_workers=2, scaling_config={"num_workers": 2})
    with pytest.raises(ConfigError, match=r"num_workers must be an int >= 1.*got 0"):
        RayStrategy(scaling_config=ScalingConfig(num_workers=0))
    with pytest.raises(ConfigError, match="does not resize its worker group"):
        RayStrategy(scaling_config={"num_workers": 2, "min_workers": 1})
    with pytest.raises(ConfigTypeError, match="Unknown scaling_config key"):
        RayStrategy(scaling_config={"workers": 2})
    with pytest.raises(ConfigError, match="num_cpus_per_worker must be a number > 0; got 0"):
        RayStrategy(num_cpus_per_worker=0)
    with pytest.raises(ConfigTypeError, match="fixes the backend"):
        RayShardedStrategy(backend="ddp")


# ------------------------------------------------------------ ray_lightning's options
class _Probe(DigitsClassifier):
    """Logs what the worker sees (threads, Ray CPUs, the init_hook's variable, the DDP wrapper).

    Its ``unused`` layer gets no gradient: DDP needs find_unused_parameters=True for it.
    """

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.unused = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        import os

        import ray

        wrapper = self.trainer.strategy.model
        probes = {
            "threads": torch.get_num_threads(),
            "ray_cpus": ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0),
            "hook_var": float(os.environ.get("POLYTRAIN_TEST_HOOK", "-1")),
            "find_unused": float(getattr(wrapper, "find_unused_parameters", -1)),
            "bucket_bytes": float(getattr(wrapper, "bucket_bytes_cap", -1)),
        }
        for name, value in probes.items():
            self.log(name, float(value), reduce_fx="max", sync_dist=True)
        return super().training_step(batch, batch_idx)


def _fit_probe(strategy: RayStrategy, root) -> dict[str, float]:
    trainer = _trainer(strategy, root, max_epochs=1, limit_train_batches=3, limit_val_batches=0)
    trainer.fit(_Probe(), datamodule=DigitsDataModule())
    return {k: v.item() for k, v in trainer.callback_metrics.items()}


def test_ddp_kwargs_reach_the_wrapped_model(tmp_path, ray_start_4_cpus, no_leftover_actors):
    strategy = RayStrategy(num_workers=2, find_unused_parameters=True, bucket_cap_mb=2)
    metrics = _fit_probe(strategy, tmp_path)
    assert metrics["find_unused"] == 1.0
    assert metrics["bucket_bytes"] == 2 * 1024 * 1024


def test_cpu_resources_and_init_hook_reach_the_workers(
    tmp_path, ray_start_4_cpus, no_leftover_actors
):
    def init_hook():
        import os

        os.environ["POLYTRAIN_TEST_HOOK"] = "7"

    strategy = RayStrategy(
        num_workers=2,
        resources_per_worker={"CPU": 2},
        init_hook=init_hook,
        find_unused_parameters=True,
    )
    assert strategy.num_cpus_per_worker == 2
    metrics = _fit_probe(strategy, tmp_path)
    assert metrics["threads"] == 2
    assert metrics["ray_cpus"] == 2.0
    assert metrics["hook_var"] == 7.0


class _ValueErrorOnRankOne(DigitsClassifier):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 1:
            raise ValueError("bad value on rank 1")
        return super().training_step(batch, batch_idx)


def test_value_error_in_training_step_is_a_value_error(
    tmp_path, ray_start_4_cpus, no_leftover_actors
):
    trainer = _trainer(RayStrategy(num_workers=2), tmp_path, max_epochs=1)
    with pytest.raises(ValueError, match="bad value on rank 1") as info:
        trainer.fit(_ValueErrorOnRankOne(), datamodule=DigitsDataModule())
    assert isinstance(info.value, WorkerError)
    assert info.value.rank == 1
    assert "in training_step" in info.value.remote_traceback
    assert "ValueError: bad value on rank 1" in info.value.remote_traceback
