"""Recovery and feedback as small objects the trainer loop calls.

- :class:`FailurePolicy`: which errors restart the worker group, and how often;
- :class:`ScalingPolicy`: the size of a restarted group (elastic ``min_workers``)
  and when a shrunk group grows back;
- :class:`HangWatchdog`: a group that stopped making progress becomes a
  :class:`~polytrain.errors.WorkerHangError`;
- :class:`DrainWatch`: a node of the group that Ray drains (a preemption) becomes a
  :class:`~polytrain.trainer_api.policies.drain.DrainDecision`: stop at a step, move off it;
- :class:`ProgressReporter`: rank 0's progress as a tqdm bar on the driver.

They talk to the workers only through the
:class:`~polytrain.launchers.base.WorkerGroup` contract.
"""

from polytrain.trainer_api.policies.drain import DrainWatch
from polytrain.trainer_api.policies.failure import FailurePolicy
from polytrain.trainer_api.policies.progress import ProgressReporter
from polytrain.trainer_api.policies.scaling import ScalingPolicy
from polytrain.trainer_api.policies.watchdog import HangWatchdog

__all__ = ["DrainWatch", "FailurePolicy", "HangWatchdog", "ProgressReporter", "ScalingPolicy"]
