"""``polytrain.train.torch``: Ray Train's ``ray.train.torch``, on every polytrain torch backend.

Example (a Ray Train loop; only the imports differ)::

    from polytrain.train import ScalingConfig, report
    from polytrain.train.torch import TorchTrainer, prepare_model, prepare_data_loader

    def train_loop_per_worker(config):
        model = prepare_model(torch.nn.Linear(4, 1))
        ...
        report({"loss": loss.item()})

    result = TorchTrainer(train_loop_per_worker, scaling_config=ScalingConfig(num_workers=2),
                          backend="ddp").fit()
"""

from __future__ import annotations

from polytrain.train.torch.prepare import (
    autocast,
    backward,
    clip_grad_norm_,
    full_state_dict,
    get_device,
    no_sync,
    prepare,
    prepare_data_loader,
    prepare_model,
    prepare_optimizer,
    step,
    zero_grad,
)
from polytrain.train.trainer import DataParallelTrainer

__all__ = [
    "TorchTrainer",
    "autocast",
    "backward",
    "clip_grad_norm_",
    "full_state_dict",
    "get_device",
    "no_sync",
    "prepare",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
    "step",
    "zero_grad",
]


class TorchTrainer(DataParallelTrainer):
    """Run ``train_loop_per_worker`` on every worker of a torch backend (Ray Train's ``TorchTrainer``).

    Args are those of :class:`~polytrain.train.trainer.DataParallelTrainer`; ``backend``
    is ``"ddp"`` by default and may be any polytrain torch backend (``horovod``,
    ``fairscale``, ``fsdp``, ``deepspeed``).
    """

    _default_backend = "ddp"
