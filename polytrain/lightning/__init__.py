"""Lightning 2.x strategies on Ray actors, built from polytrain's backends and worker group.

>>> import pytorch_lightning as pl
>>> from polytrain.lightning import RayStrategy
>>> trainer = pl.Trainer(max_epochs=2, strategy=RayStrategy(num_workers=2, backend="horovod"))
>>> trainer.fit(model)

ray_lightning's names work too: ``HorovodRayStrategy``, ``TuneReportCheckpointCallback``,
``get_tune_resources``; ``RayStrategy`` takes its ``init_hook``, ``resources_per_worker``
and DDP keyword arguments.

Importing this package imports pytorch_lightning; ``import polytrain`` does not.
"""

from polytrain.compat.imports import MissingDependencyError, install_hint, module_available

if not module_available("pytorch_lightning"):
    raise MissingDependencyError(
        "polytrain.lightning needs pytorch_lightning (2.x), which is not installed. Install "
        f"it with: {install_hint('pytorch_lightning')}"
    )

from polytrain.lightning.environment import WorkerGroupEnvironment  # noqa: E402
from polytrain.lightning.launcher import RayLauncher  # noqa: E402
from polytrain.lightning.legacy import (  # noqa: E402
    HorovodRayPlugin,
    RayDeepSpeedPlugin,
    RayHorovodPlugin,
    RayPlugin,
    RayShardedPlugin,
)
from polytrain.lightning.strategy import RayStrategy  # noqa: E402
from polytrain.lightning.tune import (  # noqa: E402
    TuneReportCallback,
    TuneReportCheckpointCallback,
    get_tune_resources,
)
from polytrain.lightning.variants import (  # noqa: E402
    HorovodRayStrategy,
    RayDeepSpeedStrategy,
    RayHorovodStrategy,
    RayShardedStrategy,
)

__all__ = [
    "HorovodRayPlugin",
    "HorovodRayStrategy",
    "RayDeepSpeedPlugin",
    "RayDeepSpeedStrategy",
    "RayHorovodPlugin",
    "RayHorovodStrategy",
    "RayLauncher",
    "RayPlugin",
    "RayShardedPlugin",
    "RayShardedStrategy",
    "RayStrategy",
    "TuneReportCallback",
    "TuneReportCheckpointCallback",
    "WorkerGroupEnvironment",
    "get_tune_resources",
]
