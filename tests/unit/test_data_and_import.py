"""Samplers added to user loaders, and what `import polytrain` costs."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from polytrain.trainer_api.data.loaders import UnpaddedDistributedSampler, add_distributed_sampler


def _loader(n=10, **kwargs):
    return DataLoader(TensorDataset(torch.arange(n).float()), batch_size=2, **kwargs)


def test_training_loader_gets_a_distributed_sampler_keeping_shuffle():
    shuffled = add_distributed_sampler(_loader(shuffle=True), 2, 1, training=True)
    assert isinstance(shuffled.sampler, DistributedSampler) and shuffled.sampler.shuffle
    assert shuffled.batch_size == 2
    ordered = add_distributed_sampler(_loader(), 2, 1, training=True)
    assert list(ordered.sampler) == [1, 3, 5, 7, 9]


def test_eval_loader_sees_every_sample_exactly_once():
    parts = [
        list(add_distributed_sampler(_loader(7), 3, r, training=False).sampler) for r in range(3)
    ]
    assert sorted(sum(parts, [])) == list(range(7))
    assert [len(UnpaddedDistributedSampler(range(7), 3, r)) for r in range(3)] == [3, 2, 2]


def test_non_dataloaders_and_existing_samplers_are_left_alone():
    data = [(1, 2)]
    assert add_distributed_sampler(data, 2, 0, training=True) is data
    loader = add_distributed_sampler(_loader(), 2, 0, training=True)
    assert add_distributed_sampler(loader, 2, 0, training=True) is loader


def test_import_polytrain_is_fast_and_imports_no_optional_framework():
    code = (
        "import sys, time; t = time.perf_counter(); import polytrain; "
        "from polytrain import available_backends; available_backends(); "
        "elapsed = time.perf_counter() - t; "
        "heavy = [m for m in ('tensorflow', 'deepspeed', 'horovod', 'fairscale', "
        "'pytorch_lightning', 'ray', 'torch') if m in sys.modules]; "
        "print(elapsed, heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    elapsed, heavy = out.stdout.split(" ", 1)
    # the registry imports torch (the base Backend uses it) but nothing optional
    assert "tensorflow" not in heavy and "deepspeed" not in heavy and "horovod" not in heavy
    assert "fairscale" not in heavy and "pytorch_lightning" not in heavy
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; t=time.perf_counter(); import polytrain; print(time.perf_counter()-t)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert float(out.stdout) < 1.0
