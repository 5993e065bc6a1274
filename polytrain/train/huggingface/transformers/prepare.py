"""``prepare_trainer``: check an HF Trainer against the backend, feed it Ray Data shards."""

from __future__ import annotations

from typing import Any

import transformers
from torch.utils.data import DataLoader, IterableDataset

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.train import session as train_session
from polytrain.train.huggingface.accelerate_scope import AccelerateScope, check_state, get_scope

#: The TRL release whose trainers are all ``transformers.Trainer`` subclasses (PPO included).
TRL_MIN_VERSION = "0.12"


def _scope(caller: str) -> AccelerateScope:
    train_session.current(caller)  # raises outside a loop, naming where to call it
    scope = get_scope()
    if scope is None:
        raise ConfigError(
            f"polytrain.train.{caller}() needs a torch loop: this loop runs on a TensorFlow "
            f"backend. Use polytrain.train.torch.TorchTrainer (backend 'ddp', 'fsdp' or "
            f"'deepspeed')."
        )
    return scope


def check_trainer_setup(what: str) -> None:
    """Worker: the Accelerator the Trainer built trains as the backend does.

    Raises:
        SessionMisuseError: outside a training loop.
        ConfigError: the backend cannot run the Trainer, or the Trainer's Accelerate
            setup contradicts it.
    """
    from accelerate.state import AcceleratorState

    scope = _scope("huggingface.transformers.prepare_trainer")
    check_state(scope, AcceleratorState(), what)


def _check_trainer_type(trainer: Any) -> None:
    if isinstance(trainer, transformers.Trainer):
        return
    module = type(trainer).__module__ or ""
    if module.split(".")[0] == "trl":
        import trl

        raise ConfigTypeError(
            f"prepare_trainer got {type(trainer).__name__} from trl {trl.__version__}, which is "
            f"not a transformers.Trainer: it has no callback hooks (add_callback, on_save), so "
            f"RayTrainReportCallback could never report. TRL >= {TRL_MIN_VERSION} trainers are "
            f"Trainer subclasses: pip install -U 'trl>={TRL_MIN_VERSION}'."
        )
    raise ConfigTypeError(
        f"prepare_trainer takes a transformers.Trainer (or a subclass, such as TRL's "
        f"SFTTrainer); got {type(trainer).__name__}: {trainer!r}."
    )


def prepare_trainer(trainer: transformers.Trainer) -> transformers.Trainer:
    """Prepare an HF ``Trainer`` for this worker (Ray Train's ``prepare_trainer``).

    Call it inside ``train_loop_per_worker`` after building the Trainer. It

    - refuses a backend the Trainer cannot train on (horovod, fairscale; fsdp and
      deepspeed on CPU workers, where Accelerate cannot shard) and an Accelerate
      setting of the script that contradicts the backend (``TrainingArguments(fsdp=...)``
      on ddp, ``deepspeed=...`` on fsdp, ...), each with the reason;
    - refuses the trainer's ``use_fp16`` unless the ``TrainingArguments`` set
      ``fp16`` or ``bf16`` (the Trainer takes its precision from them);
    - makes the Trainer read Ray Data shards
      (``get_dataset_shard(name).iter_torch_batches(...)`` as ``train_dataset`` or
      ``eval_dataset``, also in a dict of eval sets) batch by batch, as given: each
      worker trains on its own shard.

    The backend reaches the Trainer through Accelerate's environment, set for the
    loop before the Trainer was built (:mod:`polytrain.train.huggingface.accelerate_scope`):
    DDP on ddp, Accelerate's FSDP plugin from the fsdp backend's options, its
    DeepSpeed plugin from the deepspeed backend's config.

    Args:
        trainer: a ``transformers.Trainer`` or subclass (TRL's ``SFTTrainer``, ...).

    Returns:
        The same object, now of a subclass of its class that reads Ray Data shards.

    Raises:
        SessionMisuseError: called outside ``train_loop_per_worker``.
        ConfigTypeError: not a ``transformers.Trainer`` (an old TRL trainer without the
            callback hooks included).
        ConfigError: see above.
    """
    _check_trainer_type(trainer)
    scope = _scope("huggingface.transformers.prepare_trainer")
    check_state(scope, trainer.accelerator.state, "prepare_trainer")
    session = train_session.current("huggingface.transformers.prepare_trainer")
    args = trainer.args
    if session.worker_context.use_fp16 and not (args.fp16 or args.bf16):
        raise ConfigError(
            "The trainer's use_fp16=True does not reach the HF Trainer, which takes its "
            "precision from its TrainingArguments: set TrainingArguments(fp16=True) (GPU) or "
            "bf16=True, and drop use_fp16 from the polytrain trainer."
        )
    base = type(trainer)
    if not getattr(base, "_polytrain_prepared", False):
        trainer.__class__ = type(
            base.__name__, (_RayDataLoaders, base), {"_polytrain_prepared": True}
        )
    return trainer


class _ShardDataset(IterableDataset):
    """A Ray Data iterable (``iter_torch_batches``) as a torch dataset of its batches."""

    def __init__(self, batches: Any) -> None:
        super().__init__()
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


def _is_ray_iterable(value: Any) -> bool:
    try:
        from ray.data.iterator import _IterableFromIterator
    except ImportError:  # pragma: no cover - Ray Data is part of ray[default]
        return False
    return isinstance(value, _IterableFromIterator)


def _batches_loader(batches: Any) -> DataLoader:
    # batch_size=1 with an unwrapping collate: every item already is a batch.
    return DataLoader(_ShardDataset(batches), batch_size=1, collate_fn=_first)


def _first(items: list[Any]) -> Any:
    return items[0]


class _RayDataLoaders:
    """Mixed in before the Trainer's class: Ray Data shards become its loaders, as they are."""

    def get_train_dataloader(self) -> DataLoader:
        """The shard's batches, else the Trainer's own loader."""
        if _is_ray_iterable(self.train_dataset):
            return _batches_loader(self.train_dataset)
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """The eval shard's batches (also one of a dict of eval sets, by name), else the Trainer's."""
        chosen = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(chosen, str) and isinstance(self.eval_dataset, dict):
            chosen = self.eval_dataset[chosen]
        if _is_ray_iterable(chosen):
            return _batches_loader(chosen)
        return super().get_eval_dataloader(eval_dataset)
