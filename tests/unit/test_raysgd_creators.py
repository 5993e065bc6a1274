"""RaySGD users' creators keep working (issue: RaySGD compatibility), without Ray."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from polytrain.errors import CreatorError
from polytrain.trainer_api.creators import TorchCreators


def _data(config):
    return DataLoader(TensorDataset(torch.zeros(8, 2), torch.zeros(8).long()), batch_size=2)


def _opt(model, config):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_optimizer_creator_receives_the_list_that_model_creator_returned():
    seen = {}

    def models(config):
        return [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]

    def optimizers(models, config):
        seen["models"] = models
        return [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]

    def schedulers(optimizers, config):
        seen["optimizers"] = optimizers
        return [torch.optim.lr_scheduler.StepLR(o, 1) for o in optimizers]

    creators = TorchCreators(models, _data, optimizers, scheduler_creator=schedulers)
    built = creators.create_models({})
    opts = creators.create_optimizers(built, {})
    creators.create_schedulers(opts, {})
    assert type(seen["models"]) is list and len(seen["models"]) == 2
    assert type(seen["optimizers"]) is list
    assert len(built) == 2 and len(opts) == 2


def test_single_model_and_tuple_pass_through_as_returned():
    seen = []

    def optimizers(models, config):
        seen.append(models)
        items = models if isinstance(models, tuple) else (models,)
        return tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in items)

    single = TorchCreators(lambda c: torch.nn.Linear(2, 2), _data, optimizers)
    single.create_optimizers(single.create_models({}), {})
    pair = TorchCreators(
        lambda c: (torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), _data, optimizers
    )
    pair.create_optimizers(pair.create_models({}), {})
    assert isinstance(seen[0], torch.nn.Linear)
    assert type(seen[1]) is tuple and len(seen[1]) == 2


def test_a_model_instance_as_model_creator_says_how_to_write_the_creator():
    with pytest.raises(
        CreatorError, match=r"model_creator received Linear .*an instance.*lambda config: Linear"
    ):
        TorchCreators(torch.nn.Linear(2, 2), _data, _opt)


def test_an_optimizer_instance_as_optimizer_creator_is_refused():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(CreatorError, match=r"optimizer_creator received SGD.*model.parameters\(\)"):
        TorchCreators(lambda c: torch.nn.Linear(2, 2), _data, optimizer)


def test_a_loss_instance_as_loss_creator_says_to_pass_the_class():
    with pytest.raises(CreatorError, match=r"loss_creator=CrossEntropyLoss"):
        TorchCreators(lambda c: torch.nn.Linear(2, 2), _data, _opt, torch.nn.CrossEntropyLoss())


def test_data_creator_may_return_a_dataset_batched_with_the_per_worker_batch():
    dataset = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.zeros(10).long())
    creators = TorchCreators(lambda c: torch.nn.Linear(1, 2), lambda c: (dataset, dataset), _opt)
    train, val = creators.create_data({"batch_size": 4})
    assert isinstance(train, DataLoader) and train.batch_size == 4
    assert isinstance(train.sampler, torch.utils.data.RandomSampler)  # shuffled for training
    assert isinstance(val.sampler, torch.utils.data.SequentialSampler)
    assert len(train) == 3
    with pytest.raises(CreatorError, match=r"config\['batch_size'\].*not set"):
        TorchCreators(lambda c: torch.nn.Linear(1, 2), lambda c: dataset, _opt).create_data({})


def test_an_iterable_dataset_that_does_not_shard_itself_is_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    creators = TorchCreators(lambda c: torch.nn.Linear(1, 2), lambda c: Stream(), _opt)
    with pytest.raises(CreatorError, match="IterableDataset.*add_dist_sampler=False"):
        creators.create_data({"batch_size": 2})


def test_the_next_creator_gets_the_very_object_the_creator_returned():
    import collections

    Pair = collections.namedtuple("Pair", "generator discriminator")
    returned, seen = {}, {}

    def models(config):
        returned["models"] = Pair(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        return returned["models"]

    def optimizers(models, config):
        seen["models"] = models
        returned["optimizers"] = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        return returned["optimizers"]

    def schedulers(optimizers, config):
        seen["optimizers"] = optimizers
        return [torch.optim.lr_scheduler.StepLR(o, 1) for o in optimizers]

    creators = TorchCreators(models, _data, optimizers, scheduler_creator=schedulers)
    built = creators.create_models({})
    creators.create_schedulers(creators.create_optimizers(built, {}), {})
    assert seen["models"] is returned["models"]  # a named tuple, with its field names
    assert seen["models"].discriminator is built[1]
    assert seen["optimizers"] is returned["optimizers"]  # the same list, not a copy
