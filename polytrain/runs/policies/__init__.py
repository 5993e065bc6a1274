"""The run loop's policies: an event in (a failure, a drain, a shrunk cluster), a decision as data out.

- :class:`~polytrain.runs.policies.failure.FailurePolicy`: which failed calls restart the
  group, and how often (:class:`~polytrain.runs.policies.failure.FailureDecision`);
- :class:`~polytrain.runs.policies.scaling.ScalingPolicy`: the size of a restarted group
  (elastic ``min_workers``) and when a shrunk group grows back;
- :class:`~polytrain.runs.policies.drain.DrainPolicy`: whether the run moves off a
  draining node (:class:`~polytrain.runs.policies.drain.LeaveNodes`) or stops
  (:class:`~polytrain.runs.policies.drain.StopRun`).

None of them touches a worker group: the run loop (:mod:`polytrain.runs.loop`) carries
their decisions out, so each is tested without Ray.
"""
