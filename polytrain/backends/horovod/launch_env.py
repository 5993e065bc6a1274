"""``horovodrun --gloo``'s environment for ``polytrain launch --backend horovod``.

The driver runs Horovod's HTTP rendezvous server (the one the horovod backend
starts for its workers) and gives every rank what ``horovodrun --gloo`` gives it
(``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT``, ``HOROVOD_CONTROLLER=gloo``,
``HOROVOD_CPU_OPERATIONS=gloo``, ``HOROVOD_RANK``/``SIZE``/``LOCAL_*``/``CROSS_*``,
``HOROVOD_HOSTNAME``), so an unmodified script's ``hvd.init()`` joins the ring.
The network interface (``HOROVOD_GLOO_IFACE``) is picked on each rank's own node
by the launch. Horovod is imported inside the methods, never at module level.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from polytrain.backends.core.launch_env import LaunchAttempt, LauncherEnv
from polytrain.backends.horovod.config import HorovodConfig
from polytrain.backends.horovod.rendezvous import (
    _SHUTDOWN_WAIT_S,
    _stop_server,
    check_slots_match_ranks,
    horovod_env,
    host_assignments,
)

if TYPE_CHECKING:
    from polytrain.launchers.base import WorkerGroup

# gloo's rendezvous and collective timeout, as horovodrun's default (--gloo-timeout-seconds).
_GLOO_TIMEOUT_S = 30.0


class HorovodrunEnv(LauncherEnv):
    """``horovodrun --gloo``: a rendezvous server on the driver and Horovod's rank variables."""

    launcher = "horovodrun --gloo"

    def __init__(self, local_rank_arg: bool = True) -> None:
        super().__init__(local_rank_arg)
        self._server: Any = None

    def envs(self, group: WorkerGroup, attempt: LaunchAttempt) -> list[dict[str, str]]:
        """Driver: start the rendezvous server; every rank's ``horovodrun --gloo`` variables."""
        import ray
        from horovod.runner.http.http_server import RendezvousServer

        slots = host_assignments([m.node_id for m in group.metadata])
        check_slots_match_ranks(slots, group.rank_infos)
        self._server = RendezvousServer(verbose=0)
        port = self._server.start()
        self._server.init(slots)
        addr = ray.util.get_node_ip_address()
        config = HorovodConfig()
        return [horovod_env(slot, addr, port, config, _GLOO_TIMEOUT_S) for slot in slots]

    def stop(self) -> None:
        """Driver: stop the rendezvous server (never waiting long on its threads)."""
        server, self._server = self._server, None
        if server is not None:
            stopper = threading.Thread(target=_stop_server, args=(server,), daemon=True)
            stopper.start()
            stopper.join(_SHUTDOWN_WAIT_S)
