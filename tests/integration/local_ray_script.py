"""Run by test_local_ray.py in a fresh process: the local Ray instance polytrain starts.

Usage: ``python local_ray_script.py OUT.json`` with ``RAY_TMPDIR`` pointing at a
private directory whose ``ray/ray_current_cluster`` names a cluster that is gone.

1. ``ensure_ray(None)``: must ignore the stale session file (with a warning) and
   start a local instance.
2. Two actors run; every listening (or bound UDP) socket of the Ray processes this
   script started is recorded, and each port is probed on this host's outward address.
   Then the same while a 2-worker ddp trainer runs (its workers' torch store included).
3. GCS clients without the cluster's token, with a wrong one, and with the right one.
4. After ``ray.shutdown()``: ``ensure_ray`` at a loopback port that accepts TCP but is
   no Ray GCS must raise ConnectionError within its ``timeout_s`` instead of hanging.

Everything found is written to OUT.json; the test asserts on it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import psutil

GCS_CLIENT = r"""
import sys
from ray._raylet import GcsClient
try:
    client = GcsClient(address=sys.argv[1])
    print("OK", client.internal_kv_get(b"session_name", b"session", timeout=10))
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
"""


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _sockets_of(pids: set[int]) -> list[dict]:
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in pids:
            continue
        listening = conn.status == psutil.CONN_LISTEN
        bound_udp = conn.type == socket.SOCK_DGRAM and not conn.raddr
        if listening or bound_udp:
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.NoSuchProcess:
                name = "?"
            found.append(
                {"process": name, "pid": conn.pid, "ip": conn.laddr.ip, "port": conn.laddr.port}
            )
    return found


def _training_sockets() -> dict:
    """Every listening socket of the Ray processes while a 2-worker ddp trainer runs."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain import TorchTrainer

    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = TorchTrainer(
        model_creator=lambda config: torch.nn.Linear(4, 2),
        data_creator=lambda config: DataLoader(data, batch_size=config["batch_size"]),
        optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": 16},
        num_workers=2,
        backend="ddp",
    )
    try:
        trainer.train(num_steps=1)
        workers = trainer.apply_all_workers(
            lambda: {
                "pid": os.getpid(),
                "master_addr": os.environ["MASTER_ADDR"],
                "master_port": int(os.environ["MASTER_PORT"]),
            }
        )
        pids = {p.pid for p in psutil.Process().children(recursive=True)}
        return {"workers": workers, "sockets": _sockets_of(pids)}
    finally:
        trainer.shutdown()


def _gcs_client(address: str, auth_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(auth_env)
    proc = subprocess.run(
        [sys.executable, "-c", GCS_CLIENT, address],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return (proc.stdout.strip() or proc.stderr.strip()[-500:]).splitlines()[-1]


def _token_checks(gcs_address: str) -> dict[str, str]:
    from ray._raylet import AuthenticationTokenLoader

    token = AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True)
    return {
        "no_token": _gcs_client(gcs_address, {"RAY_AUTH_MODE": "disabled"}),
        "wrong_token": _gcs_client(
            gcs_address, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * len(token)}
        ),
        "right_token": _gcs_client(
            gcs_address, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        ),
    }


def _bounded_connect() -> dict:
    from polytrain.launchers.cluster.connect import ensure_ray

    silent = socket.socket()  # accepts connections (kernel backlog), never speaks gRPC
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    start = time.monotonic()
    try:
        ensure_ray(address, timeout_s=5)
        return {"address": address, "raised": None}
    except ConnectionError as exc:
        return {"address": address, "raised": str(exc), "seconds": time.monotonic() - start}


def main(out_path: str) -> None:
    import ray
    from ray._private.services import get_node_ip_address

    outward_ip = get_node_ip_address()  # before Ray starts: the host's outward address
    collect = _Collect()
    logging.getLogger("polytrain").addHandler(collect)
    from polytrain.launchers.cluster.connect import ensure_ray, probe

    ensure_ray(None)
    result: dict = {"warnings": collect.messages, "outward_ip": outward_ip}
    result["node_ip"] = ray.util.get_node_ip_address()
    result["auth_mode"] = os.environ.get("RAY_AUTH_MODE")

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self) -> int:
            return os.getpid()

    actors = [Probe.remote() for _ in range(2)]
    result["actor_pids"] = ray.get([a.pid.remote() for a in actors])
    pids = {p.pid for p in psutil.Process().children(recursive=True)}
    result["ray_pids"] = sorted(pids)
    result["sockets"] = _sockets_of(pids)
    result["outward_probes"] = {
        s["port"]: probe(f"{outward_ip}:{s['port']}", timeout_s=2) for s in result["sockets"]
    }
    result["training"] = _training_sockets()
    gcs_address = ray._private.worker._global_node.gcs_address
    result["gcs_address"] = gcs_address
    result["token"] = _token_checks(gcs_address)
    ray.shutdown()
    result["bounded_connect"] = _bounded_connect()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # a connection attempt given up on may still run in a daemon thread
