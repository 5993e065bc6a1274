"""Fine-tuning a pretrained GPT-2 medium: set-up memory per rank, and LoRA's optimizer state.

Two suites, on a GPT-2 medium (24 x 1024, 354.8M parameters, fp32: 1353 MiB)
with random weights that this script saves with ``save_pretrained`` (5 shards of
at most 300 MB) before it starts; every case is a fresh ``TorchTrainer`` with 2
workers of 1 CPU each, LoRA (r=16 on ``c_attn``, ``c_proj``, ``c_fc``) and AdamW:

* ``--suite load``: the set-up peak of every rank (``ru_maxrss`` after the trainer
  is built, minus the RSS when ``model_creator`` started: what building, loading,
  sharding and the optimizer's set-up added) and the set-up wall time, for each way
  a creator can load the model: ``polytrain.hf.pretrained(path)`` (each rank reads
  its part from the files) against ``transformers``' ``from_pretrained`` in the
  creator (rank 0 reads everything), under fsdp (FSDP2) and DeepSpeed ZeRO-3; and
  for ddp, every rank reading the whole model against rank 0 reading it and DDP's
  start-up broadcast bringing it to rank 1.
* ``--suite optimizer``: after one training step, the optimizer state each rank
  holds (the optimizers' tensors; ZeRO: its fp32 master partitions too) and the
  parameters it steps, LoRA against full fine-tuning (fsdp, ZeRO-3, ddp).

Usage::

    python benchmarks/finetune/bench.py                    # both suites, 1 rep (~20 min on 2 cores)
    python benchmarks/finetune/bench.py --suite load --reps 3
    python benchmarks/finetune/bench.py --quick            # tiny GPT-2, out/quick/ only
    python benchmarks/finetune/bench.py --render-only      # the RESULTS.md section from out/

Raw results go to ``benchmarks/out/finetune/<suite>.json`` (each case with the load
average before it) and the tables into RESULTS.md's "Fine-tuning" section, which
this script alone writes (between its markers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "out" / "finetune"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
START, END = "<!-- finetune:start -->", "<!-- finetune:end -->"
LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["c_attn", "c_proj", "c_fc"]}
SIZES = {
    "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512},
}
SEQ = 64
#: Where the worker keeps what it measured (this module, imported in the worker).
SEEN: dict[str, float] = {}


# ------------------------------------------------------------------ worker side
def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Measured:
    """``model_creator`` that records the worker's RSS before it builds anything."""

    def __init__(self, path: str, how: str) -> None:
        self.path, self.how = path, how

    def __call__(self, config: dict):
        import peft
        import torch
        import transformers

        from benchmarks.finetune import bench

        bench.SEEN["rss_before_mb"] = _rss_mb()
        if self.how == "polytrain":  # peft_config= adds the adapters
            from polytrain.hf import pretrained

            return pretrained(self.path)(config)
        lora = peft.LoraConfig(**LORA)
        if self.how == "rank0-reads":  # ranks > 0: the structure; DDP's broadcast fills it
            import torch.distributed as dist

            if dist.get_rank() != 0:
                hf_config = transformers.AutoConfig.from_pretrained(self.path)
                with torch.device("meta"):
                    model = transformers.AutoModelForCausalLM.from_config(hf_config)
                model = model.to_empty(device="cpu")
                model.tie_weights()
                return peft.get_peft_model(model, lora)
        model = transformers.AutoModelForCausalLM.from_pretrained(self.path)
        return peft.get_peft_model(model, lora) if self.how != "full" else model


def report(operator) -> dict:
    """On a worker: set-up RSS figures and the optimizer state it holds."""
    from benchmarks.finetune import bench

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "rank": operator.world_rank,
        "rss_before_mb": bench.SEEN.get("rss_before_mb", 0.0),
        "peak_mb": peak,
        **optimizer_state(operator),
    }


def optimizer_state(operator) -> dict:
    """The optimizer state on this rank: bytes of its tensors (ZeRO: with its fp32 master copy)."""
    import torch

    engine = operator.components.extra.get("deepspeed")
    nbytes, params = 0, 0
    if engine is not None:
        zero = engine.engine.optimizer
        flats = getattr(zero, "fp32_partitioned_groups_flat", None) or getattr(
            zero, "single_partition_of_fp32_groups", None
        )
        nbytes += sum(f.numel() * f.element_size() for f in flats or [])
        states = list(zero.optimizer.state.values())
        params = len(engine.params)
    else:
        states = []
        for optimizer in operator.optimizers:
            params += sum(len(g["params"]) for g in optimizer.param_groups)
            states += list(getattr(optimizer, "optim", optimizer).state.values())
    for state in states:
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                nbytes += local.numel() * local.element_size()
    return {"optimizer_mb": nbytes / 2**20, "optimizer_params": params}


def data_creator(config: dict):
    import torch

    vocab = config["vocab"]
    ids = torch.randint(0, vocab, (8, SEQ), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(rows, batch_size=config["batch_size"])


def adamw_creator(model, config):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-4)


# ------------------------------------------------------------------ driver side
def save_model(size: str, folder: Path) -> Path:
    import torch
    import transformers

    path = folder / f"gpt2-{size}"
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return path
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        **SIZES[size], n_positions=1024, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path, max_shard_size="300MB")
    return path


LOAD_CASES = [
    ("fsdp", {"version": 2}, "polytrain"),
    ("fsdp", {"version": 2}, "transformers"),
    ("deepspeed", {"stage": 3}, "polytrain"),
    ("deepspeed", {"stage": 3}, "transformers"),
    ("ddp", None, "polytrain"),
    ("ddp", None, "rank0-reads"),
]
OPTIMIZER_CASES = [
    ("fsdp", {"version": 2}, "polytrain"),
    ("fsdp", {"version": 2}, "full"),
    ("deepspeed", {"stage": 3}, "polytrain"),
    ("deepspeed", {"stage": 3}, "full"),
    ("ddp", None, "polytrain"),
]


def run_case(path: Path, size: str, backend: str, backend_config, how: str, train: bool) -> dict:
    import peft

    from polytrain import TorchTrainer

    load = os.getloadavg()[0]
    start = time.perf_counter()
    trainer = TorchTrainer(
        model_creator=Measured(str(path), how),
        data_creator=data_creator,
        optimizer_creator=adamw_creator,
        config={"batch_size": 2, "vocab": SIZES[size]["vocab_size"]},
        num_workers=2,
        num_cpus_per_worker=1,
        backend=backend,
        backend_config=backend_config,
        peft_config=peft.LoraConfig(**LORA) if how == "polytrain" else None,
        failure_config={"max_retries": 0},
    )
    try:
        setup_s = time.perf_counter() - start
        if train:
            trainer.train(num_steps=1)
        ranks = trainer.apply_all_operators(report)
    finally:
        trainer.shutdown()
    label = backend if backend != "fsdp" else "fsdp (FSDP2)"
    if backend == "deepspeed":
        label = "DeepSpeed ZeRO-3"
    return {"backend": label, "how": how, "setup_s": setup_s, "load_before": load, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=["load", "optimizer", "both"], default="both")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny GPT-2; results under out/quick")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "polytrain-finetune"))
    args = parser.parse_args()
    out = OUT / "quick" if args.quick else OUT
    if not args.render_only:
        import ray

        from polytrain import pool

        pool.configure(enabled=False)  # fresh worker processes: ru_maxrss is per process
        size = "tiny" if args.quick else "medium"
        path = save_model(size, Path(args.models))
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        suites = ["load", "optimizer"] if args.suite == "both" else [args.suite]
        for suite in suites:
            cases = LOAD_CASES if suite == "load" else OPTIMIZER_CASES
            runs = [
                run_case(path, size, *case, train=suite == "optimizer")
                for _ in range(args.reps)
                for case in cases  # interleaved: one of each, then again
            ]
            (out / f"{suite}.json").write_text(json.dumps(runs, indent=1))
            print(render_table(suite, runs))
        ray.shutdown()
    if not args.quick:
        write_section(out)


# ------------------------------------------------------------------ report
def _median(runs: list[dict], key) -> float:
    return statistics.median(key(run) for run in runs)


def _group(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["backend"], run["how"]), []).append(run)
    return groups


HOW = {
    "polytrain": "`polytrain.hf.pretrained(path)` + `peft_config=`",
    "transformers": "`from_pretrained` + `get_peft_model` in the creator",
    "rank0-reads": "rank 0 `from_pretrained`, rank 1 the structure, DDP's broadcast",
    "full": "full fine-tuning (`from_pretrained`, every parameter trained)",
}


def render_table(suite: str, runs: list[dict]) -> str:
    if suite == "load":
        lines = [
            "| backend | how the creator loads | rank 0 growth MiB | rank 1 growth MiB | set-up s | reps | load |",
            "|---|---|---|---|---|---|---|",
        ]
        for (backend, how), group in _group(runs).items():
            growth = [
                _median(
                    group, lambda r, k=k: r["ranks"][k]["peak_mb"] - r["ranks"][k]["rss_before_mb"]
                )
                for k in (0, 1)
            ]
            lines.append(
                f"| {backend} | {HOW[how]} | {growth[0]:.0f} | {growth[1]:.0f} | "
                f"{_median(group, lambda r: r['setup_s']):.1f} | {len(group)} | "
                f"{_median(group, lambda r: r['load_before']):.1f} |"
            )
        return "\n".join(lines)
    lines = [
        "| backend | training | optimizer state per rank MiB (rank 0 / 1) | parameters stepped | load |",
        "|---|---|---|---|---|",
    ]
    for (backend, how), group in _group(runs).items():
        state = [_median(group, lambda r, k=k: r["ranks"][k]["optimizer_mb"]) for k in (0, 1)]
        training = "LoRA r=16" if how == "polytrain" else "full"
        lines.append(
            f"| {backend} | {training} | {state[0]:.1f} / {state[1]:.1f} | "
            f"{group[0]['ranks'][0]['optimizer_params']} | "
            f"{_median(group, lambda r: r['load_before']):.1f} |"
        )
    return "\n".join(lines)


def write_section(out: Path) -> None:
    """Replace RESULTS.md's "Fine-tuning" section (between its markers) with the tables of ``out``."""
    parts = [START, "## Fine-tuning: pretrained weights in, LoRA's optimizer state", ""]
    notes = ROOT / "benchmarks" / "finetune" / "NOTES.md"
    if notes.exists():
        parts += [notes.read_text().strip(), ""]
    for suite in ("load", "optimizer"):
        raw = out / f"{suite}.json"
        if raw.exists():
            parts += [render_table(suite, json.loads(raw.read_text())), ""]
    parts.append(END)
    text = RESULTS.read_text()
    section = "\n".join(parts) + "\n"
    if START in text:
        text = text[: text.index(START)] + section + text[text.index(END) + len(END) + 1 :]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
