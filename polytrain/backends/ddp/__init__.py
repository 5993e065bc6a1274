"""PyTorch DistributedDataParallel on ``torch.distributed``.

The folder: ``config.py`` (the options; imports only the backend contracts and errors),
``backend.py`` (:class:`DDPBackend`, binding the parts), and the driver and worker
sides next to them. Importing this package imports no optional framework.
"""

from polytrain.backends.ddp.config import DDPConfig

__all__ = ["DDPConfig"]
