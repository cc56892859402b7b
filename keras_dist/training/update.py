"""One model update, as keras_dist's executors apply it.

A Keras `train_step` ends with `self.optimizer.apply(grads, variables)` (or
`apply_gradients`, which calls it). keras_dist's executors run the model's
own `train_step` and take over exactly that call, for the step they are
tracing, to add what distributed training needs around the optimizer:

- `intercept_apply(optimizer)` routes `optimizer.apply` through a hook set
  per thread (MirroredStrategy traces each replica in its own thread) while
  a step function is traced; without a hook the optimizer's own `apply`
  runs.
- `atomic_iterations` and `gated_writes` change, for the length of a trace,
  how an optimizer writes its state (an atomic step count on parameter
  servers; writes that a non-finite update turns into no-ops).
- `UpdateInfo` is the data of one asynchronous update -- its staleness, the
  weights the worker pulled, the worker -- for staleness-aware optimizers
  (`keras_dist.optimizers`). It has one channel: `apply_with(info, apply,
  ...)` applies an update with `info` as the current update, which every
  optimizer of the chain reads with `current_update()`.

What surrounds the update lives beside it: the non-finite policy in
`keras_dist.training.nonfinite`, clipping, scaling and shipping of
gradients in `keras_dist.training.gradients`.
"""

import contextlib
import dataclasses
import threading
from typing import Any, Optional

import keras
import tensorflow as tf

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)

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

    with _compat.instance_methods(optimizer, apply=apply):
        yield


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
    with contextlib.ExitStack() as stack:
        if not any(_scoped_state(o) for o in optimizer_chain(optimizer)):
            for o in optimizer_chain(optimizer):
                counter = getattr(o, "iterations", None)
                if counter is None or _compat.has_instance_method(counter, "assign_add"):
                    continue

                def assign_add(value, counter=counter):
                    return counter.value.assign_add(tf.cast(value, counter.value.dtype))

                stack.enter_context(_compat.instance_methods(counter, assign_add=assign_add))
        yield


def gateable(optimizer):
    """Whether a skipped update can be gated by data alone (`gated_writes`):
    one of Keras' built-in optimizers, whose every state write goes through
    its `assign` / `assign_add` / `assign_sub` methods and `iterations`
    (not with weight decay, EMA or gradient accumulation, which write
    variables directly; not a wrapper or a `LossScaleOptimizer`)."""
    return (isinstance(optimizer, keras.optimizers.Optimizer)
            and type(optimizer).__module__.startswith("keras.")
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

    with _compat.instance_methods(
            optimizer, assign=assign,
            assign_add=lambda variable, value: original["assign_add"](variable, gate(value, zeros)),
            assign_sub=lambda variable, value: original["assign_sub"](variable, gate(value, zeros))), \
            _compat.instance_methods(counter, assign_add=count):
        yield


def _scoped_state(optimizer):
    """A `LossScaleOptimizer`: it writes its own state in `keras.StatelessScope`s."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


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


def optimizer_chain(optimizer):
    """`optimizer` and the optimizers it wraps, outermost first."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


# ------------------------------------------------------------- update data
@dataclasses.dataclass(frozen=True)
class UpdateInfo:
    """The data of one asynchronous update, for staleness-aware optimizers.

    It reaches them through one channel, like optax's `extra_args`: the
    update that `apply_with(info, ...)` applies (or `providing(info)`'s
    block) is the current one, and every optimizer of the chain reads it
    with `current_update()` -- across optimizers that pass nothing on
    (Keras' `LossScaleOptimizer`) too.

    Attributes:
        staleness: Integer scalar tensor (or int). Updates other workers
            applied between this step reading the weights and applying its
            own (tau).
        pulled: List of tensors or `None`. The trainable weights exactly as
            the worker read them for this gradient (DC-ASGD, Gap-Aware).
        worker: Integer scalar tensor or `None`. The worker that computed it.

    Example:

    >>> from keras_dist.training.update import UpdateInfo, apply_with, current_update
    >>> apply_with(UpdateInfo(staleness=3), lambda: current_update().staleness)
    3
    >>> current_update() is None
    True
    """

    staleness: Any
    pulled: Optional[list] = None
    worker: Any = None


_updates = threading.local()


def apply_with(info, apply, *args):
    """Returns `apply(*args)`, run with `info` as the current update.

    The one way an update's data reaches optimizers: every caller that
    applies an update with an `UpdateInfo` -- the asynchronous step on the
    workers, a push of local steps, each local step, `keras_dist.simulate`,
    a wrapper handing the update to the optimizer it wraps -- calls
    `apply_with(info, optimizer.apply, grads, variables)` (or
    `stateless_apply`), whatever the optimizer is. `info` may be `None`
    (no update data).

    Args:
        info: `UpdateInfo` or `None`.
        apply: The function that applies the update.
        *args: Its arguments.
    """
    with providing(info):
        return apply(*args)


def providing(info):
    """Makes `info` the current update in the block (see `apply_with`).

    The value is per thread and ends with the block.
    """
    return _thread_value(_updates, "info", info)


def current_update():
    """The `UpdateInfo` of the update being applied (`apply_with`), or `None`."""
    return getattr(_updates, "info", None)
