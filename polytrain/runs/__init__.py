"""The one driver-side run loop under every front end.

- :mod:`~polytrain.runs.loop`: :class:`~polytrain.runs.loop.RunLoop`: start a worker group,
  run calls on it, watch it, carry the policies' decisions out (restart, resize, leave a
  draining node, stop);
- :mod:`~polytrain.runs.workload`: what a front end tells the loop
  (:class:`~polytrain.runs.workload.Workload`: its workers' set-up and state);
- :mod:`~polytrain.runs.watch`: the hang watchdog, the drain watch, the driver's
  termination signal, the progress bar: each reports an event;
- :mod:`~polytrain.runs.policies`: failure, scaling and drain: an event in, a decision
  as data out (tested without Ray);
- :mod:`~polytrain.runs.stop_at_step`: every rank stops a running call after the same step.

The creator-API trainers (:mod:`polytrain.trainer_api`), the function API
(:mod:`polytrain.train`), the Lightning launcher (:mod:`polytrain.lightning.launcher`)
and ``polytrain launch`` (:mod:`polytrain.cli.launch_runner`) all run on it.
"""
