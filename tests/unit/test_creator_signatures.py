"""Creators that cannot take ``config`` (torchvision's ``resnet18`` and its kind) are refused
when the trainer is built, with the one-line ``lambda`` that fixes them."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TorchTrainer
from polytrain.errors import CreatorError
from polytrain.trainer_api.creators import TorchCreators


def resnet18(*, weights=None, progress=True, **kwargs):  # no annotations: a plain repr below
    """torchvision 0.13+'s signature: keyword arguments only (the class count in kwargs)."""
    return torch.nn.Linear(4, kwargs.get("num_classes", 1000))


def resnet18_before_0_13(pretrained: bool = False, progress: bool = True, **kwargs):
    """The older signature: ``resnet18(config)`` would read the dict as ``pretrained``."""
    return torch.nn.Linear(4, kwargs.get("num_classes", 1000))


class Net(torch.nn.Module):
    """A model class whose first argument is not a config."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, num_classes)


def _data(config):
    return DataLoader(TensorDataset(torch.zeros(4, 4), torch.zeros(4).long()), batch_size=2)


def _optimizer(model, config):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _model(config):
    return torch.nn.Linear(4, 2)


def _creators(**kwargs) -> TorchCreators:
    base = {"model_creator": resnet18, "data_creator": _data, "optimizer_creator": _optimizer}
    return TorchCreators(**{**base, **kwargs})


def test_keyword_only_model_builder_is_refused_with_the_lambda_fix():
    with pytest.raises(CreatorError) as info:
        _creators(model_creator=resnet18)
    message = str(info.value)
    assert "model_creator resnet18(*, weights=None, progress=True, **kwargs)" in message
    assert "cannot be called with 1 argument(s) (too many positional arguments)" in message
    assert "polytrain calls model_creator(config) on every worker" in message
    assert "model_creator=lambda config: resnet18(num_classes=10)" in message


def test_the_lambda_fix_is_accepted_and_builds_the_model():
    creators = _creators(model_creator=lambda config: resnet18(num_classes=10))
    (model,) = creators.create_models({})
    assert model.out_features == 10


def test_trainer_refuses_it_before_any_worker_starts():
    # No Ray here: the check runs in the constructor, before workers are asked for.
    with pytest.raises(CreatorError, match=r"model_creator=lambda config: resnet18\(num_classes"):
        TorchTrainer(
            model_creator=resnet18,
            data_creator=_data,
            optimizer_creator=_optimizer,
            config={"batch_size": 4},
            num_workers=2,
        )


@pytest.mark.parametrize(
    ("creator", "parameter", "fix"),
    [
        (
            resnet18_before_0_13,
            "'pretrained' (default False)",
            "resnet18_before_0_13(num_classes=10)",
        ),
        (Net, "'num_classes' (default 10)", "Net(num_classes=10)"),
    ],
    ids=["pretrained-first", "model-class"],
)
def test_config_landing_on_a_defaulted_parameter_is_refused(creator, parameter, fix):
    with pytest.raises(CreatorError) as info:
        _creators(model_creator=creator)
    message = str(info.value)
    assert f"would receive the config dict as its argument {parameter}" in message
    assert f"model_creator=lambda config: {fix}" in message


def test_other_creators_get_their_own_arguments_in_the_fix():
    def build():
        return torch.nn.Linear(4, 2)

    def sgd(model, lr=0.1):
        return torch.optim.SGD(model.parameters(), lr=lr)

    with pytest.raises(CreatorError, match=r"model_creator=lambda config: build\(\)\."):
        _creators(model_creator=build)
    with pytest.raises(CreatorError) as info:
        _creators(model_creator=_model, optimizer_creator=sgd)
    assert "argument 'lr' (default 0.1)" in str(info.value)
    assert "optimizer_creator=lambda model, config: sgd(model, ...)" in str(info.value)
    with pytest.raises(CreatorError) as info:
        _creators(model_creator=_model, optimizer_creator=torch.optim.SGD)
    assert (
        "optimizer_creator=lambda model, config: SGD(model.parameters(), lr=config['lr'])"
        in str(info.value)
    )
    with pytest.raises(CreatorError, match=r"data_creator=lambda config: <its body>"):
        _creators(model_creator=_model, data_creator=lambda: None)


def _model_optional_config(config=None):
    return torch.nn.Linear(4, 2)


def _model_dict_default(config={}):  # noqa: B006 - the default is the point
    return torch.nn.Linear(4, 2)


def _model_varargs(*args):
    return torch.nn.Linear(4, 2)


class ConfigNet(torch.nn.Module):
    """RaySGD's ``model_creator=ResNet18``: a class that takes the config."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, config.get("classes", 2))


@pytest.mark.parametrize(
    "creator", [_model, _model_optional_config, _model_dict_default, _model_varargs, ConfigNet]
)
def test_creators_that_take_config_are_accepted(creator):
    creators = _creators(model_creator=creator)
    (model,) = creators.create_models({"classes": 2})
    assert isinstance(model, torch.nn.Module)


def test_real_torchvision_resnet18_is_refused_the_same_way():
    from examples.cifar_resnet import torchvision_problem

    problem = torchvision_problem()
    if problem is not None:
        pytest.skip(problem)
    from torchvision.models import resnet18 as torchvision_resnet18

    with pytest.raises(
        CreatorError, match=r"model_creator=lambda config: resnet18\(num_classes=10\)"
    ):
        _creators(model_creator=torchvision_resnet18)
    (model,) = _creators(
        model_creator=lambda config: torchvision_resnet18(num_classes=10)
    ).create_models({})
    assert model.fc.out_features == 10


def test_tf_trainer_creators_get_the_same_check():
    # Ray Train's MNIST example builds its Keras model with build_cnn_model(), no arguments.
    from polytrain.trainer_api.tensorflow.worker import TFCreators

    def build_cnn_model():
        raise AssertionError("not called when the trainer is built")

    with pytest.raises(CreatorError, match=r"model_creator=lambda config: build_cnn_model\(\)"):
        TFCreators(model_creator=build_cnn_model, data_creator=_data)
    with pytest.raises(
        CreatorError, match=r"Expected model_creator\(config\) -> a compiled tf_keras"
    ):
        TFCreators(model_creator=build_cnn_model, data_creator=_data)
    with pytest.raises(CreatorError, match=r"Expected data_creator\(config\) -> tf\.data\.Dataset"):
        TFCreators(model_creator=lambda config: None, data_creator=lambda: None)
