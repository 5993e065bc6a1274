"""examples/lightning_quickstart.ipynb under a real Jupyter kernel (issue 29, item 5).

The notebook defines a LightningModule and a LightningDataModule in its cells and fits
them with ``RayStrategy(num_workers=2)``: the classes exist only in the kernel's
``__main__``, so the fit works only if they reach the Ray workers by value. The
kernel joins this session's Ray instance (``RAY_ADDRESS``), as in test_notebook.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason='pip install "polytrain[dev]"')
nbclient = pytest.importorskip("nbclient", reason='pip install "polytrain[dev]"')
pytest.importorskip("ipykernel", reason='pip install "polytrain[dev]"')
pytest.importorskip("pytorch_lightning")

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "lightning_quickstart.ipynb"
EPOCHS, STEPS_PER_EPOCH = 2, 22  # 700 samples per worker, 32 per batch (44 in one process)


def _text(cell) -> str:
    return "".join(
        o.get("text", "") for o in cell.get("outputs", []) if o["output_type"] == "stream"
    )


def test_lightning_notebook_fits_on_two_ray_workers(ray_start_4_cpus, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", ray_start_4_cpus.get_runtime_context().gcs_address)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    fitted = _text(code[1])
    # The data was split over two workers: half the steps of one process.
    assert f"epochs {EPOCHS}, optimizer steps {EPOCHS * STEPS_PER_EPOCH}" in fitted, fitted
    match = re.search(r"validation: loss ([\d.]+)  accuracy ([\d.]+)", fitted)
    assert match, fitted
    val_loss, val_accuracy = map(float, match.groups())
    assert val_loss < 1.0 and 0.8 < val_accuracy <= 1.0
    # The notebook's module holds the workers' trained weights afterwards.
    local = re.search(r"accuracy of the notebook's model: ([\d.]+)", _text(code[2]))
    assert local, _text(code[2])
    assert float(local.group(1)) == pytest.approx(val_accuracy, abs=0.03)
