"""Local mode under torchrun: reading torchrun's world, and what is refused there (no processes)."""

from __future__ import annotations

import pytest

from polytrain.backends.core.context import WorkerContext
from polytrain.errors import ConfigError
from polytrain.launchers.local import LocalWorkerGroup
from polytrain.launchers.scaling import ScalingConfig
from polytrain.launchers.torchrun import TORCHRUN_VARS, torchrun_world

ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.fixture
def torchrun_env(monkeypatch):
    """This process as torchrun would start it; call with overrides."""

    def apply(**overrides: str) -> None:
        for key, value in {**ENV, **overrides}.items():
            monkeypatch.setenv(key, value)

    for key in (*TORCHRUN_VARS, "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    return apply


def test_world_read_from_torchruns_variables():
    world = torchrun_world(ENV)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (3, 1, 4, 2)
    assert world.node_rank == 1  # rank // LOCAL_WORLD_SIZE without GROUP_RANK
    assert torchrun_world({**ENV, "GROUP_RANK": "7"}).node_rank == 7
    assert (world.master_addr, world.master_port) == ("10.0.0.1", 29500)
    info = world.rank_info()
    assert (info.world_rank, info.local_rank, info.world_size, info.node_rank) == (3, 1, 4, 1)


@pytest.mark.parametrize("missing", TORCHRUN_VARS)
def test_not_torchrun_unless_every_variable_is_set(missing):
    assert torchrun_world({k: v for k, v in ENV.items() if k != missing}) is None


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ({"RANK": "one"}, "not numbers"),
        ({"RANK": "4"}, "contradict"),
        ({"LOCAL_RANK": "2"}, "contradict"),
    ],
)
def test_bad_torchrun_variables_are_config_errors(override, words):
    with pytest.raises(ConfigError, match=words):
        torchrun_world({**ENV, **override})


def test_local_mode_context_is_a_worker_of_torchruns_world(torchrun_env):
    scaling = ScalingConfig(num_workers=0)
    assert WorkerContext.from_scaling(scaling).local_mode  # no torchrun: a world of its own
    torchrun_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    assert not WorkerContext.from_scaling(scaling).local_mode  # in torchrun's process group
    assert WorkerContext.from_scaling(ScalingConfig(num_workers=2)).local_mode is False


def test_local_group_under_torchrun_world_size_one_computes_on_local_rank(torchrun_env):
    torchrun_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    group = LocalWorkerGroup()
    group.start()
    try:
        assert group.torchrun is not None and group.torchrun.world_size == 1
        assert group.device_indices == [0]
    finally:
        group.shutdown()


def test_local_group_refuses_several_torchrun_processes(torchrun_env):
    torchrun_env()
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=1.*rank 3 of 4.*function API"):
        LocalWorkerGroup().start()


@pytest.mark.parametrize(
    ("module", "cls", "words"),
    [
        ("polytrain.backends.horovod.rendezvous", "HorovodRendezvous", "horovodrun"),
        ("polytrain.backends.tensorflow.rendezvous", "TFConfigRendezvous", "one process"),
    ],
)
def test_backends_with_their_own_rendezvous_refuse_torchrun(torchrun_env, module, cls, words):
    import importlib

    torchrun_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    group = LocalWorkerGroup()
    group.start()
    rendezvous_cls = getattr(importlib.import_module(module), cls)
    try:
        with pytest.raises(ConfigError, match=f"under torchrun.*{words}"):
            rendezvous_cls(None).on_start(group, WorkerContext(local_mode=False))
    finally:
        group.shutdown()


def _loop():
    raise AssertionError("refused before the loop runs")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"run_config": {"failure_config": {"max_failures": 2}}}, "torchrun --max-restarts"),
        ({"run_config": {"failure_config": {"hang_timeout_s": 30}}}, "hang watchdog"),
        ({"backend": "horovod"}, "own rendezvous"),
    ],
)
def test_function_api_under_torchrun_refuses_what_it_cannot_do(
    torchrun_env, tmp_path, kwargs, words
):
    from polytrain.train.torch import TorchTrainer

    torchrun_env()
    run_config = {"storage_path": str(tmp_path), **kwargs.pop("run_config", {})}
    trainer = TorchTrainer(
        _loop, scaling_config={"num_workers": 0}, run_config=run_config, **kwargs
    )
    with pytest.raises(ConfigError, match=words):
        trainer.fit()
