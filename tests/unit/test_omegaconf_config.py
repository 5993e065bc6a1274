"""OmegaConf / Hydra configs wherever polytrain takes a dict of options (no Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from polytrain.backends.registry import get_backend
from polytrain.compat.omegaconf_values import plain_config
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.trainer_api.options.configs import (
    CheckpointConfig,
    ScalingConfig,
    check_user_config,
    coerce_config,
    merge_flat_options,
)
from polytrain.trainer_api.options.run_config import load_config, trainer_from_config

REPO_ROOT = Path(__file__).resolve().parents[2]
DDP = REPO_ROOT / "examples" / "configs" / "ddp.yaml"
BOTH = REPO_ROOT / "examples" / "configs" / "digits_both.yaml"

HYPER = {"lr": 0.1, "batch_size": 32, "hidden": [64, 32], "opt": {"momentum": 0.9}}


def test_config_dictconfig_equals_the_dict():
    cfg = OmegaConf.create(HYPER)
    plain = check_user_config(cfg)
    assert plain == check_user_config(HYPER) == HYPER
    assert type(plain) is dict and type(plain["opt"]) is dict
    assert type(plain["hidden"]) is list  # a ListConfig inside becomes a list


def test_config_interpolations_are_resolved():
    root = OmegaConf.create(
        {"width": 48, "model": {"hidden": "${width}", "layers": ["${width}", 10]}}
    )
    assert check_user_config(root.model) == {"hidden": 48, "layers": [48, 10]}


def test_a_missing_value_is_refused_naming_its_key():
    root = OmegaConf.create({"model": {"lr": "???", "batch_size": 32}})
    with pytest.raises(ConfigError, match=r"config: the value of 'model\.lr' is missing"):
        check_user_config(root.model)


def test_an_unresolvable_interpolation_names_its_key():
    cfg = OmegaConf.create({"lr": "${nowhere}"})
    with pytest.raises(ConfigError, match=r"config: 'lr' does not resolve: .*nowhere"):
        check_user_config(cfg)


def test_a_listconfig_is_not_a_config_dict():
    with pytest.raises(ConfigTypeError, match=r"config must be a dict .*got list"):
        check_user_config(OmegaConf.create([1, 2]))


def test_dictconfigs_nested_in_plain_values_are_converted():
    section = OmegaConf.create({"hidden": [8, 8]})
    value = {"model": section, "steps": (OmegaConf.create({"a": 1}),), "lr": 0.1}
    assert plain_config(value, "config") == {
        "model": {"hidden": [8, 8]},
        "steps": ({"a": 1},),
        "lr": 0.1,
    }
    untouched = {"a": [1, {"b": 2}]}
    assert plain_config(untouched, "config") is untouched


def test_option_groups_take_dictconfigs():
    cfg = OmegaConf.create(
        {"workers": 3, "scaling": {"num_workers": "${workers}", "address": None}}
    )
    assert coerce_config(ScalingConfig, cfg.scaling, "scaling_config") == ScalingConfig(
        num_workers=3
    )
    merged = merge_flat_options(
        CheckpointConfig, OmegaConf.create({"num_to_keep": 4}), "checkpoint_config", resume=None
    )
    assert merged == CheckpointConfig(num_to_keep=4)
    # An option in both places is still an error, and unknown keys are still named.
    with pytest.raises(ConfigError, match="given both"):
        merge_flat_options(ScalingConfig, cfg.scaling, "scaling_config", num_workers=2)
    with pytest.raises(ConfigTypeError, match=r"Unknown scaling_config key\(s\) \['bogus'\]"):
        coerce_config(ScalingConfig, OmegaConf.create({"bogus": 1}), "scaling_config")
    with pytest.raises(ConfigError, match=r"scaling_config: the value of 'num_workers' is missing"):
        coerce_config(ScalingConfig, OmegaConf.create({"num_workers": "???"}), "scaling_config")


def test_backend_config_takes_a_dictconfig():
    cfg = OmegaConf.create({"stage": 3, "deepspeed": {"stage": "${stage}"}})
    from_omegaconf = get_backend("deepspeed", cfg.deepspeed, framework="torch")
    assert from_omegaconf.config == get_backend("deepspeed", {"stage": 3}).config
    with pytest.raises(ConfigError, match=r"backend_config: the value of 'stage' is missing"):
        get_backend("deepspeed", OmegaConf.create({"stage": "???"}))


def test_a_run_config_from_a_dictconfig_equals_the_yaml_file():
    import yaml

    hydra_like = OmegaConf.create({"trainer": yaml.safe_load(DDP.read_text())})
    from_cfg = load_config(hydra_like.trainer, ["num_workers=3"])
    from_file = load_config(DDP, ["num_workers=3"])
    assert from_cfg.model_dump() == from_file.model_dump()
    assert from_cfg.source == "<DictConfig 'trainer'>"
    assert (
        load_config(yaml.safe_load(DDP.read_text())).model_dump() == load_config(DDP).model_dump()
    )


def test_a_run_config_dictconfig_with_framework_sections_follows_the_backend():
    cfg = OmegaConf.load(BOTH)
    cfg.backend = "mwms"
    run = load_config(cfg)
    assert run.trainer == "tensorflow" and run.model == "examples.tf_digits:model_creator"


def test_a_run_config_dictconfig_with_a_missing_value_names_the_key():
    cfg = OmegaConf.create(
        {"trainer": {**OmegaConf.to_container(OmegaConf.load(DDP)), "num_workers": "???"}}
    )
    with pytest.raises(ConfigError, match=r"the value of 'trainer\.num_workers' is missing"):
        load_config(cfg.trainer)
    with pytest.raises(ConfigError, match=r"the value of 'trainer\.num_workers' is missing"):
        trainer_from_config(cfg.trainer)


def test_a_run_config_dictconfig_is_validated_like_the_file():
    cfg = OmegaConf.load(DDP)
    cfg.scaling = {"num_wokers": 2}
    with pytest.raises(
        ConfigTypeError, match=r"(?s)<DictConfig>.*scaling\.num_wokers: unknown key"
    ):
        load_config(cfg)
    with pytest.raises(ConfigError, match="must be a mapping of run-config keys"):
        load_config(OmegaConf.create([1, 2]))


def test_polytrain_does_not_import_omegaconf():
    code = (
        "import sys, polytrain\n"
        "from polytrain.trainer_api.options.run_config import load_config\n"
        "from polytrain.trainer_api.options.configs import check_user_config\n"
        f"load_config({str(DDP)!r}); check_user_config({{'lr': 0.1}})\n"
        "assert 'omegaconf' not in sys.modules, 'omegaconf imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)
