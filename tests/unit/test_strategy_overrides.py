"""Every backend strategy's override of a TorchStrategy hook takes the hook's parameters.

The worker calls the hooks through the base's signature (``clip_grad_norm_(components,
max_norm, optimizer_index)``, ...): an override that kept an older signature fails
only when a run reaches it, on the workers. Checked here for every torch strategy.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from polytrain.backends.core.strategy import TorchStrategy

STRATEGIES = [
    "polytrain.backends.ddp.strategy:DDPStrategy",
    "polytrain.backends.horovod.strategy:HorovodStrategy",
    "polytrain.backends.fairscale.strategy_oss:FairscaleOSSStrategy",
    "polytrain.backends.fairscale.strategy_fsdp:FairscaleFSDPStrategy",
    "polytrain.backends.fsdp.strategy_v1:FSDP1Strategy",
    "polytrain.backends.fsdp.strategy_v2:FSDP2Strategy",
    "polytrain.backends.fsdp.strategy_mesh:MeshFSDPStrategy",
    "polytrain.backends.deepspeed.strategy:DeepSpeedStrategy",
    "polytrain.backends.deepspeed.strategy_tp:AutoTPStrategy",
]


@pytest.mark.parametrize("path", STRATEGIES)
def test_overrides_take_the_base_hooks_parameters(path):
    module, name = path.split(":")
    cls = getattr(importlib.import_module(module), name)
    different = {}
    for hook, override in vars(cls).items():
        base = getattr(TorchStrategy, hook, None)
        if hook.startswith("__") or not (callable(override) and callable(base)):
            continue
        ours = list(inspect.signature(inspect.unwrap(override)).parameters)
        theirs = list(inspect.signature(base).parameters)
        if ours != theirs:
            different[hook] = (ours, theirs)
    assert not different, f"{name} overrides with other parameters: {different}"
