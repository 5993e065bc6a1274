"""The cluster files in examples/cluster/ (issue 19): cloud launcher YAMLs, KubeRay, Slurm.

Nothing here starts a cluster. The launcher YAMLs go through Ray's own preparation and
schema (what ``ray up`` runs first); the KubeRay manifests through Ray's own KubeRay
translation (what the KubeRay autoscaler reads) plus structural checks by hand, since the
KubeRay CRD schema is not available offline; the Slurm script runs against fake
``srun``/``scontrol``/``ray``/``python``/``polytrain`` commands that record their arguments.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shlex
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from polytrain.backends.registry import describe_backends
from polytrain.cli.check import _check_node_setup, _Report, installed_extras
from polytrain.launchers.cluster.autoscaler import (
    can_ever_fit,
    node_setup_commands,
    shape_from_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER = REPO_ROOT / "examples" / "cluster"
LAUNCHER_FILES = sorted(CLUSTER.glob("*.yaml"))
CLOUD_FILES = [p for p in LAUNCHER_FILES if p.stem != "local"]
KUBERAY = CLUSTER / "kuberay"
SBATCH = CLUSTER / "slurm" / "polytrain.sbatch"
PRIVATE_PORTS = (6379, 8265)  # GCS and dashboard: never open to the internet
GPU_IMAGE_WORDS = ("deeplearning", "nvidia", "cuda", "dsvm")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _ray_validate(config: dict) -> None:
    """What ``ray up`` does to a cluster file before anything else."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    logging.getLogger("ray.autoscaler._private.util").setLevel(logging.WARNING)
    validate_config(prepare_config(copy.deepcopy(config)))


# ------------------------------------------------------------ launcher YAMLs
def test_the_three_clouds_and_on_premise_are_there():
    assert {p.stem for p in LAUNCHER_FILES} >= {"aws", "gcp", "azure", "local"}


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_ray_accepts_the_cluster_file(path):
    _ray_validate(_load(path))


def test_ray_schema_rejects_a_broken_file():
    import jsonschema

    config = _load(CLUSTER / "aws.yaml")
    config["available_node_types"]["ray.worker.gpu"]["min_workers"] = "zero"
    with pytest.raises(jsonschema.ValidationError):
        _ray_validate(config)
    config = _load(CLUSTER / "aws.yaml")
    config["setup_comands"] = []
    with pytest.raises(jsonschema.ValidationError):
        _ray_validate(config)


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_every_node_type_installs_every_backend(path):
    """Horovod included: every node type's setup (as the launcher runs it) builds it."""
    extras = {spec.extra for spec in describe_backends() if spec.extra}
    assert "horovod" in extras
    for node_type, commands in node_setup_commands(_load(path)).items():
        missing = extras - installed_extras(commands, REPO_ROOT)
        assert not missing, f"{path.name}: node type {node_type} does not install {missing}"


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_the_setup_cost_is_written_down(path):
    text = path.read_text()
    assert "about 5 minutes on 2 cores" in text and "per node" in text


def test_setup_scripts_build_into_the_cluster_environment():
    """The cluster files pass VENV/PYTHON to scripts/setup.sh, which must honour them."""
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r"^VENV=\$\{VENV:-\.venv\}", setup, re.M)
    assert re.search(r"^PY=\$\{PYTHON:-python3\}", setup, re.M)
    assert 'source "$VENV/bin/activate"' in setup
    assert re.search(r'SKIP_HOROVOD:-0}" != 1 ]; then\s+bash scripts/install_horovod.sh', setup)
    horovod = (REPO_ROOT / "scripts" / "install_horovod.sh").read_text()
    assert 'if [ -z "${VIRTUAL_ENV:-}" ]' in horovod  # builds into the active environment


def test_skip_horovod_is_noticed():
    assert "horovod" not in installed_extras(["SKIP_HOROVOD=1 bash scripts/setup.sh"], REPO_ROOT)
    assert "horovod" in installed_extras(["bash scripts/install_horovod.sh"], REPO_ROOT)
    old = 'cd ~/polytrain && pip install -q -e ".[fairscale,deepspeed,tensorflow]"'
    assert installed_extras([old], REPO_ROOT) == {"fairscale", "deepspeed", "tensorflow"}


@pytest.mark.parametrize("path", CLOUD_FILES, ids=lambda p: p.name)
def test_a_gpu_node_type_next_to_the_cpu_one(path):
    config = _load(path)
    workers = {
        name: spec
        for name, spec in config["available_node_types"].items()
        if name != config["head_node_type"]
    }
    gpu = [spec for spec in workers.values() if spec.get("resources", {}).get("GPU", 0) >= 1]
    cpu = [spec for spec in workers.values() if not spec.get("resources", {}).get("GPU")]
    assert gpu and cpu, f"{path.name}: needs a CPU and a GPU worker node type"
    for spec in gpu:
        assert spec.get("min_workers", 0) == 0  # GPU nodes start when work asks for them
        image = json.dumps(spec["node_config"]).lower()
        assert any(word in image for word in GPU_IMAGE_WORDS), f"no CUDA image: {image}"
    # The autoscaler helper sees the same: a use_gpu=True worker fits once nodes are added.
    head = {"CPU": 0.0}
    assert can_ever_fit({"CPU": 1, "GPU": 1}, 2, [head], shape_from_config(config))[0]


def test_on_premise_needs_no_node_types():
    # Ray rejects available_node_types for provider local; GPUs are detected by ray start.
    config = _load(CLUSTER / "local.yaml")
    assert config["provider"]["type"] == "local" and "available_node_types" not in config


def _open_rules(node, found):
    """Every firewall-like rule in a config: (ports, sources) for AWS, GCP and Azure."""
    if isinstance(node, dict):
        if "FromPort" in node or "ToPort" in node:  # AWS IpPermissions
            ports = (node.get("FromPort", -1), node.get("ToPort", -1))
            sources = [r.get("CidrIp") for r in node.get("IpRanges", [])]
            sources += [r.get("CidrIpv6") for r in node.get("Ipv6Ranges", [])]
            found.append((ports, sources))
        if "sourceRanges" in node:  # GCP firewall
            for allowed in node.get("allowed", []):
                for port in allowed.get("ports", ["0-65535"]):
                    low, _, high = str(port).partition("-")
                    found.append(((int(low), int(high or low)), node["sourceRanges"]))
        if "destinationPortRange" in node:  # Azure security rule
            low, _, high = str(node["destinationPortRange"]).replace("*", "0-65535").partition("-")
            found.append(((int(low), int(high or low)), [node.get("sourceAddressPrefix")]))
        for value in node.values():
            _open_rules(value, found)
    elif isinstance(node, list):
        for value in node:
            _open_rules(value, found)
    return found


def _world_open_private_ports(config) -> list:
    bad = []
    for (low, high), sources in _open_rules(config, []):
        world = any(s in ("0.0.0.0/0", "::/0", "*", "Internet") for s in sources)
        every_port = low == -1 and high == -1
        for port in PRIVATE_PORTS:
            if world and (every_port or low <= port <= high):
                bad.append(port)
    return bad


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_dashboard_and_gcs_are_not_open_to_the_internet(path):
    assert _world_open_private_ports(_load(path)) == []


def test_the_port_check_bites():
    config = _load(CLUSTER / "aws.yaml")
    config["provider"]["security_group"] = {
        "GroupName": "polytrain",
        "IpPermissions": [
            {
                "FromPort": 8265,
                "ToPort": 8265,
                "IpProtocol": "TCP",
                "IpRanges": [{"CidrIp": "0.0.0.0/0"}],
            }
        ],
    }
    assert _world_open_private_ports(config) == [8265]
    gcp = {"firewall": {"allowed": [{"ports": ["6000-7000"]}], "sourceRanges": ["0.0.0.0/0"]}}
    assert _world_open_private_ports(gcp) == [6379]
    azure = {"rule": {"destinationPortRange": "*", "sourceAddressPrefix": "*"}}
    assert _world_open_private_ports(azure) == [6379, 8265]
    private = {"rule": {"destinationPortRange": "*", "sourceAddressPrefix": "10.0.0.0/16"}}
    assert _world_open_private_ports(private) == []


def test_polytrain_check_warns_about_a_node_type_without_horovod(capsys):
    config = _load(CLUSTER / "gcp.yaml")
    config["available_node_types"]["ray_worker_gpu"]["worker_setup_commands"] = [
        "pip install 'polytrain[fairscale,deepspeed,tensorflow]'"
    ]
    report = _Report()
    _check_node_setup(report, config, CLUSTER / "gcp.yaml")
    rows = {check: (status, detail) for check, status, detail in report.rows}
    assert rows["setup ray_worker_gpu"] == (
        "WARN",
        "its setup_commands install no package for horovod",
    )
    assert rows["setup ray_worker_cpu"][0] == "OK"
    assert not report.failed  # a warning, not a failure


# ------------------------------------------------------------------ KubeRay
def _manifest(name: str) -> dict:
    return _load(KUBERAY / name)


def _containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_raycluster_structure():
    cluster = _manifest("raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert re.fullmatch(r"2\.\d+\.\d+", spec["rayVersion"])
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # training runs on worker pods
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"  # the dashboard stays private
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    for group in groups.values():
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["requests"] == container["resources"]["limits"]
    # A SIGTERM'd pod has time for the driver's checkpoint at the next boundary (README: Failures).
    pods = [head["template"]["spec"], *(g["template"]["spec"] for g in groups.values())]
    assert all(pod["terminationGracePeriodSeconds"] >= 90 for pod in pods)
    gpu_limits = groups["gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu_limits["nvidia.com/gpu"] == "1" and groups["gpu"]["minReplicas"] == 0
    assert "nvidia.com/gpu" not in str(groups["cpu"])


def test_raycluster_through_rays_kuberay_translation():
    """What the KubeRay autoscaler will see (Ray's own code, which also validates it)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    cluster = _manifest("raycluster.yaml")
    cluster["metadata"]["namespace"] = "default"
    config = _derive_autoscaling_config_from_ray_cr(cluster)
    types = config["available_node_types"]
    assert types["headgroup"]["resources"]["CPU"] == 0
    assert types["cpu"]["resources"]["CPU"] == 4 and "GPU" not in types["cpu"]["resources"]
    assert types["gpu"]["resources"]["GPU"] == 1
    assert (types["gpu"]["min_workers"], types["gpu"]["max_workers"]) == (0, 2)
    shape = shape_from_config(_manifest("raycluster.yaml"))
    assert can_ever_fit({"CPU": 1, "GPU": 1}, 2, [{"CPU": 0.0}], shape)[0]
    assert not can_ever_fit({"CPU": 1, "GPU": 1}, 3, [{"CPU": 0.0}], shape)[0]


def test_rayjob_runs_polytrain_train_on_the_same_cluster():
    job = _manifest("rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["rayClusterSpec"] == _manifest("raycluster.yaml")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    words = shlex.split(spec["entrypoint"])
    assert words[:3] == ["polytrain", "train", "-c"]
    config = words[3]
    assert config.startswith("/opt/polytrain/")  # the image's checkout (the Dockerfile's)
    assert (REPO_ROOT / config.removeprefix("/opt/polytrain/")).is_file()
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert env["PYTHONPATH"] == "/opt/polytrain"


def _dockerfile() -> list[tuple[str, str]]:
    text = (KUBERAY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_dockerfile_builds_with_the_projects_setup():
    steps = _dockerfile()
    by = {}
    for instruction, args in steps:
        by.setdefault(instruction, []).append(args)
    assert steps[0][0] == "FROM" and re.match(r"python:3\.1[0-9]", by["FROM"][0])
    (workdir,) = by["WORKDIR"]
    assert by["COPY"] == [f". {workdir}"]  # the whole checkout
    runs = " ".join(by["RUN"])
    assert "make setup" in runs and "SKIP_HOROVOD" not in runs
    for tool in ("g++", "cmake", "make", "wget"):  # Horovod's build, make, KubeRay's probes
        assert tool in by["RUN"][0].split()
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^setup:.*\n\tbash scripts/setup\.sh", makefile, re.M)
    env = " ".join(by["ENV"])
    assert f"PATH={workdir}/.venv/bin:" in env and f"PYTHONPATH={workdir}" in env
    assert workdir == "/opt/polytrain"


def test_dockerfile_context_leaves_the_host_environment_out():
    ignored = (KUBERAY / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".git", "polytrain_runs"} <= set(ignored)


def test_manifests_use_the_image_the_dockerfile_builds():
    tag = re.search(
        r"docker build -f examples/cluster/kuberay/Dockerfile -t (\S+) \.",
        (KUBERAY / "Dockerfile").read_text(),
    )[1]
    for name in ("raycluster.yaml", "rayjob.yaml"):
        manifest = _manifest(name)
        spec = manifest["spec"].get("rayClusterSpec", manifest["spec"])
        assert {c["image"] for c in _containers(spec)} == {tag}


# -------------------------------------------------------------------- Slurm
def test_sbatch_is_valid_bash():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    header = [ln for ln in SBATCH.read_text().splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --exclusive" in header and any("--nodes=" in ln for ln in header)


def _shim(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _fake_slurm(tmp_path: Path) -> tuple[Path, Path]:
    """srun/scontrol and a fake environment's ray/python/polytrain that log their calls."""
    log = tmp_path / "calls.log"
    slurm, venv = tmp_path / "slurm-bin", tmp_path / "venv" / "bin"
    slurm.mkdir()
    venv.mkdir(parents=True)
    record = f'printf "%s\\n" "$(basename "$0") $* | cpus=${{SLURM_CPUS_PER_TASK:-}} gpus=${{SLURM_GPUS_ON_NODE:-}} node=${{FAKE_NODE:-batch}} auth=${{RAY_AUTH_MODE:-}}:${{#RAY_AUTH_TOKEN}}:${{RAY_AUTH_TOKEN:0:6}} pp=${{PYTHONPATH:-}}" >> {log}\n'
    _shim(slurm / "scontrol", record + "echo node-a; echo node-b; echo node-c\n")
    # srun: log, then run the command "on" the node given by -w, with that node's allocation.
    _shim(
        slurm / "srun",
        record
        + 'while [ $# -gt 0 ]; do case "$1" in -w) FAKE_NODE=$2; shift 2;; -*) shift;; *) break;; esac; done\n'
        + "export FAKE_NODE SLURM_CPUS_PER_TASK=4\n"
        + 'case "$FAKE_NODE" in node-a) export SLURM_GPUS_ON_NODE=1;; node-b) export SLURM_GPUS_ON_NODE=2;; *) unset SLURM_GPUS_ON_NODE;; esac\n'
        + 'if [ "$1" = hostname ]; then echo "10.9.8.7 172.17.0.1"; exit 0; fi\n'
        + 'exec "$@"\n',
    )
    # ray start --block stays up until stopped, like the real one.
    _shim(
        venv / "ray",
        record
        + f'case "$*" in *--block*) echo $$ >> {tmp_path}/blocking.pids; exec sleep 300;; esac\n',
    )
    # The wait for nodes: returns once $3 `ray start` steps run, as the real one would.
    _shim(
        venv / "python",
        record
        + "cat > /dev/null\n"
        + f'for _ in $(seq 200); do [ "$(cat {tmp_path}/blocking.pids 2>/dev/null | wc -l)" -ge "$3" ] && exit 0; sleep 0.1; done; exit 1\n',
    )
    _shim(venv / "polytrain", record + 'exit "${FAKE_POLYTRAIN_RC:-0}"\n')
    # scancel --signal=TERM JOB: every step's task gets SIGTERM (here: the blocking fakes).
    _shim(slurm / "scancel", record + f"kill $(cat {tmp_path}/blocking.pids) 2>/dev/null\nexit 0\n")
    # The clean-up's search for this job's leftover Ray processes: none left.
    _shim(slurm / "pkill", record + "exit 1\n")
    return log, slurm


def _run_sbatch(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    log, slurm = _fake_slurm(tmp_path)
    done = subprocess.run(
        ["bash", str(SBATCH)],
        env=_sbatch_env(tmp_path, slurm, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, log.read_text().splitlines()


def _sbatch_env(tmp_path: Path, slurm: Path, **env: str) -> dict[str, str]:
    full_env = {
        **os.environ,
        "PATH": f"{slurm}:{os.environ['PATH']}",
        "POLYTRAIN_VENV": str(tmp_path / "venv"),
        "SLURM_SUBMIT_DIR": str(REPO_ROOT),
        "SLURM_JOB_NODELIST": "node-[a-c]",
        "SLURM_CPUS_PER_TASK": "4",
        "SLURM_GPUS_ON_NODE": "1",
        "RAY_PORT": "6390",
        "RAY_TEMP_DIR": "/tmp/ray-polytrain-77",
        "SLURM_JOB_ID": "77",
        **env,
    }
    full_env.pop("RAY_AUTH_TOKEN", None)
    return full_env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_sbatch_starts_ray_across_the_allocation_and_trains(tmp_path):
    done, calls = _run_sbatch(
        tmp_path, TRAIN_ARGS="num_workers=6 epochs=2", RAY_START_ARGS="--object-store-memory=10"
    )
    assert done.returncode == 0, done.stderr
    commands = [c.split(" | ")[0] for c in calls]
    where = [c.split(" | ")[1] for c in calls]
    address = "10.9.8.7:6390"
    assert commands[0] == "scontrol show hostnames node-[a-c]"
    assert commands[1] == "srun --nodes=1 --ntasks=1 -w node-a hostname -I"
    head = commands.index(
        "ray start --head --node-ip-address=10.9.8.7 --port=6390 --dashboard-port=8265 "
        "--num-cpus=4 --num-gpus=1 --temp-dir=/tmp/ray-polytrain-77 --object-store-memory=10 "
        "--block"
    )
    assert "node=node-a" in where[head]
    workers = [i for i, c in enumerate(commands) if c.startswith(f"ray start --address={address} ")]
    # Each node reports its own allocation (they start in parallel: any order).
    started = {where[i].split()[2]: commands[i].split()[3:] for i in workers}
    own_dir = ["--temp-dir=/tmp/ray-polytrain-77", "--object-store-memory=10", "--block"]
    assert started == {
        "node=node-b": ["--num-cpus=4", "--num-gpus=2", *own_dir],
        "node=node-c": ["--num-cpus=4", "--num-gpus=0", *own_dir],
    }
    waits = [c for c in commands if c.startswith("python ")]
    assert waits == [f"python - {address} 1 300", f"python - {address} 3 300"]
    # Workers are started once the head is up (the first wait returned); training once
    # every node has joined (the fake wait returns when all three `ray start` run).
    worker_steps = [i for i, c in enumerate(commands) if re.match(r"srun .* -w node-[bc] ", c)]
    assert len(worker_steps) == 2
    assert max(head, commands.index(waits[0])) < min(worker_steps)
    train = commands.index(
        f"polytrain train -c examples/configs/ddp.yaml --address {address} "
        f"--out polytrain_runs/slurm-77 --resume num_workers=6 epochs=2"
    )
    assert f"pp={REPO_ROOT}" in where[train] and train > max(workers)
    # The steps are stopped through Slurm with SIGTERM; only this job's Ray is looked
    # for afterwards (by its own directory), never a bare `ray stop`.
    assert commands[-2:] == ["scancel --signal=TERM 77", "pkill -TERM -f -- /tmp/ray-polytrain-77/"]
    assert "ray stop" not in commands and train < len(commands) - 1
    # One token for the job, the same on every node and the driver.
    tokens = {re.search(r"auth=(\S+)", w)[1] for w in where[head:]}
    assert len(tokens) == 1 and tokens.pop().startswith("token:64:")
    # The blocking `ray start` steps were stopped.
    pids = [int(p) for p in (tmp_path / "blocking.pids").read_text().split()]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def _catches_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M)[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_sbatch_passes_sigterm_to_the_driver_and_returns_its_status(tmp_path):
    """Slurm's --signal=B:TERM reaches the batch shell only: it passes it on and exits 143."""
    header = [ln for ln in SBATCH.read_text().splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in header and "#SBATCH --signal=B:TERM@60" in header
    log, slurm = _fake_slurm(tmp_path)
    got_term = tmp_path / "driver-got-term"
    # A driver that checkpoints on SIGTERM and exits 143, as polytrain train does.
    _shim(
        tmp_path / "venv" / "bin" / "polytrain",
        f"trap 'touch {got_term}; exit 143' TERM\ntouch {tmp_path}/driver-up\n"
        "for _ in $(seq 600); do sleep 0.1; done\nexit 0\n",
    )
    env = _sbatch_env(tmp_path, slurm, RAY_TEMP_DIR="/tmp/ray-polytrain-78", SLURM_JOB_ID="78")
    job = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, text=True)
    while job.poll() is None and not (
        (tmp_path / "driver-up").exists() and _catches_sigterm(job.pid)
    ):
        time.sleep(0.05)  # the driver runs and the script's TERM trap is in place
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 143 and got_term.exists(), out
    assert "polytrain: SIGTERM" in out


def test_sbatch_returns_the_training_status_and_still_stops_ray(tmp_path):
    done, calls = _run_sbatch(
        tmp_path, FAKE_POLYTRAIN_RC="3", CONFIG="examples/configs/horovod.yaml"
    )
    assert done.returncode == 3
    commands = [c.split(" | ")[0] for c in calls]
    assert any(c.startswith("polytrain train -c examples/configs/horovod.yaml ") for c in commands)
    assert commands[-1] == "pkill -TERM -f -- /tmp/ray-polytrain-77/"
