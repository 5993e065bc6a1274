"""Run configs: schema, overrides, error messages, creator imports; compare/jobs helpers (no Ray)."""

from __future__ import annotations

import csv
import inspect
from pathlib import Path

import pytest
import yaml

from polytrain.backends import registry
from polytrain.backends.registry import BackendSpec, available_backends, get_spec
from polytrain.cli.main import build_parser, main
from polytrain.compare.runner import BackendResult, compare_backends, format_table, write_results
from polytrain.errors import ConfigError
from polytrain.launchers.cluster.jobs import DEFAULT_EXCLUDES, JobOutcome, submit_job
from polytrain.trainer_api.options.configs import CheckpointConfig, FailureConfig, ScalingConfig
from polytrain.trainer_api.options.run_config import (
    RunConfig,
    import_object,
    load_config,
    parse_overrides,
    trainer_from_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
#: One config per backend (named after it); digits_both.yaml carries both frameworks;
#: gpt*.yaml are the language-model example's, finetune_lora.yaml the fine-tuning one's.
CONFIGS = sorted(
    p
    for p in (REPO_ROOT / "examples" / "configs").glob("*.yaml")
    if p.stem not in ("digits_both", "finetune_lora") and not p.stem.startswith("gpt")
)
DDP = REPO_ROOT / "examples" / "configs" / "ddp.yaml"
BOTH = REPO_ROOT / "examples" / "configs" / "digits_both.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


MINIMAL = """
model: examples.digits:model_creator
data: examples.digits:data_creator
optimizer: examples.digits:optimizer_creator
loss: examples.digits:loss_creator
"""


# ---------------------------------------------------------------- examples
def test_there_is_an_example_config_per_backend():
    stems = {p.stem for p in CONFIGS}
    assert {"ddp", "horovod", "fairscale", "fsdp", "deepspeed"} <= stems
    assert set(available_backends(installed_only=False)) <= stems


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_example_config_loads(path):
    run = load_config(path)
    assert run.backend_name == path.stem
    assert run.trainer == get_spec(path.stem).framework
    assert run.num_workers == 2
    assert run.scaling_config().num_workers == 2
    assert isinstance(run.failure_config(), FailureConfig)
    assert isinstance(run.checkpoint_config(), CheckpointConfig)
    # every creator resolves from the repository root (the modules import no framework)
    creators = run.resolve_creators()
    assert {"model_creator", "data_creator"} <= set(creators)
    assert all(callable(c) for c in creators.values())


@pytest.mark.parametrize("name", ["gpt", "gpt_fsdp"])
def test_the_language_model_configs_load(name):
    run = load_config(REPO_ROOT / "examples" / "configs" / f"{name}.yaml")
    assert (run.trainer, run.max_grad_norm, run.num_workers) == ("torch", 1.0, 2)
    creators = run.resolve_creators()
    assert "loss_creator" not in creators  # the model computes its loss
    assert all(callable(c) for c in creators.values())


def test_the_fine_tuning_config_loads_with_its_peft_config():
    from polytrain import TorchTrainer

    run = load_config(REPO_ROOT / "examples" / "configs" / "finetune_lora.yaml")
    assert run.peft_config["peft_type"] == "LORA"
    assert run.trainer_kwargs(TorchTrainer)["peft_config"] == run.peft_config
    assert all(callable(c) for c in run.resolve_creators().values())


def test_torch_example_configs_differ_only_in_backend():
    def without_backend(path):
        raw = yaml.safe_load(path.read_text())
        raw.pop("backend")
        raw.pop("backend_config", None)
        return raw

    reference = without_backend(DDP)
    torch_configs = [p for p in CONFIGS if get_spec(p.stem).framework == "torch"]
    assert len(torch_configs) >= 5
    for path in torch_configs:
        assert without_backend(path) == reference, path.name
    tf = yaml.safe_load((DDP.parent / "mwms.yaml").read_text())
    assert tf["config"] == reference["config"]  # the same job under TensorFlow
    assert (tf["num_workers"], tf["epochs"]) == (reference["num_workers"], reference["epochs"])


# ----------------------------------------------------- both frameworks (16.5)
def test_a_config_with_both_frameworks_follows_the_backend():
    run = load_config(BOTH)
    assert run.frameworks == ("torch", "tensorflow")
    assert (run.trainer, run.backend_name, run.model) == (
        "torch",
        "ddp",
        "examples.digits:model_creator",
    )
    assert (
        run.scheduler_step_freq == "epoch" and run.optimizer == "examples.digits:optimizer_creator"
    )
    tf = run.with_backend("mwms")
    assert (tf.trainer, tf.model, tf.optimizer) == (
        "tensorflow",
        "examples.tf_digits:model_creator",
        None,
    )
    assert tf.config == run.config and tf.num_workers == run.num_workers == 2
    back = tf.with_backend("hvd")
    assert (back.trainer, back.backend_name, back.model) == ("torch", "horovod", run.model)
    assert load_config(BOTH, ["backend=mwms"]).trainer == "tensorflow"
    # the same job: the torch and Keras versions read the shared config and data
    ddp, mwms = load_config(DDP), load_config(DDP.parent / "mwms.yaml")
    assert run.config == ddp.config == mwms.config
    assert run.resolve_creators().keys() == ddp.resolve_creators().keys()
    assert tf.resolve_creators().keys() == mwms.resolve_creators().keys()
    # saved next to a run it loads again, sections and all
    assert RunConfig.model_validate(run.to_dict()).frameworks == ("torch", "tensorflow")


def test_framework_sections_merge_config_and_reject_conflicts(tmp_path):
    path = _write(
        tmp_path,
        "config: {lr: 0.1, batch_size: 64}\n"
        "torch: {model: a.b:m, data: a.b:d, optimizer: a.b:o}\n"
        "tensorflow: {model: c.d:m, data: c.d:d, config: {lr: 0.05}}\n",
    )
    assert load_config(path).config == {"lr": 0.1, "batch_size": 64}
    assert load_config(path, ["backend=mwms"]).config == {"lr": 0.05, "batch_size": 64}
    with pytest.raises(
        ConfigError, match="model: set both at the top level and in the torch: section"
    ):
        load_config(path, ["model=x.y:z"])
    with pytest.raises(ConfigError, match=r"torch\.modle: unknown key \(did you mean 'model'\?\)"):
        load_config(path, ["torch.modle=x.y:z"])
    with pytest.raises(ConfigError, match="has only a torch: section; add a tensorflow: section"):
        load_config(path, ["tensorflow=null", "backend=mwms"])


def test_loggers_key_is_checked_and_passed_to_trainers_that_take_it():
    run = load_config(DDP, ["loggers=[tensorboard, csv]"])
    assert run.loggers == ["tensorboard", "csv"]
    assert load_config(DDP, ["loggers=mlflow,wandb"]).loggers == "mlflow,wandb"
    with pytest.raises(
        ConfigError, match="loggers: unknown logger 'tensorbord'; choose from tensorboard"
    ):
        load_config(DDP, ["loggers=[tensorbord]"])

    def takes_loggers(config, backend, loggers=None, **creators_and_options):
        pass

    kwargs = run.trainer_kwargs(takes_loggers)
    assert kwargs["loggers"] == ["tensorboard", "csv"]


# --------------------------------------------------------------- overrides
def test_overrides_apply_top_level_nested_and_sections():
    run = load_config(
        DDP,
        [
            "backend=horovod",
            "num_workers=4",
            "config.lr=0.1",
            "config.new_key=[1, 2]",
            "scaling.num_cpus_per_worker=2",
            "failure.max_retries=3",
            "checkpoint.checkpoint_dir=/tmp/x",
            "epochs=5",
        ],
    )
    assert run.backend == "horovod"
    assert run.scaling_config().num_workers == 4
    assert run.config["lr"] == 0.1 and run.config["batch_size"] == 64
    assert run.config["new_key"] == [1, 2]
    assert run.scaling_config().num_cpus_per_worker == 2.0
    assert run.failure_config().max_retries == 3
    assert run.checkpoint_config().checkpoint_dir == "/tmp/x"
    assert run.epochs == 5


def test_override_values_are_yaml_scalars():
    parsed = parse_overrides(["a=4", "b=true", "c=1e-3", "d=null", "e=text", "f=0.5", "g="])
    assert parsed == {"a": 4, "b": True, "c": 0.001, "d": None, "e": "text", "f": 0.5, "g": None}
    assert isinstance(parsed["c"], float)


def test_mapping_overrides_and_with_overrides_revalidate():
    run = load_config(DDP, {"config.lr": 0.05, "use_fp16": True})
    assert run.config["lr"] == 0.05 and run.use_fp16 is True
    other = run.with_overrides(["backend=fsdp", "scaling.start_timeout_s=5"])
    assert other.backend == "fsdp" and other.config["lr"] == 0.05
    assert other.scaling_config().start_timeout_s == 5.0
    assert run.backend == "ddp"  # the original is unchanged
    with pytest.raises(ConfigError, match="scaling.num_wokers: unknown key"):
        run.with_overrides(["scaling.num_wokers=2"])


def test_to_dict_round_trips(tmp_path):
    run = load_config(DDP, ["config.lr=0.2", "scaling.num_cpus_per_worker=2"])
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump(run.to_dict()))
    again = load_config(path)
    assert again.config == run.config
    assert again.scaling_config() == run.scaling_config()
    assert again.backend == run.backend


def test_defaults_from_a_minimal_config(tmp_path):
    run = load_config(_write(tmp_path, MINIMAL))
    assert run.trainer == "torch" and run.backend == "ddp"
    assert run.epochs == 1 and run.validate_each_epoch is True
    assert run.scaling_config() == ScalingConfig()


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["scaling.num_wokers=3"],
            "scaling.num_wokers: unknown key (did you mean 'num_workers'?); allowed: "
            "num_workers, use_gpu, num_cpus_per_worker",
        ),
        (["modle=x"], "modle: unknown key (did you mean 'model'?); allowed: trainer, model"),
        (["failure.retries=1"], "failure.retries: unknown key"),
        (["num_workers=two"], "num_workers: Input should be a valid integer; got str: 'two'"),
        (["use_gpu=maybe"], "use_gpu: Input should be a valid boolean; got str: 'maybe'"),
        (["scaling.num_cpus_per_worker=abc"], "scaling.num_cpus_per_worker: Input should be"),
        (
            ["scaling.placement_strategy=FOO"],
            "scaling.placement_strategy: placement_strategy='FOO'",
        ),
        (["failure.max_retries=-1"], "failure.max_retries: max_retries must be >= 0; got -1"),
        (["checkpoint.num_to_keep=0"], "checkpoint.num_to_keep"),
        (["epochs=0"], "epochs: Input should be greater than or equal to 1"),
        (["scheduler_step_freq=sometimes"], "scheduler_step_freq: Input should be 'batch'"),
        (["trainer=jax"], "trainer: Input should be 'torch' or 'tensorflow'"),
        (["backend=nope"], "backend: Unknown backend 'nope'. Valid names: 'ddp'"),
        (["backend=mwms"], "backend: 'mwms' is a tensorflow backend, but trainer is 'torch'"),
        (["scaling.num_workers=3"], "num_workers: set both at the top level and as scaling"),
        (["model=not a path"], "model: must be an import path"),
        (["config=[1]"], "config: Input should be a valid dictionary"),
        (["optimizer=null"], "optimizer: required for trainer 'torch'"),
    ],
)
def test_bad_values_name_the_key_path(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(DDP, overrides)
    message = str(info.value)
    assert expected in message
    assert str(DDP) in message


def test_all_errors_are_reported_at_once(tmp_path):
    path = _write(tmp_path, MINIMAL + "epochs: -1\nscaling: {num_wokers: 2}\nbogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = [line for line in str(info.value).splitlines() if line.startswith("  - ")]
    assert len(lines) == 3
    assert any(line.startswith("  - epochs:") for line in lines)


def test_missing_required_key(tmp_path):
    with pytest.raises(ConfigError, match="model: required, but missing"):
        load_config(_write(tmp_path, "data: examples.digits:data_creator\n"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("model: [unclosed\n", "is not valid YAML"), ("- a\n- b\n", "must hold a mapping")],
)
def test_bad_files(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(_write(tmp_path, text))


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/run.yaml")


@pytest.mark.parametrize("bad", ["lr", "=3", ""])
def test_malformed_overrides(bad):
    with pytest.raises(ConfigError, match="must look like key=value"):
        parse_overrides([bad])


def test_override_into_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="config.lr is 0.1, not a mapping"):
        load_config(DDP, ["config.lr.x=1"])


# ---------------------------------------------------------------- imports
def test_import_object_both_spellings():
    from examples import digits

    assert import_object("examples.digits:model_creator") is digits.model_creator
    assert import_object("examples.digits.data_creator") is digits.data_creator
    assert import_object("torch.nn:CrossEntropyLoss").__name__ == "CrossEntropyLoss"


def test_import_errors_name_the_key_and_suggest():
    with pytest.raises(
        ConfigError, match=r"model: 'examples.digits' has no attribute.*model_creator"
    ):
        import_object("examples.digits:model_creatr", "model")
    with pytest.raises(ConfigError, match="data: cannot import module 'no_such_pkg.mod'"):
        import_object("no_such_pkg.mod:fn", "data")


def test_creators_resolve_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "my_creators.py").write_text("def model(config):\n    return 'm'\n")
    path = _write(tmp_path, MINIMAL.replace("examples.digits:model_creator", "my_creators:model"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # for examples.digits
    creators = load_config(path).resolve_creators()
    assert creators["model_creator"]({}) == "m"


class _NoSchedulerTrainer:
    framework = "torch"

    def __init__(
        self,
        *,
        model_creator,
        data_creator,
        optimizer_creator,
        loss_creator,
        config,
        backend,
        backend_config,
        scaling_config,
        failure_config,
        checkpoint_config,
    ):
        self.kwargs = dict(locals())


def test_trainer_kwargs_reject_options_the_trainer_does_not_take():
    run = load_config(DDP, ["scheduler=null", "scheduler_step_freq=batch"])
    with pytest.raises(ConfigError, match="scheduler_step_freq: _NoSchedulerTrainer does not take"):
        run.trainer_kwargs(_NoSchedulerTrainer)
    run = load_config(DDP, ["scheduler=null"]).model_copy()
    run = RunConfig.model_validate(
        {k: v for k, v in run.to_dict().items() if k != "scheduler_step_freq"}
    )
    kwargs = run.trainer_kwargs(_NoSchedulerTrainer)
    assert set(kwargs) == set(inspect.signature(_NoSchedulerTrainer).parameters)
    assert kwargs["scaling_config"].num_workers == 2


def test_tensorflow_config_passes_only_what_tftrainer_takes():
    from polytrain.trainer_api.tensorflow.trainer import TFTrainer

    run = load_config(DDP.parent / "mwms.yaml", ["use_tqdm=true"])
    kwargs = run.trainer_kwargs(TFTrainer)
    assert kwargs["backend"] == "mwms" and kwargs["use_tqdm"] is True
    assert "scheduler_step_freq" not in kwargs and "optimizer_creator" not in kwargs
    with pytest.raises(ConfigError, match="use_fp16: TFTrainer does not take this option"):
        load_config(DDP.parent / "mwms.yaml", ["use_fp16=true"]).trainer_kwargs(TFTrainer)
    with pytest.raises(ConfigError, match="optimizer: TFTrainer does not take"):
        load_config(
            DDP.parent / "mwms.yaml", ["optimizer=examples.digits:optimizer_creator"]
        ).trainer_kwargs(TFTrainer)


def test_trainer_class_of_another_framework_is_rejected():
    class FakeTF:
        framework = "tensorflow"

    with pytest.raises(ConfigError, match="trainer: the config says 'torch' but FakeTF"):
        trainer_from_config(DDP, trainer_cls=FakeTF)


def test_bad_backend_config_names_the_key():
    with pytest.raises(
        ConfigError, match=r"backend_config: Unknown backend_config key\(s\) \['bogus'\]"
    ):
        load_config(DDP, ["backend_config.bogus=1"]).build_trainer()


# ------------------------------------------------------------------ compare
@pytest.fixture
def uninstalled_backend(monkeypatch):
    spec = BackendSpec(
        "fakebackend",
        "no_such_module_for_polytrain:Backend",
        "torch",
        "a registered backend whose package is missing",
        requires=("no_such_module_for_polytrain",),
    )
    monkeypatch.setitem(registry._SPECS, spec.name, spec)
    monkeypatch.setitem(registry._ALIASES, spec.name, spec.name)
    return spec.name


def test_compare_skips_a_backend_that_is_not_installed(uninstalled_backend, tmp_path):
    lines = []
    results = compare_backends(
        DDP, [uninstalled_backend], epochs=1, out_dir=tmp_path, log=lines.append
    )
    (result,) = results
    assert result.status == "skipped"
    assert "no_such_module_for_polytrain" in result.reason and "pip install" in result.reason
    assert any("skipped" in line for line in lines)
    rows = list(csv.DictReader((tmp_path / "compare.csv").open()))
    assert rows[0]["backend"] == uninstalled_backend and rows[0]["status"] == "skipped"
    assert (tmp_path / "compare.png").stat().st_size > 0


def test_compare_rejects_unknown_and_foreign_backends(tmp_path):
    with pytest.raises(registry.UnknownBackendError, match="Unknown backend 'nope'"):
        compare_backends(DDP, ["nope"], out_dir=tmp_path, log=None)
    with pytest.raises(registry.UnknownBackendError, match="'mwms' is a tensorflow backend"):
        compare_backends(DDP, ["mwms"], out_dir=tmp_path, log=None)
    assert not (tmp_path / "compare.csv").exists()
    with pytest.raises(TypeError, match="compare_backends takes a RunConfig"):
        compare_backends(42, ["ddp"], out_dir=tmp_path, log=None)


def test_results_table_csv_and_plot(tmp_path):
    results = [
        BackendResult(
            "ddp",
            losses=[2.0, 1.0, 0.5],
            epoch_times_s=[3.0, 1.0, 2.0],
            samples_per_s=[10.0, 30.0, 20.0],
            val_accuracy=0.9,
            peak_memory_mb=500.0,
        ),
        BackendResult("horovod", status="skipped", reason="not installed: pip install x"),
        BackendResult("fsdp", status="failed", reason="RuntimeError: boom"),
    ]
    assert results[0].epoch_time_s == 1.5  # the first epoch is left out
    assert results[0].throughput == 25.0
    table = format_table(results)
    assert table.splitlines()[0].split()[:2] == ["backend", "status"]
    assert "1.500" in table and "0.900" in table and "pip install x" in table
    paths = write_results(results, tmp_path / "out")
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [r["status"] for r in rows] == ["ok", "skipped", "failed"]
    assert rows[0]["final_loss"] == "0.5" and rows[0]["losses"] == "2.00000;1.00000;0.50000"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["json"].stat().st_size > 0


# --------------------------------------------------------------- cli / jobs
def test_cli_parses_every_subcommand():
    parser = build_parser()
    args = parser.parse_args(["train", "-c", "x.yaml", "backend=horovod", "config.lr=0.1"])
    assert args.overrides == ["backend=horovod", "config.lr=0.1"]
    args = parser.parse_args(["compare", "-c", "x.yaml", "--backends", "ddp,fsdp", "--epochs", "2"])
    assert args.backends == "ddp,fsdp" and args.epochs == 2
    args = parser.parse_args(["check", "--backends", "ddp"])
    assert args.backends == "ddp" and args.num_workers == 2
    args = parser.parse_args(
        ["submit", "--address", "http://h:8265", "--", "polytrain", "train", "-c", "x.yaml"]
    )
    assert args.entrypoint[-4:] == ["polytrain", "train", "-c", "x.yaml"]


def test_cli_parses_loggers_tolerance_and_verbose(capsys):
    parser = build_parser()
    args = parser.parse_args(["train", "-c", "x.yaml", "--logger", "tensorboard,csv", "-v"])
    assert args.logger == "tensorboard,csv" and args.verbose is True
    assert parser.parse_args(["--verbose", "compare", "-c", "x.yaml"]).verbose is True
    assert parser.parse_args(["compare", "-c", "x.yaml"]).verbose is False
    assert parser.parse_args(["compare", "-c", "x.yaml"]).tolerance == 0.02
    assert parser.parse_args(["compare", "-c", "x.yaml", "--tolerance", "5%"]).tolerance == 0.05
    assert parser.parse_args(["compare", "-c", "x.yaml", "--tolerance", "0.1"]).tolerance == 0.1
    with pytest.raises(SystemExit):
        parser.parse_args(["compare", "-c", "x.yaml", "--tolerance", "lots"])
    assert "'lots' is not a relative tolerance" in capsys.readouterr().err
    assert main(["train", "-c", str(DDP), "--logger", "tensorbord"]) == 2
    assert "Unknown logger 'tensorbord'" in capsys.readouterr().err


def test_cli_config_errors_exit_2(capsys):
    assert main(["train", "-c", str(DDP), "scaling.num_wokers=2"]) == 2
    assert "scaling.num_wokers: unknown key" in capsys.readouterr().err
    assert main(["submit", "--address", "http://127.0.0.1:1"]) == 2
    assert "needs the job's command" in capsys.readouterr().err


def test_job_outcome_exit_codes_and_tail():
    logs = "\n".join(f"line {i}" for i in range(100))
    assert JobOutcome("j", "SUCCEEDED").exit_code == 0
    assert JobOutcome("j", "FAILED").exit_code != 0
    assert JobOutcome("j", "STOPPED").exit_code != 0
    tail = JobOutcome("j", "FAILED", logs=logs).log_tail(3)
    assert tail == "line 97\nline 98\nline 99"
    assert ".venv" in DEFAULT_EXCLUDES and ".git" in DEFAULT_EXCLUDES


def test_submit_rejects_empty_command_and_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="command is empty"):
        submit_job("http://127.0.0.1:1", [])
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        submit_job("http://127.0.0.1:1", ["true"], working_dir=str(tmp_path / "missing"))


# ---------------------------------------------------------- cluster configs
CLUSTER = REPO_ROOT / "examples" / "cluster"


def _prepared_cluster_config(name: str) -> dict:
    import copy

    from ray.autoscaler._private.util import fillout_defaults, prepare_config

    config = yaml.safe_load((CLUSTER / f"{name}.yaml").read_text())
    # `ray up` runs prepare_config then validate_config. For the clouds only the
    # defaults are merged: their prepare step asks the cloud about instance types.
    if config["provider"]["type"] == "local":
        return prepare_config(copy.deepcopy(config))
    return fillout_defaults(copy.deepcopy(config))


def test_onprem_cluster_config_matches_rays_schema():
    from ray.autoscaler._private.util import validate_config

    config = _prepared_cluster_config("local")
    validate_config(config)  # jsonschema against ray/autoscaler/ray-schema.json
    assert config["provider"]["type"] == "local"
    (node_type,) = config["available_node_types"].values()
    assert node_type["min_workers"] == len(config["provider"]["worker_ips"]) == 2
    setup = " ".join(config["setup_commands"])
    assert "pip install" in setup and "polytrain" in setup


@pytest.mark.parametrize("name", ["aws", "gcp"])
def test_cloud_cluster_configs_match_rays_schema(name):
    from ray.autoscaler._private.util import validate_config

    config = _prepared_cluster_config(name)
    validate_config(config)
    assert config["provider"]["type"] == name
    assert any("polytrain" in command for command in config["setup_commands"])


def test_schema_check_rejects_a_broken_cluster_config():
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    config = _prepared_cluster_config("local")
    config["max_wokers"] = 2
    with pytest.raises(jsonschema.ValidationError, match="max_wokers"):
        validate_config(config)
