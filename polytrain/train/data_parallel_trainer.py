"""Ray Train's module path of ``DataParallelTrainer`` (``ray.train.data_parallel_trainer``)."""

from polytrain.train.trainer import DataParallelTrainer

__all__ = ["DataParallelTrainer"]
