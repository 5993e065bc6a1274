"""examples/quickstart.ipynb under a real Jupyter kernel (issue 16.7).

The notebook runs top to bottom with nbclient + ipykernel: creators defined in
the notebook train on Ray workers, two backends are compared, the plot is
drawn inline. A kernel interrupt (what the stop button and Ctrl-C send) during
``train()`` stops the workers and leaves the kernel usable.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason='pip install "polytrain[dev]"')
nbclient = pytest.importorskip("nbclient", reason='pip install "polytrain[dev]"')
pytest.importorskip("ipykernel", reason='pip install "polytrain[dev]"')

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO_ROOT / "examples" / "quickstart.ipynb"


@pytest.fixture
def kernel_env(ray_start_4_cpus, monkeypatch):
    """The kernel joins this session's Ray (as a notebook joins a running cluster)."""
    address = ray_start_4_cpus.get_runtime_context().gcs_address
    monkeypatch.setenv("RAY_ADDRESS", address)  # inherited by the kernel process
    return address


def _text(cell) -> str:
    return "".join(
        out.get("text", "") if out["output_type"] == "stream" else ""
        for out in cell.get("outputs", [])
    )


def test_quickstart_notebook_runs_and_shows_results(kernel_env, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    trained = _text(code[1])
    assert "epoch 0: loss" in trained and "epoch 1: loss" in trained
    accuracy = float(trained.rsplit("accuracy", 1)[1])
    assert 0.5 < accuracy <= 1.0  # the notebook's creators trained on the Ray workers
    table = _text(code[2]).splitlines()
    assert table[0].split()[:2] == ["backend", "status"]
    assert table[2].split()[:2] == ["ddp", "ok"] and table[3].split()[1] == "ok"
    assert table[3].split()[0] in ("horovod", "fsdp") and "!" not in _text(code[2])
    images = [o for o in code[3].outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1  # drawn inline
    assert (tmp_path / "polytrain_runs" / "notebook" / "compare.png").is_file()


SETUP = """
import os, time, torch
from torch.utils.data import DataLoader, TensorDataset
from polytrain import TorchTrainer

MARKER = {marker!r}

class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, x):
        open(MARKER, "a").close()  # training has started on a worker
        time.sleep(0.5)
        return self.linear(x)

def data_creator(config):
    data = TensorDataset(torch.randn(4096, 8), torch.randint(0, 2, (4096,)))
    return DataLoader(data, batch_size=config["batch_size"])

trainer = TorchTrainer(
    model_creator=lambda config: Slow(), data_creator=data_creator,
    optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
    loss_creator=torch.nn.CrossEntropyLoss, config={{"batch_size": 8}}, num_workers=2,
)
pids = trainer.apply_all_workers(os.getpid)
print("workers", pids)
"""

CHECK_STOPPED = """
import os, time

def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

deadline = time.monotonic() + 60  # a bound for a slow machine, not a speed check
while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.5)
print("still alive:", [p for p in pids if alive(p)])
"""


def _run(client, code: str, timeout: float = 300) -> tuple[dict, str]:
    chunks: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            chunks.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            chunks.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    return reply["content"], "".join(chunks)


def test_kernel_interrupt_during_train_stops_the_workers(kernel_env, tmp_path):
    from jupyter_client.manager import KernelManager

    marker = tmp_path / "training-started"
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(tmp_path), env={**os.environ, "RAY_ADDRESS": kernel_env})
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        reply, out = _run(client, SETUP.format(marker=str(marker)))
        assert reply["status"] == "ok", out
        # 256 batches of 0.5 s each: the epoch would take minutes.
        msg_id = client.execute("stats = trainer.train()")
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        time.sleep(1.0)
        manager.interrupt_kernel()
        reply = client.get_shell_msg(timeout=120)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = client.get_shell_msg(timeout=120)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        reply, out = _run(client, CHECK_STOPPED)
        assert reply["status"] == "ok" and "still alive: []" in out, out
        reply, out = _run(client, "print(21 * 2)")  # the kernel is still usable
        assert reply["status"] == "ok" and out.strip() == "42"
        reply, out = _run(client, "trainer.shutdown(); print('shut down')")
        assert reply["status"] == "ok" and "shut down" in out, out
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
