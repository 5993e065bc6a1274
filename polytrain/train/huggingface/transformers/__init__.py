"""``polytrain.train.huggingface.transformers``: Ray Train's ``ray.train.huggingface.transformers``.

An HF ``Trainer`` (or a TRL trainer, its subclass) script runs unmodified inside
``train_loop_per_worker``; only the imports change::

    from polytrain.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    def train_loop_per_worker(config):
        trainer = transformers.Trainer(model=model, args=TrainingArguments(...), ...)
        trainer.add_callback(RayTrainReportCallback())  # HF checkpoints -> polytrain checkpoints
        trainer = prepare_trainer(trainer)              # checks; Ray Data shards as loaders
        trainer.train()

:class:`RayTrainReportCallback` reports the Trainer's logged metrics and each HF
checkpoint it saves (``report(metrics, checkpoint)``); :func:`prepare_trainer`
refuses a backend or an Accelerate setting the Trainer cannot train with and feeds
``get_dataset_shard(...).iter_torch_batches()`` to the Trainer as its loaders. How
the backend reaches the Trainer (DDP, FSDP, DeepSpeed through Accelerate's
environment) is in :mod:`polytrain.train.huggingface.accelerate_scope`.

Raises on import:
    MissingDependencyError: ``transformers`` (or ``accelerate``) is not installed.
"""

from __future__ import annotations

from polytrain.compat.imports import require

require("transformers", "polytrain.train.huggingface.transformers")
require("accelerate", "polytrain.train.huggingface.transformers (the HF Trainer's Accelerate)")

from polytrain.train.huggingface.transformers.callback import RayTrainReportCallback  # noqa: E402
from polytrain.train.huggingface.transformers.prepare import prepare_trainer  # noqa: E402

__all__ = ["RayTrainReportCallback", "prepare_trainer"]
