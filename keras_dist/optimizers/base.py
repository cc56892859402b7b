"""`StalenessAwareOptimizer`: the base of keras_dist's optimizer wrappers.

A wrapper holds an `inner_optimizer` (any Keras optimizer, or another
wrapper) and forwards everything to it, in the manner of Keras'
`LossScaleOptimizer`. Before handing the gradients on it transforms them with
the staleness tau of the update and, for the wrappers that need it, the exact
weights the worker read for this gradient ("pulled" weights).

Both come as the data of the update, a `keras_dist.training.update.UpdateInfo`,
through one channel: whoever applies the update (the asynchronous executor,
local steps, `keras_dist.simulate`) calls
`keras_dist.training.update.apply_with(info, optimizer.apply, grads, variables)`,
and every wrapper of the chain reads it with `update.current_update()`, with
a `LossScaleOptimizer` (mixed precision), which passes nothing on, outside
it too. `wrapper.apply(grads, variables, update=info)` is the same, for one
call. Outside asynchronous training the staleness is unknown: the wrapper
warns once and behaves exactly as its inner optimizer.

A wrapper also steps on tensors, `stateless_apply` over its inner
optimizer's (as Keras' `LossScaleOptimizer`): what each local step on a
worker's copy runs (`keras_dist.training.local_steps`). So that one
`transform` serves both, a wrapper writes its own state with `write`, `add`
and `write_rows`, which are TensorFlow's ops on the variable, or the
`keras.StatelessScope`'s new values.

Base-optimizer arguments (`clipnorm`, `use_ema`, `weight_decay`, ...)
belong to the inner optimizer, which applies the update; a wrapper refuses
them with an error that says so, as Keras' `LossScaleOptimizer` does.
"""

import dataclasses
import warnings

import keras
import tensorflow as tf

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import gradients
from keras_dist.training import nonfinite
from keras_dist.training import update as update_lib

BASE_OPTIMIZER_ARGUMENTS = (
    "learning_rate", "weight_decay", "clipnorm", "clipvalue", "global_clipnorm",
    "use_ema", "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
    "gradient_accumulation_steps")


class StalenessAwareOptimizer(keras.optimizers.Optimizer):
    """Base class: wraps an optimizer and transforms gradients by staleness.

    Subclasses implement `transform(grads, variables, update)`, where
    `update` is the update's `UpdateInfo` (its `staleness` a float32
    tensor), returning the gradients to apply and a boolean tensor (or
    `None`) saying whether to apply them at all. With staleness 0 every
    subclass must return the gradients unchanged. `map_gradients` walks the
    gradients with each one's slot index; state is written with `write` /
    `add` / `write_rows`, so that `stateless_apply` runs the same
    `transform`.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` (or another wrapper).
            It applies the transformed update, with its own clipping, EMA,
            weight decay and gradient accumulation.
        name: String. Defaults to the class name in snake case.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.DynSGD(keras.optimizers.SGD(0.5))
    >>> opt.inner_optimizer.__class__.__name__, float(opt.learning_rate)
    ('SGD', 0.5)

    Raises:
        TypeError: if `inner_optimizer` is not a Keras optimizer.
        ValueError: for a base-optimizer argument (`clipnorm`, `use_ema`,
            ...): pass it to the inner optimizer.
    """

    needs_pulled_weights = False
    """Whether `transform` uses the weights the worker read (DC-ASGD, Gap-Aware):
    the executor reads them only then."""

    pulled_weights_for = None
    """Why it needs them, for the error without them (`check_pulled`)."""

    needs_worker = False
    """Whether `transform` uses the update's worker (DANA): it keeps state per
    worker, for `workers` of them."""

    sized_by_workers = False
    """Whether its `workers` attribute (`None`: the cluster's, when built) sizes
    its state or its rule (DANA, DelayAdaptive); `simulate.fit` sets it to
    the simulated N."""

    family = None
    """Wrappers of one family (e.g. "scaling") must not be nested in each other."""

    def __init__(self, inner_optimizer, name=None, **kwargs):
        wrapper = type(self).__name__
        given = sorted(k for k in kwargs if k in BASE_OPTIMIZER_ARGUMENTS)
        if given:
            received = ", ".join(f"{k}={kwargs[k]!r}" for k in given)
            raise ValueError(
                f"{wrapper} does not take base-optimizer arguments; the inner optimizer "
                "applies the update. Pass them to it instead, e.g. "
                f"{wrapper}(keras.optimizers.SGD(0.01, {given[0]}=...)). "
                f"Received: {received}.")
        if kwargs:
            raise TypeError(f"{wrapper} got unexpected arguments: {sorted(kwargs)}.")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"{wrapper} wraps a Keras optimizer, e.g. "
                            f"{wrapper}(keras.optimizers.SGD(0.01)). Received: "
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
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self._warned = False

    # ------------------------------------------------------------ forwarding
    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        self._build_counters()
        self.build_state(var_list)
        super().build(var_list)

    @property
    def variables(self):
        """The wrapper's own variables, then its inner optimizer's."""
        return self.own_variables + self.inner_optimizer.variables

    @property
    def own_variables(self):
        """The wrapper's own variables (its state and counters)."""
        return list(super().variables)

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
    def apply(self, grads, trainable_variables=None, update=None):
        """Transforms `grads` by the update's staleness, then applies them
        with the inner optimizer.

        Args:
            grads: List of gradient tensors.
            trainable_variables: List of variables, or `None` for those the
                optimizer was built with.
            update: `keras_dist.training.update.UpdateInfo`, or `None` for the
                current update (`keras_dist.training.update.apply_with`); none
                at all outside asynchronous training.
        """
        if update is not None:
            return update_lib.apply_with(update, self.apply, grads, trainable_variables)
        if not self.built:
            with tf.name_scope(self.name):
                self.build(trainable_variables)
            self.built = True
        update = update_lib.current_update()
        if update is None:
            self._warn_unknown_staleness()
            return self.inner_optimizer.apply(grads, trainable_variables)
        variables = trainable_variables or _compat.built_variables(self)
        new_grads, keep, after = self._transform(grads, variables, update)

        def apply_inner(grads, variables):
            update_lib.apply_with(update, self.inner_optimizer.apply, grads, variables)
            for variable, delta in after:
                variable.assign_add(delta)

        if keep is None:
            apply_inner(new_grads, trainable_variables)
            return None
        nonfinite.apply_if(keep, apply_inner, new_grads, trainable_variables,
                           lambda: _dropped(self))
        return None

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """`apply` on tensors: Keras' stateless form (see
        `keras.optimizers.Optimizer.stateless_apply`), over the inner
        optimizer's, as Keras' `LossScaleOptimizer` implements it.

        The update's data is the current update
        (`keras_dist.training.update.apply_with`); local steps give each
        step on a worker's copy staleness 0 (nothing else writes the copy).

        Args:
            optimizer_variables: Tensors, one per `self.variables` (the
                wrapper's own, then its inner optimizer's).
            grads: Gradient tensors, one per variable it was built with.
            trainable_variables: Tensors, the current trainable values.

        Returns:
            `(new trainable values, new optimizer values)`, lists of tensors;
            an entry the step did not change is the input tensor itself.
        """
        from keras_dist.training import stateless

        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be built (its "
                "variables created): call `optimizer.build(trainable_variables)`.")
        own_variables = self.own_variables
        optimizer_variables = list(optimizer_variables)
        own = optimizer_variables[:len(own_variables)]
        inner = optimizer_variables[len(own_variables):]
        update = update_lib.current_update()
        if update is None:
            self._warn_unknown_staleness()
            new_values, new_inner = stateless.stateless_apply(
                self.inner_optimizer, inner, grads, trainable_variables)
            return new_values, own + list(new_inner)
        variables = _compat.built_variables(self)
        mapping = (list(zip(variables, trainable_variables))
                   + list(zip(self.variables, optimizer_variables)))
        # The slot table's keys are taken before the scope replaces the variables.
        with _compat.stateless_variable_keys(*_chain(self)), \
                keras.StatelessScope(state_mapping=mapping) as scope:
            new_grads, keep, after = self._transform(grads, variables, update)
            gated = keep is not None and not _always(keep)
            if gated:
                add(self._dropped, tf.cast(tf.logical_not(keep), tf.float32))
        new_own = [scope.get_current_value(v) for v in own_variables]
        new_values, new_inner = update_lib.apply_with(
            update, stateless.stateless_apply, self.inner_optimizer, inner, new_grads,
            trainable_variables)
        new_values, new_inner = list(new_values), list(new_inner)
        index = {id(v): i for i, v in enumerate(variables)}
        for variable, delta in after:
            i = index[id(variable)]
            new_values[i] = new_values[i] + delta
        if gated:  # a dropped update changes nothing but the count of drops
            new_values = [tf.where(keep, new, old)
                          for new, old in zip(new_values, trainable_variables)]
            new_inner = [tf.where(keep, new, old) for new, old in zip(new_inner, inner)]
        return new_values, new_own + new_inner

    def _transform(self, grads, variables, update):
        """`transform`, and what to add to which weights once the inner
        optimizer has applied the update (`add_after_update`)."""
        if self.needs_pulled_weights:
            check_pulled(type(self).__name__, self.pulled_weights_for, update.pulled,
                         variables)
        after = []
        # Set past Keras' (and TensorFlow's) attribute tracking, which would
        # add the model's variables in the list to the optimizer's own.
        object.__setattr__(self, "_after_update", after)
        try:
            new_grads, keep = self.transform(list(grads), list(variables),
                                             _float_staleness(update))
            return new_grads, keep, after
        finally:
            object.__setattr__(self, "_after_update", None)

    def add_after_update(self, variable, delta):
        """From `transform`: adds `delta` to the trainable `variable` once the
        inner optimizer has applied this update (GapAware's weight decay)."""
        self._after_update.append((variable, delta))

    unknown_staleness_means = None
    """What the wrapper does without an update's staleness, for the warning
    (default: exactly its inner optimizer)."""

    def _warn_unknown_staleness(self):
        if self._warned:
            return
        means = self.unknown_staleness_means or (
            f"it behaves exactly as its inner {type(self.inner_optimizer).__name__}")
        warnings.warn(
            f"{type(self).__name__}: the staleness of this update is unknown (not "
            f"asynchronous parameter-server training), so {means}.", stacklevel=3)
        self._warned = True

    def transform(self, grads, variables, update):
        """Returns `(grads, keep)`; `keep` is a bool tensor or `None` (always).

        `update` is the update's `UpdateInfo`, its `staleness` a float32 tensor.
        """
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
        return [add(self._scale_sum, tf.cast(scale, tf.float32)),
                add(self._scale_count, 1.0)]

    def map_gradients(self, fn, grads, variables, pulled=None):
        """The gradients `fn` makes of each one but `None` (left as it is),
        with the mean of the scales it gives recorded (`record_mean`).

        `fn(g, variable, i, w_pulled)` gets the gradient as a tensor, its
        variable, the variable's index among those the optimizer was built
        with (its slots' index) and its pulled weight (`None` without
        `pulled`), and returns `(new gradient, scale for the logs or None)`.
        """
        out, scales = [], []
        for g, variable, w_pulled in zip(grads, variables, pulled or [None] * len(grads)):
            if g is None:
                out.append(None)
                continue
            new, scale = fn(tf.convert_to_tensor(g), variable,
                            _compat.variable_index(self, variable), w_pulled)
            out.append(new)
            if scale is not None:
                scales.append(scale)
        self.record_mean(scales)
        return out

    def record_mean(self, scales):
        """`record_scale` of the mean of `scales` (scalar tensors, one per
        gradient); nothing without any."""
        if scales:
            self.record_scale(tf.reduce_mean(tf.stack(scales)))

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
    config_fields = ()
    """The constructor's own arguments that `get_config` saves, each kept in
    the attribute of its name."""

    def get_config(self):
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                **{field: getattr(self, field) for field in self.config_fields}}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


class StalenessScaling(StalenessAwareOptimizer):
    """A wrapper that multiplies every gradient by one scale, a function of
    the update's staleness (subclasses implement `scale(staleness)`, 1 at
    staleness 0); the epoch logs get its mean (`<name>_scale_mean`).

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` that applies the
            scaled gradients.
        name: String. Defaults to the class's `default_name`.
    """

    family = "scaling"
    default_name = None

    def __init__(self, inner_optimizer, name=None, **kwargs):
        super().__init__(inner_optimizer, name=name or self.default_name, **kwargs)

    def scale(self, staleness):
        """The scale of an update of `staleness` (a float32 tensor)."""
        raise NotImplementedError

    def transform(self, grads, variables, update):
        scale = self.scale(update.staleness)
        self.record_scale(scale)
        return gradients.scale_gradients(grads, scale), None


def check_pulled(name, why, pulled, variables):
    """Refuses an update without the weights its gradients were computed on
    (one per variable), which `name`'s rule needs (`why`)."""
    if pulled is None or len(pulled) != len(variables):
        received = "pulled=None" if pulled is None else f"{len(pulled)} pulled weights"
        raise ValueError(
            f"{name} {why}, so each update needs the weights its gradients were computed "
            "on, one per variable: apply(grads, variables, update=UpdateInfo("
            "staleness=..., pulled=[...])). AsyncModel and keras_dist.simulate pass them. "
            f"Received: {received} for {len(variables)} variables.")


def check_workers(workers, name="workers"):
    """Refuses a worker count that is not an integer >= 1 or `None`."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ValueError(f"`{name}` must be an integer >= 1 or None. Received: "
                         f"{name}={workers!r}.")


def workers_of_strategy(owner, argument="workers"):
    """The number of workers of the current strategy's cluster under a
    `ParameterServerStrategy` (the cluster keras_dist built the strategy for);
    1 under any other strategy. `owner` and `argument` name who asks, for
    the error when the count is unknown."""
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        return 1
    from keras_dist.cluster.strategy import cluster_of
    from keras_dist.training.plan import workers_of

    count = workers_of(cluster_of(strategy))
    if not count:
        raise ValueError(
            f"{owner}({argument}=None) takes the number of workers from the cluster "
            "description (TF_CONFIG or SLURM) the parameter-server strategy was built from, "
            "and this strategy was not built by keras_dist from one. Pass "
            f"{argument}=N, the number of worker tasks.")
    return count


def staleness_aware_in(optimizer):
    """The outermost `StalenessAwareOptimizer` in an optimizer chain, or `None`."""
    for candidate in _chain(optimizer):
        if isinstance(candidate, StalenessAwareOptimizer):
            return candidate
    return None


_chain = update_lib.optimizer_chain


def write(variable, value):
    """Assigns `value` to a wrapper's state `variable`; returns the new value.

    TensorFlow's `assign` on the variable itself, or, in a
    `keras.StatelessScope` (`stateless_apply`), the scope's new value.
    """
    current = variable.value
    if hasattr(current, "assign"):
        return current.assign(value)
    return variable.assign(value)


def add(variable, delta):
    """Adds `delta` to a wrapper's state `variable`; returns the new value.

    TensorFlow's atomic `assign_add` on the variable itself (on a parameter
    server: no lost count, one transfer), or, in a `keras.StatelessScope`
    (`stateless_apply`), the scope's new value.
    """
    current = variable.value
    if hasattr(current, "assign_add"):
        return current.assign_add(delta)
    return variable.assign(current + delta)


def write_rows(variable, indices, rows):
    """Writes `rows` (one per index of the int32 vector `indices`) into a
    wrapper's state `variable` along its first axis, as `write` does."""
    current = variable.value
    if hasattr(current, "scatter_update"):
        return current.scatter_update(tf.IndexedSlices(rows, indices))
    return variable.assign(tf.tensor_scatter_nd_update(current, indices[:, None], rows))


def _always(keep):
    """Whether the bool tensor `keep` is known to be true when traced."""
    static = tf.get_static_value(keep)
    return static is not None and bool(static)


def _float_staleness(update):
    return dataclasses.replace(update, staleness=tf.cast(update.staleness, tf.float32))


def _dropped(wrapper):
    add(wrapper._dropped, 1.0)
    return tf.constant(False)


def _snake(name):
    out = ""
    for i, ch in enumerate(name):
        if ch.isupper() and i and not name[i - 1].isupper():
            out += "_"
        out += ch.lower()
    return out
