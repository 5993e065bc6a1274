"""The same mesh in plain torch under ``torchrun --nproc_per_node=4``: the step-time and memory baseline.

torchtitan's recipe written out with torch's own APIs: ``init_device_mesh`` of
``(dp_replicate, dp_shard, tp)``; on ``tp``, ``parallelize_module`` with the Llama
plan (q/k/v and gate/up column-parallel, o and down row-parallel, RMSNorms
sequence parallel, the embedding split by vocabulary, the LM head's logits
gathered); then ``fully_shard`` on every decoder layer and on the root over
``(dp_replicate, dp_shard)`` (HSDP when replicated). Every rank builds the model
(seeded, the same weights), one thread per process as polytrain's workers run.
Each rank writes the mean step time of the timed steps (between two barriers,
:func:`workload.timed_steps`), each step's time, its held bytes and its peak memory.

With ``--turns DIR --windows W`` it takes turns with polytrain_mesh.py instead
(turns.py): it starts once polytrain has set up, then runs ``W`` windows of
``spec.steps`` steps each when its turn comes. Its set-up then ends by giving the
freed heap back to the system (as polytrain's workers do after theirs), and so does
every wait for a turn, so that the two jobs fit in memory side by side; it changes
no tensor.

Usage: torchrun --nproc_per_node=4 benchmarks/parallel/native_mesh.py --spec JSON --out DIR
       [--turns DIR --windows W]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from benchmarks.parallel import turns, workload

DIMS = ("dp_replicate", "dp_shard", "tp")


def tensor_parallel(model: torch.nn.Module, tp_mesh) -> None:
    parallelize_module(
        model.model,
        tp_mesh,
        {
            "embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "norm": SequenceParallel(),
        },
    )
    parallelize_module(
        model.lm_head, tp_mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    )
    for layer in model.model.layers:
        plan = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        parallelize_module(layer, tp_mesh, plan)


def take_turns(model, optimizer, spec: workload.Spec, dp_rank: int, directory: str, windows: int):
    """``windows`` windows of ``spec.steps`` timed steps, each when the turn counter says so."""
    turns.release_heap()
    side = turns.Turns(directory, "native", windows)
    rank = dist.get_rank()
    if rank == 0:
        side.mark_ready()
    while not (side.directory / "polytrain.ready").exists():
        time.sleep(turns.POLL_S)
    step_times = []
    for window in range(windows):
        turns.release_heap()
        side.wait_for(side.turn_of(window))
        faults = turns.page_faults()
        timed = workload.timed_steps(model, optimizer, spec, dp_rank, first=window * spec.steps)
        faults = turns.gather_faults(faults)  # after the clock stopped
        step_times += timed["step_times"]
        if rank == 0:
            side.hand_over(window, timed["step_s"] * spec.steps, spec.steps, faults)
    side.wait_for(side.end)  # tear down only once polytrain's last window is over
    return {"step_s": workload.median(step_times), "step_times": step_times}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--turns", help="take turns with polytrain through this directory")
    parser.add_argument("--windows", type=int, default=0)
    args = parser.parse_args()
    spec = workload.Spec.from_json(args.spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = spec.mesh
    mesh = init_device_mesh("cpu", tuple(sizes[d] for d in DIMS), mesh_dim_names=DIMS)
    model = workload.build_model(spec.size)
    if sizes["tp"] > 1:
        tensor_parallel(model, mesh["tp"])
    dp_mesh = mesh["dp_replicate", "dp_shard"] if sizes["dp_replicate"] > 1 else mesh["dp_shard"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = workload.make_optimizer(model.parameters(), spec.optimizer)
    dp_rank = mesh["dp_replicate"].get_local_rank() * sizes["dp_shard"]
    dp_rank += mesh["dp_shard"].get_local_rank()
    if args.turns:
        timed = take_turns(model, optimizer, spec, dp_rank, args.turns, args.windows)
    else:
        warm = dataclasses.replace(spec, steps=spec.warmup, warmup=0)
        if spec.warmup:
            workload.timed_steps(model, optimizer, warm, dp_rank, first=0)
        timed = workload.timed_steps(model, optimizer, spec, dp_rank, first=spec.warmup)
    out = Path(args.out)
    result = {
        "rank": rank,
        **timed,
        "held": workload.held_bytes(model, optimizer),
        "peak_rss_mb": workload.peak_rss_mb(),
    }
    (out / f"native_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
