"""The contracts every backend implements, and what the torch backends share.

- :mod:`~polytrain.backends.core.backend`: :class:`Backend` and :class:`BackendConfig`;
- :mod:`~polytrain.backends.core.rendezvous`: the driver side;
- :mod:`~polytrain.backends.core.strategy`: the worker side (torch, Keras);
- :mod:`~polytrain.backends.core.precision`: mixed precision;
- :mod:`~polytrain.backends.core.context`: what a worker knows about itself;
- :mod:`~polytrain.backends.core.sharding`: optimizer-sharding helpers;
- :mod:`~polytrain.backends.core.torch_distributed`: the process-group rendezvous.
"""
