"""The default step lets go of the model's output before backward (issue 26: memory per rank).

A language model's output holds its logits (and key/value cache): batch x sequence x
vocabulary floats that the backward does not need once the loss is computed. Holding
them through backward and the optimizer step adds their size to every rank's peak.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.data import DataLoader, Dataset

from polytrain import TorchTrainer

#: For every backward: whether the forward's logits were still alive.
ALIVE_IN_BACKWARD: list[bool] = []


class LogitsWatcher(torch.nn.Module):
    """Returns ``{"loss", "logits"}`` like an HF model; a gradient hook checks the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 8)
        self._logits: weakref.ref | None = None
        self.linear.weight.register_hook(self._note)

    def _note(self, grad: torch.Tensor) -> torch.Tensor:
        ALIVE_IN_BACKWARD.append(self._logits is not None and self._logits() is not None)
        return grad

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.linear(x)
        self._logits = weakref.ref(logits)
        # sum's backward keeps no input: only the output dict refers to the logits.
        return {"loss": logits.sum(), "logits": logits}


class _Dicts(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((4,), float(index))}


def test_the_output_is_released_before_backward():
    ALIVE_IN_BACKWARD.clear()
    trainer = TorchTrainer(
        model_creator=lambda config: LogitsWatcher(),
        data_creator=lambda config: DataLoader(_Dicts(), batch_size=config["batch_size"]),
        optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.01),
        config={"batch_size": 4},
        num_workers=0,
    )
    try:
        trainer.train(num_steps=2)
    finally:
        trainer.shutdown()
    assert ALIVE_IN_BACKWARD == [False, False]
