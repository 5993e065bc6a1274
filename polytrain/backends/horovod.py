"""Horovod ring-allreduce on the worker group's actors, rendezvous through Horovod's gloo controller.

The driver runs Horovod's own HTTP rendezvous server
(:class:`horovod.runner.http.http_server.RendezvousServer`) and gives every
worker the environment ``horovodrun --gloo`` and ``horovod.ray`` give theirs
(``HOROVOD_RANK``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR``, ...), with Horovod's ranks
equal to the worker group's world ranks. Workers then call ``hvd.init()``; the
user's optimizers are wrapped in ``hvd.DistributedOptimizer``.

``horovod`` is imported inside the functions that need it, so importing this
module (done lazily by the registry) loads no Horovod code in the driver until
a trainer starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.base import Backend, BackendConfig, Components, WorkerContext

logger = logging.getLogger(__name__)

COMPRESSIONS = ("none", "fp16")
OPS = ("average", "sum", "adasum")

# Seconds the driver waits for workers to shut Horovod down, and for the rendezvous
# server to stop, before it gives up on them (dead or stuck workers are killed next).
_SHUTDOWN_WAIT_S = 5.0
_ACCUM_KEY = "horovod_backward_passes"


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
    """

    compression: str = "none"
    backward_passes_per_step: int = 1
    op: str = "average"
    stall_check_s: float = 60.0
    stall_shutdown_s: float = 0.0

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"The provided compression ({self.compression!r}) is not supported. Must be one "
                f"of {COMPRESSIONS}."
            )
        if self.op not in OPS:
            raise ValueError(
                f"The provided op ({self.op!r}) is not supported. Must be one of {OPS}."
            )
        steps = self.backward_passes_per_step
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"The provided backward_passes_per_step ({steps!r}) is not supported. Must be an "
                f"int >= 1 (1 = no gradient accumulation)."
            )
        for name in ("stall_check_s", "stall_shutdown_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(
                    f"The provided {name} ({value!r}) is not supported. Must be a number of "
                    f"seconds >= 0 (0 disables it)."
                )
        if self.stall_shutdown_s and not 0 < self.stall_check_s <= self.stall_shutdown_s:
            raise ValueError(
                f"The provided stall_shutdown_s ({self.stall_shutdown_s!r}) is not supported with "
                f"stall_check_s={self.stall_check_s!r}: Horovod shuts down only after a stall it "
                f"has detected. Must be 0, or >= stall_check_s with stall_check_s > 0."
            )


# ---------------------------------------------------------------- pure helpers
def host_assignments(node_ids: Sequence[str]) -> list[Any]:
    """Horovod's slot plan (``SlotInfo`` per world rank) for workers on ``node_ids``.

    ``node_ids`` is in world-rank order with co-located workers contiguous (as the
    worker group orders them). The node id doubles as Horovod's host name: it is
    unique per Ray node, unlike host names, and is what ``horovod.ray`` uses.
    """
    from horovod.runner.common.util import hosts

    slots: dict[str, int] = {}
    for node in node_ids:
        slots[node] = slots.get(node, 0) + 1
    host_string = ",".join(f"{node}:{count}" for node, count in slots.items())
    return hosts.get_host_assignments(hosts.parse_hosts(host_string), len(node_ids))


def horovod_env(
    slot: Any,
    rendezvous_addr: str,
    rendezvous_port: int,
    config: HorovodConfig,
    timeout_s: float,
) -> dict[str, str]:
    """The environment one worker needs for ``hvd.init()`` with the gloo controller.

    Args:
        slot: the worker's ``SlotInfo`` from :func:`host_assignments`.
        rendezvous_addr: an address of the driver that the worker can reach.
        rendezvous_port: the port of the driver's rendezvous server.
        config: the backend options (stall settings).
        timeout_s: gloo's timeout for rendezvous and collectives.
    """
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(max(1, int(timeout_s))),
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(int(config.stall_check_s)),
        "HOROVOD_STALL_CHECK_DISABLE": "1" if config.stall_check_s == 0 else "0",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(int(config.stall_shutdown_s)),
    }


def check_slots_match_ranks(slots: Sequence[Any], rank_infos: Sequence[Any]) -> None:
    """Raise if Horovod's slot plan disagrees with the worker group's ranks."""
    for slot, info in zip(slots, rank_infos, strict=True):
        mine = (info.world_rank, info.local_rank, info.world_size, info.local_world_size)
        theirs = (slot.rank, slot.local_rank, slot.size, slot.local_size)
        if mine != theirs:
            raise RuntimeError(
                f"Horovod's rank plan {theirs} (rank, local_rank, size, local_size) differs from "
                f"the worker group's {mine}; the workers of a node must have contiguous ranks."
            )


# -------------------------------------------------------- worker-side helpers
def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


def _interface_with_address(ip: str) -> str | None:
    """The network interface that holds ``ip`` on this host, if any."""
    import socket

    import psutil

    for iface, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return iface
    return None


def _init_worker(env: dict[str, str], node_ip: str) -> tuple[int, int, int, int]:
    """Worker: set the Horovod environment and join the rendezvous (blocks for all ranks)."""
    env = dict(env)
    # gloo binds to the interface that carries the address Ray reaches this node on:
    # that one routes to the other nodes. Interface names may differ between hosts.
    iface = _interface_with_address(node_ip)
    if iface is not None:
        env["HOROVOD_GLOO_IFACE"] = iface
    os.environ.update(env)
    hvd = _hvd()
    if hvd.is_initialized():  # a reused process: join the new group instead
        hvd.shutdown()
    hvd.init()
    return hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()


def _shutdown_worker() -> None:
    hvd = _hvd()
    if hvd.is_initialized():
        hvd.shutdown()


def _stop_server(server: Any) -> None:
    server.stop()
    # RendezvousServer.stop() leaves the listening socket open.
    httpd = getattr(server, "_httpd", None)
    if httpd is not None:
        httpd.server_close()


class _HostStaging:
    """A Horovod compression that stages GPU tensors through host memory.

    For a Horovod built without CUDA support: tensors are (optionally compressed,)
    copied to the CPU for gloo, and copied back to their device afterwards.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compressed, ctx = self.inner.compress(tensor)
        return compressed.cpu(), (ctx, tensor.device)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        inner_ctx, device = ctx
        return self.inner.decompress(tensor.to(device), inner_ctx)


def _named_parameters(
    models: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer, index: int
) -> list[tuple[str, torch.nn.Parameter]]:
    """Unique, rank-independent names for every parameter of ``optimizer``.

    Horovod matches tensors across ranks by name. Parameters of the models get
    their module path (prefixed with the model index, so two models never clash);
    parameters that belong to no model get their position in the optimizer.
    """
    names: dict[int, str] = {}
    for m, model in enumerate(models):
        for name, param in model.named_parameters():
            names.setdefault(id(param), f"model{m}.{name}")
    named = []
    for g, group in enumerate(optimizer.param_groups):
        for p, param in enumerate(group["params"]):
            named.append((names.get(id(param), f"optimizer{index}.group{g}.param{p}"), param))
    return named


def _reduces_cuda_tensors(hvd: Any) -> bool:
    # NCCL is Horovod's GPU allreduce path next to the gloo controller; gloo itself
    # reduces host memory only.
    return bool(hvd.nccl_built())


# --------------------------------------------------------------------- backend
class HorovodBackend(Backend):
    """Data parallelism with Horovod's ring-allreduce and ``hvd.DistributedOptimizer``.

    The workers are the worker group's actors; the driver hosts Horovod's gloo
    rendezvous server. Models stay unwrapped (Horovod hooks the optimizer), so
    checkpoints are plain torch state dicts that load under any backend.
    """

    name = "horovod"
    framework = "torch"
    config_cls = HorovodConfig
    config: HorovodConfig

    #: Stage GPU tensors through host memory even if Horovod can handle CUDA tensors.
    force_host_staging: bool = False

    def __init__(self, config: HorovodConfig | dict | None = None) -> None:
        super().__init__(config)
        self._server: Any = None
        self._local_mode = False
        self._owns_local_init = False

    def __getstate__(self) -> dict[str, Any]:
        # The backend travels to the workers; the driver's server stays behind.
        state = dict(self.__dict__)
        state["_server"] = None
        return state

    # ----------------------------------------------------------------- driver
    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: refuse Adasum, which Horovod runs only over MPI (this backend uses gloo).

        Raises:
            ValueError: ``op="adasum"``.
        """
        if self.config.op == "adasum":
            raise ValueError(
                "The provided op ('adasum') is not supported by the horovod backend: Horovod "
                "implements Adasum only on top of MPI (launched by horovodrun/mpirun), and "
                "polytrain's workers rendezvous through Horovod's gloo controller ('No Adasum "
                "operation enabled'). Use op='average' (the default) or op='sum'."
            )

    def on_start(self, group: Any, ctx_template: WorkerContext) -> None:
        """Driver: start the rendezvous server, give every worker its env, run ``hvd.init()``.

        In local mode the driver is the only worker: ``hvd.init()`` runs in this
        process with size 1 and no environment is changed.
        """
        self._local_mode = ctx_template.local_mode
        if self._local_mode:
            hvd = _hvd()
            self._owns_local_init = not hvd.is_initialized()
            if self._owns_local_init:
                hvd.init()
            return

        import ray
        from horovod.runner.http.http_server import RendezvousServer

        slots = host_assignments([m.node_id for m in group.metadata])
        check_slots_match_ranks(slots, group.rank_infos)
        server = RendezvousServer(verbose=0)
        port = server.start()
        self._server = server
        server.init(slots)
        addr = ray.util.get_node_ip_address()
        refs = [
            group.execute_single_async(
                rank,
                _init_worker,
                horovod_env(slot, addr, port, self.config, ctx_template.timeout_s),
                group.metadata[rank].node_ip,
            )
            for rank, slot in enumerate(slots)
        ]
        joined = group.get(refs)
        for info, (rank, size, local_rank, local_size) in zip(
            group.rank_infos, joined, strict=True
        ):
            if (rank, size, local_rank, local_size) != (
                info.world_rank,
                info.world_size,
                info.local_rank,
                info.local_world_size,
            ):
                raise RuntimeError(
                    f"Worker {info.world_rank} joined Horovod as rank {rank} of {size} (local "
                    f"{local_rank} of {local_size}); expected {info}."
                )

    def on_shutdown(self, group: Any) -> None:
        """Driver: shut Horovod down in every worker and stop the rendezvous server.

        Waits at most a few seconds: dead workers, or workers stuck in a collective
        with a dead peer, are left to the worker group, which kills them.
        """
        try:
            if self._local_mode:
                if self._owns_local_init:
                    _shutdown_worker()
                    self._owns_local_init = False
            else:
                group.execute_best_effort(_shutdown_worker, timeout_s=_SHUTDOWN_WAIT_S)
        except Exception:  # noqa: BLE001 - dead workers must not stop the shutdown
            logger.debug("Horovod shutdown in the workers failed", exc_info=True)
        finally:
            server, self._server = self._server, None
            if server is not None:
                # Stopping joins the server's threads; never let that block the driver.
                stopper = threading.Thread(target=_stop_server, args=(server,), daemon=True)
                stopper.start()
                stopper.join(_SHUTDOWN_WAIT_S)

    # ----------------------------------------------------------------- worker
    def _compression(self, hvd: Any, ctx: WorkerContext) -> Any:
        compression = hvd.Compression.fp16 if self.config.compression == "fp16" else None
        compression = compression or hvd.Compression.none
        if self._host_staging(hvd, ctx):
            return _HostStaging(compression)
        return compression

    def _host_staging(self, hvd: Any, ctx: WorkerContext) -> bool:
        return self.force_host_staging or (
            ctx.device.type == "cuda" and not _reduces_cuda_tensors(hvd)
        )

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap every optimizer in ``hvd.DistributedOptimizer``; broadcast rank 0's state.

        Models are not wrapped. On GPU, Horovod's CUDA path (NCCL) reduces the
        gradients when Horovod was built with it; otherwise they are staged through
        host memory and reduced with gloo.
        """
        hvd = _hvd()
        if not hvd.is_initialized():
            raise RuntimeError(
                "Horovod is not initialised in this worker: HorovodBackend.on_start must run in "
                "the driver before prepare (use the backend through TorchTrainer)."
            )
        op = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[self.config.op]
        compression = self._compression(hvd, ctx)
        components.optimizers = [
            hvd.DistributedOptimizer(
                optimizer,
                named_parameters=_named_parameters(components.models, optimizer, index),
                compression=compression,
                backward_passes_per_step=self.config.backward_passes_per_step,
                op=op,
            )
            for index, optimizer in enumerate(components.optimizers)
        ]
        components.extra[_ACCUM_KEY] = 0
        self._broadcast_from_rank0(components, ctx)
        return components

    def _broadcast_from_rank0(self, components: Components, ctx: WorkerContext) -> None:
        hvd = _hvd()
        if hvd.size() == 1:
            return
        staging = self._host_staging(hvd, ctx)
        for index, model in enumerate(components.models):
            state = model.state_dict()
            if staging:
                cpu_state = {k: v.detach().cpu().clone() for k, v in state.items()}
                hvd.broadcast_parameters(
                    [(f"model{index}.{k}", v) for k, v in cpu_state.items()], root_rank=0
                )
                model.load_state_dict(cpu_state)
            else:
                hvd.broadcast_parameters(
                    [(f"model{index}.{k}", v) for k, v in state.items()], root_rank=0
                )
        for index, optimizer in enumerate(components.optimizers):
            if staging:
                # Horovod cannot touch CUDA tensors here: send the state pickled.
                state = hvd.broadcast_object(
                    _to_cpu(optimizer.state_dict()), root_rank=0, name=f"optimizer{index}"
                )
                optimizer.load_state_dict(state)
            elif optimizer.state:
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            else:
                # hvd.broadcast_optimizer_state initialises an empty state with a
                # zero-gradient step, which would count one Adam step and apply weight
                # decay once: DDP does neither. Nothing but the options to send.
                options = hvd.broadcast_object(
                    [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                    root_rank=0,
                    name=f"optimizer{index}.options",
                )
                for group, group_options in zip(optimizer.param_groups, options, strict=True):
                    group.update(group_options)

    def sample_distribution(self, ctx: WorkerContext) -> tuple[int, int]:
        """Worker: Horovod's ``(size, rank)``."""
        hvd = _hvd()
        return hvd.size(), hvd.rank()

    def _accumulating(self, components: Components) -> bool:
        """True between the backward passes of one accumulation window."""
        k = self.config.backward_passes_per_step
        return k > 1 and components.extra.get(_ACCUM_KEY, 0) % k != 0

    def zero_grad(self, components: Components) -> None:
        """Worker: plain ``zero_grad()`` (Horovod's optimizer rejects ``set_to_none``).

        Skipped inside an accumulation window (``backward_passes_per_step > 1``).
        """
        if self._accumulating(components):
            return
        for optimizer in components.optimizers:
            optimizer.zero_grad()

    def backward(self, loss: torch.Tensor, components: Components) -> None:
        """Worker: back-propagate; Horovod's hooks start the allreduce of ready gradients."""
        super().backward(loss, components)
        components.extra[_ACCUM_KEY] = components.extra.get(_ACCUM_KEY, 0) + 1

    def step(self, components: Components, optimizer_index: int | None = None) -> None:
        """Worker: wait for the allreduce and apply the gradients.

        With a GradScaler the gradients are synchronised first, so the scaler
        unscales and checks the reduced gradients. Inside an accumulation window
        this does nothing.
        """
        if self._accumulating(components):
            return
        optimizers = (
            components.optimizers
            if optimizer_index is None
            else [components.optimizers[optimizer_index]]
        )
        scaler = components.scaler
        for optimizer in optimizers:
            if scaler is not None:
                optimizer.synchronize()
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
            else:
                optimizer.step()
        if scaler is not None:
            scaler.update()

    @contextlib.contextmanager
    def no_sync(self, components: Components) -> Iterator[None]:
        """Worker: backward passes inside accumulate locally and start no allreduce.

        Horovod counts backward passes per parameter and reduces on the last of
        ``backward_passes_per_step``; here the count is held back for the passes
        inside the context, as DDP's ``no_sync`` does.
        """
        saved = []
        for optimizer in components.optimizers:
            delays = getattr(optimizer, "_allreduce_delay", None)
            if delays is None:
                continue
            saved.append((optimizer, dict(delays)))
            for param in delays:
                delays[param] += 1 << 30
        try:
            yield
        finally:
            for optimizer, delays in saved:
                optimizer._allreduce_delay.update(delays)
                # A hook that ran inside the context left a (None, None) handle; the
                # next backward pass or synchronize() replaces it.

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker: load the state on every rank, then broadcast rank 0's copy again."""
        super().load_full_state_dict(components, state, ctx)
        components.extra[_ACCUM_KEY] = 0
        self._broadcast_from_rank0(components, ctx)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
