"""RayStrategy with a fixed backend: Horovod, fairscale sharding, DeepSpeed (and ray_lightning's names)."""

from __future__ import annotations

from typing import Any, ClassVar

from polytrain.lightning.options import reject_backend
from polytrain.lightning.strategy import RayStrategy


class _FixedBackendStrategy(RayStrategy):
    """A :class:`RayStrategy` whose backend the subclass fixes (``backend=`` is refused)."""

    fixed_backend: ClassVar[str] = ""

    def __init__(
        self, num_workers: int | None = None, use_gpu: bool | None = None, **kwargs: Any
    ) -> None:
        reject_backend(type(self).__name__, kwargs)
        super().__init__(
            backend=self.fixed_backend, num_workers=num_workers, use_gpu=use_gpu, **kwargs
        )


class RayHorovodStrategy(_FixedBackendStrategy):
    """:class:`RayStrategy` with ``backend="horovod"`` (Horovod ring-allreduce over gloo).

    Lightning 2.x dropped its own Horovod strategy; this one runs Horovod through
    polytrain's backend. Takes the arguments of :class:`RayStrategy` except ``backend``.
    """

    fixed_backend = "horovod"


class RayShardedStrategy(_FixedBackendStrategy):
    """:class:`RayStrategy` with ``backend="fairscale"`` (optimizer-state sharding).

    Lightning 2.x dropped its fairscale strategies; this one runs fairscale's OSS +
    ShardedDataParallel through polytrain's backend. Takes the arguments of
    :class:`RayStrategy` except ``backend``.
    """

    fixed_backend = "fairscale"


class RayDeepSpeedStrategy(_FixedBackendStrategy):
    """:class:`RayStrategy` with ``backend="deepspeed"`` (DeepSpeed ZeRO; ``backend_config`` picks the stage).

    Takes the arguments of :class:`RayStrategy` except ``backend``.
    """

    fixed_backend = "deepspeed"


#: ray_lightning's name of :class:`RayHorovodStrategy` (the same class).
HorovodRayStrategy = RayHorovodStrategy
