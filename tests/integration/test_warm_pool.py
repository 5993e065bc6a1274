"""The warm worker pool (issue 14): released workers are reused, clean, bounded and given back.

Every test runs real Ray actors; the process-group tests real gloo groups. Workers
are identified by their pids: a reused group has the previous group's pids.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from polytrain import TorchTrainer
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.torch_distributed import start_process_group
from polytrain.launchers.pool import warm_pool as pool
from polytrain.launchers.worker import WORKER_STATE
from polytrain.launchers.worker_group import RayWorkerGroup
from tests.helpers import (
    parity_data_creator,
    parity_model_creator,
    parity_optimizer_creator,
)

# Every test starts with an empty warm pool: these tests count the pool's own groups and reuses.
KEEP_WARM_POOL = False


LEAK_VAR = "POLYTRAIN_TEST_LEAKED_VAR"


_started: list = []  # groups and trainers of the running test


@pytest.fixture(autouse=True)
def empty_pool():
    """Every test starts and ends with an empty pool, the default settings and no group left."""
    pool.clear()
    pool.reset_settings()
    yield
    for started in _started:
        started.shutdown()  # safe twice; a half-finished test's groups go too
    _started.clear()
    pool.clear()
    pool.reset_settings()


def _group(num_workers: int = 2, **kwargs) -> RayWorkerGroup:
    group = RayWorkerGroup(num_workers=num_workers, start_timeout_s=20, **kwargs)
    _started.append(group)
    group.start()
    return group


def _pids(group) -> list[int]:
    return group.execute(os.getpid)


def _trainer(**kwargs) -> TorchTrainer:
    options = {
        "model_creator": parity_model_creator,
        "data_creator": parity_data_creator,
        "optimizer_creator": parity_optimizer_creator,
        "loss_creator": torch.nn.CrossEntropyLoss,
        "config": {"batch_size": 64},
        "num_workers": 2,
        "backend": "ddp",
    }
    options.update(kwargs)
    trainer = TorchTrainer(**options)
    _started.append(trainer)
    return trainer


# ------------------------------------------------------------ worker functions
def _leave_state() -> None:
    WORKER_STATE["previous_trainer"] = torch.zeros(10)


def _has_state() -> bool:
    return "previous_trainer" in WORKER_STATE


def _change_process(directory: str) -> None:
    os.environ[LEAK_VAR] = "1"
    os.environ["PATH"] = "/nonexistent"
    os.chdir(directory)
    sys.path.insert(0, directory)


def _process_view(directory: str) -> tuple[str | None, str, str, bool]:
    return os.environ.get(LEAK_VAR), os.environ["PATH"], os.getcwd(), directory in sys.path


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def _import_user_module(directory: str) -> int:
    sys.path.insert(0, directory)
    try:
        import p7_user_module

        return p7_user_module.VALUE
    finally:
        sys.path.remove(directory)


def _user_module_loaded() -> bool:
    return "p7_user_module" in sys.modules


def _seed_and_draw(seed: int) -> tuple[int, list[float]]:
    torch.manual_seed(seed)
    return torch.initial_seed(), torch.rand(3).tolist()


def _initial_seed_and_draw() -> tuple[int, list[float]]:
    return torch.initial_seed(), torch.rand(3).tolist()


def _fail() -> None:
    raise ValueError("boom")


def _cuda_allocated() -> int:
    return torch.cuda.memory_allocated()


def _allocate_cuda() -> None:
    WORKER_STATE["cuda"] = torch.ones(2**20, device="cuda")


# ----------------------------------------------------------------------- reuse
def test_second_trainer_takes_the_first_trainers_workers(ray_start_4_cpus):
    first = _trainer()
    first.train(num_steps=2)
    pids = first.apply_all_workers(os.getpid)
    first.shutdown()
    assert pool.idle_workers() == 2

    second = _trainer()
    assert second._group.reused
    assert second.apply_all_workers(os.getpid) == pids
    stats = second.train(num_steps=2)  # a new process group and fresh components
    assert torch.isfinite(torch.tensor(stats["loss"]))
    second.shutdown()


def _start_environment() -> dict[str, str]:
    """What this process was started with (/proc), not what it set on itself since."""
    with open("/proc/self/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {key.decode(): value.decode(errors="replace") for key, value in pairs}


def test_torch_workers_start_with_one_malloc_arena_beside_the_jobs_environment(
    ray_start_4_cpus,
):
    if "MALLOC_ARENA_MAX" in os.environ:
        pytest.skip("the driver's MALLOC_ARENA_MAX reaches every process of the local Ray")
    plain = _group()  # no process environment asked for: glibc's default
    assert [env.get("MALLOC_ARENA_MAX") for env in plain.execute(_start_environment)] == [
        None,
        None,
    ]
    plain.shutdown()
    trainer = _trainer()  # ddp: its processes must start otherwise, so not the pooled ones
    assert not trainer._group.reused
    started = trainer.apply_all_workers(_start_environment)
    assert [env.get("MALLOC_ARENA_MAX") for env in started] == ["1", "1"]
    # Ray merged it into the job's runtime_env: the session's PYTHONPATH is still there.
    repo_root = str(Path(__file__).resolve().parents[2])
    assert all(repo_root in env["PYTHONPATH"].split(os.pathsep) for env in started)
    assert trainer._group.process_env == {"MALLOC_ARENA_MAX": "1"}
    trainer.shutdown()


def test_other_bundle_starts_fresh_workers(ray_start_4_cpus):
    first = _group(num_workers=2)
    pids = _pids(first)
    first.shutdown()
    other = _group(num_workers=1, num_cpus_per_worker=2)  # another world size alone: resized
    assert not other.reused and set(_pids(other)).isdisjoint(pids)
    other.shutdown()


def test_off_switch_stops_released_workers(ray_start_4_cpus, monkeypatch):
    monkeypatch.setenv(pool.ENV_SWITCH, "0")
    first = _group()
    pids = _pids(first)
    first.shutdown()
    assert pool.idle_workers() == 0
    second = _group()
    assert not second.reused and set(_pids(second)).isdisjoint(pids)
    second.shutdown()


def test_failed_group_is_not_reused(ray_start_4_cpus):
    first = _group()
    pids = _pids(first)
    with pytest.raises(ValueError, match="boom"):
        first.execute(_fail)
    first.shutdown()
    assert pool.idle_workers() == 0
    second = _group()
    assert set(_pids(second)).isdisjoint(pids)
    second.shutdown()


# -------------------------------------------------------------- starts clean
def test_reused_worker_has_no_worker_state(ray_start_4_cpus):
    first = _group()
    first.execute(_leave_state)
    first.shutdown()
    second = _group()
    assert second.reused
    assert second.execute(_has_state) == [False, False]
    second.shutdown()


def test_reused_worker_has_its_start_environment(ray_start_4_cpus, tmp_path):
    first = _group(env_vars={"FIRST_GROUP_VAR": "a"})
    start_path = first.execute_single(0, lambda: os.environ["PATH"])
    start_cwd = first.execute_single(0, os.getcwd)
    first.execute(_change_process, str(tmp_path))
    first.shutdown()

    second = _group(env_vars={"SECOND_GROUP_VAR": "b"})
    assert second.reused
    view = second.execute(_process_view, str(tmp_path))
    assert view == [(None, start_path, start_cwd, False)] * 2
    env = second.execute(
        lambda: (os.environ.get("FIRST_GROUP_VAR"), os.environ["SECOND_GROUP_VAR"])
    )
    assert env == [(None, "b")] * 2
    second.shutdown()


def test_reused_worker_has_no_process_group(ray_start_4_cpus):
    first = _group()
    # A process group no rendezvous shuts down (as Lightning's extra gloo group next to Horovod).
    start_process_group(first, WorkerContext(world_size=2, timeout_s=30.0), "gloo")
    assert first.execute(_dist_initialized) == [True, True]
    first.shutdown()
    second = _group()
    assert second.reused
    assert second.execute(_dist_initialized) == [False, False]
    start_process_group(second, WorkerContext(world_size=2, timeout_s=30.0), "gloo")
    assert second.execute(_dist_initialized) == [True, True]
    second.shutdown()


def _store_view() -> tuple[int | None, str | None, float]:
    import torch.distributed as dist

    from polytrain.backends.core import torch_distributed

    server = torch_distributed._store_server
    total = torch.ones(1)
    dist.all_reduce(total)
    return (server.port if server is not None else None, os.environ["MASTER_PORT"], total.item())


def _store_server_alive() -> bool:
    from polytrain.backends.core import torch_distributed

    return torch_distributed._store_server is not None


def test_rendezvous_store_is_bound_by_rank_0_and_let_go_with_its_group(ray_start_4_cpus):
    """Rank 0 listens on a port its OS chose (no free-port race) and advertises it."""
    from polytrain.backends.core.torch_distributed import stop_process_group

    group = _group()
    for _ in range(2):  # a second group on the same (warm) workers gets a store of its own
        start_process_group(group, WorkerContext(world_size=2, timeout_s=30.0), "gloo")
        (port, env0, total0), (none, env1, total1) = group.execute(_store_view)
        assert port is not None and none is None
        assert env0 == env1 == str(port) and total0 == total1 == 2.0
        stop_process_group(group)
        assert group.execute(_store_server_alive) == [False, False]
    group.shutdown()


def test_reused_worker_imports_the_current_user_code(ray_start_4_cpus, tmp_path):
    module = tmp_path / "p7_user_module.py"
    module.write_text("VALUE = 1\n")
    first = _group()
    assert first.execute(_import_user_module, str(tmp_path)) == [1, 1]
    first.shutdown()
    module.write_text("VALUE = 2\n")  # the user edits the code between two trainers
    second = _group()
    assert second.reused
    assert second.execute(_user_module_loaded) == [False, False]
    assert second.execute(_import_user_module, str(tmp_path)) == [2, 2]
    second.shutdown()


def test_reused_worker_does_not_inherit_a_random_seed(ray_start_4_cpus):
    first = _group()
    seeded = first.execute(_seed_and_draw, 123)
    assert seeded[0][0] == 123
    first.shutdown()
    second = _group()
    assert second.reused
    for seed, draw in second.execute(_initial_seed_and_draw):
        # Seeded anew, non-deterministically, as a new process is.
        assert seed != 123 and draw != seeded[0][1]
    second.shutdown()


@pytest.mark.gpu
def test_reused_worker_holds_no_cuda_memory(ray_start_4_cpus):
    first = _group(num_workers=1, num_gpus_per_worker=1)
    first.execute(_allocate_cuda)
    assert first.execute(_cuda_allocated)[0] > 0
    first.shutdown()
    second = _group(num_workers=1, num_gpus_per_worker=1)
    assert second.reused
    assert second.execute(_cuda_allocated) == [0]
    second.shutdown()


# ------------------------------------------------------------------- bounds
def test_idle_workers_are_stopped_after_the_idle_timeout(ray_start_4_cpus):
    pool.configure(idle_timeout_s=0.5)
    group = _group()
    group.shutdown()
    assert pool.idle_workers() == 2
    _wait_until(lambda: pool.idle_workers() == 0 and _cpus_free(ray_start_4_cpus))


def test_max_idle_bounds_the_pool(ray_start_4_cpus):
    pool.configure(max_idle=1)
    group = _group(num_workers=2)
    group.shutdown()
    assert pool.idle_workers() == 0
    single = _group(num_workers=1)
    single.shutdown()
    assert pool.idle_workers() == 1


def test_idle_workers_make_room_for_a_group_of_another_shape(ray_start_4_cpus):
    small = _group(num_workers=2)
    small.shutdown()
    assert pool.idle_workers() == 2
    # 4 CPUs: 3 more fit only once the 2 idle workers are gone.
    large = _group(num_workers=1, num_cpus_per_worker=3)
    assert not large.reused and pool.idle_workers() == 0
    large.shutdown()


def test_idle_workers_give_way_to_a_waiting_placement_group(ray_start_4_cpus):
    from ray.util.placement_group import placement_group, remove_placement_group

    group = _group(num_workers=2)
    group.shutdown()
    assert pool.idle_workers() == 2
    # Another job's request (here: a bare placement group of this driver) for 3 CPUs.
    other = placement_group([{"CPU": 1}] * 3)
    ready, _ = ray_start_4_cpus.wait([other.ready()], timeout=30)
    assert ready and pool.idle_workers() == 0
    remove_placement_group(other)


def test_shutdown_can_give_every_worker_back_at_once(ray_start_4_cpus):
    trainer = _trainer()
    trainer.train(num_steps=1)
    other = _group(num_workers=1, num_cpus_per_worker=2)  # beside the trainer: 4 CPUs taken
    other.shutdown()
    assert pool.idle_workers() == 1
    trainer.shutdown(release_workers=True)
    assert pool.idle_workers() == 0  # neither the trainer's workers nor the other idle group
    _wait_until(lambda: _cpus_free(ray_start_4_cpus))


def _cpus_free(ray) -> bool:
    return ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0)


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


# --------------------------------------------------------------- pre-imports
def _pre_imported() -> list[str]:
    from polytrain.launchers.worker import STARTUP

    return sorted(k.removeprefix("import:") for k in STARTUP if k.startswith("import:"))


def test_new_workers_pre_import_the_backends_modules(ray_start_4_cpus):
    trainer = _trainer(num_workers=1, backend="ddp")  # the pool is empty: a new worker
    assert not trainer._group.reused
    assert trainer.apply_all_workers(_pre_imported) == [
        ["torch", "torch._dynamo", "torch.distributed"]
    ]
    trainer.shutdown()
    pool.clear()
    pool.configure(preload=())  # the setting overrides the backend's modules
    plain = _trainer(num_workers=1, backend="ddp")
    assert plain.apply_all_workers(_pre_imported) == [[]]
    plain.shutdown()
