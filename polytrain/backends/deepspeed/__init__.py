"""DeepSpeed ZeRO stages 0-3 on the workers' ``torch.distributed`` process group.

The trainer builds the model, the optimizer (``optimizer_creator``) and the
scheduler on every worker as usual. The backend binds three parts:

- :class:`DeepSpeedConfig`: typed options plus any DeepSpeed JSON config, checked
  when the trainer is built (and parsed by DeepSpeed's own validators);
- :class:`~polytrain.backends.deepspeed.rendezvous.DeepSpeedRendezvous` (driver
  side): the workers' process group (on CPU DeepSpeed's accelerator uses gloo);
- :class:`~polytrain.backends.deepspeed.strategy.DeepSpeedStrategy` (worker side):
  ``deepspeed.initialize`` on the model and the user's optimizer, which partitions
  the optimizer state (stage 1), the gradients (stage 2) and the parameters
  (stage 3) across the workers.

Checkpoints stay backend-independent
(:mod:`~polytrain.backends.deepspeed.state`): the consolidated fp32 weights keyed
like the user's module and the optimizer state in plain ``torch.optim`` format,
so a checkpoint written here loads under ``ddp`` at any world size and the other
way round.

The folder: ``config.py`` (the options; imports only the backend contracts and errors),
``backend.py`` (:class:`DeepSpeedBackend`, binding the parts), and the driver and worker
sides next to them. Importing this package imports no optional framework.
"""

from polytrain.backends.deepspeed.config import DeepSpeedConfig

__all__ = ["DeepSpeedConfig"]
