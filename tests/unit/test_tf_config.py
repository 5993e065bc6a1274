"""TF_CONFIG building and the mwms backend's driver-side logic, without Ray or TensorFlow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.backends.core.strategy import KerasStrategy
from polytrain.backends.registry import get_backend
from polytrain.backends.tensorflow.backend import MultiWorkerMirroredBackend
from polytrain.backends.tensorflow.config import MWMSConfig
from polytrain.backends.tensorflow.rendezvous import (
    TFConfigRendezvous,
    build_tf_config,
    format_address,
    is_chief,
    plan_ports,
    worker_env,
)
from polytrain.backends.tensorflow.strategy import MWMSStrategy
from polytrain.compat.keras import LEGACY_KERAS_VAR, legacy_keras_env
from polytrain.errors import ConfigError

ADDRESSES = ["10.0.0.1:2222", "10.0.0.1:2223", "10.0.0.2:2222"]


def test_cluster_spec_lists_every_worker_in_rank_order():
    for index in range(3):
        config = build_tf_config(ADDRESSES, index)
        assert config == {
            "cluster": {"worker": ADDRESSES},
            "task": {"type": "worker", "index": index},
        }
    # JSON round trip: what the workers read from the environment.
    assert json.loads(json.dumps(build_tf_config(ADDRESSES, 2)))["task"]["index"] == 2


def test_worker_zero_is_the_only_chief():
    chiefs = [is_chief(build_tf_config(ADDRESSES, i)) for i in range(len(ADDRESSES))]
    assert chiefs == [True, False, False]
    explicit = {
        "cluster": {"chief": ["a:1"], "worker": ["b:1"]},
        "task": {"type": "worker", "index": 0},
    }
    assert not is_chief(explicit)
    assert is_chief({**explicit, "task": {"type": "chief", "index": 0}})


@pytest.mark.parametrize(
    "addresses, index, message",
    [
        ([], 0, "at least one worker address"),
        (["h:1", "h:1"], 0, r"unique; \['h:1'\] appear more than once"),
        (ADDRESSES, 3, "index 3 is out of range for a cluster of 3"),
        (ADDRESSES, -1, "index -1 is out of range"),
        (ADDRESSES, True, "index True is out of range"),
    ],
)
def test_bad_cluster_raises_with_the_value(addresses, index, message):
    with pytest.raises(ValueError, match=message):
        build_tf_config(addresses, index)


def test_addresses_and_port_plan():
    assert format_address("10.0.0.1", 2222) == "10.0.0.1:2222"
    assert format_address("::1", 2222) == "[::1]:2222"
    assert format_address("[::1]", 2222) == "[::1]:2222"
    # One worker per node reserves the ports of all workers on that node.
    assert plan_ports(["a", "b", "a", "a"]) == {"a": (0, 3), "b": (1, 1)}


def test_worker_env_sets_tf_config_and_own_gpu_only():
    env = worker_env(ADDRESSES, 1)
    assert set(env) == {"TF_CONFIG"}
    assert json.loads(env["TF_CONFIG"]) == build_tf_config(ADDRESSES, 1)
    gpu_env = worker_env(ADDRESSES, 2, gpu_ids=("3",), use_gpu=True)
    assert gpu_env["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(ValueError, match="worker 0 was given no GPU"):
        worker_env(ADDRESSES, 0, gpu_ids=(), use_gpu=True)


def test_backend_registry_config_and_settings(monkeypatch):
    monkeypatch.delenv("POLYTRAIN_VERBOSE", raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    backend = get_backend("tf", {"communication": "RING", "auto_shard_policy": "off"})
    assert isinstance(backend, MultiWorkerMirroredBackend)
    assert backend.framework == "tensorflow"
    assert backend.config == MWMSConfig(communication="ring", auto_shard_policy="off")
    assert MWMSConfig() == MWMSConfig(communication="auto", auto_shard_policy="data")
    assert backend.make_rendezvous().worker_env_vars() == {
        LEGACY_KERAS_VAR: "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",  # quiet by default (issue 16.4)
    }
    with pytest.raises(ValueError, match=r"communication \('gloo'\) is not supported.*'ring'"):
        MWMSConfig(communication="gloo")
    with pytest.raises(ValueError, match=r"auto_shard_policy \('hint'\).*'data', 'file'"):
        MWMSConfig(auto_shard_policy="hint")
    # TensorFlow's per-op timeout costs a sleeping thread per collective: off by default.
    assert MWMSConfig().collective_timeout_s is None
    assert get_backend("mwms", {"collective_timeout_s": 30}).config.collective_timeout_s == 30
    for bad in (0, -1, "60", True):
        with pytest.raises(ValueError, match=rf"collective_timeout_s must be .*got {bad!r}"):
            MWMSConfig(collective_timeout_s=bad)
    with pytest.raises(TypeError, match=r"Unknown backend_config key\(s\) \['timeout'\]"):
        get_backend("mwms", {"timeout": 5})
    with pytest.raises(ValueError, match="communication='nccl' needs use_gpu=True"):
        get_backend("mwms", {"communication": "nccl"}).validate_settings(
            num_workers=2, use_gpu=False, use_fp16=False
        )


def test_backend_binds_a_driver_side_and_a_keras_worker_side():
    backend = get_backend("mwms", {"communication": "ring"})
    assert backend.config_cls is MWMSConfig
    rendezvous = backend.make_rendezvous()
    assert isinstance(rendezvous, TFConfigRendezvous) and isinstance(rendezvous, Rendezvous)
    strategy = backend.make_strategy()
    assert isinstance(strategy, MWMSStrategy) and isinstance(strategy, KerasStrategy)
    assert strategy.config is backend.config and strategy.framework == "tensorflow"
    # Only the hooks that make sense for Keras: nothing torch-shaped that raises by design.
    for hook in ("backward", "step", "make_scaler", "unwrap_model", "no_sync", "on_start"):
        assert not hasattr(strategy, hook) and not hasattr(backend, hook), hook


def test_config_errors_are_config_errors():
    for make in (
        lambda: MWMSConfig(communication="gloo"),
        lambda: MWMSConfig(collective_timeout_s=0),
        lambda: build_tf_config([], 0),
        lambda: worker_env(ADDRESSES, 0, use_gpu=True),
        lambda: get_backend("mwms").validate_settings(num_workers=1, use_gpu=False, use_fp16=True),
    ):
        with pytest.raises(ConfigError):
            make()


class _InProcessGroup:
    """Runs what the rendezvous sends to "workers" in this process, on three fake nodes' metadata."""

    def __init__(self, nodes):
        self.metadata = [
            SimpleNamespace(node_id=node, node_ip=f"10.0.0.{node}", gpu_ids=()) for node in nodes
        ]
        self.calls = []

    def execute_single_async(self, rank, fn, *args):
        self.calls.append((rank, fn.__name__))
        return fn(*args)

    def get(self, refs, ranks=None):
        return list(refs)


def test_rendezvous_gives_every_worker_its_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "")  # restored after the test
    rendezvous = get_backend("mwms").make_rendezvous()
    local = _InProcessGroup(["1"])
    rendezvous.on_start(local, WorkerContext(local_mode=True))
    assert local.calls == []  # local mode: no cluster
    group = _InProcessGroup(["1", "1", "2"])
    rendezvous.on_start(group, WorkerContext(world_size=3))
    # One port request per node (by its first worker), then one TF_CONFIG per worker.
    assert group.calls == [(0, "_free_ports"), (2, "_free_ports")] + [
        (rank, "_connect_worker") for rank in range(3)
    ]
    tf_config = json.loads(os.environ["TF_CONFIG"])  # the last "worker" set it here
    addresses = tf_config["cluster"]["worker"]
    assert tf_config["task"] == {"type": "worker", "index": 2}
    assert [a.rsplit(":", 1)[0] for a in addresses] == ["10.0.0.1", "10.0.0.1", "10.0.0.2"]
    assert addresses[0] != addresses[1]


def test_legacy_keras_env_is_restored():
    import os

    before = os.environ.get(LEGACY_KERAS_VAR)
    with legacy_keras_env():
        assert os.environ[LEGACY_KERAS_VAR] == "1"
    assert os.environ.get(LEGACY_KERAS_VAR) == before


def test_importing_the_tf_modules_imports_neither_tensorflow_nor_torch():
    # TensorFlow starts only in the workers, after TF_CONFIG is set; torch (about 1 s
    # and hundreds of MiB) is never needed by a TFTrainer's driver or workers.
    code = (
        "import sys, polytrain\n"
        "from polytrain import TFTrainer\n"
        "import polytrain.trainer_api.tensorflow.worker\n"
        "# The TF workers reach the backend only through the instance they are sent.\n"
        "assert 'polytrain.backends.tensorflow' not in sys.modules\n"
        "import polytrain.backends.tensorflow, polytrain.compat.keras\n"
        "import polytrain.trainer_api.tensorflow.worker, polytrain.checkpoint.single_file\n"
        "import polytrain.backends.tensorflow.rendezvous, polytrain.backends.tensorflow.strategy\n"
        "from polytrain.backends.registry import get_backend\n"
        "from polytrain.backends.core.backend import WorkerContext\n"
        "get_backend('mwms')\n"
        "from polytrain.launchers.ranks import RankInfo\n"
        "placed = WorkerContext(world_size=2).for_rank(RankInfo(1, 1, 2, 2, 0))\n"
        "assert (placed.world_rank, placed.world_size) == (1, 2)\n"
        "bad = [m for m in ('tensorflow', 'tf_keras', 'keras', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
