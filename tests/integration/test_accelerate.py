"""An unmodified ``Accelerator()`` loop inside ``train_loop_per_worker``, equal to one process.

The loop uses ``prepare``, ``accumulate`` (2 micro-batches per step), ``backward``,
``clip_grad_norm_`` and ``save_state`` / ``load_state``; it builds a plain
``Accelerator()`` (no ``cpu=True``): the worker's environment gives Accelerate the
group's process group and device. Rank 1 is killed after the checkpoint of step 2;
the restarted loop loads that state and the final weights equal one process's.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile

import pytest
import torch

from polytrain.train import (
    Checkpoint,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    get_checkpoint,
    get_context,
    report,
)
from polytrain.train.torch import TorchTrainer, get_device

pytest.importorskip("accelerate")

from tests.integration.accelerate_loop import (  # noqa: E402
    ACCUMULATE,
    MICRO_BATCH,
    STEPS,
    train_with_accelerate,
)

TOL = 1e-6


def accelerate_loop(config):
    """Reports ``save_state`` checkpoints; rank 1 dies after step 3 of the first attempt."""
    checkpoint = get_checkpoint()
    rank = get_context().get_world_rank()

    def on_step(step, accelerator, losses):
        if step % 2 == 0:
            with tempfile.TemporaryDirectory() as d:
                accelerator.save_state(d)
                if rank == 0:
                    with open(os.path.join(d, "progress.json"), "w") as handle:
                        json.dump({"step": step, "losses": losses}, handle)
                report({"step": step, "loss": losses[-1]}, checkpoint=Checkpoint.from_directory(d))
        if checkpoint is None and step == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    if checkpoint is None:
        state, losses, accelerator = train_with_accelerate(MICRO_BATCH, on_step=on_step)
    else:
        with checkpoint.as_directory() as d:
            state, losses, accelerator = train_with_accelerate(MICRO_BATCH, d, on_step)
    assert accelerator.num_processes == 2
    assert accelerator.device == get_device()
    if rank == 0:
        torch.save({"state": state, "losses": losses}, os.path.join(config["dir"], "final.pt"))


def test_accelerator_loop_on_two_workers_equals_one_process(tmp_path, ray_start_4_cpus):
    from polytrain.train.huggingface.accelerate_scope import _reset_accelerate

    reference_state, reference_losses, _ = train_with_accelerate(ACCUMULATE * MICRO_BATCH)
    _reset_accelerate()
    fit = TorchTrainer(
        accelerate_loop,
        train_loop_config={"dir": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(tmp_path), name="acc", failure_config=FailureConfig(max_failures=1)
        ),
    )
    result = fit.fit()
    assert fit.num_restarts == 1
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert len(final["losses"]) == len(reference_losses) == STEPS * ACCUMULATE
    assert max(abs(a - b) for a, b in zip(final["losses"], reference_losses, strict=True)) <= TOL
    for name, value in reference_state.items():
        assert torch.allclose(final["state"][name], value, atol=TOL), name
    assert [m["step"] for _, m in result.best_checkpoints] == [2, 4]
    # every rank's random state is in the checkpoint (save_state writes one per process)
    files = os.listdir(result.checkpoint.path)
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(files)
