"""A trainer's checkpoints: the driver's orchestration and the workers' writer.

- :mod:`~polytrain.trainer_api.checkpointing.manager`: where the workers write, retention;
- :mod:`~polytrain.trainer_api.checkpointing.step_plans`: mid-epoch checkpoints;
- :mod:`~polytrain.trainer_api.checkpointing.recovery`: what a restarted group resumes from;
- :mod:`~polytrain.trainer_api.checkpointing.trainer_checkpoints`: the object a trainer
  holds for its checkpoints (requests, recovery points, save, load);
- :mod:`~polytrain.trainer_api.checkpointing.worker_writer`: plan, snapshot, write on a worker.

The on-disk format is :mod:`polytrain.checkpoint`, a floor below this package.
"""
