"""``polytrain checkpoint``: convert and inspect checkpoints offline (no Ray, no workers).

::

    polytrain checkpoint convert runs/ckpt/checkpoint_000003 model.pt      # directory -> one file
    polytrain checkpoint convert model.pt runs/converted --shards 4        # file -> directory
    polytrain checkpoint convert --to safetensors runs/ckpt/checkpoint_000003 gpt2-out  # HF layout
    polytrain checkpoint convert --to peft runs/lora/checkpoint_000003 adapter      # PEFT adapter
    polytrain checkpoint convert --to safetensors --merge runs/lora/checkpoint_000003 merged
    polytrain checkpoint inspect runs/ckpt/checkpoint_000003

A checkpoint directory (written by the workers, sharded under fairscale, fsdp
and deepspeed) and a consolidated file (``trainer.save()``) hold the same
state; either loads under every backend at any world size with
``trainer.load(path)``. ``--to safetensors`` writes the model from either in the
Hugging Face layout (``model.safetensors`` or shards + index, and ``config.json``
when the checkpoint carries the model's HF config), as ``trainer.save_pretrained``;
a PEFT model's checkpoint converts to its adapter (``--to peft``) or to the model
merged into its base (``--merge``; the base is read from its own directory when
the checkpoint left the frozen base out).
"""

from __future__ import annotations

import argparse
import json

from polytrain.cli.commands import EXIT_OK
from polytrain.errors import ConfigError

__all__ = ["add_checkpoint", "cmd_checkpoint"]


def add_checkpoint(sub: argparse._SubParsersAction) -> None:
    """Register the ``checkpoint`` subcommand on the ``polytrain`` parser."""
    parser = sub.add_parser("checkpoint", help="convert or inspect checkpoints (offline)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    convert = actions.add_parser(
        "convert",
        help="checkpoint directory <-> consolidated file, or either -> safetensors",
        description="Convert a checkpoint directory (sharded or not) into one consolidated "
        "file, or a consolidated file into a directory. The direction follows SRC. With "
        "--to safetensors, write the model of either in the Hugging Face layout into the "
        "new directory DST.",
    )
    convert.add_argument("src", help="a checkpoint directory or a file written by trainer.save()")
    convert.add_argument("dst", help="the file (or new directory) to write")
    convert.add_argument(
        "--shards", type=int, default=1, help="rank files of a new directory (default: 1)"
    )
    convert.add_argument(
        "--to",
        choices=["safetensors", "peft"],
        default=None,
        help="safetensors: the model in the Hugging Face layout (config.json, model.safetensors "
        "or shards + model.safetensors.index.json); peft: a PEFT model's adapter "
        "(adapter_model.safetensors, adapter_config.json)",
    )
    convert.add_argument(
        "--merge",
        action="store_true",
        help="with --to safetensors: a PEFT model merged into its base (LoRA)",
    )
    convert.add_argument(
        "--base",
        default=None,
        help="with --merge: the base model's directory, for a checkpoint that left the frozen "
        "base out (default: the base the adapter names)",
    )
    convert.add_argument(
        "--max-shard-size",
        default="5GB",
        help='with --to safetensors: bytes per file, e.g. "5GB" (default), "200MB"',
    )
    convert.add_argument(
        "--model-index",
        type=int,
        default=0,
        help="with --to safetensors: which model of the checkpoint (default: 0)",
    )
    convert.set_defaults(func=cmd_checkpoint)
    inspect = actions.add_parser("inspect", help="summarise a checkpoint file or directory")
    inspect.add_argument("path", help="a checkpoint directory or file")
    inspect.set_defaults(func=cmd_checkpoint)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Run ``polytrain checkpoint convert|inspect``; prints the result as JSON."""
    from polytrain.checkpoint import convert
    from polytrain.checkpoint.layout import is_checkpoint_dir

    if args.action == "inspect":
        print(json.dumps(convert.describe(args.path), indent=1, default=str))
        return EXIT_OK
    if (args.merge and args.to != "safetensors") or (args.base and not args.merge):
        raise ConfigError("--merge goes with --to safetensors, and --base with --merge.")
    if args.to == "peft" or args.merge:
        return _convert_peft(args)
    if args.to == "safetensors":
        from polytrain.checkpoint import safetensors_export

        size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
        result = safetensors_export.export_checkpoint(
            args.src, args.dst, max_shard_size=size, model_index=args.model_index
        )
        print(f"wrote the model in the Hugging Face layout: {result['path']} ({result['files']})")
        return EXIT_OK
    if args.shards < 1:
        raise ConfigError(f"--shards must be >= 1; got {args.shards}.")
    if is_checkpoint_dir(args.src):
        written = convert.to_consolidated(args.src, args.dst)
        kind = "consolidated file"
    else:
        written = convert.to_sharded(args.src, args.dst, args.shards)
        kind = f"checkpoint directory ({args.shards} rank file(s))"
    print(f"wrote {kind}: {written}")
    return EXIT_OK


def _convert_peft(args: argparse.Namespace) -> int:
    """``--to peft`` (the adapter) or ``--to safetensors --merge`` (merged into the base)."""
    from polytrain.hf import export as hf_export

    if args.to == "peft":
        result = hf_export.export_adapter(args.src, args.dst, model_index=args.model_index)
        print(f"wrote the adapter in the PEFT layout: {result['path']} ({result['files']})")
        return EXIT_OK
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    result = hf_export.export_merged(
        args.src, args.dst, max_shard_size=size, model_index=args.model_index, base=args.base
    )
    print(
        f"wrote the merged model in the Hugging Face layout: {result['path']} ({result['files']})"
    )
    return EXIT_OK
