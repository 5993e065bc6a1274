"""Options of the ``horovod`` backend (what ``backend_config=`` accepts)."""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.backends.core.backend import BackendConfig
from polytrain.errors import ConfigError

__all__ = ["COMPRESSIONS", "OPS", "HorovodConfig"]

COMPRESSIONS = ("none", "fp16")
OPS = ("average", "sum", "adasum")


@dataclass
class HorovodConfig(BackendConfig):
    """Options of the ``horovod`` backend.

    Attributes:
        compression: "none", or "fp16" to send gradients as float16 (halves the bytes
            on the wire; the update is applied in the parameters' dtype).
        backward_passes_per_step: gradient accumulation. Gradients of this many
            backward passes are summed locally, allreduced once, and the optimizer
            steps on every ``backward_passes_per_step``-th call of ``step``; the other
            calls (and the ``zero_grad`` calls between them) do nothing.
        op: how gradients are combined across workers: "average" (like DDP) or
            "sum". "adasum" is Horovod's Adasum, which needs MPI and is refused.
        stall_check_s: Horovod warns when some ranks have not submitted a tensor
            for this long (``HOROVOD_STALL_CHECK_TIME_SECONDS``); 0 disables the check.
        stall_shutdown_s: Horovod shuts itself down (every pending collective
            raises) after a stall this long (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``);
            0 waits forever.

    Raises:
        ConfigError: a value that is not allowed, naming it and the choices.
    """

    compression: str = "none"
    backward_passes_per_step: int = 1
    op: str = "average"
    stall_check_s: float = 60.0
    stall_shutdown_s: float = 0.0

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"The provided compression ({self.compression!r}) is not supported. Must be one "
                f"of {COMPRESSIONS}."
            )
        if self.op not in OPS:
            raise ConfigError(
                f"The provided op ({self.op!r}) is not supported. Must be one of {OPS}."
            )
        steps = self.backward_passes_per_step
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(
                f"The provided backward_passes_per_step ({steps!r}) is not supported. Must be an "
                f"int >= 1 (1 = no gradient accumulation)."
            )
        self._check_stall_settings()

    def _check_stall_settings(self) -> None:
        for name in ("stall_check_s", "stall_shutdown_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(
                    f"The provided {name} ({value!r}) is not supported. Must be a number of "
                    f"seconds >= 0 (0 disables it)."
                )
        if self.stall_shutdown_s and not 0 < self.stall_check_s <= self.stall_shutdown_s:
            raise ConfigError(
                f"The provided stall_shutdown_s ({self.stall_shutdown_s!r}) is not supported with "
                f"stall_check_s={self.stall_check_s!r}: Horovod shuts down only after a stall it "
                f"has detected. Must be 0, or >= stall_check_s with stall_check_s > 0."
            )
