"""``polytrain launch``: an unmodified ``torchrun`` / ``horovodrun`` / ``deepspeed`` script on N Ray workers.

::

    polytrain launch -n 4 [--backend ddp|horovod|deepspeed] [--accelerate-config FILE]
                     [--cpus-per-worker C]
                     [--gpus-per-worker G] [--max-restarts R] [--no-local-rank]
                     [--address ADDR] script.py [script args ...]
"""

from __future__ import annotations

import argparse


def cmd_launch(args: argparse.Namespace) -> int:
    """Run the script on ``-n`` workers; exit with the first failing rank's code (130 on Ctrl-C)."""
    from polytrain.cli.launch_runner import launch

    return launch(
        args.script,
        list(args.script_args),
        num_workers=args.num_workers,
        backend=args.backend,
        cpus_per_worker=args.cpus_per_worker,
        gpus_per_worker=args.gpus_per_worker,
        max_restarts=args.max_restarts,
        local_rank_arg=not args.no_local_rank,
        address=args.address,
        accelerate_config=args.accelerate_config,
    )


def add_launch(sub: argparse._SubParsersAction) -> None:
    """The ``launch`` subcommand."""
    launch = sub.add_parser(
        "launch",
        help="run an unmodified torchrun / horovodrun / deepspeed script on N Ray workers",
        description="Example: polytrain launch -n 2 --max-restarts 1 train.py --epochs 3. Each "
        "rank gets its launcher's environment: torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*) with --backend ddp, horovodrun --gloo's "
        "(HOROVOD_RANK, HOROVOD_GLOO_RENDEZVOUS_ADDR, ...) with horovod, the deepspeed "
        "launcher's (and --local_rank=N) with deepspeed, accelerate launch's with "
        "--accelerate-config; output lines are prefixed [rankN]:.",
    )
    launch.add_argument("-n", "--num-workers", type=int, default=1, help="ranks (default: 1)")
    launch.add_argument(
        "--backend",
        default=None,
        help="whose launcher environment: ddp (torchrun, default), horovod, deepspeed; with "
        "--accelerate-config the backend the config must be (default: the config's)",
    )
    launch.add_argument(
        "--accelerate-config",
        metavar="FILE",
        help="an Accelerate config file (accelerate config): each rank gets accelerate "
        "launch's environment for it (DDP, FSDP or DeepSpeed)",
    )
    launch.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs per rank")
    launch.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs per rank")
    launch.add_argument(
        "--max-restarts", type=int, default=0, help="restart every rank this often after a failure"
    )
    launch.add_argument(
        "--no-local-rank",
        "--no_local_rank",
        action="store_true",
        help="deepspeed: do not append --local_rank=N to the script's arguments",
    )
    launch.add_argument("--address", help="Ray cluster to use (host:port or 'auto')")
    launch.add_argument("script", help="the training script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    launch.set_defaults(func=cmd_launch)
