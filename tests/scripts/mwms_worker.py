"""One task of a 2-process MultiWorkerMirrored test: trains and saves results.

Run by tests/test_fit_multiworker.py with TF_CONFIG set, and by
tests/test_ray.py on Ray's actors. argv: out_dir.
Env MWMS_TEST_INPUT: the input, "arrays" (the default) or "dataset"; the
results go to out_dir/<task>.json and .npz. Several, comma-separated
("arrays,dataset"): one `kd.fit` after the other in this process, each
mode's results to out_dir/<task>-<mode>.json and .npz.
"""

import json
import os
import sys

import numpy as np

import keras_dist as kd

strategy = kd.resolve_strategy()  # first: collective ops start with the process

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402


def build_model():
    # seed: the same initial weights on every worker
    return digits_model(keras.optimizers.SGD(0.1, momentum=0.9), hidden=32, seed=7)


def main(out_dir):
    modes = os.environ.get("MWMS_TEST_INPUT", "arrays").split(",")
    for mode in modes:
        train(out_dir, mode, suffix="" if len(modes) == 1 else f"-{mode}")


def train(out_dir, mode, suffix):
    (x, y), (x_test, y_test) = load_digits()
    if mode == "dataset":
        data = dict(x=__import__("tensorflow").data.Dataset.from_tensor_slices(
            (x, y)).batch(64))
    else:
        data = dict(x=x, y=y, batch_size=64)
    history = kd.fit(build_model, strategy=strategy, epochs=4,
                     validation_data=(x_test, y_test), verbose=0, **data)
    model = history.model
    loss, acc = kd.evaluate(model, x_test, y_test, verbose=0)
    # Keras' own evaluate / predict fail here (PerReplica); after kd.fit the
    # model's are keras_dist's.
    own = model.evaluate(x_test, y_test, return_dict=True, verbose=0)
    predicted = model.predict(x_test, batch_size=50, verbose=0)
    # The same batches both ways: with other batch sizes the matmuls round
    # differently on some CPUs (oneDNN picks its kernels by shape).
    same_predictions = bool(np.array_equal(
        predicted, kd.predict(model, x_test, batch_size=50, verbose=0)))
    task = kd.ClusterConfig.from_env()  # TF_CONFIG, or a Kubernetes Job's pod
    name = f"{task.task_type}{task.task_index}{suffix}"
    np.savez(os.path.join(out_dir, f"{name}.npz"), *model.get_weights())
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"history": history.history, "test_accuracy": acc,
                   "test_loss": loss, "own_evaluate": own,
                   "predict_shape": list(predicted.shape),
                   "predict_accuracy": float((predicted.argmax(1) == y_test).mean()),
                   "same_predictions": same_predictions,
                   "version": model.version,
                   "iterations": int(model.optimizer.iterations.numpy()),
                   "staleness": model.staleness_stats.logs(),
                   "replicas": strategy.num_replicas_in_sync}, f)


if __name__ == "__main__":
    main(sys.argv[1])
