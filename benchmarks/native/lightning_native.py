"""Lightning's own ``strategy="ddp"`` under torchrun: the baseline of the lightning benchmark.

This module also holds what both sides of that benchmark share: the
LightningModule (:class:`WorkloadModule`, the MLP workload of
:mod:`benchmarks.workloads.mlp`), the timing callback (:class:`StepTimes`) and the
Trainer options (:func:`trainer_options`). ``drivers/polytrain_lightning.py``
imports them and trains the same module under polytrain's Lightning strategies,
so only the strategy and the launcher differ between the runs.

Lightning detects torchrun's environment (``TORCHELASTIC_RUN_ID``, ``RANK``,
``WORLD_SIZE``, ...) and starts no processes of its own: every rank joins the gloo
process group in ``strategy.setup_environment()``.

Usage: torchrun --nproc_per_node=2 benchmarks/native/lightning_native.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()  # before the heavy imports: what the interpreter start costs is visible

import argparse  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.workloads import mlp, recorder  # noqa: E402


class WorkloadModule(pl.LightningModule):
    """The benchmark's MLP, data and Adam as a LightningModule.

    The network is built in :meth:`configure_model`, i.e. in every training process
    after the process group is up (as the native DDP script builds it), never on a
    driver that only ships the module to Ray workers: the recorder's memory baseline
    is taken right before, in the process that trains. Lightning's automatic
    optimization runs the workload's step (forward, loss, zero_grad, backward,
    optimizer step); on CPU every op is synchronous, so the step ends when the
    optimizer step returns, which :meth:`optimizer_step` records for
    :class:`StepTimes`.

    Args:
        spec: the workload (steps per worker; the model must be "mlp" or "big").
    """

    def __init__(self, spec: mlp.WorkloadSpec) -> None:
        super().__init__()
        self.spec = spec
        self.net: torch.nn.Module | None = None
        self.criterion = torch.nn.CrossEntropyLoss()
        #: ``(perf_counter, time.time())`` at the end of the latest optimizer step.
        self.step_end: tuple[float, float] | None = None

    def configure_model(self) -> None:
        """Build the seeded network once, in the training process."""
        if self.net is None:
            self.net = mlp.build_model(self.spec)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """The network's logits."""
        assert self.net is not None, "configure_model() has not run"
        return self.net(features)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Cross-entropy of the logits (nothing logged: no metric traffic on either side)."""
        features, target = batch
        return self.criterion(self(features), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The workload's optimizer (Adam, lr 1e-3)."""
        return mlp.make_optimizer(self, self.spec)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step (the closure: forward, loss, zero_grad, backward), then its end time."""
        super().optimizer_step(*args, **kwargs)
        self.step_end = (time.perf_counter(), time.time())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        """The generated data, ``GLOBAL_BATCH / workers`` per batch; the strategy adds the sampler.

        Lightning replaces the sequential sampler with a ``DistributedSampler`` for
        the rank (``use_distributed_sampler``), under its own ddp strategy and under
        polytrain's alike.
        """
        return torch.utils.data.DataLoader(
            mlp.make_dataset(self.spec),
            batch_size=mlp.GLOBAL_BATCH // self.trainer.world_size,
            drop_last=True,
        )


class StepTimes(pl.Callback):
    """Records every step into :data:`benchmarks.workloads.recorder.RECORDER` and writes ``rank*.json``.

    Step time: ``on_train_batch_start`` to the end of the optimizer step
    (:attr:`WorkloadModule.step_end`). Interval: one ``on_train_batch_end`` to the
    next (adds Lightning's loop, its hooks and the data loading). Marks:
    ``process_group`` at the ``setup`` hook (the strategy's environment, the process
    group included, is up), ``model_build`` in ``configure_model``, ``wrapped`` at
    ``on_fit_start`` (the strategy has wrapped the module and optimizers), and
    ``first_step`` at the end of the first optimizer step. The first batch start
    also ends the set-up memory record (its peak, then the high-water mark is reset).
    At ``on_train_end`` each rank writes its summary (peak RSS included) to
    ``result_dir/rank{global_rank}.json``.

    Args:
        result_dir: where the rank files go (a local path every worker can write).
    """

    def __init__(self, result_dir: str) -> None:
        super().__init__()
        self.result_dir = result_dir
        self._start = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Mark that the strategy's environment (the process group) is up."""
        recorder.RECORDER.mark("process_group")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Mark that the strategy has wrapped the module and optimizers."""
        recorder.RECORDER.mark("wrapped")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Start the step's clock (the first call also closes the set-up memory record)."""
        recorder.RECORDER.setup_done()  # no-op after the first call
        self._start = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Record the step (batch start to optimizer step end) and this batch end."""
        batch_end = time.perf_counter()
        step_end = getattr(pl_module, "step_end", None)
        if step_end is None:
            raise RuntimeError(
                f"StepTimes needs a module that records its optimizer step's end "
                f"(WorkloadModule); got {type(pl_module).__name__}."
            )
        rec = recorder.RECORDER
        rec.step_s.append(step_end[0] - self._start)
        rec.ends.append(batch_end)
        rec.marks.setdefault("first_step", step_end[1])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write this rank's record."""
        extra = {
            "local_rank": trainer.local_rank,
            "strategy": type(trainer.strategy).__name__,
        }
        recorder.write_summary(self.result_dir, trainer.global_rank, extra)


def trainer_options(spec: mlp.WorkloadSpec, result_dir: str) -> dict[str, Any]:
    """The ``pl.Trainer`` arguments both sides use, except the strategy and devices.

    One epoch of ``spec.steps`` batches per rank on CPU; no validation, checkpoints,
    logger, progress bar or model summary, so the loop does only what training needs.
    """
    return {
        "accelerator": "cpu",
        "max_epochs": 1,
        "max_steps": spec.steps,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "callbacks": [StepTimes(result_dir)],
    }


def main() -> None:
    """Fit the module with Lightning's ddp strategy on the torchrun-given rank."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    rec = recorder.RECORDER
    rec.marks["script_start"] = _START
    rec.mark("imported")
    spec = mlp.WorkloadSpec.from_json(args.spec)
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 and polytrain's workers
    world = int(os.environ["WORLD_SIZE"])
    trainer = pl.Trainer(
        strategy="ddp", devices=world, num_nodes=1, **trainer_options(spec, args.result_dir)
    )
    trainer.fit(WorkloadModule(spec))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
