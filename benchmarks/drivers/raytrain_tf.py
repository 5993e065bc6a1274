"""Ray Train's TensorflowTrainer on the Keras MLP (``ScalingConfig(num_workers=2)``), for comparison.

Ray Train sets ``TF_CONFIG`` in every worker; the loop is the native script's.

Usage: python benchmarks/drivers/raytrain_tf.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # inherited by Ray's workers

import ray  # noqa: E402

from benchmarks.workloads import mlp, recorder  # noqa: E402


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: the native MWMS loop."""
    import tensorflow as tf

    rec = recorder.RECORDER
    rec.mark("loop_start")
    spec = mlp.WorkloadSpec.from_json(config["spec"])
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = mlp.tf_build_model(spec)
    model.distribute_reduction_method = "first"
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = mlp.tf_dataset(spec).with_options(options)
    rec.mark("wrapped")
    model.fit(
        dataset,
        epochs=mlp.TF_EPOCHS,
        steps_per_epoch=spec.steps,
        verbose=0,
        callbacks=[mlp.tf_timing_callback()],
    )
    recorder.write_summary(config["result_dir"], rank)


def main() -> None:
    """Run Ray Train's TensorflowTrainer once; the workers write their records."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    marks = {"script_start": _START, "imported": time.time()}
    ray.init(include_dashboard=False, configure_logging=False)
    marks["ray_init_done"] = time.time()
    trainer = TensorflowTrainer(
        train_loop,
        train_loop_config={"spec": args.spec, "result_dir": args.result_dir},
        scaling_config=ScalingConfig(num_workers=mlp.NUM_WORKERS),
        run_config=RunConfig(storage_path=str(Path(args.result_dir) / "ray_results")),
    )
    trainer.fit()
    marks["train_done"] = time.time()
    Path(args.result_dir, "driver.json").write_text(json.dumps({"marks": marks}))
    ray.shutdown()


if __name__ == "__main__":
    main()
