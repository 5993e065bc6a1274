"""Plain TensorFlow MultiWorkerMirroredStrategy: one of two processes started with a hand-written TF_CONFIG.

The orchestrator starts two of these with ``TF_CONFIG`` naming two ports on
127.0.0.1 and ``TF_USE_LEGACY_KERAS=1``; each trains the Keras MLP with ``model.fit``.

Usage: TF_CONFIG=... python benchmarks/native/tf_native.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

from benchmarks.workloads import mlp, recorder  # noqa: E402


def main() -> None:
    """Train the Keras MLP under MWMS and record per-batch times."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    rec = recorder.RECORDER
    rec.marks["script_start"] = _START
    rec.mark("imported")
    spec = mlp.WorkloadSpec.from_json(args.spec)
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    # The same thread settings polytrain gives a worker with one CPU.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rec.mark("process_group")
    with strategy.scope():
        model = mlp.tf_build_model(spec)
    # The same metric reduction polytrain's backend sets (the first replica's result).
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
    recorder.write_summary(args.result_dir, rank)


if __name__ == "__main__":
    main()
