"""Search learning rate and backend with Ray Tune's ASHA scheduler, 2 workers per trial.

Every trial is a TorchTrainer with its own 2 Ray workers, inside the trial's
placement group (1 CPU for the trial, 1 per worker). ``backend`` is searched like
any hyperparameter. ASHA stops trials whose validation accuracy trails at each
rung; a stopped or paused trial resumes from its last checkpoint.

Run it:  python examples/tune_asha.py --num-samples 8 --epochs 4
"""

from __future__ import annotations

import argparse

import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from examples import digits


def run(
    num_samples: int,
    epochs: int,
    backends: list[str],
    num_workers: int = 2,
    storage_path: str | None = None,
) -> tune.ResultGrid:
    """Run the search and return Tune's results."""
    from polytrain import TorchTrainer

    trainable = TorchTrainer.as_trainable(
        model_creator=digits.model_creator,
        data_creator=digits.data_creator,
        optimizer_creator=digits.optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": 64},
        num_workers=num_workers,
        num_epochs=epochs,
    )
    tuner = tune.Tuner(
        trainable,
        param_space={
            "lr": tune.loguniform(1e-4, 3e-1),
            "backend": tune.choice(backends),  # the backend is a hyperparameter too
        },
        tune_config=tune.TuneConfig(
            metric="val_accuracy",
            mode="max",
            num_samples=num_samples,
            scheduler=ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=2),
        ),
        run_config=tune.RunConfig(name="polytrain_asha", storage_path=storage_path, verbose=1),
    )
    return tuner.fit()


def main() -> None:
    """Search from the command line and print the best trial."""
    import ray

    from polytrain import available_backends

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument(
        "--backends",
        nargs="+",
        default=[b for b in ("ddp", "horovod") if b in available_backends("torch")],
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    args = parser.parse_args()

    ray.init(address=args.address)
    results = run(args.num_samples, args.epochs, args.backends, args.num_workers)
    best = results.get_best_result()
    print("best config:", best.config)
    print("best val_accuracy:", best.metrics["val_accuracy"])
    print("checkpoint:", best.checkpoint)


if __name__ == "__main__":
    main()
