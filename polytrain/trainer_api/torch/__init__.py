"""TorchTrainer: the driver side, the worker entry points, the operator, torch checkpoints."""
