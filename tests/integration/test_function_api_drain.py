"""Your own loop on a drained node: told through ``get_preemption_info()``, moved at its checkpoint.

A simulated two-node cluster (``multinode_script.start_cluster``: a head on 127.0.0.1
with no CPU, two 2-CPU raylets on 127.0.0.2 and 127.0.0.3) cannot share the test
session's Ray instance (a driver joins one cluster per process), so this file runs
itself as a script in a fresh process with a private, short ``RAY_TMPDIR``, and the
tests read the JSON it writes.

The loop trains ``STEPS`` global batches of the parity data on two ddp workers, one
per node, elastic (``min_workers=1``) with ``max_failures=0``; it reads
``get_preemption_info()`` after every step and, once that answers, reports a
checkpoint. Rank 1 marks step 3, and the driver's thread drains rank 1's node then
(a preemption with a 60 s deadline, through the GCS call of ``ray drain-node``). The
run must end with one preemption and no restart, on the node left; every rank must
have seen the drain first at the same step and stopped there; every step trained
once; and the weights those of one process on the same global batches.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 32  # twice over the 16 global batches of the 512 parity samples
GLOBAL_BATCH = 32
BATCHES = 16
MARK_STEP = 3  # rank 1 marks it; the driver drains rank 1's node then
DEADLINE_S = 60


# ------------------------------------------------------------------ the loop (on the workers)
def _append(path: str, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _info_record(info) -> dict | None:
    if info is None:
        return None
    return {
        "node_id": info.node_id,
        "node_ip": info.node_ip,
        "reason": info.reason,
        "deadline_ms": info.deadline_ms,
        "ranks": list(info.ranks),
        "seconds_left": info.seconds_left(),
    }


def drain_loop(config: dict) -> None:
    """SGD over the global batches; a checkpoint as soon as get_preemption_info() answers."""
    import time

    import ray
    import torch

    from polytrain import train
    from polytrain.train import torch as pt
    from tests.helpers import parity_dataset, parity_model_creator

    ctx = train.get_context()
    rank, size = ctx.get_world_rank(), ctx.get_world_size()
    model = parity_model_creator({})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    model, optimizer = pt.prepare(model, optimizer)
    node_id = ray.get_runtime_context().get_node_id()
    where = {"node_id": node_id, "node_ip": ray.util.get_node_ip_address()}
    _append(config["facts"], {"rank": rank, "size": size, "start": start, **where})
    x, y = parity_dataset().tensors
    loss_fn = torch.nn.CrossEntropyLoss()

    def save(step: int, directory: str) -> train.Checkpoint | None:
        if rank != 0:
            return None  # rank 0 alone passes the checkpoint: the others must stop too
        state = {
            "model": getattr(model, "module", model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
        }
        torch.save(state, os.path.join(directory, "state.pt"))
        return train.Checkpoint.from_directory(directory)

    for step in range(start, config["steps"]):
        first = (step % BATCHES) * GLOBAL_BATCH
        # this rank's share of the global batch, interleaved as DistributedSampler does
        index = torch.arange(first + rank, first + GLOBAL_BATCH, size)
        pt.zero_grad()
        loss = loss_fn(model(x[index]), y[index])
        pt.backward(loss)
        pt.step()
        info = train.get_preemption_info()
        _append(
            f"{config['seen']}.{rank}",
            {"step": step, "size": size, "info": _info_record(info)},
        )
        if (step, rank, size) == (MARK_STEP, 1, 2):
            with open(config["marker"], "w") as handle:
                handle.write(node_id)
        with tempfile.TemporaryDirectory() as scratch:
            if info is None:
                if size > 1:
                    time.sleep(0.2)  # the drain lands mid-run
                train.report({"step": step, "loss": loss.item()})
            else:  # the node goes: save now
                train.report({"step": step, "loss": loss.item()}, checkpoint=save(step, scratch))
    with tempfile.TemporaryDirectory() as scratch:
        train.report({"step": config["steps"]}, checkpoint=save(config["steps"] - 1, scratch))


# ------------------------------------------------------------------ the driver (a fresh process)
def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fit_on_a_drained_cluster(tmp: Path) -> dict:
    import threading
    import time

    import torch

    from polytrain.train import FailureConfig, RunConfig
    from polytrain.train.torch import TorchTrainer
    from tests.helpers import max_param_diff, parity_model_creator, plain_reference
    from tests.integration.multinode_script import drain_node

    config = {
        "steps": STEPS,
        "facts": str(tmp / "facts.jsonl"),
        "seen": str(tmp / "seen.jsonl"),
        "marker": str(tmp / "marker"),
    }
    drained: dict = {}

    def drain_when_marked() -> None:
        marker = Path(config["marker"])
        while not marker.exists() or not marker.read_text():
            time.sleep(0.02)
        drained["victim"] = marker.read_text()
        drained["at"] = time.time()
        drained["accepted"] = list(drain_node(drained["victim"], DEADLINE_S, "function API test"))

    trainer = TorchTrainer(
        drain_loop,
        train_loop_config=config,
        scaling_config={
            "num_workers": 2,
            "min_workers": 1,
            "num_cpus_per_worker": 2,  # one worker per node: the node left holds one
            "placement_strategy": "SPREAD",
        },
        run_config=RunConfig(
            storage_path=str(tmp / "runs"),
            name="drain",
            failure_config=FailureConfig(max_failures=0),
        ),
        backend="ddp",
    )
    threading.Thread(target=drain_when_marked, daemon=True).start()
    started = time.monotonic()
    result = trainer.fit()
    fit_s = time.monotonic() - started
    model = parity_model_creator({})
    with result.checkpoint.as_directory() as d:
        model.load_state_dict(torch.load(os.path.join(d, "state.pt"), weights_only=True)["model"])
    return {
        "fit_seconds": round(fit_s, 1),
        "drained": drained,
        "drains": trainer.num_drains,
        "restarts": trainer.num_restarts,
        "reported_steps": [int(step) for step in result.metrics_dataframe["step"]],
        "facts": _read_jsonl(tmp / "facts.jsonl"),
        "seen": {rank: _read_jsonl(tmp / f"seen.jsonl.{rank}") for rank in (0, 1)},
        "max_diff": max_param_diff(model, plain_reference(STEPS, GLOBAL_BATCH)),
    }


def main(out_path: str) -> None:
    """Build the cluster, fit, write what happened to ``out_path`` (errors as text)."""
    import logging
    import time
    import traceback

    sys.path.insert(0, str(REPO_ROOT))
    import ray

    from polytrain.launchers.cluster.connect import ensure_ray

    # Before the cluster starts: importing it points the raylets' workers at this
    # repository (PYTHONPATH) and turns the warm pool off, as for every multinode check.
    from tests.integration.multinode_script import _Lines, start_cluster

    handler = _Lines()
    logging.getLogger("polytrain").addHandler(handler)
    logging.getLogger("polytrain").setLevel(logging.INFO)
    started = time.monotonic()
    cluster, _ = start_cluster()
    result: dict = {}
    try:
        ensure_ray(cluster.address, timeout_s=60)
        result = _fit_on_a_drained_cluster(Path(out_path).parent)
        result["status"] = "ok"
    except Exception:  # noqa: BLE001 - reported to the test, which names it
        result = {"status": "error", "error": traceback.format_exc()}
    finally:
        result["log"] = handler.lines
        result["seconds"] = round(time.monotonic() - started, 1)
        Path(out_path).write_text(json.dumps(result, indent=1))
        ray.shutdown()
        cluster.shutdown()


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def drained(tmp_path_factory) -> dict:
    # Imported here: this file also runs as a script, where tests/ is not importable yet.
    from tests.integration.fresh_cluster import run_script_on_fresh_cluster

    tmp = tmp_path_factory.mktemp("function_api_drain")
    result = run_script_on_fresh_cluster(
        __file__, tmp / "result.json", timeout_s=300, prefix="ptfd"
    )
    assert result["status"] == "ok", result.get("error")
    return result


def _attempts(drained: dict) -> tuple[dict, dict]:
    """The first group's rank 1 (on the drained node) and the second group's only worker."""
    facts = drained["facts"]
    first = [f for f in facts if f["size"] == 2]
    second = [f for f in facts if f["size"] == 1]
    assert sorted(f["rank"] for f in first) == [0, 1] and len(second) == 1, facts
    return next(f for f in first if f["rank"] == 1), second[0]


def test_the_drained_node_is_left_at_the_loops_checkpoint_counted_as_a_preemption(drained):
    assert drained["drained"]["accepted"][0] is True  # the GCS took the drain request
    rank1, after = _attempts(drained)
    victim = drained["drained"]["victim"]
    assert rank1["node_id"] == victim
    # max_failures=0 survived it: a preemption, no restart
    assert drained["drains"] == 1 and drained["restarts"] == 0
    # the loop went on, elastic, on the node left, from the step after its checkpoint
    assert after["node_id"] != victim and after["rank"] == 0
    steps0 = drained["seen"]["0"]
    stop = max(r["step"] for r in steps0 if r["size"] == 2)
    assert after["start"] == stop + 1
    assert MARK_STEP < stop < STEPS - 1


def test_every_rank_is_told_at_the_same_step_and_stops_there(drained):
    rank1, _ = _attempts(drained)
    firsts, infos = {}, {}
    for rank in ("0", "1"):
        group = [r for r in drained["seen"][rank] if r["size"] == 2]
        told = [r for r in group if r["info"] is not None]
        firsts[rank] = told[0]["step"]
        # told once, at the last step of the group: the checkpoint there ended the loop
        assert len(told) == 1 and told[0]["step"] == group[-1]["step"], group
        infos[rank] = {k: v for k, v in told[0]["info"].items() if k != "seconds_left"}
        assert 0 < told[0]["info"]["seconds_left"] <= DEADLINE_S
    assert firsts["0"] == firsts["1"]
    assert infos["0"] == infos["1"]
    expected = {"node_id": rank1["node_id"], "node_ip": rank1["node_ip"], "reason": "preemption"}
    assert {k: infos["0"][k] for k in expected} == expected and infos["0"]["ranks"] == [1]
    deadline_s = infos["0"]["deadline_ms"] / 1000.0
    assert abs(deadline_s - (drained["drained"]["at"] + DEADLINE_S)) < 2.0
    # the group after the move runs off the draining node: told nothing
    assert all(r["info"] is None for r in drained["seen"]["0"] if r["size"] == 1)


def test_every_step_trained_once_with_the_weights_of_one_process(drained):
    trained = [(r["step"], r["size"]) for r in drained["seen"]["0"]]
    assert [step for step, _ in trained] == list(range(STEPS))
    sizes = [size for _, size in trained]
    assert sizes == sorted(sizes, reverse=True) and set(sizes) == {1, 2}
    # every report once: those of the first group up to its checkpoint, then the second's
    assert drained["reported_steps"] == [*range(STEPS), STEPS]
    assert drained["max_diff"] <= 1e-5, drained["max_diff"]


def test_the_log_names_the_node_the_reason_the_deadline_and_what_is_done(drained):
    rank1, _ = _attempts(drained)
    lines = drained["log"]
    node = f"Node {rank1['node_id']} ({rank1['node_ip']})"
    announced = f"{node} is draining (preemption, deadline in "
    assert any(
        line.startswith(announced) and "train.get_preemption_info()" in line for line in lines
    ), lines
    assert any(
        line.startswith(
            f"Drain 1 (FailureConfig max_preemption_failures=unlimited) of node "
            f"{rank1['node_id']}: checkpoint "
        )
        for line in lines
    ), lines
    assert any(line.startswith("Continuing from ") for line in lines), lines


def test_the_run_is_quick(drained):
    assert drained["fit_seconds"] < 60, drained["fit_seconds"]
    assert drained["seconds"] < 90, drained["seconds"]


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)
