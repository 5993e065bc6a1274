"""HorovodConfig validation and the horovod backend's rank/env bookkeeping, without Ray."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from polytrain.backends.horovod.backend import HorovodBackend
from polytrain.backends.horovod.config import HorovodConfig
from polytrain.backends.horovod.rendezvous import check_slots_match_ranks, horovod_env
from polytrain.backends.registry import get_backend, get_spec
from polytrain.launchers.ranks import compute_ranks

needs_horovod = pytest.mark.skipif(
    not get_spec("horovod").installed, reason="horovod is not installed"
)


def test_defaults_and_dict_form():
    config = HorovodConfig.from_value({"compression": "fp16", "backward_passes_per_step": 4})
    assert config == HorovodConfig(compression="fp16", backward_passes_per_step=4)
    assert HorovodConfig().op == "average"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"op": "max"}, r"The provided op \('max'\) is not supported. Must be one of"),
        ({"compression": "int8"}, r"The provided compression \('int8'\) is not supported"),
        ({"backward_passes_per_step": 0}, r"backward_passes_per_step \(0\).*int >= 1"),
        ({"backward_passes_per_step": 2.0}, r"backward_passes_per_step \(2.0\)"),
        ({"backward_passes_per_step": True}, r"backward_passes_per_step \(True\)"),
        ({"stall_check_s": -1}, r"stall_check_s \(-1\).*>= 0"),
        (
            {"stall_check_s": 60, "stall_shutdown_s": 10},
            r"stall_shutdown_s \(10\).*>= stall_check_s",
        ),
        ({"stall_check_s": 0, "stall_shutdown_s": 10}, r"stall_shutdown_s \(10\)"),
    ],
)
def test_bad_values_name_the_value_and_the_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HorovodConfig(**kwargs)


def test_unknown_key_lists_the_allowed_keys():
    with pytest.raises(TypeError, match=r"Unknown backend_config key\(s\) \['fp16'\].*compression"):
        HorovodBackend({"fp16": True})


def test_adasum_is_refused_with_the_reason():
    backend = HorovodBackend({"op": "adasum"})
    with pytest.raises(ValueError, match=r"op \('adasum'\).*MPI.*op='average'"):
        backend.validate_settings(num_workers=2, use_gpu=False, use_fp16=False)
    HorovodBackend({"op": "sum"}).validate_settings(num_workers=2, use_gpu=False, use_fp16=False)


@needs_horovod
def test_alias_resolves_to_the_backend():
    backend = get_backend("hvd", {"op": "sum"})
    assert isinstance(backend, HorovodBackend) and backend.config.op == "sum"


def test_backend_pickles_without_driver_state():
    backend = HorovodBackend()
    rendezvous = backend.make_rendezvous()  # the driver side, one per worker group
    rendezvous._server = object()  # the driver's rendezvous server never travels
    clone = pickle.loads(pickle.dumps(backend))
    assert getattr(clone, "_server", None) is None and clone.config == backend.config


@needs_horovod
def test_slot_plan_and_env_follow_the_worker_group_ranks():
    from polytrain.backends.horovod.rendezvous import host_assignments

    nodes = ["node-a", "node-a", "node-b", "node-b", "node-b"]
    slots = host_assignments(nodes)
    infos = compute_ranks(nodes)
    check_slots_match_ranks(slots, infos)
    env = horovod_env(slots[3], "10.0.0.1", 1234, HorovodConfig(stall_check_s=0), 30.0)
    assert env["HOROVOD_RANK"] == "3" and env["HOROVOD_SIZE"] == "5"
    assert env["HOROVOD_LOCAL_RANK"] == "1" and env["HOROVOD_LOCAL_SIZE"] == "3"
    # local rank 1 exists on both nodes: node-b is the second of them
    assert env["HOROVOD_CROSS_RANK"] == "1" and env["HOROVOD_CROSS_SIZE"] == "2"
    assert env["HOROVOD_HOSTNAME"] == "node-b"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1"
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "1234"
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "30"
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    # ranks that are not contiguous per node cannot be expressed to Horovod
    with pytest.raises(RuntimeError, match="contiguous"):
        check_slots_match_ranks(
            slots, compute_ranks(["node-a", "node-b", "node-a", "node-b", "node-b"])
        )


def test_importing_polytrain_and_the_backend_module_loads_no_horovod():
    code = (
        "import sys, polytrain, polytrain.backends.horovod; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'horovod'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_force_host_staging_reaches_the_worker_strategy():
    class Staged(HorovodBackend):
        force_host_staging = True

    assert Staged({"op": "sum"}).make_strategy().force_host_staging
    strategy = HorovodBackend().make_strategy()
    assert not strategy.force_host_staging and strategy.config == HorovodConfig()


def test_driver_sides_import_no_framework():
    code = (
        "import sys, polytrain.backends.horovod.rendezvous, "
        "polytrain.backends.deepspeed.rendezvous; "
        "print(sorted(m for m in ('torch', 'horovod', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
