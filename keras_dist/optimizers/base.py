"""`StalenessAwareOptimizer`: the base of keras_dist's optimizer wrappers.

A wrapper holds an `inner_optimizer` (any Keras optimizer, or another
wrapper) and forwards everything to it, in the manner of Keras'
`LossScaleOptimizer`. Before handing the gradients on it transforms them with
the staleness tau of the update and, for the wrappers that need it, the exact
weights the worker read for this gradient ("pulled" weights).

`AsyncModel` passes both in: it calls `set_pending(tau, pulled)` on the
staleness-aware optimizer of the chain just before applying the update, so
the wrapper works whether it is the outermost optimizer or sits inside a
`LossScaleOptimizer` (mixed precision). Outside asynchronous training the
staleness is unknown: the wrapper warns once and behaves exactly as its
inner optimizer.
"""

import warnings

import keras
import tensorflow as tf


class StalenessAwareOptimizer(keras.optimizers.Optimizer):
    """Base class: wraps an optimizer and transforms gradients by staleness.

    Subclasses implement `transform(grads, variables, staleness, pulled)`,
    returning the gradients to apply and a boolean tensor (or `None`) saying
    whether to apply them at all. With staleness 0 every subclass must
    return the gradients unchanged.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` (or another wrapper).
        name: String. Defaults to the class name in snake case.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.DynSGD(keras.optimizers.SGD(0.5))
    >>> opt.inner_optimizer.__class__.__name__, float(opt.learning_rate)
    ('SGD', 0.5)

    Raises:
        TypeError: if `inner_optimizer` is not a Keras optimizer.
    """

    needs_pulled_weights = False
    """Whether `transform` uses the weights the worker read (DC-ASGD, Gap-Aware)."""

    family = None
    """Wrappers of one family (e.g. "scaling") must not be nested in each other."""

    def __init__(self, inner_optimizer, name=None, **kwargs):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a Keras optimizer, e.g. "
                f"{type(self).__name__}(keras.optimizers.SGD(0.01)). Received: "
                f"inner_optimizer={inner_optimizer!r} of type "
                f"{type(inner_optimizer).__name__}.")
        for inner in _chain(inner_optimizer):
            if isinstance(inner, StalenessAwareOptimizer) and self.family and (
                    inner.family == self.family):
                raise ValueError(
                    f"{type(self).__name__} cannot wrap {type(inner).__name__}: both "
                    f"correct for staleness by {self.family}, so nesting them would "
                    "apply the correction twice. Use one of them.")
        if any(isinstance(o, keras.optimizers.LossScaleOptimizer)
               for o in _chain(inner_optimizer)):
            raise ValueError(
                f"{type(self).__name__} wraps a LossScaleOptimizer. Wrap the other way "
                f"round: LossScaleOptimizer({type(self).__name__}(...)). Under a "
                "mixed_float16 policy, pass just "
                f"{type(self).__name__}(...): Keras' compile adds the LossScaleOptimizer "
                "outside it (inside, the loss would be scaled twice, and DCASGD / "
                "GapAware would see scaled gradients).")
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self.inner_optimizer = inner_optimizer
        self._pending = None
        self._warned = False

    # ------------------------------------------------------------ forwarding
    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        self._build_counters()
        self.build_state(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------------ the update
    def set_pending(self, staleness, pulled=None):
        """Staleness (and pulled weights) of the update about to be applied."""
        self._pending = (staleness, pulled)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with tf.name_scope(self.name):
                self.build(trainable_variables)
            self.built = True
        pending, self._pending = self._pending, None
        if pending is None:
            if not self._warned:
                warnings.warn(
                    f"{type(self).__name__}: the staleness of this update is unknown "
                    "(not asynchronous parameter-server training), so it behaves "
                    f"exactly as its inner {type(self.inner_optimizer).__name__}.",
                    stacklevel=2)
                self._warned = True
            return self.inner_optimizer.apply(grads, trainable_variables)
        staleness, pulled = pending
        staleness = tf.cast(staleness, tf.float32)
        variables = trainable_variables or self._trainable_variables
        new_grads, keep = self.transform(list(grads), list(variables), staleness, pulled)
        inner = self.inner_optimizer
        if isinstance(inner, StalenessAwareOptimizer):
            inner.set_pending(pending[0], pulled)
        if keep is None:
            return inner.apply(new_grads, trainable_variables)
        apply_if(keep, inner, new_grads, trainable_variables, lambda: _dropped(self))
        if isinstance(inner, StalenessAwareOptimizer):
            inner._pending = None  # a dropped update leaves nothing pending
        return None

    def transform(self, grads, variables, staleness, pulled):
        """Returns `(grads, keep)`; `keep` is a bool tensor or `None` (always)."""
        raise NotImplementedError

    # ---------------------------------------------------------- bookkeeping
    def build_state(self, var_list):
        """Creates the subclass's own state (override; default: none)."""

    def _build_counters(self):
        self._scale_sum = self._scalar("scale_sum")
        self._scale_count = self._scalar("scale_count")
        self._dropped = self._scalar("dropped")

    def _scalar(self, name):
        return self.add_variable(shape=(), initializer="zeros", dtype="float32",
                                 aggregation="none", name=name)

    def record_scale(self, scale):
        """Adds one update's mean applied scale / penalty to the epoch logs."""
        return [self._scale_sum.value.assign_add(tf.cast(scale, tf.float32)),
                self._scale_count.value.assign_add(1.0)]

    def staleness_logs(self):
        """This wrapper's (and inner wrappers') epoch numbers, for the logs."""
        logs = {}
        prefix = _snake(type(self).__name__)
        count = float(self._scale_count.numpy()) if self.built else 0.0
        if count:
            logs[f"{prefix}_scale_mean"] = float(self._scale_sum.numpy()) / count
        if self.built and type(self).count_drops:
            logs["dropped_updates"] = int(self._dropped.numpy())
        if isinstance(self.inner_optimizer, StalenessAwareOptimizer):
            logs.update(self.inner_optimizer.staleness_logs())
        return logs

    count_drops = False

    def reset_staleness_logs(self):
        if self.built:
            for variable in (self._scale_sum, self._scale_count, self._dropped):
                variable.assign(0.0)
        if isinstance(self.inner_optimizer, StalenessAwareOptimizer):
            self.inner_optimizer.reset_staleness_logs()

    # ---------------------------------------------------------- serialization
    def get_config(self):
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


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


def staleness_aware_in(optimizer):
    """The outermost `StalenessAwareOptimizer` in an optimizer chain, or `None`."""
    for candidate in _chain(optimizer):
        if isinstance(candidate, StalenessAwareOptimizer):
            return candidate
    return None


def _chain(optimizer):
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


def apply_if(keep, optimizer, grads, variables, on_skip):
    """Applies `grads` with `optimizer` when the bool tensor `keep` is true,
    else runs `on_skip` (which returns a bool tensor).

    An optimizer's apply synchronizes through `merge_call`, which may not sit
    inside a `cond` in replica context; under a strategy the decision is
    therefore taken in cross-replica context (the construction Keras'
    `LossScaleOptimizer` uses).
    """
    context = tf.distribute.get_replica_context()
    if not tf.distribute.has_strategy() or context is None:
        tf.cond(keep, lambda: _applied(optimizer, grads, variables), on_skip)
        return

    def decide(distribution, keep, grads, variables):
        keep = distribution.experimental_local_results(keep)[0]

        def apply_fn():
            distribution.extended.call_for_each_replica(
                _applied, args=(optimizer, grads, variables))
            return tf.constant(True)

        return tf.cond(keep, apply_fn, on_skip)

    context.merge_call(decide, args=(keep, grads, variables))


def _applied(inner, grads, variables):
    inner.apply(grads, variables)
    return tf.constant(True)


def _dropped(wrapper):
    wrapper._dropped.value.assign_add(1.0)
    return tf.constant(False)


def _snake(name):
    out = ""
    for i, ch in enumerate(name):
        if ch.isupper() and i and not name[i - 1].isupper():
            out += "_"
        out += ch.lower()
    return out
