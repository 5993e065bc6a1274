"""TensorFlow ``MultiWorkerMirroredStrategy`` on Ray actors, configured through ``TF_CONFIG``.

The driver hook (:meth:`MultiWorkerMirroredBackend.on_start`) asks every actor
for its address and a free port, builds each worker's ``TF_CONFIG`` with the
pure function :func:`build_tf_config` and sets it in the actors before they
import TensorFlow. The worker hooks create the strategy, check the Keras model
and set the data sets' auto-sharding policy.

TensorFlow is imported only inside the worker hooks, never when this module is
imported: the driver can resolve and configure the backend without paying for
(or initialising) TensorFlow.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from polytrain.backends.base import Backend, BackendConfig, Components, WorkerContext
from polytrain.compat.keras import KERAS3_FIX, LEGACY_KERAS_ENV, keras_flavor
from polytrain.errors import CreatorError
from polytrain.launchers.worker import find_free_port

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
            raise ValueError(
                f"collective_timeout_s must be a positive number of seconds or None (no "
                f"timeout); got {timeout!r}."
            )
        for name, allowed in (
            ("communication", COMMUNICATIONS),
            ("auto_shard_policy", AUTO_SHARD_POLICIES),
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or value.lower() not in allowed:
                raise ValueError(
                    f"The provided {name} ({value!r}) is not supported. Must be one of "
                    f"{', '.join(repr(a) for a in allowed)}."
                )
            setattr(self, name, value.lower())


# ------------------------------------------------------------------ TF_CONFIG
def format_address(host: str, port: int) -> str:
    """``host:port`` for a TF_CONFIG cluster entry (IPv6 hosts in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{int(port)}"


def build_tf_config(addresses: Sequence[str], index: int) -> dict[str, Any]:
    """The ``TF_CONFIG`` of worker ``index`` in a cluster of ``addresses``.

    Every process is a ``"worker"``; with no ``"chief"`` task in the cluster,
    TensorFlow makes worker 0 the chief (it writes summaries and checkpoints).

    Args:
        addresses: ``host:port`` of every worker, in world-rank order.
        index: this worker's world rank.

    Raises:
        ValueError: no addresses, a repeated address, or an index out of range.
    """
    addresses = list(addresses)
    if not addresses:
        raise ValueError("A TF_CONFIG cluster needs at least one worker address; got none.")
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise ValueError(
            f"Worker addresses must be unique; {duplicates} appear more than once in "
            f"{addresses}. Every worker needs its own port."
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(addresses):
        raise ValueError(
            f"Worker index {index!r} is out of range for a cluster of {len(addresses)} "
            f"worker(s); must be 0 <= index < {len(addresses)}."
        )
    return {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}


def is_chief(tf_config: dict[str, Any]) -> bool:
    """True for the process TensorFlow treats as chief under this ``TF_CONFIG``."""
    task = tf_config.get("task", {})
    if task.get("type") == "chief":
        return True
    return (
        task.get("type") == "worker"
        and task.get("index") == 0
        and "chief" not in tf_config.get("cluster", {})
    )


def plan_ports(node_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Which worker asks for how many ports, per node: ``{node_id: (first_rank, count)}``.

    One worker per node reserves all of its node's ports at once, so co-located
    workers can never be handed the same port.
    """
    plan: dict[str, tuple[int, int]] = {}
    for rank, node in enumerate(node_ids):
        first, count = plan.get(node, (rank, 0))
        plan[node] = (first, count + 1)
    return plan


def worker_env(
    addresses: Sequence[str], index: int, gpu_ids: Sequence[str] = (), use_gpu: bool = False
) -> dict[str, str]:
    """The environment of worker ``index``: its ``TF_CONFIG`` and, on GPU, only its own GPU.

    Each worker sees just its own GPU: MultiWorkerMirroredStrategy would otherwise
    make a local replica on every GPU it sees.
    """
    env = {"TF_CONFIG": json.dumps(build_tf_config(addresses, index))}
    if use_gpu:
        if not gpu_ids:
            raise ValueError(
                f"use_gpu=True but worker {index} was given no GPU by Ray; set use_gpu=False "
                f"or add GPU nodes."
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    return env


def _free_ports(count: int) -> list[int]:
    # Hold every socket until all are bound, so the ports are distinct.
    if count == 1:
        return [find_free_port()]
    import socket

    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _set_env(env: dict[str, str]) -> None:
    os.environ.update(env)


# -------------------------------------------------------------------- backend
class MultiWorkerMirroredBackend(Backend):
    """Synchronous data parallelism with ``tf.distribute.MultiWorkerMirroredStrategy``.

    Every worker holds a full replica of the Keras model; gradients are all-reduced
    after every step (ring all-reduce over gRPC on CPU, NCCL on GPU). Models must be
    ``tf_keras`` (Keras 2) models: see :mod:`polytrain.compat.keras`.
    """

    name = "mwms"
    framework = "tensorflow"
    config_cls = MWMSConfig
    config: MWMSConfig

    # ----------------------------------------------------------------- driver
    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: NCCL needs GPUs; mixed precision is a Keras policy set in the creator."""
        if self.config.communication == "nccl" and not use_gpu:
            raise ValueError(
                "communication='nccl' needs use_gpu=True; use 'ring' or 'auto' on CPU."
            )
        if use_fp16:
            raise ValueError(
                "use_fp16 is not a TFTrainer option: set a Keras mixed-precision policy in "
                "model_creator (keras.mixed_precision.set_global_policy('mixed_float16'))."
            )

    def worker_env_vars(self) -> dict[str, str]:
        """Driver: every worker starts with ``TF_USE_LEGACY_KERAS=1`` (before TensorFlow loads)."""
        return dict(LEGACY_KERAS_ENV)

    def on_start(self, group: Any, ctx_template: WorkerContext) -> None:
        """Driver: give every worker its ``TF_CONFIG`` (and, on GPU, only its own GPU).

        Runs before any worker imports TensorFlow: the strategy reads ``TF_CONFIG``
        when it is created, and collective ops must be configured before TensorFlow's
        runtime starts. Local mode needs no cluster.
        """
        if ctx_template.local_mode:
            return
        node_ids = [meta.node_id for meta in group.metadata]
        ports: list[int] = [0] * len(node_ids)
        plan = plan_ports(node_ids)
        refs = {
            node: group.execute_single_async(first, _free_ports, count)
            for node, (first, count) in plan.items()
        }
        for node, ref in refs.items():
            node_ports = iter(group.get([ref], ranks=[plan[node][0]])[0])
            for rank, rank_node in enumerate(node_ids):
                if rank_node == node:
                    ports[rank] = next(node_ports)
        addresses = [
            format_address(meta.node_ip, port)
            for meta, port in zip(group.metadata, ports, strict=True)
        ]
        env_refs = [
            group.execute_single_async(
                rank,
                _set_env,
                worker_env(addresses, rank, group.metadata[rank].gpu_ids, ctx_template.use_gpu),
            )
            for rank in range(len(addresses))
        ]
        group.get(env_refs)

    # ----------------------------------------------------------------- worker
    def make_strategy(self, ctx: WorkerContext) -> Any:
        """Worker: the ``tf.distribute`` strategy (the default one in local mode).

        Creating it starts this worker's gRPC server and connects to the others, so
        it must run before any other TensorFlow operation in the process.
        """
        import tensorflow as tf

        if ctx.local_mode:
            return tf.distribute.get_strategy()
        implementation = self.config.communication
        if implementation == "auto" and ctx.use_gpu:
            implementation = "nccl"
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=getattr(
                tf.distribute.experimental.CommunicationImplementation, implementation.upper()
            ),
            # Not ctx.timeout_s: see MWMSConfig.collective_timeout_s (a thread per op).
            timeout_seconds=(
                float(self.config.collective_timeout_s)
                if self.config.collective_timeout_s
                else None
            ),
        )
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

    def shard_options(self) -> Any:
        """Worker: ``tf.data.Options`` with the configured auto-shard policy."""
        import tensorflow as tf

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(
            tf.data.experimental.AutoShardPolicy, self.config.auto_shard_policy.upper()
        )
        return options

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: check the model is a compiled tf_keras model; set the data sharding policy.

        The strategy itself distributes the model (its variables were created in
        ``strategy.scope()``) and the data sets (``model.fit`` distributes them); what
        is left here is to reject models that cannot train under the strategy and to
        tell tf.data how to split the global batches between workers.
        """
        model = components.models[0]
        check_keras_model(model, "model_creator")
        if getattr(model, "_distribute_reduction_method", None) is None:
            # Every replica's metric results are already aggregated over all workers, so
            # report the first replica's. Keras's default ("auto") SUMs the replicas'
            # values across workers, which logs a multiple of the loss wherever those
            # values are not collapsed into one first.
            model.distribute_reduction_method = "first"
        options = self.shard_options()
        components.train_loader = components.train_loader.with_options(options)
        if components.val_loader is not None:
            components.val_loader = components.val_loader.with_options(options)
        return components

    def backward(self, loss: Any, components: Components) -> None:
        """Worker: not used: ``model.fit`` computes and applies the gradients."""
        raise TypeError(
            "The mwms backend trains through model.fit; customise the step by overriding "
            "train_step in your Keras model."
        )

    def step(self, components: Components, optimizer_index: int | None = None) -> None:
        """Worker: not used: ``model.fit`` applies the gradients."""
        raise TypeError(
            "The mwms backend trains through model.fit; customise the step by overriding "
            "train_step in your Keras model."
        )

    def make_scaler(self, ctx: WorkerContext) -> Any:
        """Worker: no GradScaler (Keras's LossScaleOptimizer does this job)."""
        return None

    def unwrap_model(self, model: Any) -> Any:
        """Worker: the Keras model itself (the strategy does not wrap it)."""
        return model

    @contextlib.contextmanager
    def worker_scope(self, ctx: WorkerContext) -> Iterator[None]:
        """Worker: nothing to enter: the strategy places every operation itself."""
        yield

    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker: the model's weights and the optimizer's variables as numpy arrays.

        Mirrored variables hold the same value on every worker, so rank 0 reads its own.
        """
        if ctx.world_rank != 0:
            return None
        model = components.models[0]
        return {
            "models": [[w.copy() for w in model.get_weights()]],
            "optimizers": [optimizer_weights(model.optimizer)],
        }

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker: load weights (and optimizer variables, when present) on every rank."""
        model = components.models[0]
        weights = state["models"]
        if len(weights) != 1:
            raise ValueError(
                f"The checkpoint holds {len(weights)} models; a TFTrainer trains exactly one."
            )
        model.set_weights(weights[0])
        optimizers = state.get("optimizers") or [None]
        strategy = components.extra.get("strategy")
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            set_optimizer_weights(model.optimizer, model, optimizers[0])


def check_keras_model(model: Any, creator: str) -> None:
    """Raise a :class:`CreatorError` unless ``model`` is a compiled tf_keras model."""
    flavor = keras_flavor(model)
    if flavor == "keras3":
        raise CreatorError(
            f"{creator} returned a Keras 3 model ({type(model).__module__}."
            f"{type(model).__qualname__}); TFTrainer needs a tf_keras (Keras 2) model. "
            f"{KERAS3_FIX}"
        )
    from polytrain.compat.keras import get_keras

    keras = get_keras()
    if not isinstance(model, keras.Model):
        text = repr(model)
        text = text[:77] + "..." if len(text) > 80 else text
        raise CreatorError(
            f"{creator} returned {type(model).__name__} ({text}); expected a compiled "
            f"tf_keras Model. Signature: model_creator(config) -> keras.Model (compiled)."
        )
    if getattr(model, "optimizer", None) is None:
        raise CreatorError(
            f"{creator} returned an uncompiled model ({type(model).__name__}); call "
            f"model.compile(optimizer=..., loss=..., metrics=[...]) inside {creator}."
        )


def _optimizer_variables(optimizer: Any) -> list[Any]:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def optimizer_weights(optimizer: Any) -> list[Any] | None:
    """The optimizer's variables (iterations and slots) as numpy arrays; None if not built."""
    variables = _optimizer_variables(optimizer)
    if not variables:
        return None
    return [v.numpy().copy() for v in variables]


def set_optimizer_weights(optimizer: Any, model: Any, values: list[Any] | None) -> None:
    """Build the optimizer's slots for ``model`` if needed and assign ``values`` to them.

    ``None`` keeps a fresh optimizer state (the weights still load).
    """
    if values is None:
        return
    if not _optimizer_variables(optimizer) or len(_optimizer_variables(optimizer)) < len(values):
        if hasattr(optimizer, "build"):
            optimizer.build(model.trainable_variables)
        else:  # legacy optimizers create their slots on the first apply
            optimizer._create_all_weights(model.trainable_variables)
    variables = _optimizer_variables(optimizer)
    if len(variables) != len(values):
        raise ValueError(
            f"The checkpoint has {len(values)} optimizer variables but "
            f"{type(optimizer).__name__} has {len(variables)}: the optimizer in model_creator "
            f"differs from the one that wrote the checkpoint."
        )
    for variable, value in zip(variables, values, strict=True):
        if tuple(variable.shape) != tuple(value.shape):
            raise ValueError(
                f"Optimizer variable {variable.name} has shape {tuple(variable.shape)}; the "
                f"checkpoint's value has shape {tuple(value.shape)}."
            )
        variable.assign(value)
