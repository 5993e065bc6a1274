"""TorchTrainer: train PyTorch creators on any torch backend with one flag."""

from __future__ import annotations

import functools
import os
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.parallelism import refuse_tp_with_peft_config
from polytrain.backends.core.step_options import step_options
from polytrain.checkpoint import safetensors_export
from polytrain.checkpoint.directory import SaveRequest
from polytrain.checkpoint.pieces import FROZEN_KEY, left_out, with_left_out
from polytrain.errors import CheckpointError, ConfigError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.ranks import split_batch_size
from polytrain.trainer_api.creators import TorchCreators
from polytrain.trainer_api.data import ray_data
from polytrain.trainer_api.options.configs import (
    CheckpointConfig,
    FailureConfig,
    ScalingConfig,
)
from polytrain.trainer_api.profiling import reduce_profiles
from polytrain.trainer_api.results import combine_call_stats, reduce_worker_stats
from polytrain.trainer_api.torch import export as torch_export
from polytrain.trainer_api.torch import worker as torch_worker
from polytrain.trainer_api.torch.calls import check_call_options, driver_keys, operator_class
from polytrain.trainer_api.torch.operator import TrainingOperator
from polytrain.trainer_api.trainer import BaseTrainer

#: The parts of a checkpoint dict the workers load (the rest is the envelope).
_STATE_KEYS = ("models", "optimizers", "schedulers", "scaler", "operator", "global_step")
_STATE_KEYS += (FROZEN_KEY,)  # which frozen parameters the checkpoint left out


def _data_source(datasets: Any, data_creator: Any) -> tuple[Any, Any]:
    """The checked Ray Data ``datasets`` and the data creator that serves the workers."""
    checked = ray_data.check_datasets(datasets, data_creator)
    return checked, data_creator if checked is None else ray_data.shard_loaders


class TorchTrainer(BaseTrainer):
    """Train a PyTorch model on Ray workers with any torch backend.

    Example:
        >>> trainer = TorchTrainer(
        ...     model_creator=lambda config: torch.nn.Linear(64, 10),
        ...     data_creator=digits_creator,
        ...     optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=config["lr"]),
        ...     loss_creator=torch.nn.CrossEntropyLoss,
        ...     config={"lr": 0.1, "batch_size": 64},
        ...     num_workers=2, backend="ddp")
        >>> stats = trainer.train()
        >>> trainer.save("ckpt.pt"); trainer.shutdown()

    Args:
        model_creator: ``config -> nn.Module`` (or a tuple of modules).
        data_creator: ``config -> train_loader`` or ``(train_loader, val_loader)``. It is
            called on every worker with ``config["batch_size"]`` set to the per-worker
            batch: the global ``batch_size // num_workers`` (the remainder is dropped,
            with a warning). A ``DistributedSampler`` is added to the loaders unless
            ``add_dist_sampler=False``. Leave it out when ``datasets`` is given.
        optimizer_creator: ``(model, config) -> Optimizer`` (or a tuple); gets the tuple
            of models when ``model_creator`` returns several.
        loss_creator: a loss class (``torch.nn.CrossEntropyLoss``) or ``config -> callable``;
            optional for models whose output carries its loss (``output.loss``).
        scheduler_creator: ``(optimizer, config) -> scheduler``, optional.
        training_operator_cls: a :class:`TrainingOperator` subclass for custom steps.
        config: the user's hyperparameters; ``batch_size`` is the global batch.
        num_workers: shortcut for ``scaling_config.num_workers`` (0 = local mode).
        use_gpu: shortcut for ``scaling_config.use_gpu``.
        num_cpus_per_worker: shortcut for ``scaling_config.num_cpus_per_worker``.
        backend: a backend name or alias (see :func:`polytrain.available_backends`) or a
            :class:`~polytrain.backends.Backend` instance.
        backend_config: the backend's typed config, or a dict of its fields.
        use_fp16: alias of ``precision="fp16"`` (fp16 + GradScaler on GPU, bf16 on CPU).
        max_grad_norm: clip the global gradient norm to this before every optimizer step
            and report ``grad_norm`` (the norm before clipping); None: off.
        gradient_accumulation_steps: batches per optimizer step; ``num_steps`` and
            ``global_step`` count optimizer steps (see docs/language-models.md).
        precision: "fp32" (default), "bf16" or "fp16" (see :class:`~polytrain.backends.core.step_options.StepOptions`).
        activation_checkpointing: True (HF gradient checkpointing, else the repeated
            blocks) or a list of module classes / class names to recompute in backward
            (non-reentrant), applied before the backend wraps the model; False: off.
        compile: ``torch.compile`` the model on every worker after the backend wrapped it
            (ddp, fsdp version 2, horovod, fairscale sddp/oss, deepspeed, local mode; fsdp
            version 1 and fairscale mode "fsdp" refuse it at construction).
        parallelism: the device mesh, ``{"dp_replicate": R, "dp_shard": S, "tp": T}``
            (``R * S * T == num_workers``; -1: the rest): HSDP (R replicas of S-way
            sharding, replicas across nodes) and tensor parallelism (T workers of a node
            split each block) on the fsdp backend; tp as AutoTP and dp_replicate as hpZ on
            deepspeed where it supports them; other backends refuse all but plain data
            parallelism. ``config["batch_size"]`` is split over the ``R * S`` data-parallel
            workers. See docs/parallelism.md.
        tp_plan: ``{module name pattern: style}`` for a model without a built-in
            tensor-parallel plan (HF Llama-style and GPT-2 have one); styles are torch
            ``ParallelStyle`` instances or names ("colwise", "rowwise", ...).
        use_tqdm: show rank 0's progress as a bar on the driver.
        scheduler_step_freq: "batch", "epoch" or "manual" (your operator steps it).
        add_dist_sampler: give the loaders a distributed sampler.
        check_finite_loss: raise at the first NaN/inf loss, naming step and rank.
        scaling_config: :class:`ScalingConfig` (or dict): workers, resources, placement.
        failure_config: :class:`FailureConfig` (or dict): retries, hang detection.
        checkpoint_config: :class:`CheckpointConfig` (or dict): where checkpoints go.
        init_hook: a function of no arguments run on every worker after it starts (and
            after a restart), before the process group and the creators (RaySGD's
            ``initialization_hook``).
        loggers: experiment trackers (Logger instances or "tensorboard", "mlflow",
            "wandb", "csv") that get the reduced metrics of every call.
        datasets: Ray Data input instead of ``data_creator``: ``{"train": ds, "val": ds}``
            (``ray.data.Dataset``), split between the workers with ``streaming_split``;
            batches are tuples of the columns in order, label last (dicts of the
            columns for token data: an ``input_ids`` column; see
            :mod:`polytrain.trainer_api.data.ray_data`).
        peft_config: a ``peft.PeftConfig`` (``peft.LoraConfig(r=8, target_modules=[...])``)
            or a dict of one with its ``peft_type``: the model ``model_creator`` returns is
            wrapped with ``peft.get_peft_model`` wherever it is built; only the adapters
            train (see docs/fine-tuning.md).
    """

    framework = "torch"
    checkpoint_worker_module = torch_worker
    stops_at_steps = True

    def __init__(
        self,
        *,
        model_creator: Callable[[dict], Any],
        data_creator: Callable[[dict], Any] | None = None,
        optimizer_creator: Callable[[Any, dict], Any],
        loss_creator: Any = None,
        scheduler_creator: Callable[[Any, dict], Any] | None = None,
        training_operator_cls: type[TrainingOperator] | None = None,
        config: dict[str, Any] | None = None,
        num_workers: int | None = None,
        use_gpu: bool | None = None,
        num_cpus_per_worker: float | None = None,
        backend: str | Backend = "ddp",
        backend_config: Any = None,
        use_fp16: bool = False,
        use_tqdm: bool = False,
        scheduler_step_freq: str = "batch",
        add_dist_sampler: bool = True,
        check_finite_loss: bool = True,
        scaling_config: ScalingConfig | dict | None = None,
        failure_config: FailureConfig | dict | None = None,
        checkpoint_config: CheckpointConfig | dict | None = None,
        init_hook: Callable[[], None] | None = None,
        loggers: Any = None,
        datasets: dict[str, Any] | None = None,
        max_grad_norm: float | None = None,
        gradient_accumulation_steps: int = 1,
        precision: str | None = None,
        activation_checkpointing: bool | list[Any] = False,
        compile: bool = False,
        peft_config: Any = None,
        parallelism: dict[str, int] | None = None,
        tp_plan: dict[str, Any] | None = None,
    ) -> None:
        step = (max_grad_norm, gradient_accumulation_steps, precision, use_fp16)
        self.step = step_options(*step, activation_checkpointing, compile)
        self.datasets, data_creator = _data_source(datasets, data_creator)
        self.operator_cls = operator_class(training_operator_cls, scheduler_step_freq)
        creators = (model_creator, data_creator, optimizer_creator, loss_creator, scheduler_creator)
        self.creators = TorchCreators(*creators, peft_config=peft_config)
        super().__init__(
            backend=backend,
            backend_config=backend_config,
            config=config,
            num_workers=num_workers,
            use_gpu=use_gpu,
            num_cpus_per_worker=num_cpus_per_worker,
            scaling_config=scaling_config,
            failure_config=failure_config,
            checkpoint_config=checkpoint_config,
            use_fp16=self.step.mixed,
            use_tqdm=use_tqdm,
            init_hook=init_hook,
            loggers=loggers,
        )
        self.worker_config = self._configure_backend(parallelism, tp_plan)
        self.scheduler_step_freq, self.add_dist_sampler = scheduler_step_freq, add_dist_sampler
        self.check_finite_loss = check_finite_loss
        self._start()

    def _configure_backend(self, parallelism: Any, tp_plan: Any) -> dict[str, Any]:
        """Check the step options and the mesh with the backend; the per-worker config."""
        self.backend.validate_step_options(self.step)  # compile=True too
        workers = self.scaling.num_workers
        self.backend.configure_parallelism(
            parallelism, tp_plan, num_workers=workers, min_workers=self.scaling.min_workers
        )
        if self.creators.peft_config is not None and self.backend.parallelism is not None:
            # The workers refuse an adapted model under TP too (get_peft_model in a creator).
            refuse_tp_with_peft_config(self.backend.parallelism.tp)
        # Validates the global batch against the data-parallel workers (TP peers share one).
        return self._per_worker_config(self.config, self.backend.data_parallel_size(workers))

    @staticmethod
    def _per_worker_config(
        config: dict[str, Any], num_workers: int, warn: bool = True
    ) -> dict[str, Any]:
        """``config`` with ``batch_size`` (the global batch, already checked) split between workers."""
        worker_config = dict(config)
        if "batch_size" in config:
            global_batch = config["batch_size"]
            per_worker = split_batch_size(global_batch, num_workers)
            if warn and num_workers > 1 and global_batch % num_workers:
                warnings.warn(
                    f"batch_size={global_batch} does not divide by num_workers={num_workers}: "
                    f"each worker uses {per_worker}, so the effective global batch is "
                    f"{per_worker * num_workers}.",
                    stacklevel=3,
                )
            worker_config["batch_size"] = per_worker
        return worker_config

    # ------------------------------------------------------------- workers
    def setup_workers(self, group: WorkerGroup) -> None:
        """Run loop: build the creators' components on every worker of a new group."""
        if self.datasets is not None:  # a fresh split for every group: no stale coordinator
            shards = ray_data.split(self.datasets, len(group))
            group.get(
                [
                    group.execute_single_async(rank, ray_data.receive_shards, shard)
                    for rank, shard in enumerate(shards)
                ]
            )
        setup = torch_worker.WorkerSetup(
            creators=self.creators,
            operator_cls=self.operator_cls,
            backend=self.backend,
            config=self._per_worker_config(
                self.config, self.backend.data_parallel_size(len(group)), warn=False
            ),
            context=self._context_template(),
            scheduler_step_freq=self.scheduler_step_freq,
            add_dist_sampler=self.add_dist_sampler,
            check_finite_loss=self.check_finite_loss,
        )
        refs = [
            group.execute_single_async(rank, torch_worker.setup_worker, setup, info, device)
            for rank, (info, device) in enumerate(
                zip(group.rank_infos, group.device_indices, strict=True)
            )
        ]
        group.get(refs)

    def _worker_state(self) -> dict[str, Any]:
        return self._run(torch_worker.get_state, self.epoch)[0]

    def _load_worker_state(self, state: dict[str, Any]) -> None:
        payload = {key: state[key] for key in _STATE_KEYS if key in state}
        self._run(torch_worker.load_state, self._share(payload))

    # ------------------------------------------------------------ training
    def train(
        self,
        num_steps: int | None = None,
        info: dict[str, Any] | None = None,
        *,
        profile: bool = False,
        reduce_results: bool = True,
        max_retries: int | None = None,
        end_epoch: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Train the rest of the current epoch, or ``num_steps`` batches of it, on every worker.

        Calls continue the epoch where the previous one stopped: the workers keep
        their loader's iterator, and the epoch ends (the sampler moves on to the
        next shuffle) only when the loader is exhausted. A call that reaches the
        end of the epoch stops there, with fewer than ``num_steps`` batches, as in
        RaySGD; so ``for _ in range(k): trainer.train(num_steps=100)`` walks
        through the epochs, and ``train()`` finishes the current one.

        Args:
            num_steps: at most this many batches (per worker); None: to the end of the epoch.
            info: passed to the operator's ``train_epoch`` and every ``train_batch``.
            profile: add ``profile``: the time per phase (``data_s``, ``forward_s``,
                ``backward_s``, ``step_s``, ``other_s``, ``total_s``, the mean over the
                workers; ``capture_s``, ``reduce_s``, ``driver_s``), see
                :mod:`polytrain.trainer_api.profiling`.
            reduce_results: False returns every worker's own metrics, a list in rank order.
            max_retries: restarts allowed for this call after a lost or hung worker,
                instead of ``failure_config.max_retries`` (RaySGD's per-call option).
            end_epoch: end the epoch after this call even if the loader has batches left:
                a shortened epoch (like Lightning's ``limit_train_batches``); the next
                call starts the next epoch with its new shuffle. ``train(num_steps=N,
                end_epoch=True)`` is an epoch of at most N batches.

        Returns:
            Metrics reduced over workers, weighted by sample count: ``epoch`` (the
            epoch the batches belonged to, from 0), ``loss``, ``num_samples``,
            ``num_steps``, ``samples_per_s``, ``epoch_time_s`` (this call's time),
            ``num_restarts``, ``num_workers``, ``checkpoint_path`` (when the call ended
            an epoch with a ``checkpoint_dir``) and whatever a custom operator's
            ``train_batch`` returns.
        """
        check_call_options(num_steps, info)
        self._begin_call(max_retries)

        def once(steps: int | None, ends: bool, due: bool) -> Any:
            return self._train_once(steps, info, profile, ends, max_retries, due)

        with self.termination.watching():  # SIGTERM: a checkpoint at the next boundary
            if self._step_plan.active and self._keeps_state:
                stats, results = self._train_in_pieces(once, num_steps, end_epoch)
            else:
                stats, results, _, _ = once(num_steps, end_epoch, False)
            self._log("train", stats)
            self._stop_if_terminated()
        return stats if reduce_results else self._raw(results, stats)

    def _train_in_pieces(
        self, once: Callable[[int, bool, bool], Any], num_steps: int | None, end_epoch: bool
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One ``train()`` call as worker calls that end where a mid-epoch checkpoint is due.

        The plan (``CheckpointConfig.every_n_steps`` / ``every_s``) sizes each piece;
        the pieces train exactly the batches one call would have (calls continue the
        epoch), and a termination signal ends the call after the running piece.
        """
        plan, parts, left = self._step_plan, [], num_steps
        while True:
            piece, due = plan.next_piece(left)
            last = left is not None and piece >= left
            start = time.monotonic()
            stats, results, wrote, epoch_done = once(piece, end_epoch and last, due)
            steps = int(stats.get("num_steps", 0) or 0)
            plan.record(steps, time.monotonic() - start, wrote)
            parts.append(stats)
            if left is not None:
                left -= steps
            stopped = self.termination.requested()
            if stopped or epoch_done or steps < piece or (left is not None and left <= 0):
                return combine_call_stats(parts), results

    def _train_once(
        self,
        num_steps: int | None,
        info: dict[str, Any] | None,
        profile: bool,
        end_epoch: bool,
        max_retries: int | None,
        checkpoint_due: bool,
    ) -> tuple[dict[str, Any], list[dict[str, Any]], bool, bool]:
        """``num_steps`` of training: ``(stats, per-worker results, wrote a checkpoint, epoch ended)``.

        One worker call, unless a node of the group drains during it: then the call
        stops after an agreed step, the group moves off the node from a checkpoint
        there (:meth:`_leave_drained_nodes`) and the rest of the steps run on it.
        """
        parts, left = [], num_steps
        while True:
            piece = self._train_piece(left, info, profile, end_epoch, max_retries, checkpoint_due)
            stats, results, wrote, epoch_done = piece
            parts.append(stats)
            if self.loop.pending_drain is None:
                break
            self._leave_drained_nodes()
            if left is not None:
                left -= int(stats.get("num_steps", 0) or 0)
            if epoch_done or (left is not None and left <= 0):
                wrote = True  # the checkpoint at the drain is where this call ends
                break
        return combine_call_stats(parts), results, wrote, epoch_done

    def _train_piece(
        self,
        num_steps: int | None,
        info: dict[str, Any] | None,
        profile: bool,
        end_epoch: bool,
        max_retries: int | None,
        checkpoint_due: bool,
    ) -> tuple[dict[str, Any], list[dict[str, Any]], bool, bool]:
        """One worker call: ``(stats, per-worker results, wrote a checkpoint, epoch ended)``."""
        start = time.perf_counter()
        results = self._run(
            torch_worker.train_epoch,
            progress=f"epoch {self.epoch}",
            max_retries=max_retries,
            args_fn=lambda: (
                self._train_call(num_steps, info, profile, end_epoch, checkpoint_due),
            ),
        )
        state, path, cursor, written = driver_keys(results)
        stats = self._reduce(results, start)
        self._end_call(stats, cursor)
        if written[0] is not None:  # the workers wrote a checkpoint directory
            self.checkpoints.keep_directory(stats, written)
        else:
            self.checkpoints.keep_state(stats, state, path)
        return stats, results, written[0] is not None, bool(cursor["epoch_done"])

    def _train_call(
        self,
        num_steps: int | None,
        info: dict[str, Any] | None,
        profile: bool,
        end_epoch: bool,
        checkpoint_due: bool = False,
    ) -> torch_worker.TrainCall:
        capture = mid = None
        # Local mode loses no worker: it captures only for checkpoint_dir's files.
        if self._keeps_state and not (
            self.scaling.local_mode and self.checkpoint.checkpoint_dir is None
        ):
            if (
                self.checkpoints.workers_see_directory()
            ):  # each worker writes its part, the driver keeps the path
                capture = self.checkpoints.request(self.epoch + 1)
                if checkpoint_due and num_steps:  # where this call will stop, inside the epoch
                    batches = num_steps * self.step.gradient_accumulation_steps
                    mid = self.checkpoints.request(self.epoch, self.position.epoch_step + batches)
            else:
                envelope = {
                    k: v for k, v in self.checkpoints.wrap_state({}).items() if k != "epoch"
                }
                capture = torch_worker.StateCapture(envelope, None)
        return torch_worker.TrainCall(
            self.epoch,
            self.position.epoch_step,
            num_steps,
            info,
            profile,
            capture,
            bool(end_epoch),
            mid,
            self._open_stoppable_call(self.step.gradient_accumulation_steps),
        )

    def _reduce(self, results: list[dict[str, Any]], start: float) -> dict[str, Any]:
        reduce_start = time.perf_counter()
        profiles = [r.pop("profile", None) for r in results]
        stats = reduce_worker_stats(results)
        if any(profiles):
            profile = reduce_profiles(profiles)
            profile["reduce_s"] = time.perf_counter() - reduce_start
            profile["driver_s"] = time.perf_counter() - start
            stats["profile"] = profile
            for result, own in zip(results, profiles, strict=True):
                result["profile"] = own
        return stats

    @staticmethod
    def _raw(results: list[dict[str, Any]], stats: dict[str, Any]) -> list[dict[str, Any]]:
        for result in results:
            for key in ("epoch", "num_restarts", "num_workers", "checkpoint_path"):
                if key in stats:
                    result[key] = stats[key]
        return results

    def validate(
        self,
        num_steps: int | None = None,
        info: dict[str, Any] | None = None,
        *,
        profile: bool = False,
        reduce_results: bool = True,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Evaluate on the validation loader (all of it, or ``num_steps`` batches per worker).

        Returns ``val_loss`` (and ``val_accuracy``), ``num_samples``, ``num_steps``
        and ``time_s``, reduced over workers (a list in rank order with
        ``reduce_results=False``); ``profile`` as for :meth:`train`.
        """
        check_call_options(num_steps, info)
        start = time.perf_counter()
        results = self._run(torch_worker.validate, num_steps, info, profile)
        stats = self._reduce(results, start)
        self._log("val", stats)
        return stats if reduce_results else results

    def update_scheduler(self, metric: Any) -> None:
        """Call ``scheduler.step(metric)`` on every worker's schedulers (e.g. ReduceLROnPlateau).

        For ``scheduler_step_freq="manual"`` with a metric-driven scheduler::

            val = trainer.validate()
            trainer.update_scheduler(val["val_loss"])
        """
        self._run(torch_worker.update_scheduler, metric)

    def follow_config(self, old: dict[str, Any]) -> None:
        """The optimizers take the hyperparameters ``config`` changed from ``old`` (``lr`` scaled).

        Each changed hyperparameter (``lr``, ``momentum``, ...) is found by building the
        optimizers under both configs on every worker; ``lr`` is scaled by new/old and the
        schedulers' base learning rates follow, so a schedule keeps its progress.
        """
        self.apply_all_operators(
            functools.partial(torch_worker.retune_optimizers, self.creators, old)
        )

    def apply_all_operators(self, fn: Callable[[TrainingOperator], Any]) -> list[Any]:
        """Run ``fn(operator)`` on every worker's :class:`TrainingOperator`; results in rank order."""
        return self._run(torch_worker.apply_to_operator, fn)

    def save_pretrained(
        self,
        path: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        *,
        model_index: int = 0,
        merge: bool = False,
    ) -> dict[str, Any]:
        """The trained model in the Hugging Face layout (a PEFT model: its adapter), from the workers.

        ``path`` gets ``model.safetensors`` (above ``max_shard_size``:
        ``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``)
        and, for a ``transformers`` model, ``config.json`` (and ``generation_config.json``)
        as its ``save_pretrained`` writes them, so ``AutoModelForCausalLM.from_pretrained(path)``
        loads it. Tied weights are written once, as HF and ``safetensors.torch.save_model``
        do. Every worker writes the model tensors it holds, then rank 0 assembles the
        files one shard at a time: no tensor travels through the driver. ``path`` is as
        rank 0 sees it; the files appear there together when the export is complete.

        A ``peft`` model writes its adapter (PEFT's layout) or, ``merge=True``, the merged
        model; one ``from_pretrained`` would load wrongly is refused (docs/fine-tuning.md).

        Args:
            path: a new or empty local directory.
            max_shard_size: bytes per safetensors file, or ``"5GB"`` (HF's default), ``"200MB"``.
            model_index: which model, when ``model_creator`` returns several.
            merge: write a PEFT model merged into its base (LoRA) instead of its adapter.

        Returns:
            ``{"path", "files", "total_size"}`` (and ``"sharded"`` in HF's layout).

        Raises:
            CheckpointError: ``path`` exists and is not empty (checked before anything is
                written), or the export was refused (the reason is in the message).
            ConfigError: ``max_shard_size`` is not a size, or the workers cannot share a
                directory to write into (another node without a shared ``checkpoint_dir``).
        """
        self._ensure_open()
        target = safetensors_export.check_target(path)
        safetensors_export.parse_max_shard_size(max_shard_size)
        if not self.checkpoints.workers_see_directory():
            raise ConfigError(
                "save_pretrained needs a directory every worker sees (the workers write their "
                "shards there first): set checkpoint_config={'checkpoint_dir': ...} on storage "
                "every node sees (NFS, or an fsspec URL such as s3://bucket/run)."
            )
        root = self.checkpoint_manager.root()
        name = f".polytrain-export-{uuid.uuid4().hex[:12]}"
        state = SaveRequest(url=root.url_of(name), header=self.checkpoints.header(self.epoch))
        request = torch_export.ExportRequest(state, str(target), max_shard_size, model_index, merge)
        try:
            results = self._run(
                torch_worker.apply_to_operator,
                functools.partial(torch_export.save_pretrained_operator, request=request),
            )
        finally:
            root.child(name).remove()
        if "error" in results[0]:
            raise CheckpointError(f"save_pretrained({str(path)!r}) failed: {results[0]['error']}")
        return results[0]

    def get_model(self) -> torch.nn.Module | list[torch.nn.Module] | tuple[torch.nn.Module, ...]:
        """The trained model(s) as plain modules on the driver's CPU.

        Shaped as ``model_creator`` returned them: one module, or the list or tuple of
        several.
        """
        state = self.state_dict()
        models = self.creators.create_models(self.config)
        for index, (model, model_state) in enumerate(zip(models, state["models"], strict=True)):
            # A run with frozen parameters saves what it trains; the rest is the creator's.
            model.load_state_dict(with_left_out(model_state, model, left_out(state, index)))
            model.cpu()
        return models.as_returned()
