"""One non-finite rule for every loop, Keras' own one-device loop included.

keras_dist's executors (several replicas, parameter servers) apply each
update under `update.NonFinitePolicy`. On one device `kd.fit` trains with
Keras' own `model.fit`, which applies an update with NaN / Inf gradients as
it is (the weights become NaN). `keras_loop(model, mode)` puts the same
policy inside Keras' loop, at the optimizer, as Keras' `LossScaleOptimizer`
guards its own updates: while `model.fit` runs, the model's `train_step` is
traced with the optimizer's `apply` routed through the policy, so `"skip"`
skips (weights, slots and `iterations` untouched; counted as
`skipped_nonfinite` in the epoch logs) and `"raise"` raises
`NonFiniteUpdateError`. With finite gradients the traced step computes
exactly what Keras' computes (the same update, taken in a `tf.cond`).

`finite_loss_only(model)`: in the block, the model's loss tracker leaves out
a step whose loss is not finite, so an epoch's `loss` averages the steps
whose loss was finite (their updates were applied; a skipped update almost
always comes with a NaN loss) and `keras.callbacks.TerminateOnNaN` does not
stop a run whose weights are fine. Used while a train step is traced, in
every loop, under `"skip"`. `judge_epoch`: an epoch with no finite loss at
all logs NaN (Keras' mean of nothing is 0), and `TerminateOnNaN` then stops
a run that cannot train.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import update


@contextlib.contextmanager
def finite_loss_only(model, mode="skip"):
    """In the block (while a train step is traced), `model`'s loss tracker
    counts a batch only when its loss is finite (`mode="skip"`; any other
    mode changes nothing). With a finite loss it adds exactly what Keras
    adds."""
    tracker = _loss_tracker(model) if mode == "skip" else None
    if tracker is None or _compat.overrides(tracker, "update_state"):
        yield
        return
    original = tracker.update_state

    def update_state(values, sample_weight=None):
        values = tf.convert_to_tensor(values)
        finite = tf.reduce_all(tf.math.is_finite(values))
        values = tf.where(finite, values, tf.zeros_like(values))
        if sample_weight is None:
            sample_weight = tf.ones_like(values)
        sample_weight = tf.convert_to_tensor(sample_weight)
        sample_weight = sample_weight * tf.cast(finite, sample_weight.dtype)
        return original(values, sample_weight=sample_weight)

    _compat.override(tracker, update_state=update_state)
    try:
        yield
    finally:
        _compat.drop_override(tracker, "update_state")


def judge_epoch(model, logs, mode, callbacks, epoch):
    """At an epoch's end (before validation, which reuses the loss tracker):
    under "skip", an epoch that counted no finite loss (every update
    skipped) logs `loss: nan`, not Keras' mean of nothing (0), and with a
    `keras.callbacks.TerminateOnNaN` among `callbacks` training stops there,
    as it stops Keras' own fit whose loss went NaN. (TerminateOnNaN itself
    judges batches; a batch's loss here counts the finite batches so far,
    so one bad batch does not stop a run whose weights are fine.)"""
    if "loss" in logs and logs.get("skipped_nonfinite", 0) and counted_nothing(model, mode):
        conclude_nothing_counted(model, logs, callbacks, epoch)


def counted_nothing(model, mode):
    """Whether, under "skip", the loss tracker counted no batch (eager)."""
    tracker = _loss_tracker(model) if mode == "skip" else None
    if tracker is None or not hasattr(tracker, "count"):
        return False
    return float(np.asarray(tracker.count.numpy())) == 0


def conclude_nothing_counted(model, logs, callbacks, epoch):
    """`loss: nan` in `logs`; stops training when `TerminateOnNaN` is there."""
    logs["loss"] = float("nan")
    found = getattr(callbacks, "callbacks", callbacks) or ()
    if any(isinstance(cb, keras.callbacks.TerminateOnNaN) for cb in found):
        print(f"Epoch {epoch + 1}: every update was non-finite and skipped, the loss is "
              "NaN; TerminateOnNaN stops training", flush=True)
        model.stop_training = True


def _loss_tracker(model):
    """The `loss` mean Keras' `train_step` updates (first of `model.metrics`
    once compiled), or `None`."""
    for metric in getattr(model, "metrics", ()):
        if metric.name == "loss" and isinstance(metric, keras.metrics.Mean):
            return metric
    return None


class _EpochLogs(keras.callbacks.Callback):
    """Adds `skipped_nonfinite` to the epoch logs (once anything was
    skipped in this `fit` call, as the executors do) and keeps the epoch
    for `NonFiniteUpdateError`'s message. First in the callback list, so
    `History` and the progress bar see what it adds."""

    def __init__(self, policy, callbacks):
        super().__init__()
        self.policy = policy
        self.callbacks = callbacks
        self.epoch = 0
        self.nothing = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.nothing = False
        self.policy.begin_epoch()

    def on_train_batch_end(self, batch, logs=None):
        # Read at the epoch's last batch (validation reuses the tracker
        # before on_epoch_end); Keras may number a short last execution
        # past the end.
        steps = (self.params or {}).get("steps")
        if not steps or batch + 1 >= steps:
            self.nothing = counted_nothing(self.model, self.policy.mode)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self.policy.epoch_logs())
            if self.nothing and "loss" in logs and logs.get("skipped_nonfinite", 0):
                conclude_nothing_counted(self.model, logs, self.callbacks, epoch)


def keras_loop(model, mode, fit, *args, **kwargs):
    """Runs `fit(*args, **kwargs)` (Keras' own `model.fit`) with `model`'s
    updates under the non-finite policy `mode` ("skip" or "raise").

    Example:

    >>> import numpy as np, keras
    >>> from keras_dist.training import nonfinite as guard
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x = np.array([[1.0, 2.0]] * 4 + [[np.nan, 1.0]] * 4)  # batches 3 and 4: NaN
    >>> history = guard.keras_loop(model, "skip", model.fit, x, np.ones((8, 1)),
    ...                            batch_size=2, shuffle=False, verbose=0)
    >>> bool(np.isfinite(model.get_weights()[0]).all())
    True
    >>> history.history["skipped_nonfinite"]
    [2]
    """
    policy = update.NonFinitePolicy(mode)
    optimizer = model.optimizer
    if optimizer is None or update.skips_itself(optimizer):
        return fit(*args, **kwargs)  # a LossScaleOptimizer decides itself
    policy.build()
    policy.begin_training()

    def hook(original, grads, variables):
        return policy.apply(original, grads, variables, optimizer=optimizer)

    original_step = model.train_step

    def train_step(data):
        with update.apply_hook(hook), finite_loss_only(model, mode):
            return original_step(data)

    callbacks = kwargs.pop("callbacks", None)
    logs = _EpochLogs(policy, callbacks)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks.insert(0, logs)
        logs.set_model(model)
    else:
        callbacks = [logs, *(callbacks or [])]
    _compat.override(model, train_step=train_step)
    model.train_function = None  # traced afresh, with the guard
    try:
        with update.intercept_apply(optimizer):
            return fit(*args, callbacks=callbacks, **kwargs)
    except tf.errors.InvalidArgumentError as error:
        update.raise_if_nonfinite(error, logs.epoch)
        raise
    finally:
        _compat.drop_override(model, "train_step")
        model.train_function = None  # Keras' own fit traces its own step again
