"""Creator validation and the typed option groups, without Ray."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain.errors import ConfigError, ConfigTypeError, CreatorError
from polytrain.trainer_api.creators import TorchCreators
from polytrain.trainer_api.options.configs import (
    CheckpointConfig,
    FailureConfig,
    ScalingConfig,
    coerce_config,
    merge_flat_options,
)


def _model(config):
    return torch.nn.Linear(2, 2)


def _data(config):
    return DataLoader(TensorDataset(torch.zeros(4, 2), torch.zeros(4).long()), batch_size=2)


def _opt(model, config):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_not_callable_creator():
    with pytest.raises(CreatorError, match=r"model_creator must be callable.*got str"):
        TorchCreators("resnet", _data, _opt)


def test_creator_with_wrong_arity():
    with pytest.raises(CreatorError, match=r"data_creator .*cannot be called with 1 argument"):
        TorchCreators(_model, lambda: None, _opt)


def test_loss_creator_may_be_a_class_or_a_function_of_config():
    creators = TorchCreators(_model, _data, _opt, torch.nn.MSELoss)
    assert isinstance(creators.create_loss({}), torch.nn.MSELoss)
    creators = TorchCreators(_model, _data, _opt, lambda config: torch.nn.L1Loss())
    assert isinstance(creators.create_loss({}), torch.nn.L1Loss)
    with pytest.raises(CreatorError, match="loss_creator must be a loss class or a callable"):
        TorchCreators(_model, _data, _opt, 3)


@pytest.mark.parametrize(
    ("kwargs", "method", "args", "pattern"),
    [
        ({"model_creator": lambda c: "m"}, "create_models", ({},), "model_creator returned str"),
        (
            {"optimizer_creator": lambda m, c: [1]},
            "create_optimizers",
            ((torch.nn.Linear(1, 1),), {}),
            "optimizer_creator returned list .*torch.optim.Optimizer",
        ),
        (
            {"data_creator": lambda c: 5},
            "create_data",
            ({},),
            "data_creator returned int .*DataLoader",
        ),
        ({"data_creator": lambda c: (1, 2, 3)}, "create_data", ({},), "tuple of 3 items"),
        (
            {"scheduler_creator": lambda o, c: object()},
            "create_schedulers",
            ((None,), {}),
            "scheduler_creator returned object",
        ),
        ({"loss_creator": lambda c: 5}, "create_loss", ({},), "loss_creator returned int"),
    ],
)
def test_wrong_return_types_name_the_creator(kwargs, method, args, pattern):
    base = {"model_creator": _model, "data_creator": _data, "optimizer_creator": _opt}
    creators = TorchCreators(**{**base, **kwargs})
    with pytest.raises(CreatorError, match=pattern):
        getattr(creators, method)(*args)


def test_tuples_of_models_and_optimizers():
    creators = TorchCreators(
        lambda c: (torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)),
        _data,
        lambda models, c: tuple(torch.optim.SGD(m.parameters(), lr=1) for m in models),
    )
    models = creators.create_models({})
    assert len(models) == 2 and len(creators.create_optimizers(models, {})) == 2
    train, val = creators.create_data({})
    assert val is None


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_workers": -1}, "num_workers must be >= 0; got -1"),
        ({"num_workers": 2.5}, "num_workers must be an int >= 0; got float"),
        ({"num_workers": True}, "num_workers must be an int"),
        ({"use_gpu": "yes"}, "use_gpu must be True or False"),
        ({"placement_strategy": "RANDOM"}, "placement_strategy='RANDOM' is not supported"),
        ({"start_timeout_s": -1}, "start_timeout_s must be a number >= 0"),
    ],
)
def test_scaling_config_rejects_bad_values(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ScalingConfig(**kwargs)


def test_other_option_groups_validate():
    with pytest.raises(ConfigError, match="max_retries must be >= 0"):
        FailureConfig(max_retries=-1)
    with pytest.raises(ConfigError, match="hang_timeout_s must be a number"):
        FailureConfig(hang_timeout_s="soon")
    with pytest.raises(ConfigError, match="num_to_keep must be >= 1"):
        CheckpointConfig(num_to_keep=0)


def test_coerce_and_merge():
    assert coerce_config(ScalingConfig, {"num_workers": 3}, "scaling_config").num_workers == 3
    with pytest.raises(ConfigError, match=r"Unknown scaling_config key\(s\) \['workers'\]"):
        coerce_config(ScalingConfig, {"workers": 3}, "scaling_config")
    merged = merge_flat_options(ScalingConfig, None, "scaling_config", num_workers=4, use_gpu=None)
    assert merged.num_workers == 4 and merged.use_gpu is False
    with pytest.raises(ConfigError, match="given both as keyword"):
        merge_flat_options(ScalingConfig, {"num_workers": 1}, "scaling_config", num_workers=2)
    assert ScalingConfig(num_workers=0).local_mode and ScalingConfig(num_workers=0).world_size == 1


# --- keyword shortcuts next to a config group (issue 19, point 6) -----------------------


def test_shortcut_next_to_a_group_that_does_not_set_it_is_merged():
    merged = merge_flat_options(
        ScalingConfig, {"address": "auto"}, "scaling_config", num_workers=4, use_gpu=None
    )
    assert merged == ScalingConfig(num_workers=4, address="auto")


def test_shortcut_and_group_fields_are_validated_together():
    # min_workers=2 alone is invalid against the default num_workers=1; with the
    # shortcut num_workers=4 the merged config is valid.
    merged = merge_flat_options(ScalingConfig, {"min_workers": 2}, "scaling_config", num_workers=4)
    assert (merged.num_workers, merged.min_workers) == (4, 2)
    with pytest.raises(ConfigError, match="min_workers=3 must be between 1 and num_workers=2"):
        merge_flat_options(ScalingConfig, {"min_workers": 3}, "scaling_config", num_workers=2)


def test_shortcut_next_to_a_group_instance_fills_fields_left_at_their_default():
    group = ScalingConfig(address="auto", start_timeout_s=5.0)
    merged = merge_flat_options(ScalingConfig, group, "scaling_config", num_workers=3)
    assert merged == ScalingConfig(num_workers=3, address="auto", start_timeout_s=5.0)
    assert group.num_workers == 1  # the caller's instance is not changed


def test_only_the_keys_given_twice_are_refused():
    with pytest.raises(ConfigError) as info:
        merge_flat_options(
            ScalingConfig,
            {"num_workers": 1, "address": "auto"},
            "scaling_config",
            num_workers=2,
            use_gpu=False,
        )
    assert "['num_workers'] given both as keyword argument(s) and inside scaling_config" in str(
        info.value
    )
    with pytest.raises(ConfigError, match=r"\['num_workers'\] given both"):
        merge_flat_options(
            ScalingConfig, ScalingConfig(num_workers=2), "scaling_config", num_workers=2
        )


def test_group_of_the_wrong_type_or_with_unknown_keys_is_a_config_type_error():
    with pytest.raises(ConfigTypeError, match="scaling_config must be a ScalingConfig"):
        merge_flat_options(ScalingConfig, 4, "scaling_config", num_workers=2)
    with pytest.raises(ConfigTypeError, match=r"Unknown scaling_config key\(s\) \['workers'\]"):
        merge_flat_options(ScalingConfig, {"workers": 3}, "scaling_config", num_workers=2)


def test_trainer_takes_a_shortcut_next_to_a_scaling_group():
    from polytrain import TorchTrainer
    from tests.helpers import DIGITS

    trainer = TorchTrainer(
        **DIGITS, config={"batch_size": 32}, num_workers=0, scaling_config={"start_timeout_s": 5}
    )
    try:
        assert trainer.scaling == ScalingConfig(num_workers=0, start_timeout_s=5)
    finally:
        trainer.shutdown()
