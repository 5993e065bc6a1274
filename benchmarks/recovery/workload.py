"""The model of the recovery benchmarks, and the local Ray instance each of their driver runs starts.

12 x Linear(2000, 2000) with ReLU and a 10-class head: 48M parameters, about
580 MB of fp32 model and Adam state, a model whose optimizer state is large.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYERS, WIDTH = 12, 2000
#: The global batch (split between the 2 workers).
GLOBAL_BATCH = 64


def model_creator(config: dict):
    """LAYERS x Linear(WIDTH, WIDTH) with ReLU, then a 10-class head."""
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def optimizer_creator(model, config: dict):
    """Adam: two state tensors per parameter."""
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-4)


def init_local_ray(**options: object) -> None:
    """A local Ray instance for one benchmark driver: 4 logical CPUs, this repository importable."""
    import ray

    sys.path.insert(0, str(REPO))
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
        configure_logging=False,
        **options,
    )
