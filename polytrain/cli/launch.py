"""``polytrain launch``: an unmodified ``torchrun`` script on N Ray workers.

::

    polytrain launch -n 4 [--cpus-per-worker C] [--gpus-per-worker G] [--max-restarts R]
                     [--address ADDR] script.py [script args ...]
"""

from __future__ import annotations

import argparse


def cmd_launch(args: argparse.Namespace) -> int:
    """Run the script on ``-n`` workers; exit with the first failing rank's code."""
    from polytrain.train.launch import launch

    return launch(
        args.script,
        list(args.script_args),
        num_workers=args.num_workers,
        cpus_per_worker=args.cpus_per_worker,
        gpus_per_worker=args.gpus_per_worker,
        max_restarts=args.max_restarts,
        address=args.address,
    )


def add_launch(sub: argparse._SubParsersAction) -> None:
    """The ``launch`` subcommand."""
    launch = sub.add_parser(
        "launch",
        help="run an unmodified torchrun script on N Ray workers",
        description="Example: polytrain launch -n 2 --max-restarts 1 train.py --epochs 3. Each "
        "rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT, TORCHELASTIC_*); output lines are prefixed [rankN]:.",
    )
    launch.add_argument("-n", "--num-workers", type=int, default=1, help="ranks (default: 1)")
    launch.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs per rank")
    launch.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs per rank")
    launch.add_argument(
        "--max-restarts", type=int, default=0, help="restart every rank this often after a failure"
    )
    launch.add_argument("--address", help="Ray cluster to use (host:port or 'auto')")
    launch.add_argument("script", help="the training script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    launch.set_defaults(func=cmd_launch)
