"""Every Lightning 1.x plugin spelling answers with its Lightning 2.x strategy (no Ray needed)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytorch_lightning")

import polytrain.lightning as lightning  # noqa: E402

# (the 1.x name, ray_lightning's or the reversed order users also wrote; the 2.x strategy)
SPELLINGS = [
    ("RayPlugin", "RayStrategy"),
    ("HorovodRayPlugin", "RayHorovodStrategy"),
    ("RayHorovodPlugin", "RayHorovodStrategy"),
    ("RayShardedPlugin", "RayShardedStrategy"),
    ("RayDeepSpeedPlugin", "RayDeepSpeedStrategy"),
]


@pytest.mark.parametrize(("old", "new"), SPELLINGS, ids=[old for old, _ in SPELLINGS])
def test_plugin_spelling_names_the_strategy(old, new):
    plugin = getattr(lightning, old)
    assert old in lightning.__all__
    with pytest.raises(TypeError) as info:
        plugin(num_workers=2, use_gpu=False)
    message = str(info.value)
    assert f"{old}(num_workers=2, use_gpu=False) is the Lightning 1.x spelling" in message
    assert f"Trainer(strategy={new}(num_workers=2, use_gpu=False))" in message
    assert f"from polytrain.lightning import {new}" in message
    # The strategy the message names is importable under that name.
    assert issubclass(getattr(lightning, new), lightning.RayStrategy)
