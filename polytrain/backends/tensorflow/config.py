"""Options of the ``mwms`` backend (what ``backend_config=`` accepts)."""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.backends.core.backend import BackendConfig
from polytrain.errors import ConfigError

__all__ = ["AUTO_SHARD_POLICIES", "COMMUNICATIONS", "MWMSConfig"]

COMMUNICATIONS = ("auto", "ring", "nccl")
AUTO_SHARD_POLICIES = ("data", "file", "auto", "off")


@dataclass
class MWMSConfig(BackendConfig):
    """Options of the ``mwms`` backend.

    Attributes:
        communication: the collective implementation: "auto" (TensorFlow's choice on
            CPU, NCCL on GPU), "ring" (gRPC ring all-reduce, works everywhere) or
            "nccl" (GPU only).
        auto_shard_policy: how every worker gets its share of the input data sets:
            "data" (default: every worker reads the whole pipeline and keeps its part
            of each global batch; works for any data set), "file" (workers read
            different input files; needs at least as many files as workers), "auto"
            (file if possible, else data) or "off" (no sharding: the data set must
            already differ per worker).
        collective_timeout_s: timeout of one collective operation, or None (the
            default) for none. TensorFlow implements it with one extra thread per
            collective op that sleeps for the whole timeout, even after the op is done:
            about 8 threads per training step of a 3-layer MLP, so a 1800 s timeout at
            50 steps/s would hold some 700,000 threads. Without it, a lost worker is still
            caught by Ray (the group is torn down at once) and a hung one by
            ``failure_config.hang_timeout_s``; set a short value (tens of seconds) only
            if you need TensorFlow itself to abort a stuck collective.

    ``failure_config.collective_timeout_s`` (the torch and Horovod collective timeout)
    does not apply to this backend, for the reason above.
    """

    communication: str = "auto"
    auto_shard_policy: str = "data"
    collective_timeout_s: float | None = None

    def __post_init__(self) -> None:
        timeout = self.collective_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ConfigError(
                f"collective_timeout_s must be a positive number of seconds or None (no "
                f"timeout); got {timeout!r}."
            )
        for name, allowed in (
            ("communication", COMMUNICATIONS),
            ("auto_shard_policy", AUTO_SHARD_POLICIES),
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or value.lower() not in allowed:
                raise ConfigError(
                    f"The provided {name} ({value!r}) is not supported. Must be one of "
                    f"{', '.join(repr(a) for a in allowed)}."
                )
            setattr(self, name, value.lower())
