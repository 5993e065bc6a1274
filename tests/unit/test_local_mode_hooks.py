"""Sharding strategies in local mode (no process group): every hook is the replicated one.

One decorator (:func:`polytrain.backends.core.local_mode.sharded_only`) replaces the
per-method guard; these tests fail if a sharding strategy overrides a hook without
it, or if a decorated hook does anything but the replicated behaviour locally.
"""

from __future__ import annotations

import pytest
import torch

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.local_mode import REPLICATED, sharded_only

SHARDING_STRATEGIES = [
    ("polytrain.backends.fsdp.strategy_v1", "FSDP1Strategy"),
    ("polytrain.backends.fsdp.strategy_v2", "FSDP2Strategy"),
    ("polytrain.backends.fsdp.strategy_mesh", "MeshFSDPStrategy"),
    ("polytrain.backends.fairscale.strategy_oss", "FairscaleOSSStrategy"),
    ("polytrain.backends.fairscale.strategy_fsdp", "FairscaleFSDPStrategy"),
]


def _strategy_class(module: str, name: str) -> type:
    import importlib

    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(("module", "name"), SHARDING_STRATEGIES)
def test_every_hook_a_sharding_strategy_overrides_falls_back_in_local_mode(module, name):
    if "fairscale" in module:
        pytest.importorskip("fairscale")
    cls = _strategy_class(module, name)
    overridden = [hook for hook in REPLICATED if hook in vars(cls)]
    assert overridden, f"{name} overrides none of {sorted(REPLICATED)}"
    unguarded = [hook for hook in overridden if not hasattr(vars(cls)[hook], "__wrapped__")]
    assert not unguarded, f"{name} overrides {unguarded} without @sharded_only"


def test_a_hook_with_no_replicated_behaviour_is_refused_where_it_is_defined():
    with pytest.raises(TypeError, match="no replicated behaviour for 'clip_grad_norm_'"):

        class _Strategy:
            @sharded_only
            def clip_grad_norm_(self, components, max_norm, ctx):  # pragma: no cover
                raise AssertionError


def test_local_fsdp2_prepares_nothing_and_its_state_is_the_whole_model():
    from polytrain.backends.fsdp.strategy_v2 import FSDP2Strategy

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    components = Components(models=[model], optimizers=[optimizer])
    ctx = WorkerContext(local_mode=True)
    strategy = FSDP2Strategy()
    assert strategy.prepare(components, ctx) is components
    assert components.models[0] is model
    full = strategy.full_state_dict(components, ctx)
    assert full["models"][0].keys() == model.state_dict().keys()
    assert all(torch.equal(full["models"][0][k], v) for k, v in model.state_dict().items())
    changed = {k: v + 1 for k, v in full["models"][0].items()}
    strategy.load_full_state_dict(components, {"models": [changed], "optimizers": None}, ctx)
    assert torch.equal(model.weight, changed["weight"])
    local = strategy.sharded_state_dict(components, ctx)
    assert local.skeleton is not None and local.pieces
