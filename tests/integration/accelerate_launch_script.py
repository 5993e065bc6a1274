"""An Accelerate script as ``accelerate launch --config_file FILE script.py OUT`` runs it.

Nothing in it knows polytrain: a plain ``Accelerator()`` loop (``accelerate_loop.py``, the
one of ``test_accelerate.py``) that saves its state every 2 steps into ``OUT/state`` and,
when started again, loads it (``load_state``) and goes on. Rank 1 exits with code 3
after step 3 of the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so a launch
with ``--max-restarts 1`` finishes on the second. The main process writes the
final weights and losses to ``OUT/final.pt``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate_loop import MICRO_BATCH, train_with_accelerate  # a sibling of this script


def main(out: str) -> None:
    state_dir = os.path.join(out, "state")
    progress = os.path.join(state_dir, "progress.json")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def on_step(step, accelerator, losses):
        if step % 2 == 0:
            accelerator.save_state(state_dir)
            if accelerator.is_main_process:
                with open(progress, "w") as handle:
                    json.dump({"step": step, "losses": losses}, handle)
            accelerator.wait_for_everyone()
        if first_attempt and step == 3 and accelerator.process_index == 1:
            sys.exit(3)

    resume = state_dir if os.path.isfile(progress) else None
    state, losses, accelerator = train_with_accelerate(MICRO_BATCH, resume, on_step)
    if accelerator.is_main_process:
        torch.save(
            {"state": state, "losses": losses, "processes": accelerator.num_processes},
            os.path.join(out, "final.pt"),
        )


if __name__ == "__main__":
    main(sys.argv[1])
