"""The GPU check's worker: one torchrun process (world size 1) that runs cases one after another.

    torchrun --standalone --nproc-per-node 1 -m polytrain.tools.gpu_check worker \\
        --plan plan.json --out cases.jsonl

It starts the process group itself (nccl on a GPU, gloo on a CPU), so every
polytrain ``TorchTrainer(num_workers=0)`` joins it as rank 0 of torchrun's world
(:mod:`polytrain.launchers.torchrun`): the backends wrap and shard as in any
worker. Each case appends a ``start`` line and then a ``result`` line to the
JSON-lines file, so the orchestrator (:mod:`polytrain.tools.gpu_check.run`) knows
which case a crash or a hang interrupted and can go on with the rest in a new
process. Between cases the trainer is shut down, the compiled graphs are dropped
(``torch._dynamo.reset()``: each case compiles its own) and the memory is freed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from typing import Any

from polytrain.tools.gpu_check import workload as wl
from polytrain.tools.gpu_check.cases import Case

_WORKLOAD_KEY = "gpu_check_workload"


# ------------------------------------------------------------- polytrain's creators
def _workload(config: dict[str, Any]) -> wl.Workload:
    return wl.Workload(**config[_WORKLOAD_KEY])


def model_creator(config: dict[str, Any]) -> Any:
    """``model_creator``: the seeded GPT-2."""
    return wl.build_model(_workload(config))


def data_creator(config: dict[str, Any]) -> Any:
    """``data_creator``: the batches in order; ``config["batch_size"]`` is the worker's batch."""
    return wl.make_loader(_workload(config), config["batch_size"])


def optimizer_creator(model: Any, config: dict[str, Any]) -> Any:
    """``optimizer_creator``: AdamW."""
    return wl.make_optimizer(model)


def polytrain_steps(case: Case, workload: wl.Workload, device: str) -> dict[str, Any]:
    """The case on polytrain: ``TorchTrainer(num_workers=0)`` in this torchrun process.

    Returns the same fields as :func:`~polytrain.tools.gpu_check.workload.plain_steps`,
    plus what the backend made of the model.
    """
    from polytrain import TorchTrainer

    start = time.perf_counter()
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        config={"batch_size": workload.batch, _WORKLOAD_KEY: vars(workload)},
        num_workers=0,
        use_gpu=device == "cuda",
        num_cpus_per_worker=max(os.cpu_count() or 1, 1),
        backend=case.backend,
        backend_config=case.backend_config or None,
        precision=case.precision,
        activation_checkpointing=case.checkpointing,
        compile=case.compile,
    )
    try:
        setup_s = time.perf_counter() - start
        wrapped = trainer.apply_all_operators(lambda op: type(op.model).__name__)[0]
        losses, first_step_s = [], 0.0
        for index in range(workload.check_steps):
            began = time.perf_counter()
            losses.append(float(trainer.train(num_steps=1)["loss"]))
            if index == 0:
                first_step_s = time.perf_counter() - began
        if workload.warmup_steps:
            trainer.train(num_steps=workload.warmup_steps)
        chunks = []
        for size in workload.chunk_sizes():
            wl.synchronize(device)
            began = time.perf_counter()
            stats = trainer.train(num_steps=size)
            wl.synchronize(device)
            chunks.append((time.perf_counter() - began) / size)
            if stats.get("num_steps") != size:
                raise RuntimeError(f"timed {stats.get('num_steps')} steps, not {size}")
    finally:
        trainer.shutdown()
    return {
        "losses": losses,
        **wl.timing(chunks),
        "setup_s": setup_s,
        "first_step_s": first_step_s,
        "model_class": wrapped,
    }


# ------------------------------------------------------------------------ the worker
def _reset(device: str) -> None:
    """Forget the previous case: compiled graphs, memory, peak statistics."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_case(case: Case, workload: wl.Workload, device: str) -> dict[str, Any]:
    """One case; its measurements, or its error (never raises)."""
    import torch

    _reset(device)
    began = time.perf_counter()
    try:
        if case.runner == "plain":
            out = wl.plain_steps(workload, device, case.precision, case.checkpointing, case.compile)
        else:
            out = polytrain_steps(case, workload, device)
        out["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - a failed case is a result of the check
        out = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-6000:],
        }
    out["wall_s"] = time.perf_counter() - began
    if device == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _write(out: Any, line: dict[str, Any]) -> None:
    out.write(json.dumps(line) + "\n")
    out.flush()
    os.fsync(out.fileno())


def _init_process_group(device: str) -> None:
    """Torchrun's world (size 1) with NCCL on a GPU, gloo on a CPU; the trainers join it."""
    import datetime

    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        init_method="env://",
        timeout=datetime.timedelta(seconds=600),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the plan's cases in order (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m polytrain.tools.gpu_check worker")
    parser.add_argument("--plan", required=True, help="JSON: device, workload, cases")
    parser.add_argument("--out", required=True, help="JSON lines appended per case")
    args = parser.parse_args(argv)
    with open(args.plan) as handle:
        plan = json.load(handle)
    device = plan["device"]
    workload = wl.Workload(**plan["workload"])
    _init_process_group(device)
    import torch.distributed as dist

    try:
        with open(args.out, "a") as out:
            for fields in plan["cases"]:
                case = Case.from_dict(fields)
                _write(out, {"event": "start", "case": case.name, "time": time.time()})
                result = run_case(case, workload, device)
                _write(out, {"event": "result", "case": case.name, **result})
    finally:
        dist.destroy_process_group()
    return 0
