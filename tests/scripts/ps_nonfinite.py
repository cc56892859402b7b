"""Asynchronous training on data with NaN rows; run by keras-dist-run.

argv: out_dir mode ("skip" or "raise"). The chief writes out_dir/result.json.
"""

import json
import os
import signal
import sys
import threading

import numpy as np
import tensorflow as tf

import keras_dist as kd

strategy = kd.resolve_strategy()
if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
    kd.serve()

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402


def main(out_dir, mode):
    (x, y), (x_test, y_test) = load_digits()
    x = x.copy()
    x[::60] = np.nan  # 24 poisoned examples: some batches give NaN gradients
    with strategy.scope():
        model = digits_model(keras.optimizers.SGD(0.05, momentum=0.9), cls=kd.AsyncModel,
                             seed=0)
    model.nonfinite_updates = mode
    result = {}
    # "raise": the fit ends by an exception mid-epoch, with a backup that
    # catches SIGTERM; afterwards nothing of it may be left (issue 48).
    callbacks = ([kd.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=10)]
                 if mode == "raise" else [])
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
    threads = _threads()
    try:
        history = model.fit(x, y, epochs=8, steps_per_epoch=45, batch_size=32, verbose=2,
                            callbacks=callbacks)
        result["history"] = history.history
        result["finite_weights"] = all(bool(np.isfinite(w).all()) for w in model.get_weights())
        result["test_accuracy"] = model.evaluate(x_test, y_test, return_dict=True,
                                                 verbose=0)["accuracy"]
        result["version"] = model.version
        result["iterations"] = int(model.optimizer.iterations.numpy())
    except Exception as error:  # the "raise" mode: what the user sees
        result["error"] = f"{type(error).__name__}: {error}"
        result["handlers_restored"] = handlers == {
            number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
        result["threads_left"] = sorted(_threads() - threads)
        result["executor_left"] = "_kd_executor" in model.__dict__
        # The same model trains again (finite data; the backup, written in
        # epoch 1 where the error came, resumes there).
        version = model.version
        model.nonfinite_updates = "skip"
        model.fit(np.nan_to_num(x), y, epochs=2, steps_per_epoch=45, batch_size=32,
                  verbose=0, callbacks=[kd.callbacks.BackupAndRestore(
                      os.path.join(out_dir, "backup"), save_freq=10)])
        result["trained_again"] = model.version > version
    if mode == "skip":
        # A user's TerminateOnNaN(raise_error=True) raises at the first
        # skipped batch, as Keras' does at its first NaN loss (issue 47).
        try:
            model.fit(x, y, epochs=2, steps_per_epoch=45, batch_size=32, verbose=0,
                      callbacks=[keras.callbacks.TerminateOnNaN(raise_error=True)])
            result["terminate_on_nan"] = "no error"
        except RuntimeError as error:
            result["terminate_on_nan"] = str(error)
            result["finite_after_terminate"] = all(
                bool(np.isfinite(w).all()) for w in model.get_weights())
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


def _threads():
    return {t.name for t in threading.enumerate() if t.name.startswith("keras_dist")
            and t.name != "keras_dist-iterator-release"}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
