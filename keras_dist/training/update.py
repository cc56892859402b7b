"""One model update, as keras_dist's executors apply it.

A Keras `train_step` ends with `self.optimizer.apply(grads, variables)` (or
`apply_gradients`, which calls it). keras_dist's executors run the model's
own `train_step` and take over exactly that call, for the step they are
tracing, to add what distributed training needs around the optimizer:

- `intercept_apply(optimizer)` routes `optimizer.apply` through a hook set
  per thread (MirroredStrategy traces each replica in its own thread) while
  a step function is traced; without a hook the optimizer's own `apply`
  runs.
- `UpdateInfo` is the data of one asynchronous update -- its staleness, the
  weights the worker pulled, the worker -- handed to staleness-aware
  optimizers (`keras_dist.optimizers`) as an argument, or through
  `providing(info)` across optimizers that do not forward it (Keras'
  `LossScaleOptimizer`).
- `NonFinitePolicy` skips (and counts) or refuses updates whose gradients
  are not finite, in the manner of optax's `apply_if_finite`; both executors
  use it.
- `global_gradient_apply` gives synchronous replicas Keras' one-device
  semantics: gradient clipping on the global gradient, and the loss of a
  batch split unevenly over replicas averaged over the global batch.
"""

import contextlib
import dataclasses
import threading
from typing import Any, Optional

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)

MODES = ("skip", "raise")

_hooks = threading.local()


# ------------------------------------------------------------ interception
@contextlib.contextmanager
def intercept_apply(optimizer):
    """Routes `optimizer.apply` through the calling thread's hook, if any.

    Keras' `apply_gradients` calls `self.apply`, and an instance attribute is
    found before the class's method, so both are covered. The dispatcher is
    only there inside this block (while a step function is traced).
    """
    if optimizer is None:
        yield
        return
    original = type(optimizer).apply.__get__(optimizer)

    def apply(grads, trainable_variables=None):
        hook = getattr(_hooks, "apply", None)
        if hook is None:
            return original(grads, trainable_variables)
        return hook(original, list(grads), trainable_variables)

    optimizer.__dict__["apply"] = apply
    try:
        yield
    finally:
        optimizer.__dict__.pop("apply", None)


@contextlib.contextmanager
def atomic_iterations(optimizer):
    """Makes each optimizer's step counter (`iterations`) count atomically.

    Keras increments `iterations` with `Variable.assign_add`, which is a
    read followed by a write: on a parameter server shared by workers that
    loses increments (two workers read 5 and both write 6) and costs two
    transfers in a row. In the block (while an asynchronous step is traced)
    it is TF's atomic `assign_add` on the variable itself: one transfer, no
    lost count. A chain with a `LossScaleOptimizer` (which updates its
    state in `keras.StatelessScope`s) is left as it is.
    """
    patched = []
    if not any(skips_itself(o) for o in optimizer_chain(optimizer)):
        for o in optimizer_chain(optimizer):
            counter = getattr(o, "iterations", None)
            if counter is None or "assign_add" in counter.__dict__:
                continue

            def assign_add(value, counter=counter):
                return counter.value.assign_add(tf.cast(value, counter.value.dtype))

            counter.__dict__["assign_add"] = assign_add
            patched.append(counter)
    try:
        yield
    finally:
        for counter in patched:
            counter.__dict__.pop("assign_add", None)


def gateable(optimizer):
    """Whether a skipped update can be gated by data alone (`gated_writes`):
    one of Keras' built-in optimizers, whose every state write goes through
    its `assign` / `assign_add` / `assign_sub` methods and `iterations`
    (not with weight decay, EMA or gradient accumulation, which write
    variables directly; not a wrapper or a `LossScaleOptimizer`)."""
    return (isinstance(optimizer, keras.optimizers.Optimizer)
            and type(optimizer).__module__.startswith("keras.")
            and not skips_itself(optimizer)
            and getattr(optimizer, "inner_optimizer", None) is None
            and not getattr(optimizer, "weight_decay", None)
            and not getattr(optimizer, "use_ema", False)
            and not getattr(optimizer, "gradient_accumulation_steps", None))


@contextlib.contextmanager
def gated_writes(optimizer, keep):
    """Makes the optimizer's state writes no-ops where `keep` is false.

    While an update is traced in the block, `assign_add` / `assign_sub` add
    zero and `assign` writes the old value back when the bool tensor `keep`
    is false (`tf.where`, so a NaN in the discarded value goes nowhere), and
    `iterations` counts `keep`. A skipped update then leaves weights, slots
    and the step count exactly as they were, without a conditional around
    remote ops: under parameter servers each op of a conditional branch
    costs a control edge between hosts.
    """
    original = {name: getattr(type(optimizer), name).__get__(optimizer)
                for name in ("assign", "assign_add", "assign_sub")}

    def gate(value, otherwise):
        if isinstance(value, tf.IndexedSlices):
            return tf.IndexedSlices(tf.where(keep, value.values, otherwise(value)),
                                    value.indices, value.dense_shape)
        value = tf.convert_to_tensor(value)
        return tf.where(keep, value, otherwise(value))

    def zeros(value):
        return tf.zeros_like(value.values if isinstance(value, tf.IndexedSlices) else value)

    def assign(variable, value):
        def old(value):
            # A keras.Variable's value; a tf.Variable (what Keras' TF optimizer
            # hands update_step: Ftrl assigns its variable) is read as it is
            # (its `.value` is a method).
            current = variable.value if isinstance(variable, keras.Variable) else variable
            if isinstance(value, tf.IndexedSlices):
                if hasattr(current, "sparse_read"):  # only those rows, from each shard
                    return tf.cast(current.sparse_read(value.indices), value.dtype)
                return tf.gather(current, value.indices)
            return tf.cast(current, value.dtype)
        return original["assign"](variable, gate(value, old))

    counter = optimizer.iterations

    def count(value):
        return counter.value.assign_add(tf.cast(keep, counter.value.dtype)
                                        * tf.cast(value, counter.value.dtype))

    optimizer.__dict__.update(
        assign=assign,
        assign_add=lambda variable, value: original["assign_add"](variable, gate(value, zeros)),
        assign_sub=lambda variable, value: original["assign_sub"](variable, gate(value, zeros)))
    had_count = "assign_add" in counter.__dict__
    previous = counter.__dict__.get("assign_add")
    counter.__dict__["assign_add"] = count
    try:
        yield
    finally:
        for name in ("assign", "assign_add", "assign_sub"):
            optimizer.__dict__.pop(name, None)
        if had_count:
            counter.__dict__["assign_add"] = previous
        else:
            counter.__dict__.pop("assign_add", None)


def apply_hook(hook):
    """Sets this thread's hook, `hook(original_apply, grads, variables)`, for
    the block."""
    return _thread_value(_hooks, "apply", hook)


@contextlib.contextmanager
def _thread_value(local, name, value):
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)


# ------------------------------------------------------------- update data
@dataclasses.dataclass(frozen=True)
class UpdateInfo:
    """The data of one asynchronous update, for staleness-aware optimizers.

    Attributes:
        staleness: Integer scalar tensor (or int). Updates other workers
            applied between this step reading the weights and applying its
            own (tau).
        pulled: List of tensors or `None`. The trainable weights exactly as
            the worker read them for this gradient (DC-ASGD, Gap-Aware).
        worker: Integer scalar tensor or `None`. The worker that computed it.

    Example:

    >>> from keras_dist.training.update import UpdateInfo, providing, current_update
    >>> with providing(UpdateInfo(staleness=3)):
    ...     current_update().staleness
    3
    >>> current_update() is None
    True
    """

    staleness: Any
    pulled: Optional[list] = None
    worker: Any = None


_updates = threading.local()


def providing(info):
    """Makes `info` the current update for optimizers applied in the block.

    Used where an optimizer that does not forward `update=` (Keras'
    `LossScaleOptimizer`) sits between the executor and a staleness-aware
    wrapper. The value is per thread and ends with the block.
    """
    return _thread_value(_updates, "info", info)


def current_update():
    """The `UpdateInfo` provided by the enclosing `providing` block, or `None`."""
    return getattr(_updates, "info", None)


# --------------------------------------------------------- non-finite policy
_NONFINITE_MARK = "keras_dist: non-finite gradients (NaN or Inf) in an update"  # no quote: TF escapes it


class NonFiniteUpdateError(FloatingPointError):
    """An update's gradients were NaN or Inf under `nonfinite_updates="raise"`.

    Raised by `keras_dist.fit` and `AsyncModel.fit` (keras_dist's own loops:
    several replicas, parameter servers) in place of TensorFlow's
    `InvalidArgumentError: Graph execution error`, which would bury the cause.
    The weights are those before the failing update.

    Example:

    >>> from keras_dist.training.update import NonFiniteUpdateError
    >>> issubclass(NonFiniteUpdateError, FloatingPointError)
    True
    """


def raise_if_nonfinite(error, epoch):
    """Raises `NonFiniteUpdateError` when TensorFlow's `error` is the "raise"
    policy's check failing in `epoch` (0-based); returns otherwise."""
    if _NONFINITE_MARK in str(getattr(error, "message", error)):
        raise NonFiniteUpdateError(
            f"In epoch {epoch + 1}, an update's gradients are not finite (NaN or "
            "Inf), and nonfinite_updates='raise' stops training there (the weights "
            "are those before that update). Look for NaN or Inf in the inputs or "
            "the loss, or lower the learning rate; to skip such updates and count "
            "them instead, pass nonfinite_updates='skip' to keras_dist.fit or set "
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
    `keras_dist.fit` guards Keras' own loop with it (`keras_dist.training.nonfinite`).

    Args:
        mode: String. `"skip"` or `"raise"`. Defaults to `"skip"`.

    Example:

    >>> from keras_dist.training.update import NonFinitePolicy
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

    def begin_epoch(self):
        self._skipped_before = self.skipped

    def epoch_logs(self):
        """`{"skipped_nonfinite": n}` for the epoch once this `fit` call has
        skipped anything (so a clean run's History is Keras'), else `{}`."""
        skipped = self.skipped - getattr(self, "_skipped_before", 0)
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
            finite = all_finite(grads)
        if self.mode == "raise":
            check = tf.debugging.Assert(finite, [_NONFINITE_MARK])
            with tf.control_dependencies([check]):
                grads = identity_all(grads)
            apply_fn(grads, variables)
            return
        if self._replicated:
            self.counter.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
            apply_if(finite, apply_fn, grads, variables, lambda: tf.constant(False))
            return
        if gate and gateable(optimizer):
            with gated_writes(optimizer, finite):
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


def all_finite(grads):
    """A boolean scalar: whether every gradient is finite."""
    flags = [tf.reduce_all(tf.math.is_finite(_values(g))) for g in grads if g is not None]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


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


# ------------------------------------------------- synchronous global update
def global_gradient_apply(optimizer, examples, policy, synced=None):
    """A sync hook giving replicas Keras' one-device update.

    Each replica's loss is its local mean scaled by 1 / replicas (Keras'
    `scale_loss_for_distribution`); with a batch split unevenly (33 over 2)
    that is not the global mean. The hook rescales each replica's gradient by
    `replicas * local_examples / global_examples`, which makes their sum the
    gradient of the global mean (exact for the default `sum_over_batch_size`
    reduction; the factor is 1 for even splits).

    Keras clips (`clipnorm`, `clipvalue`, `global_clipnorm`) inside `apply`,
    before its own all-reduce, i.e. each replica's share. When any optimizer
    of the chain clips, the hook all-reduces the gradients first and hands
    each replica `global / replicas` with the thresholds divided by the
    number of replicas (`clipping_for_replicas`, around the trace), so the
    clipped sum is the clipped global gradient
    (`clip(g / R, c / R) = clip(g, c) / R`; exact for 2 or 4 replicas,
    within one rounding otherwise).

    The finite check and the global batch size travel in one small
    all-reduce, so every replica takes the same skip decision. It is the
    first point where the replicas meet: when `synced` is a list, the hook
    appends the time that all-reduce returned on this replica (each replica
    reads its own clock, so the time it waited there for the others is
    free of clock differences between hosts).
    """
    def hook(original, grads, variables):
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context is not None else 1
        local_bad = tf.cast(tf.logical_not(all_finite(grads)), tf.float32)
        finite = tf.equal(local_bad, 0.0)
        if replicas > 1:
            local = tf.cast(examples, tf.float32)
            total_examples, total_bad = tf.unstack(context.all_reduce(
                tf.distribute.ReduceOp.SUM, tf.stack([local, local_bad])))
            if synced is not None:
                with tf.control_dependencies([total_examples]):
                    synced.append(tf.timestamp())
            factor = tf.math.divide_no_nan(local * replicas, total_examples)
            grads = scale_gradients(grads, factor)
            finite = tf.equal(total_bad, 0.0)
            if _clips(optimizer):
                grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
                grads = scale_gradients(grads, 1.0 / replicas)
        policy.apply(original, grads, variables, finite=finite, optimizer=optimizer)

    return hook


_CLIP_ARGS = ("clipnorm", "clipvalue", "global_clipnorm")


def _clips(optimizer):
    return any(getattr(o, a, None) for o in optimizer_chain(optimizer) for a in _CLIP_ARGS)


@contextlib.contextmanager
def clipping_for_replicas(optimizer, replicas):
    """Divides the chain's clipping thresholds by `replicas` in the block.

    Wraps the (single-threaded) call that traces a synchronous step, so
    every replica's trace sees the same thresholds; see
    `global_gradient_apply`.
    """
    saved = []
    if replicas > 1 and _clips(optimizer):
        for o in optimizer_chain(optimizer):
            for name in _CLIP_ARGS:
                value = getattr(o, name, None)
                if value:
                    saved.append((o, name, value))
                    setattr(o, name, value / replicas)
    try:
        yield
    finally:
        for o, name, value in saved:
            setattr(o, name, value)


def optimizer_chain(optimizer):
    """`optimizer` and the optimizers it wraps, outermost first."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


def scale_gradients(grads, scale):
    """Multiplies dense and sparse (`IndexedSlices`) gradients by `scale`."""
    out = []
    for g in grads:
        if g is None:
            out.append(None)
        elif isinstance(g, tf.IndexedSlices):
            out.append(tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype),
                                        g.indices, g.dense_shape))
        else:
            out.append(g * tf.cast(scale, g.dtype))
    return out


def home_device(variables):
    """The one device every variable of `variables` lives on, else `None`.

    `None` as well for a `ShardedVariable` (several devices), an empty list,
    or a variable without a device string.

    Example:

    >>> import keras
    >>> from keras_dist.training.update import home_device
    >>> layer = keras.layers.Dense(2)
    >>> layer.build((None, 3))
    >>> home_device(layer.trainable_variables).endswith("CPU:0")
    True
    """
    devices = set()
    for variable in variables:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        try:
            device = value.device
        except (AttributeError, ValueError, NotImplementedError):
            return None
        if not isinstance(device, str) or not device:
            return None
        devices.add(device)
    return devices.pop() if len(devices) == 1 else None


def ship_gradients(grads, device, extra=None):
    """`grads` as tensors on `device`, sent in one transfer per dtype.

    Each gradient consumed on a parameter server is otherwise a transfer of
    its own. Here the dense gradients of each dtype are flattened into one
    vector where they were computed, and split back on `device`, so the
    update's math there reads local tensors. `None`, sparse
    (`IndexedSlices`) and not fully shaped gradients are left as they are.
    `extra`, a float64 vector (a step's report), rides along bit for bit
    in the same transfer.

    Returns:
        `(grads, extra)`, both on `device` (`extra` is `None` without one).

    Example:

    >>> import tensorflow as tf
    >>> from keras_dist.training.update import ship_gradients
    >>> grads = [tf.ones((2, 3)), None, tf.zeros((3,))]
    >>> shipped, extra = ship_gradients(grads, "/CPU:0", tf.constant([0.1], tf.float64))
    >>> [None if g is None else tuple(g.shape) for g in shipped], float(extra[0])
    ([(2, 3), None, (3,)], 0.1)
    """
    groups = {}
    for i, g in enumerate(grads):
        if tf.is_tensor(g) and not isinstance(g, tf.IndexedSlices) \
                and g.shape.is_fully_defined():
            groups.setdefault(g.dtype, []).append(i)
    out, arrived = list(grads), None
    carrier = next((d for d in groups if d.is_floating and 8 % d.size == 0), None)
    if extra is not None and carrier is None:
        with tf.device(device):
            arrived = tf.identity(extra)
    for dtype, indices in groups.items():
        pieces = [tf.reshape(grads[i], [-1]) for i in indices]
        sizes = [grads[i].shape.num_elements() for i in indices]
        if extra is not None and dtype == carrier:  # the float64 bits as `dtype`s
            ratio = 8 // dtype.size
            pieces.append(tf.reshape(tf.bitcast(tf.cast(extra, tf.float64), dtype), [-1]))
            sizes.append(int(extra.shape[0]) * ratio)
        flat = tf.concat(pieces, axis=0)
        with tf.device(device):
            parts = tf.split(flat, sizes)
            for i, part in zip(indices, parts):
                out[i] = tf.reshape(part, grads[i].shape)
            if extra is not None and dtype == carrier:
                bits = parts[-1] if ratio == 1 else tf.reshape(parts[-1], [-1, ratio])
                arrived = tf.bitcast(bits, tf.float64)
    return out, arrived


def identity_all(grads):
    return [None if g is None
            else tf.nest.map_structure(tf.identity, g, expand_composites=True)
            for g in grads]


def _values(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g
