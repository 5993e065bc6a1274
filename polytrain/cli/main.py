"""The ``polytrain`` command: train, compare, check, submit, launch.

::

    polytrain train   -c examples/configs/ddp.yaml [key=value ...] [--logger tensorboard,csv]
    polytrain compare -c examples/configs/ddp.yaml --backends ddp,horovod,deepspeed
    polytrain compare -c examples/configs/digits_both.yaml     # torch and TensorFlow together
    polytrain check   [--address ADDR] [--backends ddp,fsdp]
    polytrain submit  --address http://HEAD:8265 -- polytrain train -c cfg.yaml
    polytrain launch  -n 2 --max-restarts 1 train.py --epochs 3   # an unmodified torchrun script

Overrides use dotted keys with YAML values: ``backend=horovod num_workers=4
config.lr=0.05 scaling.num_cpus_per_worker=2``.

Third-party noise (framework warnings and start-up logs from every worker) is
filtered unless ``--verbose`` (or ``POLYTRAIN_VERBOSE=1``) asks for everything.

Like ``polytrain/__init__.py`` this module is a face of the package: nothing in
the package imports it. The commands live in :mod:`polytrain.cli.commands` and
:mod:`polytrain.cli.check`; this module holds the parser and the entry point
(``polytrain.cli.main:main``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from polytrain.cli.check import cmd_check
from polytrain.cli.commands import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    cmd_compare,
    cmd_submit,
    cmd_train,
    print_error,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "cmd_check",
    "cmd_compare",
    "cmd_submit",
    "cmd_train",
    "main",
]

_RAY_HELP = "Ray cluster to use (host:port or 'auto'); default: RAY_ADDRESS, else a new local one"
_VERBOSE_HELP = "show every warning and log line of the frameworks (also: POLYTRAIN_VERBOSE=1)"


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    # On the subcommands too, so `polytrain compare -c x.yaml --verbose` works; SUPPRESS
    # keeps a subcommand from resetting a `polytrain --verbose compare ...`.
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP
    )


def _tolerance(text: str) -> float:
    """``0.02`` or ``2%`` -> 0.02."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a relative tolerance; write e.g. 0.02 or 2%"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the tolerance must be >= 0")
    return value


# ------------------------------------------------------------------ parser
def _add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train a YAML run config")
    train.add_argument("-c", "--config", required=True, help="the YAML run config")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    train.add_argument("--out", help="run directory (default: ./polytrain_runs/<config>-<time>/)")
    train.add_argument("--address", help=_RAY_HELP)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--logger",
        help="experiment trackers, comma-separated: tensorboard, mlflow, wandb, csv "
        "(default: the config's loggers:); they write into the run directory",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (or the config's checkpoint.checkpoint_dir) from its "
        "newest committed checkpoint: after a crashed or stopped driver",
    )
    _add_verbose(train)
    train.set_defaults(func=cmd_train)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    compare = sub.add_parser("compare", help="run one config on several backends and compare")
    compare.add_argument("-c", "--config", required=True, help="the YAML run config")
    compare.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    compare.add_argument(
        "--backends", help="comma-separated names (default: every installed backend)"
    )
    compare.add_argument("--epochs", type=int, help="epochs per backend (default: the config's)")
    compare.add_argument("--num-steps", type=int, help="batches per epoch (default: all)")
    compare.add_argument(
        "--out", help="output directory (default: ./polytrain_runs/compare-<time>/)"
    )
    compare.add_argument(
        "--tolerance",
        type=_tolerance,
        default=0.02,
        help="flag backends whose final loss or validation metrics differ from their "
        "framework's first backend by more than this (relative; default 0.02 = 2%%)",
    )
    compare.add_argument("--address", help=_RAY_HELP)
    _add_verbose(compare)
    compare.set_defaults(func=cmd_compare)


def _add_check(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check", help="pre-flight check of Ray, backends and collectives")
    check.add_argument("--address", help=_RAY_HELP)
    check.add_argument("--backends", help="comma-separated names to require (default: all)")
    check.add_argument("--no-collective", action="store_true", help="skip the training steps")
    check.add_argument("--num-workers", type=int, default=2, help="workers per collective check")
    check.add_argument("--timeout", type=float, default=180.0, help="seconds per worker check")
    check.add_argument(
        "--cluster-config",
        metavar="FILE",
        help="the cluster file (launcher YAML or RayCluster manifest): its node types and what "
        "its nodes install",
    )
    _add_verbose(check)
    check.set_defaults(func=cmd_check)


def _add_submit(sub: argparse._SubParsersAction) -> None:
    submit = sub.add_parser(
        "submit",
        help="run a command on a Ray cluster through the Jobs API",
        description="Example: polytrain submit --address http://HEAD:8265 -- polytrain train "
        "-c examples/configs/ddp.yaml",
    )
    submit.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265"),
        help="the head's dashboard address (default: RAY_API_SERVER_ADDRESS or "
        "http://127.0.0.1:8265)",
    )
    submit.add_argument("--working-dir", default=".", help="uploaded with the job (default: .)")
    submit.add_argument("--no-working-dir", action="store_true", help="upload nothing")
    submit.add_argument(
        "--exclude", action="append", default=[], help="more patterns not to upload"
    )
    submit.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="job environment"
    )
    submit.add_argument(
        "--pip",
        action="append",
        default=[],
        metavar="REQUIREMENT",
        help="a pip requirement installed for this job only (repeatable)",
    )
    submit.add_argument(
        "--requirements",
        metavar="FILE",
        help="a requirements file (read here), installed for this job",
    )
    submit.add_argument("--no-wait", action="store_true", help="return once submitted")
    submit.add_argument("--timeout", type=float, help="stop the job after this many seconds")
    submit.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    submit.set_defaults(func=cmd_submit)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``polytrain`` command."""
    import polytrain

    parser = argparse.ArgumentParser(
        prog="polytrain",
        description="One trainer API, every distributed backend.",
        epilog="Overrides are dotted keys with YAML values: backend=horovod config.lr=0.05",
    )
    parser.add_argument("--version", action="version", version=f"polytrain {polytrain.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from polytrain.cli.checkpoint import add_checkpoint
    from polytrain.cli.launch import add_launch

    for add in (_add_train, _add_compare, _add_check, _add_submit, add_checkpoint, add_launch):
        add(sub)
    return parser


# -------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``polytrain`` command; returns its exit status."""
    from polytrain.compat import quiet
    from polytrain.errors import ConfigError, PolytrainError, RunStoppedError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        quiet.set_verbose(True)  # before Ray starts: the workers inherit it
    quiet.install()
    if getattr(args, "env", None):
        bad = [item for item in args.env if "=" not in item]
        if bad:
            parser.error(f"--env takes KEY=VALUE; got {bad}")
    try:
        return args.func(args)
    except RunStoppedError as exc:
        # The driver's SIGTERM (a Slurm time limit, a pod eviction) or one drain too many:
        # the checkpoint at the stop is committed; the same command with --resume continues.
        print_error(str(exc))
        return exc.exit_code
    except (PolytrainError, ConnectionError, ValueError, ImportError, FileNotFoundError) as exc:
        # A bad config value, option or backend name (UnknownBackendError is a
        # ConfigError too) is a usage error; anything else failed while running.
        if isinstance(exc, ConfigError):
            print_error(str(exc))
            return EXIT_USAGE
        print_error(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
