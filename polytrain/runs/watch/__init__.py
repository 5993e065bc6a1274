"""What the run loop watches while a call runs; each watch reports an event, none acts.

- :class:`~polytrain.runs.watch.hang.HangWatchdog`: a group that stopped making progress
  becomes a :class:`~polytrain.errors.WorkerHangError`;
- :class:`~polytrain.runs.watch.drains.DrainWatch`: a node of the group that Ray drains
  becomes a :class:`~polytrain.runs.watch.drains.DrainEvent`;
- :class:`~polytrain.runs.watch.termination.TerminationWatch`: the driver's SIGTERM
  (a scheduler's "stop soon") becomes a flag the loop reads at the next boundary;
- :class:`~polytrain.runs.watch.progress.ProgressReporter`: rank 0's progress as a tqdm
  bar on the driver.

They talk to the workers only through the :class:`~polytrain.launchers.base.WorkerGroup`
contract.
"""
