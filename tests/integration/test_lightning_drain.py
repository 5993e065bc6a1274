"""A Lightning fit on a drained node: stopped at a batch, checkpointed, resumed off the node, 0 steps lost.

A simulated two-node cluster (``multinode_script.start_cluster``: a head on 127.0.0.1
with no CPU, two 2-CPU raylets on 127.0.0.2 and 127.0.0.3) cannot share the test
session's Ray instance (a driver joins one cluster per process), so this file runs
itself as a script in a fresh process with a private, short ``RAY_TMPDIR``, and the
tests read the JSON it writes.

``RayStrategy(num_workers=2, placement_strategy="SPREAD", max_retries=0)`` fits a small
deterministic regression (no dropout, ``seed_everything``) for two epochs, once without
a fault (the reference) and once with rank 1's node drained in the middle of epoch 0
(a preemption with a 60 s deadline, through the GCS call of ``ray drain-node``). The
drained fit must stop at a batch boundary on both workers, checkpoint there and continue
off the node: one preemption, no restart (``max_retries=0`` survives it), every global
step trained once in order (rank 0's history of ``(epoch, batch_idx, global_step)``),
the weights bit for bit those of the reference, the log naming node, reason and
deadline, and no drain checkpoint left behind. ``make test-long`` runs the same check
for the Horovod, sharded and DeepSpeed variants (their checkpoints gather through their
backends on every rank), in a second cluster, with the drained node replaced in between.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2
BATCH = 8
BATCHES = 12  # per worker and epoch
EPOCHS = 2
MARK_BATCH = 2  # rank 1 marks it in epoch 0; the driver drains rank 1's node then
DEADLINE_S = 60
SLOW_S = 0.25  # per batch of epoch 0 in the drained fit: the drain lands inside the epoch


# ------------------------------------------------------------------ the module (on the workers)
def _module_class():
    import time

    import pytorch_lightning as pl
    import ray
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(pl.LightningModule):
        """A small MLP; rank 0 logs every batch, rank 1 marks batch MARK_BATCH of epoch 0."""

        def __init__(self, files: dict, slow: bool) -> None:
            super().__init__()
            torch.manual_seed(0)  # the same initial weights in every run
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )
            self.files, self.slow = files, slow
            self._placed = False

        def training_step(self, batch, batch_idx):
            if not self._placed:  # once per group: where this rank runs
                self._placed = True
                with open(self.files["facts"], "a") as file:
                    record = {
                        "rank": self.global_rank,
                        "node_id": ray.get_runtime_context().get_node_id(),
                        "node_ip": ray.util.get_node_ip_address(),
                        "epoch": self.current_epoch,
                        "batch": batch_idx,
                    }
                    file.write(json.dumps(record) + "\n")
            if self.slow and self.current_epoch == 0:
                time.sleep(SLOW_S)
            if self.global_rank == 0:
                with open(self.files["history"], "a") as file:
                    file.write(f"{self.current_epoch} {batch_idx} {self.global_step}\n")
            if (self.current_epoch, batch_idx, self.global_rank) == (0, MARK_BATCH, 1):
                marker = Path(self.files["marker"])
                if not marker.exists():
                    marker.write_text(ray.get_runtime_context().get_node_id())
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def train_dataloader(self) -> DataLoader:
            generator = torch.Generator().manual_seed(0)
            x = torch.randn(WORKERS * BATCHES * BATCH, 8, generator=generator)
            noise = 0.1 * torch.randn(len(x), 1, generator=generator)
            y = x @ torch.randn(8, 1, generator=generator) + noise
            return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)

    class Validated(Regression):
        """For ``trainer.validate``: the same notes, from the validation batches."""

        def validation_step(self, batch, batch_idx):
            if not self._placed:
                self._placed = True
                with open(self.files["facts"], "a") as file:
                    node = ray.get_runtime_context().get_node_id()
                    file.write(json.dumps({"rank": self.global_rank, "node_id": node}) + "\n")
            if self.slow:
                time.sleep(SLOW_S)
            if (batch_idx, self.global_rank) == (MARK_BATCH, 1):
                marker = Path(self.files["marker"])
                if not marker.exists():
                    marker.write_text(ray.get_runtime_context().get_node_id())
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

        def val_dataloader(self) -> DataLoader:
            return self.train_dataloader()

    return Regression, Validated


# ------------------------------------------------------------------ the driver (a fresh process)
#: The strategies by name, with the backend each needs.
STRATEGIES = {
    "ddp": ("RayStrategy", "ddp"),
    "horovod": ("RayHorovodStrategy", "horovod"),
    "sharded": ("RayShardedStrategy", "fairscale"),
    "deepspeed": ("RayDeepSpeedStrategy", "deepspeed"),
}


def _strategy_class(name: str):
    import polytrain.lightning

    return getattr(polytrain.lightning, STRATEGIES[name][0])


def _read(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _drain_when_marked(marker: Path) -> dict:
    """Drain the node a worker writes into ``marker``, from a thread; the record fills in then."""
    import threading
    import time

    from tests.integration.multinode_script import drain_node

    drained: dict = {}

    def drain() -> None:
        while not marker.exists() or not marker.read_text():
            time.sleep(0.02)
        drained["victim"] = marker.read_text()
        drained["at"] = time.time()
        drained["accepted"] = list(drain_node(drained["victim"], DEADLINE_S, "lightning test"))

    threading.Thread(target=drain, daemon=True).start()
    return drained


def _fit(tmp: Path, name: str, strategy_name: str, drain: bool) -> tuple[dict, object]:
    import time

    import pytorch_lightning as pl

    files = {key: str(tmp / f"{name}-{key}") for key in ("facts", "history", "marker")}
    strategy = _strategy_class(strategy_name)(
        num_workers=WORKERS,
        num_cpus_per_worker=1,
        placement_strategy="SPREAD",  # one worker per node; both fit on the node left
        max_retries=0,
    )
    trainer = pl.Trainer(
        strategy=strategy,
        default_root_dir=str(tmp / name),
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    drained = _drain_when_marked(Path(files["marker"])) if drain else {}
    model = _module_class()[0](files, slow=drain)
    started = time.monotonic()
    trainer.fit(model)
    record = {
        "fit_seconds": round(time.monotonic() - started, 1),
        "drained": drained,
        "drains": strategy.num_drains,
        "restarts": strategy.num_restarts,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "history": [[int(v) for v in line.split()] for line in _read(Path(files["history"]))],
        "facts": [json.loads(line) for line in _read(Path(files["facts"]))],
        "leftovers": sorted(os.listdir(tmp / name)) if (tmp / name).exists() else [],
    }
    return record, model


def _check(tmp: Path, name: str, cluster, nodes: dict, lines: list[str], last: bool) -> dict:
    """A reference fit and a drained one with strategy ``name``; unless ``last``, the drained node is replaced."""
    import time

    import torch

    from polytrain.backends.registry import get_spec
    from tests.integration.multinode_script import _replace_node

    backend = STRATEGIES[name][1]
    if not get_spec(backend).installed:
        return {"status": "skipped", "reason": f"{backend} is not installed"}
    started = time.monotonic()
    lines.clear()
    result: dict = {}
    result["reference"], reference = _fit(tmp, f"{name}-reference", name, drain=False)
    try:
        result["drained"], drained = _fit(tmp, f"{name}-drained", name, drain=True)
    finally:
        marker = tmp / f"{name}-drained-marker"
        victim = marker.read_text() if marker.exists() else ""
        facts = [json.loads(line) for line in _read(tmp / f"{name}-drained-facts")]
        ips = {f["node_ip"] for f in facts if victim and f["node_id"] == victim}
        for ip in ips if not last else ():
            _replace_node(cluster, nodes, ip)  # a drained node stays draining: a fresh one
    expected = reference.state_dict()
    result["unequal"] = [
        key for key, value in drained.state_dict().items() if not torch.equal(value, expected[key])
    ]
    result["log"] = list(lines)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["status"] = "ok"
    return result


def _check_validate(tmp: Path, lines: list[str]) -> dict:
    """``trainer.validate`` on a node that drains: left at once, run again off the node."""
    import time

    import pytorch_lightning as pl

    from polytrain.lightning import RayStrategy

    lines.clear()
    files = {key: str(tmp / f"validate-{key}") for key in ("facts", "history", "marker")}
    strategy = RayStrategy(
        num_workers=WORKERS, num_cpus_per_worker=1, placement_strategy="SPREAD", max_retries=0
    )
    trainer = pl.Trainer(
        strategy=strategy,
        default_root_dir=str(tmp / "validate"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    drained = _drain_when_marked(Path(files["marker"]))
    started = time.monotonic()
    metrics = trainer.validate(_module_class()[1](files, slow=True))
    return {
        "status": "ok",
        "seconds": round(time.monotonic() - started, 1),
        "drained": drained,
        "metrics": metrics,
        "drains": strategy.num_drains,
        "restarts": strategy.num_restarts,
        "facts": [json.loads(line) for line in _read(Path(files["facts"]))],
        "log": list(lines),
    }


def main(out_path: str, *names: str) -> None:
    """Build the cluster, check each strategy in ``names`` (default: ddp), write ``out_path``."""
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
    cluster, nodes = start_cluster()
    result: dict = {"runs": {}}
    try:
        import pytorch_lightning as pl

        ensure_ray(cluster.address, timeout_s=60)
        pl.seed_everything(0)  # PL_GLOBAL_SEED: the distributed sampler's shuffle seed
        tmp = Path(out_path).parent
        validate = not names  # the default run: ddp, then a validate call
        names = names or ("ddp",)
        for name in names:
            try:
                last = name == names[-1] and not validate
                result["runs"][name] = _check(tmp, name, cluster, nodes, handler.lines, last)
            except Exception:  # noqa: BLE001 - reported to the test, which names it
                result["runs"][name] = {"status": "error", "error": traceback.format_exc()}
        if validate:
            try:
                result["validate"] = _check_validate(tmp, handler.lines)
            except Exception:  # noqa: BLE001 - reported to the test, which names it
                result["validate"] = {"status": "error", "error": traceback.format_exc()}
        result["status"] = "ok"
    except Exception:  # noqa: BLE001 - reported to the test, which names it
        result = {"status": "error", "error": traceback.format_exc()}
    finally:
        result["seconds"] = round(time.monotonic() - started, 1)
        Path(out_path).write_text(json.dumps(result, indent=1))
        ray.shutdown()
        cluster.shutdown()


# ------------------------------------------------------------------ the tests
def _run_script(tmp_path_factory, *names: str) -> dict:
    pytest.importorskip("pytorch_lightning")
    # Imported here: this file also runs as a script, where tests/ is not importable yet.
    from tests.integration.fresh_cluster import run_script_on_fresh_cluster

    tmp = tmp_path_factory.mktemp("lightning_drain")
    result = run_script_on_fresh_cluster(
        __file__, tmp / "result.json", *names, timeout_s=400, prefix="ptld"
    )
    assert result["status"] == "ok", result.get("error")
    return result


@pytest.fixture(scope="module")
def ddp_script(tmp_path_factory) -> dict:
    """RayStrategy (ddp): every run."""
    return _run_script(tmp_path_factory)


@pytest.fixture(scope="module")
def variants_script(tmp_path_factory) -> dict:
    """The Horovod, sharded and DeepSpeed variants, in one cluster (make test-long)."""
    return _run_script(tmp_path_factory, "horovod", "sharded", "deepspeed")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("ddp", id="ddp"),
        pytest.param("horovod", id="horovod", marks=pytest.mark.long_matrix),
        pytest.param("sharded", id="sharded", marks=pytest.mark.long_matrix),
        pytest.param("deepspeed", id="deepspeed", marks=pytest.mark.long_matrix),
    ],
)
def run(request) -> dict:
    """One strategy's reference and drained fits (the variants stop through their backends' state)."""
    script = request.getfixturevalue("ddp_script" if request.param == "ddp" else "variants_script")
    result = script["runs"][request.param]
    if result["status"] == "skipped":
        pytest.skip(result["reason"])
    assert result["status"] == "ok", result.get("error")
    return {**result, "strategy": STRATEGIES[request.param][0]}


def _groups(run: dict) -> tuple[list[dict], list[dict]]:
    """The drained fit's placements: the first group's ranks, then the second's."""
    facts = run["drained"]["facts"]
    first = [f for f in facts if (f["epoch"], f["batch"]) == (0, 0)]
    second = [f for f in facts if (f["epoch"], f["batch"]) != (0, 0)]
    assert sorted(f["rank"] for f in first) == [0, 1], facts
    assert sorted(f["rank"] for f in second) == [0, 1], facts
    return sorted(first, key=lambda f: f["rank"]), sorted(second, key=lambda f: f["rank"])


def _every_step() -> list[list[int]]:
    return [[e, b, e * BATCHES + b] for e in range(EPOCHS) for b in range(BATCHES)]


def test_the_drained_node_is_left_as_a_preemption_not_a_restart(run):
    drained = run["drained"]
    assert drained["drained"]["accepted"][0] is True  # the GCS took the drain request
    first, second = _groups(run)
    victim = drained["drained"]["victim"]
    assert first[1]["node_id"] == victim and first[0]["node_id"] != victim  # one per node
    # max_retries=0 survived it: one preemption, no restart
    assert drained["drains"] == 1 and drained["restarts"] == 0
    # the new group runs off the draining node, from the batch after the stop
    assert all(f["node_id"] != victim for f in second), second
    assert second[0]["epoch"] == 0 and 0 < second[0]["batch"] < BATCHES
    assert drained["current_epoch"] == EPOCHS and drained["global_step"] == EPOCHS * BATCHES


def test_every_step_trained_once_with_the_weights_of_the_uninterrupted_fit(run):
    assert run["reference"]["history"] == _every_step()
    assert run["reference"]["drains"] == 0
    history = run["drained"]["history"]
    assert history == _every_step()  # no repeat, no gap, in order
    assert run["unequal"] == []  # torch.equal for every tensor of the state dict


def test_the_log_names_the_node_the_reason_the_deadline_and_the_checkpoint(run):
    first, second = _groups(run)
    victim, ip = first[1]["node_id"], first[1]["node_ip"]
    lines = run["log"]
    announced = [
        line
        for line in lines
        if line.startswith(f"Node {victim} ({ip}) is draining (preemption, deadline in ")
    ]
    assert len(announced) == 1, lines
    assert announced[0].endswith(
        ": the workers (rank 1) finish their current batch, checkpoint there and the fit "
        "continues off the node."
    )
    stop = second[0]["batch"]
    preempted = [line for line in lines if line.startswith("Drain 1 ")]
    assert len(preempted) == 1, lines
    assert preempted[0].startswith(
        f"Drain 1 ({run['strategy']} max_drains=unlimited) of node {victim}: checkpoint "
    )
    assert f"holds epoch 0, batch {stop} (global step {stop}) (" in preempted[0]
    assert preempted[0].endswith(" s before the deadline).")
    assert any(line.startswith("Continuing from ") for line in lines), lines
    assert not any("; restart " in line for line in lines), lines  # not a lost worker


def test_no_drain_checkpoint_is_left_behind(run):
    assert "drain_checkpoints" not in run["drained"]["leftovers"]


def test_a_validate_call_on_a_drained_node_runs_again_off_it(ddp_script):
    run = ddp_script["validate"]
    assert run["status"] == "ok", run.get("error")
    victim = run["drained"]["victim"]
    assert run["drained"]["accepted"][0] is True
    assert run["drains"] == 1 and run["restarts"] == 0
    facts = run["facts"]
    assert len(facts) == 4, facts  # two groups of two
    first, second = facts[:2], facts[2:]
    assert victim in {f["node_id"] for f in first}
    assert all(f["node_id"] != victim for f in second), facts
    assert len(run["metrics"]) == 1 and "val_loss" in run["metrics"][0]
    assert any(
        line.endswith(
            ": the workers (rank 1) stop the running validate call, which runs again off the node."
        )
        for line in run["log"]
    ), run["log"]
    assert any(
        line.startswith(f"Drain 1 (RayStrategy max_drains=unlimited) of node {victim}: ")
        and "the validate call stopped" in line
        for line in run["log"]
    ), run["log"]


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
    sys.stdout.flush()
    os._exit(0)
