"""The function API (``polytrain.train``): your own loop on every backend, on real Ray workers."""

from __future__ import annotations

import csv
import os
import signal
import tempfile
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from polytrain import train as polytrain_train
from polytrain.errors import WorkerError, WorkerHangError
from polytrain.train import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    get_checkpoint,
    get_context,
    report,
)
from polytrain.train import torch as train_torch
from polytrain.train.horovod import HorovodTrainer
from polytrain.train.torch import TorchTrainer
from tests.helpers import max_param_diff, parity_dataset, parity_model_creator, plain_reference
from tests.integration.test_backend_suite import _params

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

# Every test starts with an empty warm pool: elastic restarts and Ray Data need the CPUs idle pooled workers would hold.
KEEP_WARM_POOL = False

STEPS = 6
GLOBAL_BATCH = 32

# One case per backend: the cheapest of each backend's registry cases.
ONE_PER_BACKEND = [
    ("ddp", "ddp", None, 0.0),
    ("horovod", "horovod", None, 1e-5),
    ("fairscale-sddp", "fairscale", {"mode": "sddp"}, 1e-5),
    ("fsdp", "fsdp", None, 1e-5),
    ("deepspeed-zero2", "deepspeed", {"stage": 2}, 1e-5),
]
# The other configurations of those backends: make test-long runs them (long_matrix).
OTHER_CONFIGS = [
    ("fsdp-v1", "fsdp", {"version": 1}, 1e-5),
    ("fairscale-oss", "fairscale", {"mode": "oss"}, 1e-5),
    ("deepspeed-zero1", "deepspeed", {"stage": 1}, 1e-5),
    ("deepspeed-zero3", "deepspeed", {"stage": 3}, 1e-4),
]


def parity_loop(config):
    """A plain SGD loop written once; the helpers make it right on every backend."""
    per_worker = config["batch_size"] // get_context().get_world_size()
    loader = train_torch.prepare_data_loader(
        DataLoader(parity_dataset(), batch_size=per_worker, shuffle=False)
    )
    model = parity_model_creator({})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = train_torch.prepare(model, optimizer, data_loader=loader)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(loader):
        if step == config["steps"]:
            break
        train_torch.zero_grad()
        loss = loss_fn(model(x), y)
        train_torch.backward(loss)
        train_torch.step()
    state = train_torch.full_state_dict()  # collective: every rank calls it
    with tempfile.TemporaryDirectory() as d:
        if state is not None:
            torch.save(state["models"][0], os.path.join(d, "model.pt"))
        report({"loss": loss.item()}, checkpoint=Checkpoint.from_directory(d))


def _load_model(checkpoint: Checkpoint) -> torch.nn.Module:
    model = parity_model_creator({})
    with checkpoint.as_directory() as d:
        model.load_state_dict(torch.load(os.path.join(d, "model.pt"), weights_only=True))
    return model


@pytest.mark.parametrize(
    ("backend", "backend_config", "tol"),
    _params(ONE_PER_BACKEND + OTHER_CONFIGS, every_run={case[0] for case in ONE_PER_BACKEND}),
)
def test_same_loop_matches_one_process_on_every_backend(backend, backend_config, tol, tmp_path):
    result = TorchTrainer(
        parity_loop,
        train_loop_config={"steps": STEPS, "batch_size": GLOBAL_BATCH},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="parity"),
        backend=backend,
        backend_config=backend_config,
    ).fit()
    reference = plain_reference(STEPS, GLOBAL_BATCH)
    assert result.checkpoint is not None and result.error is None
    assert result.path == str(tmp_path / "parity")
    assert max_param_diff(_load_model(result.checkpoint), reference) <= max(tol, 1e-6)


def horovod_loop(config):
    import horovod.torch as hvd

    hvd.init()  # as in a Ray Train 1.x / horovodrun script: already initialised, returns
    model = parity_model_creator({})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = parity_dataset()
    per_worker = config["batch_size"] // hvd.size()
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(config["steps"]):
        start = step * config["batch_size"] + hvd.rank() * per_worker
        x, y = data[start : start + per_worker]
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    with tempfile.TemporaryDirectory() as d:
        if hvd.rank() == 0:
            torch.save(model.state_dict(), os.path.join(d, "model.pt"))
        report({"size": hvd.size()}, checkpoint=Checkpoint.from_directory(d))


def test_horovod_trainer_with_hvd_init_in_the_loop(tmp_path):
    pytest.importorskip("horovod.torch")
    result = HorovodTrainer(
        horovod_loop,
        train_loop_config={"steps": STEPS, "batch_size": GLOBAL_BATCH},
        scaling_config={"num_workers": 2},
        run_config=RunConfig(storage_path=str(tmp_path), name="hvd"),
    ).fit()
    assert result.metrics == {"size": 2}
    # rank 1's contiguous half of each global batch: the same global batches as one process
    reference = plain_reference(STEPS, GLOBAL_BATCH)
    assert max_param_diff(_load_model(result.checkpoint), reference) <= 1e-5


def reporting_loop(config):
    """Reports every step, each rank adding its own file; rank 1 kills itself once."""
    ctx = get_context()
    start = 0
    checkpoint = get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = torch.load(os.path.join(d, "rank0.pt"), weights_only=True)["step"] + 1
            # every rank's files of that step are there
            assert sorted(f for f in os.listdir(d) if f.endswith(".pt")) == ["rank0.pt", "rank1.pt"]
    for step in range(start, config["steps"]):
        if step == config.get("kill_at") and ctx.get_world_rank() == 1 and checkpoint is None:
            os.kill(os.getpid(), signal.SIGKILL)
        with tempfile.TemporaryDirectory() as d:
            torch.save({"step": step}, os.path.join(d, f"rank{ctx.get_world_rank()}.pt"))
            report(
                {"step": step, "score": -abs(step - 1), "resumed_from": start},
                checkpoint=Checkpoint.from_directory(d),
            )


def test_report_metrics_dataframe_and_score_pruning(tmp_path):
    result = TorchTrainer(
        reporting_loop,
        train_loop_config={"steps": 4},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(tmp_path),
            name="prune",
            checkpoint_config=CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute="score", checkpoint_score_order="max"
            ),
            loggers=["csv", "tensorboard"],
        ),
    ).fit()
    frame = result.metrics_dataframe
    assert list(frame["step"]) == [0, 1, 2, 3]
    assert result.metrics == {"step": 3, "score": -2, "resumed_from": 0}
    # the best (step 1) and the latest (step 3, kept for restarts) stay
    kept = sorted(name for name in os.listdir(tmp_path / "prune") if name.startswith("checkpoint_"))
    assert kept == ["checkpoint_000001", "checkpoint_000003"]
    # Ray Train's best_checkpoints: the num_to_keep best; the latest is Result.checkpoint
    assert [m["step"] for _, m in result.best_checkpoints] == [1]
    assert os.path.exists(os.path.join(result.checkpoint.path, "COMMITTED"))
    assert result.checkpoint.path.endswith("checkpoint_000003")
    # Trackers get rank 0's reports from the driver, one record per report (step = its number).
    with open(os.path.join(result.path, "metrics.csv")) as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4]
    assert [float(row["score"]) for row in rows] == [-1, 0, -1, -2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(result.path, "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("score")] == [
        (1, -1),
        (2, 0),
        (3, -1),
        (4, -2),
    ]


def test_sigkilled_worker_restarts_the_loop_from_the_last_checkpoint(tmp_path, no_leftover_actors):
    run_config = RunConfig(
        storage_path=str(tmp_path), name="kill", failure_config=FailureConfig(max_failures=1)
    )
    result = TorchTrainer(
        reporting_loop,
        train_loop_config={"steps": 5, "kill_at": 2},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config,
    ).fit()
    frame = result.metrics_dataframe
    # steps 0-1 from the first attempt, 2-4 from the restarted one, which began at step 2
    assert list(frame["step"]) == [0, 1, 2, 3, 4]
    assert list(frame["resumed_from"]) == [0, 0, 2, 2, 2]
    assert result.checkpoint.path.endswith("checkpoint_000004")

    # a new trainer on the same run continues from its latest checkpoint
    again = TorchTrainer(
        reporting_loop,
        train_loop_config={"steps": 6},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="kill"),
    ).fit()
    assert list(again.metrics_dataframe["resumed_from"]) == [5]
    assert again.checkpoint.path.endswith("checkpoint_000005")


def elastic_loop(config):
    """Reports once with a checkpoint; on the first attempt rank 2 then dies (after the flag)."""
    ctx = get_context()
    resumed = get_checkpoint() is not None
    with tempfile.TemporaryDirectory() as d:
        torch.save(
            {"world_size": ctx.get_world_size()}, os.path.join(d, f"rank{ctx.get_world_rank()}.pt")
        )
        report(
            {"world_size": ctx.get_world_size(), "resumed": resumed},
            checkpoint=Checkpoint.from_directory(d),
        )
    if resumed:
        return
    if ctx.get_world_rank() == 2:
        while not os.path.exists(config["flag"]):
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # ranks 0 and 1 wait here until the lost rank stops the group


def test_elastic_min_workers_restarts_the_loop_on_the_workers_that_fit(
    ray_start_4_cpus, tmp_path, no_leftover_actors
):
    """ScalingConfig(min_workers=2): after a lost worker the loop goes on with 2 of 3 workers."""
    ray = ray_start_4_cpus

    @ray.remote(num_cpus=2)
    class Hog:
        def ready(self):
            return True

    flag, hogs = tmp_path / "hog_requested", []

    def hog_after_the_first_checkpoint():
        # 3 of 4 CPUs are the workers'; this 2-CPU demand waits and takes the CPU the lost
        # worker frees, so the restarted group fits only 2 workers.
        deadline = time.monotonic() + 300
        while not list((tmp_path / "elastic").glob("checkpoint_*/COMMITTED")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        hogs.append(Hog.remote())
        flag.write_text("requested")

    thread = threading.Thread(target=hog_after_the_first_checkpoint, daemon=True)
    thread.start()
    try:
        result = TorchTrainer(
            elastic_loop,
            train_loop_config={"flag": str(flag)},
            scaling_config=ScalingConfig(num_workers=3, min_workers=2, start_timeout_s=20),
            run_config=RunConfig(
                storage_path=str(tmp_path),
                name="elastic",
                failure_config=FailureConfig(max_failures=2),
            ),
        ).fit()
        thread.join(timeout=5)
        assert hogs and ray.get(hogs[0].ready.remote(), timeout=60)
    finally:
        for hog in hogs:
            ray.kill(hog)
    frame = result.metrics_dataframe
    assert list(frame["world_size"]) == [3, 2]
    assert list(frame["resumed"]) == [False, True]
    files = sorted(f for f in os.listdir(result.checkpoint.path) if f.endswith(".pt"))
    assert files == ["rank0.pt", "rank1.pt"]  # the restarted group's two ranks


def hanging_loop():
    """Rank 1 stops reporting after its first report; rank 0 goes on and waits for it."""
    report({"step": 0})
    if get_context().get_world_rank() == 1:
        threading.Event().wait()
    report({"step": 1})
    torch.distributed.barrier()


def test_a_hung_loop_is_reported_with_the_stuck_rank(tmp_path, no_leftover_actors):
    """FailureConfig(hang_timeout_s): no report for that long from a rank is a hang."""
    start = time.monotonic()
    with pytest.raises(WorkerHangError) as info:
        TorchTrainer(
            hanging_loop,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(
                storage_path=str(tmp_path),
                name="hang",
                failure_config=FailureConfig(hang_timeout_s=5),
            ),
        ).fit()
    assert time.monotonic() - start < 60
    assert info.value.rank == 1 and "Stuck: rank 1" in str(info.value)


def failing_loop():
    if get_context().get_world_rank() == 1:
        raise ValueError("rank one fails on purpose")
    torch.distributed.barrier()  # rank 0 waits for rank 1 forever: the teardown must end it


def test_loop_error_reaches_the_driver_with_rank_and_traceback(tmp_path, no_leftover_actors):
    trainer = TorchTrainer(
        failing_loop,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="fail"),
    )
    with pytest.raises(WorkerError, match="rank one fails on purpose") as info:
        trainer.fit()
    assert info.value.rank == 1
    assert "failing_loop" in info.value.remote_traceback


def dataset_loop():
    shard = polytrain_train.get_dataset_shard("train")
    rows = 0
    for batch in shard.iter_torch_batches(batch_size=8):
        rows += len(batch["x"])
    report({"rows": rows, "rank": get_context().get_world_rank()})


def test_each_worker_reads_its_split_of_a_ray_dataset(tmp_path):
    import ray

    dataset = ray.data.from_items([{"x": float(i)} for i in range(64)])
    result = TorchTrainer(
        dataset_loop,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="data"),
        datasets={"train": dataset},
    ).fit()
    assert result.metrics == {"rows": 32, "rank": 0}  # rank 0's half of an equal split
    assert result.checkpoint is None  # nothing was reported with a checkpoint


def tf_loop(config):
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    ctx = get_context()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((config["steps"] * 8, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], dtype=np.float32)
    with strategy.scope():
        w = tf.Variable(tf.zeros((3, 1)))

    @tf.function
    def train_step(xb, yb):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.matmul(xb, w) - yb) ** 2)
            grad = tape.gradient(loss, w)
            grad = tf.distribute.get_replica_context().all_reduce("MEAN", grad)
            w.assign_sub(0.1 * grad)
            return loss

        return strategy.run(replica_step, args=(xb, yb))

    half = 4
    for step in range(config["steps"]):
        start = step * 8 + ctx.get_world_rank() * half
        train_step(tf.constant(x[start : start + half]), tf.constant(y[start : start + half]))
    report({"w": [float(v) for v in w.numpy().ravel()], "world_size": ctx.get_world_size()})


def test_tensorflow_trainer_runs_a_gradient_tape_loop_under_mwms(tmp_path):
    np = pytest.importorskip("numpy")
    pytest.importorskip("tensorflow")
    from polytrain.train.tensorflow import TensorflowTrainer

    steps = 3
    result = TensorflowTrainer(
        tf_loop,
        train_loop_config={"steps": steps},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="tf"),
    ).fit()
    # one process on the global batches of 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * 8, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], dtype=np.float32)
    w = np.zeros((3, 1), dtype=np.float32)
    for step in range(steps):
        xb, yb = x[step * 8 : step * 8 + 8], y[step * 8 : step * 8 + 8]
        w -= 0.1 * (2 * xb.T @ (xb @ w - yb) / len(xb))
    assert result.metrics["world_size"] == 2
    assert np.allclose(result.metrics["w"], w.ravel(), atol=1e-5)


SCRIPT = os.path.join(os.path.dirname(__file__), "torchrun_ddp_script.py")


def test_launch_runs_an_unmodified_torchrun_script_and_restarts_it(tmp_path, no_leftover_actors):
    from polytrain.cli.launch_runner import launch

    # rank 1 exits 3 on the first attempt; the restart succeeds
    code = launch(
        SCRIPT,
        [str(tmp_path), "--fail-rank", "1", "--fail-on-restart", "0"],
        num_workers=2,
        max_restarts=1,
    )
    assert code == 0
    lines = [(tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert [line[:3] for line in lines] == [["0", "2", "1"], ["1", "2", "1"]]
    assert lines[0][3] == lines[1][3]  # DDP kept the replicas equal

    # without restarts left the first failing rank's exit code comes back
    assert (
        launch(
            SCRIPT,
            [str(tmp_path), "--fail-rank", "1", "--fail-on-restart", "5"],
            num_workers=2,
            max_restarts=1,
        )
        == 3
    )
