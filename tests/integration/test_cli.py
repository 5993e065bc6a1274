"""The `polytrain` command end to end: real subprocesses against real Ray instances.

`train`, `compare` and `check` join the session's Ray instance through
``--address`` (starting one per command would cost seconds each); `submit`
talks to a Ray head with a dashboard that this module starts in its own temp
dir and stops again, killing only the processes that belong to it.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks.harness.cases import free_ports
from polytrain import TorchTrainer
from polytrain.backends.registry import available_backends, get_spec
from polytrain.checkpoint.single_file import load_checkpoint
from polytrain.errors import ConfigError
from tests.integration.cluster_processes import stop_ray_head

REPO_ROOT = Path(__file__).resolve().parents[2]
DDP = "examples/configs/ddp.yaml"
CLI_TIMEOUT_S = 420


def run_cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.run(
        [sys.executable, "-m", "polytrain", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    print(proc.stdout[-4000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    return proc


@pytest.fixture(scope="module")
def ray_address(ray_start_4_cpus):
    return ray_start_4_cpus.get_runtime_context().gcs_address


def _second_backend() -> str:
    """Another installed torch backend whose module imports, else DDP again under its alias."""
    for name in ("horovod", "fairscale", "fsdp", "deepspeed"):
        spec = get_spec(name)
        if spec.installed and importlib.util.find_spec(spec.target.split(":")[0]) is not None:
            return name
    return "torch"  # the alias of ddp: the same job a second time


# -------------------------------------------------------------- from_config
def test_from_config_builds_a_working_trainer(ray_start_4_cpus, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    trainer = TorchTrainer.from_config(DDP, **{"config.lr": 0.05, "config.batch_size": 32})
    try:
        assert trainer.backend_name == "ddp"
        assert trainer.config["lr"] == 0.05
        assert trainer.scaling.num_workers == 2
        first = trainer.train(num_steps=4)
        second = trainer.train(num_steps=4)
        assert math.isfinite(first["loss"]) and second["loss"] < first["loss"]
        assert 0.0 <= trainer.validate(num_steps=2)["val_accuracy"] <= 1.0
    finally:
        trainer.shutdown()
    with pytest.raises(ConfigError, match="scaling.num_wokers: unknown key"):
        TorchTrainer.from_config(DDP, **{"scaling.num_wokers": 2})


# -------------------------------------------------------------------- train
def test_train_prints_metrics_and_writes_a_checkpoint(ray_address, tmp_path):
    proc = run_cli(
        "train", "-c", DDP, "epochs=2", "num_steps=3", "config.lr=0.05",
        "--out", str(tmp_path), "--address", ray_address, "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    epochs = re.findall(
        r"^epoch (\d): loss ([\d.]+)  val_loss ([\d.]+)  val_accuracy", proc.stdout, re.M
    )
    assert [e[0] for e in epochs] == ["0", "1"]
    match = re.search(r"^checkpoint: (.+)$", proc.stdout, re.M)
    assert match, proc.stdout
    path = Path(match.group(1))
    assert path.is_file() and path.parent == tmp_path
    state = load_checkpoint(path, framework="torch")
    assert state["backend"] == "ddp" and state["epoch"] == 2
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
    assert "lr: 0.05" in (tmp_path / "run_config.yaml").read_text()


def test_final_checkpoint_goes_to_out_even_with_a_checkpoint_dir(ray_address, tmp_path):
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpts"
    proc = run_cli(
        "train", "-c", DDP, "epochs=1", "num_steps=2", f"checkpoint.checkpoint_dir={ckpt_dir}",
        "--out", str(run_dir), "--address", ray_address, "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # Where the README says: --out holds final.pt beside metrics.jsonl; the configured
    # checkpoint_dir holds the epoch-end checkpoints only.
    printed = re.search(r"^checkpoint: (.+)$", proc.stdout, re.M)
    assert printed and Path(printed.group(1)) == run_dir / "final.pt", proc.stdout
    assert (run_dir / "final.pt").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert not (ckpt_dir / "final.pt").exists()
    assert sorted(ckpt_dir.glob("checkpoint_*/COMMITTED")), list(tmp_path.rglob("*"))


def test_resume_continues_a_stopped_run_and_checkpoints_convert_offline(ray_address, tmp_path):
    options = ("--out", str(tmp_path), "--address", ray_address, "--no-progress")
    first = run_cli("train", "-c", DDP, "num_steps=3", "epochs=2", *options)
    assert first.returncode == 0, first.stderr
    # The epoch-end checkpoints went into the run directory: a driver stopped here can resume.
    committed = sorted((tmp_path / "checkpoints").glob("checkpoint_*/COMMITTED"))
    assert committed, list(tmp_path.rglob("*"))
    resumed = run_cli("train", "-c", DDP, "num_steps=3", "epochs=3", *options, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at epoch 2 of 3" in resumed.stdout
    assert re.findall(r"^epoch (\d): loss", resumed.stdout, re.M) == ["2"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1, 2]  # appended, not rewritten

    newest = sorted((tmp_path / "checkpoints").glob("checkpoint_*"))[-1]
    inspect = run_cli("checkpoint", "inspect", str(newest))
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["epoch"] == 3
    converted = tmp_path / "converted.pt"
    convert = run_cli("checkpoint", "convert", str(newest), str(converted))
    assert convert.returncode == 0, convert.stderr
    state = load_checkpoint(converted, framework="torch")
    assert state["epoch"] == 3 and state["backend"] == "ddp"


def test_resume_without_a_place_to_resume_from_is_refused(tmp_path):
    proc = run_cli("train", "-c", DDP, "--resume", timeout=120)
    assert proc.returncode != 0
    assert "--resume" in proc.stderr and "--out" in proc.stderr


# ------------------------------------------------------------------ compare
def test_compare_two_backends_writes_table_csv_and_plot(ray_address, tmp_path):
    second = _second_backend()
    proc = run_cli(
        "compare", "-c", DDP, "--backends", f"ddp,{second}", "--epochs", "2",
        "--num-steps", "2", "--out", str(tmp_path), "--address", ray_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("backend"))
    assert header.split()[:4] == ["backend", "status", "epoch", "time"]
    assert re.search(rf"^{second}\s+ok\s+\d", proc.stdout, re.M), proc.stdout
    rows = list(csv.DictReader((tmp_path / "compare.csv").open()))
    assert [r["backend"] for r in rows] == ["ddp", second]
    for row in rows:
        assert row["status"] == "ok", row
        assert float(row["samples_per_s"]) > 0 and float(row["final_loss"]) > 0
        assert 0 <= float(row["val_accuracy"]) <= 1 and float(row["peak_memory_mb"]) > 0
        assert len(row["losses"].split(";")) == 2
    png = tmp_path / "compare.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert str(png) in proc.stdout


def test_train_logs_to_csv_and_tensorboard(ray_address, tmp_path):
    """`train --logger`: hyperparameters once, train and val metrics per epoch, step + epoch axes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = run_cli(
        "train", "-c", DDP, "epochs=2", "num_steps=3", "--logger", "csv,tensorboard",
        "--out", str(tmp_path), "--address", ray_address, "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["step"], r["epoch"], bool(r["train/loss"]), bool(r["val/loss"])) for r in rows] == [
        ("3", "0", True, False), ("3", "0", False, True), ("6", "1", True, False), ("6", "1", False, True),
    ]  # fmt: skip
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [float(rows[i]["train/loss"]) for i in (0, 2)] == pytest.approx(
        [j["loss"] for j in jsonl]
    )
    hparams = (tmp_path / "hparams.yaml").read_text()
    assert "backend: ddp" in hparams and "config/lr: 0.1" in hparams and "num_workers: 2" in hparams
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val/accuracy")] == [3, 6]
    assert [e.value for e in events.Scalars("epoch")] == [0.0, 1.0]
    assert f"tensorboard: {tmp_path / 'tensorboard'}" in proc.stdout


def test_compare_puts_both_frameworks_in_one_table(ray_address, tmp_path):
    """digits_both.yaml: the torch and Keras versions of the job side by side (issue 16.5)."""
    proc = run_cli(
        "compare", "-c", "examples/configs/digits_both.yaml", "--backends", "ddp,mwms",
        "--epochs", "2", "--num-steps", "3", "--out", str(tmp_path), "--address", ray_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader((tmp_path / "compare.csv").open()))
    assert [(r["backend"], r["framework"], r["status"]) for r in rows] == [
        ("ddp", "torch", "ok"),
        ("mwms", "tensorflow", "ok"),
    ]
    for row in rows:
        assert len(row["losses"].split(";")) == 2 and 0 <= float(row["val_accuracy"]) <= 1
        assert row["diverges"] == "False"  # each framework is its own reference
    assert re.search(r"^mwms\s+ok\s+.*tensorflow\s+ref", proc.stdout, re.M), proc.stdout
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_flags_a_backend_whose_settings_change_the_result(ray_address, tmp_path):
    """DeepSpeed with gradient clipping on: its row is marked, with the setting named (16.6)."""
    proc = run_cli(
        "compare", "-c", "examples/configs/deepspeed.yaml", "--backends", "ddp,deepspeed",
        "backend_config.config.gradient_clipping=0.01", "--epochs", "1", "--num-steps", "8",
        "--out", str(tmp_path), "--address", ray_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {r["backend"]: r for r in csv.DictReader((tmp_path / "compare.csv").open())}
    assert rows["ddp"]["diverges"] == "False" and rows["deepspeed"]["diverges"] == "True"
    assert float(rows["deepspeed"]["final_loss"]) > float(rows["ddp"]["final_loss"]) * 1.02
    note = rows["deepspeed"]["divergence"]
    assert note.startswith("final loss") and "vs ddp" in note
    assert "gradient clipping (backend_config.config.gradient_clipping=0.01)" in note
    assert re.search(r"^deepspeed\s+ok\s+.*\+\d+\.\d% !", proc.stdout, re.M), proc.stdout
    assert re.search(
        r"^! deepspeed: final loss .* likely cause: gradient clipping", proc.stdout, re.M
    )


# -------------------------------------------------------------------- check
def test_check_passes_on_a_healthy_ray(ray_address):
    proc = run_cli("check", "--backends", "ddp", "--address", ray_address)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^backend ddp\s+OK\s+torch; importable on workers", proc.stdout, re.M)
    assert re.search(r"^collective ddp\s+OK\s+2 workers trained 2 steps", proc.stdout, re.M)
    assert re.search(r"^versions\s+OK", proc.stdout, re.M)
    assert "all good" in proc.stdout


def test_check_fails_with_a_clear_row_for_a_missing_backend(ray_address):
    proc = run_cli(
        "check", "--backends", "ddp,nonexistent", "--no-collective", "--address", ray_address
    )
    assert proc.returncode == 1
    assert re.search(
        r"^backend nonexistent\s+FAIL\s+Unknown backend 'nonexistent'", proc.stdout, re.M
    )
    assert re.search(r"^backend ddp\s+OK", proc.stdout, re.M)
    assert "FAILED" in proc.stderr
    not_installed = [
        n for n in available_backends(installed_only=False) if not get_spec(n).installed
    ]
    if not_installed:  # a registered backend without its package is a failure when requested
        proc = run_cli(
            "check", "--backends", not_installed[0], "--no-collective", "--address", ray_address
        )
        assert proc.returncode == 1
        assert re.search(rf"^backend {not_installed[0]}\s+FAIL\s+not installed", proc.stdout, re.M)


# ------------------------------------------------------------------- submit


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head with a dashboard on 127.0.0.1, in its own temp dir and ports.

    ``ray stop`` would stop every Ray instance on the machine, so the head runs
    under ``ray start --block`` in its own session and is stopped by signalling that
    process group, then any process whose command line names our temp dir.
    """
    temp_dir = tempfile.mkdtemp(prefix="ptjob", dir="/tmp")
    gcs, dashboard, client, agent_http, agent_grpc, metrics, runtime_env_agent, node_manager, object_manager = free_ports(9)  # fmt: skip
    ray_bin = Path(sys.executable).with_name("ray")
    command = [
        str(ray_bin), "start", "--head", "--block", f"--temp-dir={temp_dir}",
        "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env_agent}", f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}", "--disable-usage-stats",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    log = open(Path(temp_dir) / "ray_start.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited: {(Path(temp_dir) / 'ray_start.log').read_text()}")
            try:
                JobSubmissionClient(address).list_jobs()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    pytest.fail(f"the dashboard at {address} did not come up in 240 s")
                time.sleep(2)
        yield address
    finally:
        stop_ray_head(proc, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_submit_succeeding_job_returns_0(ray_head):
    # A real training job: the working dir (this repository) is uploaded, and the
    # job's workers import the example creators from it.
    proc = run_cli(
        "submit", "--address", ray_head, "--working-dir", str(REPO_ROOT), "--",
        sys.executable, "-m", "polytrain", "train", "-c", DDP, "num_workers=1", "epochs=1",
        "num_steps=2", "--no-progress", "--out", "polytrain_runs/submit-test",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^epoch 0: loss [\d.]+", proc.stdout, re.M)
    assert "checkpoint: " in proc.stdout and "SUCCEEDED" in proc.stdout
    assert not (REPO_ROOT / "polytrain_runs" / "submit-test").exists()  # written on the cluster


def test_submit_failing_job_returns_nonzero_with_log_tail(ray_head):
    script = "import sys; print('about to fail: marker-7f3a'); sys.exit(3)"
    proc = run_cli(
        "submit", "--address", ray_head, "--no-working-dir", "--", sys.executable, "-c", script
    )
    assert proc.returncode != 0
    assert "FAILED" in proc.stderr
    tail = proc.stderr.split("--- last log lines ---", 1)[1]
    assert "marker-7f3a" in tail


# ------------------------------------------------ submit --pip / --requirements
# Per-job packages (issue 29, item 5), against the module's ray_head: a job imports two
# packages that this environment does not have, one named with --pip, one in a file given
# with --requirements. Both are wheels built here in tmp_path (the machine has no
# internet), so Ray's pip runtime env installs them offline into the job's own
# virtualenv. The job runs `python` (the job's virtualenv comes first on its PATH), not
# this interpreter's absolute path, which would miss the packages. The markers the job
# prints come from the packages' code, not from the command line.
PACKAGES = {"pt_jobdep_a": "dependency-ok-7e21", "pt_jobdep_b": "dependency-ok-3c90"}


def _wheel(folder: Path, name: str, message: str) -> Path:
    """A pure-Python wheel of package ``name`` whose ``MESSAGE`` is ``message``."""
    info = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": f"MESSAGE = {message!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: polytrain-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def test_submit_installs_pip_and_requirements_for_the_job(
    ray_start_4_cpus,
    ray_head,
    tmp_path,
):
    # ray_start_4_cpus first: the session's Ray sets RAY_AUTH_MODE=token
    # here, which the head inherits and the Jobs client then answers with the token.
    for name in PACKAGES:
        assert importlib.util.find_spec(name) is None, f"{name} must not be installed here"
    wheel_a = _wheel(tmp_path, "pt_jobdep_a", PACKAGES["pt_jobdep_a"])
    wheel_b = _wheel(tmp_path, "pt_jobdep_b", PACKAGES["pt_jobdep_b"])
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"# the job's own packages\npt_jobdep_b @ {wheel_b.as_uri()}\n")
    script = "import pt_jobdep_a, pt_jobdep_b; print(pt_jobdep_a.MESSAGE, pt_jobdep_b.MESSAGE)"
    proc = run_cli(
        "submit", "--address", ray_head, "--no-working-dir", "--pip", str(wheel_a),
        "--requirements", str(requirements), "--", "python", "-c", script,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^job \S+ SUCCEEDED$", proc.stdout, re.M), proc.stdout[-3000:]
    assert f"{PACKAGES['pt_jobdep_a']} {PACKAGES['pt_jobdep_b']}" in proc.stdout


def test_submit_with_unreadable_requirements_fails_before_submitting(tmp_path):
    missing = tmp_path / "nope.txt"
    proc = run_cli(
        "submit", "--address", "http://127.0.0.1:9", "--no-working-dir",
        "--requirements", str(missing), "--", sys.executable, "-c", "print(1)",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"--requirements {str(missing)!r} cannot be read" in proc.stderr
