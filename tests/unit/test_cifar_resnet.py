"""examples/cifar_resnet.py's plain-torch ResNet-18 is torchvision's resnet18, layer for layer."""

from __future__ import annotations

import pytest
import torch

from examples import cifar_resnet


def test_resnet18_has_torchvisions_size_and_output():
    # torchvision documents resnet18 at 11,689,512 parameters (ImageNet head).
    assert sum(p.numel() for p in cifar_resnet.ResNet18().parameters()) == 11_689_512
    model = cifar_resnet.ResNet18(num_classes=10)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert len(model.state_dict()) == 122  # weights, biases and batch-norm buffers


def test_the_creator_builds_the_same_weights_on_every_call():
    first = cifar_resnet.model_creator({"torchvision": False})
    second = cifar_resnet.model_creator({"torchvision": False})
    assert all(
        torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )


def test_checkpoints_interchange_with_torchvision():
    problem = cifar_resnet.torchvision_problem()
    if problem is not None:
        pytest.skip(problem)
    from torchvision.models import resnet18

    ours, theirs = cifar_resnet.ResNet18(num_classes=10), resnet18(num_classes=10)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }
    theirs.load_state_dict(ours.state_dict())
    theirs.eval(), ours.eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(ours(x), theirs(x))
