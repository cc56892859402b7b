"""One non-finite rule for every loop, Keras' own one-device loop included.

`NonFinitePolicy` is what keras_dist's executors (several replicas,
parameter servers) do with an update whose gradients are NaN or Inf, in the
manner of optax's `apply_if_finite`: `"skip"` it (and count it) or
`"raise"` `NonFiniteUpdateError` (`raise_if_nonfinite` turns TensorFlow's
failed check into it).

On one device `kd.fit` trains with Keras' own `model.fit`, which applies an
update with NaN / Inf gradients as it is (the weights become NaN). `keras_loop(model, mode)` puts the same
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
from keras_dist.training import compiled
from keras_dist.training import gradients
from keras_dist.training import update

MODES = ("skip", "raise")

# What the "raise" policy's check says when it fails, by what it checks, after
# a mark `raise_if_nonfinite` finds in TensorFlow's error (no quotes: TF
# escapes them).
_NONFINITE_MARK = "keras_dist: non-finite"
_CHECKED = {
    "gradients": "an update's gradients are not finite (NaN or Inf)",
    "round": "a round of local steps ended with non-finite weights (NaN or Inf)",
}


class NonFiniteUpdateError(FloatingPointError):
    """An update's gradients were NaN or Inf under `nonfinite_updates="raise"`.

    Raised by `keras_dist.fit` and `AsyncModel.fit` (keras_dist's own loops:
    several replicas, parameter servers) in place of TensorFlow's
    `InvalidArgumentError: Graph execution error`, which would bury the cause.
    The weights are those before the failing update.

    Example:

    >>> from keras_dist.training.nonfinite import NonFiniteUpdateError
    >>> issubclass(NonFiniteUpdateError, FloatingPointError)
    True
    """


def check(finite, what="gradients"):
    """The "raise" policy's check: an op that fails when the bool tensor
    `finite` is false, saying `what` was not finite ("gradients", or
    "round": a round of local steps), in words `raise_if_nonfinite` finds."""
    return tf.debugging.Assert(finite, [f"{_NONFINITE_MARK} {what}: {_CHECKED[what]}"])


def raise_if_nonfinite(error, epoch):
    """Raises `NonFiniteUpdateError` when TensorFlow's `error` is the "raise"
    policy's check (`check`) failing in `epoch` (0-based); returns otherwise.

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.training import nonfinite
    >>> try:
    ...     nonfinite.check(tf.constant(False), "round")
    ... except tf.errors.InvalidArgumentError as error:
    ...     nonfinite.raise_if_nonfinite(error, epoch=2)
    Traceback (most recent call last):
    ...
    keras_dist.training.nonfinite.NonFiniteUpdateError: In epoch 3, a round of local steps ended with non-finite weights (NaN or Inf), ...
    """
    message = str(getattr(error, "message", error))
    for what, checked in _CHECKED.items():
        if f"{_NONFINITE_MARK} {what}:" in message:
            raise NonFiniteUpdateError(
                f"In epoch {epoch + 1}, {checked}, and nonfinite_updates='raise' stops "
                "training there (the weights are those before that update). Look for "
                "NaN or Inf in the inputs or the loss, or lower the learning rate; to "
                "skip such updates and count them instead, pass "
                "nonfinite_updates='skip' to keras_dist.fit or set "
                "model.nonfinite_updates = 'skip'.") from None


class NonFinitePolicy:
    """What an executor does with an update whose gradients are not finite.

    - `"skip"`: the update is not applied (weights, optimizer slots and the
      step count are untouched) and it is counted: `skipped` on the parameter
      servers or mirrored replicas, reported as `skipped_nonfinite` in the
      epoch logs of any epoch that skipped one.
    - `"raise"`: training stops with a `NonFiniteUpdateError` naming the
      epoch and the option.

    Under a `LossScaleOptimizer` (mixed_float16) that optimizer skips
    non-finite steps itself (and lowers its loss scale); the policy leaves
    the decision to it. The policy is the same on one device, where
    `keras_dist.fit` guards Keras' own loop with it (`keras_loop`).

    Args:
        mode: String. `"skip"` or `"raise"`. Defaults to `"skip"`.

    Example:

    >>> from keras_dist.training.nonfinite import NonFinitePolicy
    >>> NonFinitePolicy("raise").mode
    'raise'

    Raises:
        ValueError: for any other mode.
    """

    def __init__(self, mode="skip"):
        if mode not in MODES:
            raise ValueError(
                f"`nonfinite_updates` must be one of {MODES}. Received: "
                f"nonfinite_updates={mode!r}.")
        self.mode = mode
        self.counter = None
        self._replicated = False

    def build(self, replicated=False):
        """Creates the skip counter in the current strategy's scope.

        With `replicated=True` (synchronous replicas, which all take the
        same decision) each replica counts into its own copy, without any
        communication, and the first replica's count is read.
        """
        if self.counter is None:
            self._replicated = replicated
            extra = dict(synchronization=tf.VariableSynchronization.ON_READ) if replicated else {}
            self.counter = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="keras_dist_skipped_nonfinite",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA, **extra)
        return self

    @property
    def skipped(self):
        """Integer. Updates skipped so far (reads the counter)."""
        return 0 if self.counter is None else int(self.counter.numpy())

    def begin_training(self):
        """A new `fit` call: nothing skipped in it yet."""
        self._reporting = False

    def begin_epoch(self, skipped=None):
        """A new epoch; `skipped`: the count now, when the caller read it."""
        self._skipped_before = self.skipped if skipped is None else int(skipped)

    def epoch_logs(self, skipped=None):
        """`{"skipped_nonfinite": n}` for the epoch once this `fit` call has
        skipped anything (so a clean run's History is Keras'), else `{}`.
        `skipped`: the count now, when the caller read it."""
        skipped = (self.skipped if skipped is None else int(skipped)) - getattr(
            self, "_skipped_before", 0)
        self._reporting = getattr(self, "_reporting", False) or skipped > 0
        return {"skipped_nonfinite": skipped} if self._reporting else {}

    def apply(self, apply_fn, grads, variables, finite=None, optimizer=None, gate=False):
        """Applies `apply_fn(grads, variables)` under the policy.

        `finite` is a boolean tensor (the same on every replica of a
        synchronous step); by default it is computed from `grads`. When
        `optimizer` decides on non-finite updates itself (a
        `LossScaleOptimizer`) the update is handed to it as it is. With
        `gate` (parameter servers) a `gateable` optimizer skips by data
        alone (`gated_writes`) instead of a conditional, and the update's
        skip (a float64 0 or 1 tensor) is returned for the caller to report
        and `add_skipped` on the chief; otherwise `None` (counted here).
        """
        if skips_itself(optimizer):
            apply_fn(grads, variables)
            return
        if finite is None:
            finite = gradients.all_finite(grads)
        if self.mode == "raise":
            with tf.control_dependencies([check(finite)]):
                grads = gradients.identity_all(grads)
            apply_fn(grads, variables)
            return
        if self._replicated:
            self.counter.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
            apply_if(finite, apply_fn, grads, variables, lambda: tf.constant(False))
            return
        if gate and update.gateable(optimizer):
            with update.gated_writes(optimizer, finite):
                apply_fn(grads, variables)
            # Counted by the caller (no round trip): see `add_skipped`.
            return tf.cast(tf.logical_not(finite), tf.float64)
        apply_if(finite, apply_fn, grads, variables, self._count)

    def add_skipped(self, n):
        """Counts `n` updates a worker skipped and reported (eager, on the chief)."""
        if n:
            self.counter.assign_add(int(n))

    def _count(self):
        # Counted only when skipped: no round trip to a parameter server otherwise.
        with tf.control_dependencies([self.counter.assign_add(1)]):
            return tf.constant(False)


def skips_itself(optimizer):
    """Whether `optimizer` decides on non-finite updates itself (loss scaling)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def apply_if(keep, apply_fn, grads, variables, on_skip):
    """Runs `apply_fn(grads, variables)` when the bool tensor `keep` is true,
    else `on_skip()` (which returns a bool tensor).

    An optimizer's apply synchronizes through `merge_call`, which may not sit
    inside a `cond` in replica context; under a strategy the decision is
    therefore taken in cross-replica context (the construction Keras'
    `LossScaleOptimizer` uses). `keep` must be the same on every replica.
    """
    def applied(grads, variables):
        apply_fn(grads, variables)
        return tf.constant(True)

    context = tf.distribute.get_replica_context()
    if not tf.distribute.has_strategy() or context is None:
        tf.cond(keep, lambda: applied(grads, variables), on_skip)
        return

    def decide(distribution, keep, grads, variables):
        keep = distribution.experimental_local_results(keep)[0]

        def apply_branch():
            distribution.extended.call_for_each_replica(applied, args=(grads, variables))
            return tf.constant(True)

        if tf.executing_eagerly():  # an eager first step: a Python branch
            return apply_branch() if bool(keep) else on_skip()
        return tf.cond(keep, apply_branch, on_skip)

    context.merge_call(decide, args=(keep, grads, variables))


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


def watches_nonfinite(callbacks):
    """Whether one of `callbacks` (a list or a `CallbackList`) asks to see a
    non-finite loss: Keras' `TerminateOnNaN`, or a subclass of it."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return any(isinstance(c, keras.callbacks.TerminateOnNaN) for c in callbacks or ())


class NonFiniteShown:
    """Shows the batch whose update the "skip" policy dropped to the
    callbacks as Keras would: with a NaN `loss`. The policy keeps the weights
    and the epoch's mean finite, but a `TerminateOnNaN` must still see the
    NaN it watches for (and raise, or stop training, as in Keras). Used only
    when one is there: each batch end reads the skip counter.

    Example:

    >>> from keras_dist.training.nonfinite import NonFiniteShown, NonFinitePolicy
    >>> policy = NonFinitePolicy("skip").build()
    >>> shown = NonFiniteShown(policy)
    >>> shown.logs({"loss": 0.5})
    {'loss': 0.5}
    >>> _ = policy.counter.assign_add(1)  # this batch's update was skipped
    >>> shown.logs({"loss": 0.5})
    {'loss': nan}
    """

    def __init__(self, policy):
        self.policy = policy
        self.seen = policy.skipped

    def logs(self, logs):
        """The batch's `logs`, with `loss` NaN if an update was skipped since
        the last call (a new dict then; `logs` itself is left as it is)."""
        skipped = self.policy.skipped
        if skipped > self.seen:
            self.seen = skipped
            return {**(logs or {}), "loss": float("nan")}
        return logs


class _EpochLogs(keras.callbacks.Callback):
    """Adds `skipped_nonfinite` to the epoch logs (once anything was
    skipped in this `fit` call, as the executors do) and keeps the epoch
    for `NonFiniteUpdateError`'s message. First in the callback list, so
    `History` and the progress bar see what it adds."""

    def __init__(self, policy, callbacks):
        super().__init__()
        self.policy, self.callbacks = policy, callbacks
        self.epoch, self.nothing = 0, False
        self.shown = NonFiniteShown(policy) if watches_nonfinite(callbacks) else None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.nothing = False
        self.policy.begin_epoch()

    def on_train_batch_end(self, batch, logs=None):
        shown = False
        if self.shown is not None and logs is not None:
            # First in the list: the callbacks after this one get this dict.
            seen = self.shown.logs(logs)
            shown = seen is not logs
            logs.update(seen)
        # Read at the epoch's last batch (validation reuses the tracker
        # before on_epoch_end), or where a TerminateOnNaN may stop the
        # epoch; Keras may number a short last execution past the end.
        steps = (self.params or {}).get("steps")
        if shown or not steps or batch + 1 >= steps:
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
    NonFinitePolicy(mode)  # checks `mode`
    optimizer = model.optimizer
    if optimizer is None or skips_itself(optimizer):
        try:
            return fit(*args, **kwargs)  # a LossScaleOptimizer decides itself
        except BaseException:
            _end_after_error(kwargs.get("callbacks"))
            raise
    guarded = compiled.cached(model, ("keras_loop", mode), lambda: _Guarded(model, mode))
    policy = guarded.policy
    policy.begin_training()
    callbacks = kwargs.pop("callbacks", None)
    logs = _EpochLogs(policy, callbacks)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks.insert(0, logs)
        logs.set_model(model)
    else:
        callbacks = [logs, *(callbacks or [])]
    # Keras' fit traces `train_function` only when the model has none: the
    # guarded one traced by an earlier `kd.fit` of this compilation is put
    # in, and Keras' own (if any) is put back afterwards for `model.fit`.
    own = model.train_function
    _compat.override(model, train_step=guarded.train_step)
    model.train_function = guarded.train_function
    try:
        with update.intercept_apply(optimizer):
            return fit(*args, callbacks=callbacks, **kwargs)
    except BaseException as error:
        # Keras calls no on_train_end when its fit raises: what keras_dist's
        # callbacks hold past fit (signal handlers, a lock) is let go here.
        try:
            _end_after_error(callbacks)
        finally:
            if isinstance(error, tf.errors.InvalidArgumentError):
                raise_if_nonfinite(error, logs.epoch)
        raise
    finally:
        guarded.train_function = model.train_function
        _compat.drop_override(model, "train_step")
        model.train_function = own


def _end_after_error(callbacks):
    from keras_dist.callbacks import base as replica_cbs  # imports training

    replica_cbs.end_after_error(callbacks)


class _Guarded:
    """What `keras_loop` keeps per model, compilation and mode
    (`compiled.cached`): the policy with its skip counter, the model's
    `train_step` under the policy, and the `train_function` Keras traced
    from it, so a second `kd.fit` traces nothing again, as a second
    `model.fit` does not."""

    def __init__(self, model, mode):
        self.policy = policy = NonFinitePolicy(mode).build()
        optimizer = model.optimizer
        original_step = model.train_step

        def hook(original, grads, variables):
            return policy.apply(original, grads, variables, optimizer=optimizer)

        def train_step(data):
            with update.apply_hook(hook), finite_loss_only(model, mode):
                return original_step(data)

        self.train_step = train_step
        self.train_function = None
