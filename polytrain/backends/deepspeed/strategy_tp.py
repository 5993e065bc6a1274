"""DeepSpeed with AutoTP (``parallelism={"tp": T, ...}`` on the deepspeed backend, worker side).

DeepSpeed's AutoTP (``tensor_parallel.autotp_size``) replaces the model's linear
layers by tensor-parallel ones over groups of T consecutive ranks (its own
``(data_parallel, tensor_parallel)`` mesh, TP innermost, as polytrain's), and
ZeRO runs over the data-parallel groups. This strategy adds what the plain one
lacks for it:

* TP peers read the same batches (``sample_distribution``: the data-parallel rank
  ``rank // T``); their samples count once;
* every node's worker count must be a multiple of T (a TP group inside a node);
* checkpoints: the weights are gathered whole with DeepSpeed's own
  ``_consolidated_16bit_state_dict`` (which gathers AutoTP's slices), so
  ``trainer.save``, ``get_model`` and ``save_pretrained`` give the unsharded model
  that loads anywhere. AutoTP's optimizer state is kept per slice and has no
  portable form: it is saved as None (a load starts the optimizer fresh, with a
  warning), and loading a checkpoint into an AutoTP run is refused.
"""

from __future__ import annotations

import logging
from typing import Any

from polytrain.backends.core import sharding as _sharding
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.local_mode import sharded_only
from polytrain.backends.core.local_state import gathered_local_state
from polytrain.backends.core.parallelism import Parallelism, mesh_ranks, refuse_adapters_under_tp
from polytrain.backends.deepspeed.config import DeepSpeedConfig
from polytrain.backends.deepspeed.state import engine_state
from polytrain.backends.deepspeed.strategy import DeepSpeedStrategy
from polytrain.checkpoint.pieces import LocalState, ShardReader
from polytrain.errors import CheckpointError

logger = logging.getLogger(__name__)


class AutoTPStrategy(DeepSpeedStrategy):
    """The deepspeed strategy for an engine with AutoTP over ``tp`` ranks.

    Args:
        config: the backend's config, its ``tensor_parallel`` section set.
        tp: the AutoTP size.
    """

    def __init__(self, config: DeepSpeedConfig, tp: int) -> None:
        super().__init__(config)
        self.tp = tp

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: check that the TP groups fit the nodes, then build the engine.

        Raises:
            ConfigError: a model with PEFT adapters (AutoTP would split their base layers).
        """
        for model in components.models:
            refuse_adapters_under_tp(model, self.tp)
        if _sharding.shards(ctx):
            import torch.distributed as dist

            places: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(places, (ctx.node_rank, ctx.local_rank))
            sizes = Parallelism(dp_shard=ctx.world_size // self.tp, tp=self.tp)
            mesh_ranks(sizes, [tuple(p) for p in places])  # raises if a node splits a group
        return super().prepare(components, ctx)

    @sharded_only
    def sample_distribution(self, ctx: WorkerContext) -> tuple[int, int]:
        """Worker: ``(world // tp, rank // tp)``: DeepSpeed's data-parallel rank."""
        return ctx.world_size // self.tp, ctx.world_rank // self.tp

    def counts_samples(self, ctx: WorkerContext) -> bool:
        """Worker: the first rank of each TP group reports the group's samples."""
        return ctx.world_rank % self.tp == 0

    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): the whole weights; no portable optimizer state."""
        engine = engine_state(components).engine
        weights = engine._consolidated_16bit_state_dict()  # gathers AutoTP's slices
        if ctx.world_rank != 0:
            return None
        logger.warning(
            "DeepSpeed AutoTP keeps the optimizer state per weight slice, which has no portable "
            "form: the checkpoint holds the weights only (a load starts the optimizer fresh)."
        )
        models = [{k: v.float() if v.is_floating_point() else v for k, v in weights.items()}]
        return {"models": models, "optimizers": [None]}

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Refused: see :func:`_refuse_load`."""
        _refuse_load()

    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker (collective): the gathered state, which rank 0 writes alone."""
        return gathered_local_state(self, components, ctx)

    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Refused: see :func:`_refuse_load`."""
        _refuse_load()


def _refuse_load() -> None:
    raise CheckpointError(
        "Loading a checkpoint into a DeepSpeed AutoTP run (parallelism tp > 1 on the "
        "deepspeed backend) is not supported: AutoTP slices the weights and the ZeRO "
        "partitions after the engine is built. Load it with backend='fsdp' and the same "
        "parallelism (tensor parallelism that loads from any layout), or without tp."
    )
