"""The user's Accelerate loop of the Accelerate tests: nothing in it knows polytrain.

Shared by ``test_accelerate.py`` (inside ``train_loop_per_worker``) and
``accelerate_launch_script.py`` (under ``polytrain launch --accelerate-config``),
which imports it as a sibling module.
"""

from __future__ import annotations

import json
import os

import accelerate
import torch

MICRO_BATCH = 4
ACCUMULATE = 2
STEPS = 4  # optimizer steps


def _data(batch: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * ACCUMULATE * 2 * MICRO_BATCH, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def train_with_accelerate(batch: int, checkpoint_dir=None, on_step=None):
    """The user's Accelerate loop; ``on_step(step, accelerator, losses)`` after each optimizer step."""
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=ACCUMULATE)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _data(batch))
    step, losses = 0, []
    if checkpoint_dir is not None:
        accelerator.load_state(checkpoint_dir)
        with open(os.path.join(checkpoint_dir, "progress.json")) as handle:
            step, losses = json.load(handle).values()
        loader = accelerator.skip_first_batches(loader, step * ACCUMULATE)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            losses.append(accelerator.gather(loss.detach()).mean().item())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if on_step is not None:
                on_step(step, accelerator, losses)
    return accelerator.unwrap_model(model).state_dict(), losses, accelerator
