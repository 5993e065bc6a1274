"""The warm worker pool: idle groups kept for the next trainer of the same shape.

- :mod:`~polytrain.launchers.pool.warm_pool`: taking and returning groups, eviction;
- :mod:`~polytrain.launchers.pool.groups`: the pooled group types (whole, resized);
- :mod:`~polytrain.launchers.pool.settings`: ``configure(max_idle=..., idle_timeout_s=...)``;
- :mod:`~polytrain.launchers.pool.reset`: a returned worker's per-process clean-up, through
  the hooks backends register (this package names no backend).

Users reach it through :mod:`polytrain.pool`.
"""
