"""Asynchronous digits training on a shuffled input, for repeated-run checks.

argv: variant, one of
  fn      a dataset_fn with `shuffle(1000)` (docs/getting-started.md's block);
  ds      a shuffled `tf.data.Dataset` made after `resolve_strategy`, which
          the coordinator serializes to every worker;
  arrays  arrays, which keras_dist shuffles on each worker.
Prints `RESULT <variant> <final loss>` on the chief.
"""

import os
import sys

import keras_dist as kd

strategy = kd.resolve_strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402

VARIANT = sys.argv[1] if len(sys.argv) > 1 else "fn"


def build_model():
    return digits_model(keras.optimizers.SGD(0.05, momentum=0.9), seed=0)


(x_train, y_train), _ = load_digits()
if VARIANT == "fn":
    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(64)
        ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.shuffle(1000).batch(batch).repeat()

    history = kd.fit(build_model, dataset_fn, strategy=strategy, epochs=5,
                     steps_per_epoch=20, verbose=0)
elif VARIANT == "ds":
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(1000).batch(64)
    history = kd.fit(build_model, dataset, strategy=strategy, epochs=5, verbose=0)
elif VARIANT == "arrays":
    history = kd.fit(build_model, x_train, y_train, strategy=strategy, epochs=5,
                     batch_size=64, verbose=0)
else:
    raise SystemExit(f"unknown variant {VARIANT!r}: use fn, ds or arrays")
print("RESULT", VARIANT, history.history["loss"][-1])
