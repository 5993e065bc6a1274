"""The offline GPU check: polytrain's GPU paths proven on a bare CUDA machine in minutes.

``scripts/gpu_check.sh`` drives it (docs/gpu-check.md). Its parts:

- :mod:`~polytrain.tools.gpu_check.bundle`: ``prepare`` builds the offline bundle
  (polytrain's wheel, DeepSpeed and fairscale wheels, what else the target lacks;
  at most 60 MiB, with a manifest), ``verify`` checks it, ``split`` / ``join`` carry
  a wheel too large for one bundle (Ray's) in parts;
- :mod:`~polytrain.tools.gpu_check.run`: the check itself (one command);
- :mod:`~polytrain.tools.gpu_check.worker`: the torchrun process that runs the cases;
- :mod:`~polytrain.tools.gpu_check.cases`, :mod:`~polytrain.tools.gpu_check.workload`:
  what is run and compared, the tolerances, FLOPs and peaks;
- :mod:`~polytrain.tools.gpu_check.report`: the JSON report, its table and its
  dated section of ``benchmarks/RESULTS.md``.

It ships inside polytrain's wheel because the target machine gets nothing else:
``python -m polytrain.tools.gpu_check COMMAND`` (``run``, ``worker``, ``prepare``,
``verify``, ``split``, ``join``, ``results``).
"""
