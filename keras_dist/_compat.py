"""Every private TensorFlow and Keras name keras_dist uses, and nothing else.

keras_dist keeps to the public APIs of TensorFlow (`tf.distribute.*`, ...) and
Keras (`keras.*`). Where something has no public route, the private name is
used here and only here: the other modules call the small functions below
(tests/test_layout.py checks that no other module imports `keras.src` or
`tensorflow.python`, or reaches for the names listed here). A change in
either library then shows in one file, and tests/test_sharded.py,
tests/test_resume.py, tests/test_inputs.py and tests/test_loop.py exercise
each name against Keras' own results.

Models, variables, strategies, data (each: the name, why there is no public
route, where keras_dist uses it):

- `model._initial_epoch` (`initial_epoch`, `set_initial_epoch`): the epoch a
  restoring callback tells `fit` to start from. Keras' own
  `BackupAndRestore` sets it in `on_train_begin` and Keras' `fit` reads it
  after calling that; nothing public carries it. Set by
  `keras_dist.callbacks.backup` (so that Keras' own loop resumes too),
  read by `keras_dist.training.driver`.
- `model._compile_loss`, `model._compile_metrics`
  (`compiled_loss_and_metrics`, `compiled_loss`, `compiled_metrics`): Keras' compiled loss and metrics
  containers. Keras' symbolic build checks that they are built, and the
  per-output loss trackers of a multi-output model are not among
  `model.metrics`. Read by `keras_dist.training.driver` (the build before
  the first compiled step).
- `Layer._flatten_layers` (`sublayers`): every layer nested in a model.
  `Model.layers` lists one level only. Used by `keras_dist.training.sharded`
  (`prepare`: each `Embedding`).
- `keras.Variable._value` (`backend_variable`, `set_backend_variable`): the
  `tf.Variable` (or `ShardedVariable`) a Keras variable wraps. The public
  `keras.Variable.value` is a tensor read through autocast and any
  `StatelessScope`, not the variable. Used by `keras_dist.training.sharded`
  (is a variable sharded; its shards; one shard of each optimizer slot
  during a per-shard update).
- `tf.__internal__.distribute.ShardedVariable` (`ShardedVariable`): the type
  `ParameterServerStrategy`'s `variable_partitioner` creates; TF exports no
  public name for it. Used by `keras_dist.training.sharded`.
- `tf.__internal__.CompositeTensor`, its `_type_spec`, and TF's composite
  gradient protocol (`__composite_gradient__`, with
  `get_gradient_components` / `replace_gradient_components`)
  (`CompositeHandle`): how `tf.GradientTape` differentiates a source made of
  several variables; there is no public protocol. Used by
  `keras_dist.training.sharded` (a `ShardedVariable`'s gradient `handle`).
- `strategy.extended._create_variable` (`strategy_variable_creator`,
  `set_strategy_variable_creator`): the creator a strategy's scope calls for
  every new variable. `tf.variable_creator_scope` covers one block, not
  every later `strategy.scope()`. Used by `keras_dist.training.sharded`
  (`install`: each new `ShardedVariable` gets its gradient handle).
- The TF optimizer's `_distributed_tf_update_step`
  (`override_distributed_update_step`): where Keras' TensorFlow optimizer
  applies a list of gradients under a strategy; no public hook. And its
  `_trainable_variables_indices`, `_var_key`, `_get_variable_index`
  (`alias_optimizer_variable`): how `update_step` finds a variable's slots.
  Used by `keras_dist.training.sharded` (elementwise optimizers update a
  sharded variable shard by shard, each with its shard of every slot).
- `keras.src.trainers.data_adapters.get_data_adapter` (`keras_data_adapter`):
  Keras' reader of a generator or `keras.utils.PyDataset` (batches, order,
  class weights, workers, epoch hooks); Keras exports no data adapters.
  Unchanged from Keras 3.0 to 3.15. Used by `keras_dist.training.data`.
- `keras.src.backend.compute_output_spec` (`symbolic_call`): runs a
  function on `keras.KerasTensor`s in Keras' symbolic scope, as Keras'
  symbolic build does before its first compiled step (a model's variables,
  its compiled loss's and metrics' state); an overridden `compute_loss` can
  tell that call from training only through this scope. Keras exports
  `Layer.compute_output_spec` for one layer's `call`, nothing for the loss
  and metrics. Used by `keras_dist.training.driver` (`build_for_training`).
- Instance-method swaps (`override`, `overrides`, `drop_override`): a
  method of one TF or Keras object shadowed by an instance attribute,
  written to the instance's `__dict__` so that Keras' attribute tracking
  neither tracks nor saves it, and nothing else (no class) changes. Each
  swap relies on TF or Keras calling that method on that object:
  `strategy.extended.update` / `colocate_vars_with` (Keras' TF optimizer,
  for each slot and update), a `ShardedVariable`'s `handle` / `read_value`
  / `__array__` (`tf.GradientTape`, Keras' saving) and `Embedding.call`
  (Keras' `Layer.__call__`) in `keras_dist.training.sharded`; a loss
  tracker's `update_state` and `model.train_step` (Keras' compiled train
  function) in `keras_dist.training.nonfinite`; `model.evaluate` /
  `model.predict` in `keras_dist.training.api`.

Optimizers: Keras 3 keeps the table from a trainable variable to its slots
(`_var_key`, `_get_variable_index`), the list an optimizer was built with,
the weight-decay exclusions and the backend-neutral update methods private;
keras_dist's staleness-aware wrappers (`keras_dist.optimizers`) look up
their own slots with them, `keras_dist.training.stateless` runs Keras'
update rules on tensors with them, and `keras_dist.training.update` swaps
an optimizer's `apply` and state writes while a step is traced.
"""

import contextlib

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)


# ---- models, variables, strategies, data

def initial_epoch(model):
    """The epoch a restoring callback set for `fit` to start from, or `None`."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model, epoch):
    """Tells `fit` (Keras' own or keras_dist's) to start from `epoch`; `None`
    clears it, so that a later `fit` does not reuse it."""
    model._initial_epoch = epoch


def compiled_loss_and_metrics(model):
    """Keras' compiled loss and metrics containers of `model` (those it has)."""
    return [m for m in (compiled_loss(model), compiled_metrics(model)) if m is not None]


def compiled_loss(model):
    """Keras' compiled loss container of `model`, or `None` (no loss compiled)."""
    return getattr(model, "_compile_loss", None)


def compiled_metrics(model):
    """Keras' compiled metrics container of `model`, or `None`."""
    return getattr(model, "_compile_metrics", None)


def symbolic_call(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on symbolic tensors, in Keras' symbolic scope.

    Inside a name scope: the scratch graph would take the model's name as a
    root scope, which TensorFlow refuses for a name Keras derives from a
    class whose name starts with "_" ("'_my_model' is not a valid root scope
    name"; Keras' own one-device fit first builds inside its traced step,
    never at a root)."""
    from keras.src import backend

    def scoped(*args, **kwargs):
        with tf.name_scope("keras_dist_build"):
            return fn(*args, **kwargs)

    return backend.compute_output_spec(scoped, *args, **kwargs)


def sublayers(model):
    """Every layer nested in `model`, at any depth (not `model` itself)."""
    return model._flatten_layers(include_self=False)


def backend_variable(variable):
    """The TensorFlow variable a `keras.Variable` wraps (anything else as it is)."""
    if isinstance(variable, keras.Variable):
        return getattr(variable, "_value", variable)
    return variable


def set_backend_variable(variable, value):
    """Makes the `keras.Variable` `variable` wrap the TensorFlow variable `value`."""
    variable._value = value


ShardedVariable = tf.__internal__.distribute.ShardedVariable
"""TF's variable split into shards by a `variable_partitioner`."""


class CompositeHandle(tf.__internal__.CompositeTensor):
    """A stand-in `handle` for a variable made of several (a `ShardedVariable`).

    `tf.GradientTape` differentiates it through the subclass's `gradient=`
    (an object with TF's `get_gradient_components(handle)` and
    `replace_gradient_components(handle, grads)`); its type spec, dtype and
    shape are the variable's.
    """

    def __init_subclass__(cls, *, gradient, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__composite_gradient__ = gradient

    def __init__(self, variable):
        self.variable, self.dtype, self.shape = variable, variable.dtype, variable.shape

    @property
    def _type_spec(self):
        return self.variable._type_spec


def strategy_variable_creator(extended):
    """The creator `extended`'s strategy scope calls for each new variable
    (`creator(next_creator, **kwargs)`)."""
    return extended._create_variable


def set_strategy_variable_creator(extended, creator):
    """Has `extended`'s strategy scope create variables with `creator` (this
    strategy object only)."""
    override(extended, _create_variable=creator)


def override_distributed_update_step(optimizer, wrap):
    """Gives one Keras TF `optimizer` the update `wrap(original)`, where
    `original(distribution, grads_and_vars, learning_rate)` is its class's
    and the result takes the same arguments. Returns `False`, changing
    nothing, if the optimizer already has one of its own."""
    name = "_distributed_tf_update_step"
    if overrides(optimizer, name):
        return False
    override(optimizer, **{name: wrap(getattr(type(optimizer), name).__get__(optimizer))})
    return True


def alias_optimizer_variable(optimizer, variable, alias):
    """Makes `optimizer.update_step(grad, alias, ...)` find the slots of
    `variable` (e.g. `alias` is one shard of it)."""
    index = optimizer._get_variable_index(variable)
    optimizer._trainable_variables_indices[optimizer._var_key(alias)] = index


def keras_data_adapter(x, *, class_weight, shuffle):
    """Keras' own data adapter of a generator or `keras.utils.PyDataset`
    (what `keras.Model.fit(x)` reads it with)."""
    from keras.src.trainers import data_adapters

    return data_adapters.get_data_adapter(x, class_weight=class_weight, shuffle=shuffle)


def plain_functional_or_sequential(model):
    """Whether `model`'s class is exactly Keras' `Sequential` or its
    functional model class (what `keras.Model(inputs, outputs)` gives), not
    a subclass of either: a functional-style subclass (`MyModel(inputs,
    outputs)` where `MyModel` subclasses `keras.Model`) is a subclass of the
    functional class, which has no public name (Keras:
    `keras.src.models.functional.Functional`)."""
    from keras.src.models.functional import Functional

    return type(model) in (keras.Sequential, Functional)


def override(obj, **attributes):
    """Shadows methods of one TF or Keras object by instance attributes
    (outside Keras' attribute tracking). Returns `obj`."""
    obj.__dict__.update(attributes)
    return obj


def overrides(obj, name):
    """Whether `obj` has its own `name` (from `override`)."""
    return name in obj.__dict__


def drop_override(obj, *names):
    """Undoes `override` for `names` (the class's methods show again)."""
    for name in names:
        obj.__dict__.pop(name, None)


# ---- optimizers
def built_variables(optimizer):
    """The trainable variables `optimizer` was built with, in build order.

    No public attribute holds them (Keras: `_trainable_variables`). Used by
    `optimizers.base` (`apply` without variables, `stateless_apply`),
    `optimizers.dana` (`master_weights`) and `training.stateless`.
    """
    return optimizer._trainable_variables


def variable_index(optimizer, variable):
    """The position of `variable` among those `optimizer` was built with,
    which indexes its slots (`_get_variable_index`).

    No public slot lookup exists. Used by the wrappers' slots in
    `optimizers.dana`, `optimizers.dcasgd`, `optimizers.gap_aware` and
    `optimizers.delayed_nesterov`.
    """
    return optimizer._get_variable_index(variable)


def uses_weight_decay(optimizer, variable):
    """Whether `optimizer` decays `variable` (`_use_weight_decay`).

    `exclude_from_weight_decay` has a setter only. Used by
    `optimizers.gap_aware` (`scale_weight_decay=True`).
    """
    return optimizer._use_weight_decay(variable)


@contextlib.contextmanager
def instance_methods(obj, **methods):
    """Gives `obj` these methods (instance attributes, found before its
    class's) for the block, and its own back after it.

    Keras has no hook at an optimizer's `apply` or at its state writes
    (`assign`, `assign_add`, ...), and the TensorFlow backend's optimizer
    overrides the backend-neutral methods `stateless_apply` needs. Used by
    `training.update` (`intercept_apply`, `atomic_iterations`,
    `gated_writes`) and `training.stateless`.
    """
    saved = {name: obj.__dict__[name] for name in methods if name in obj.__dict__}
    obj.__dict__.update(methods)
    try:
        yield
    finally:
        for name in methods:
            obj.__dict__.pop(name, None)
        obj.__dict__.update(saved)


def has_instance_method(obj, name):
    """Whether `obj` already has its own `name` (an `instance_methods` block
    of an enclosing trace)."""
    return name in obj.__dict__


@contextlib.contextmanager
def stateless_variable_keys(*optimizers):
    """In the block, each optimizer's slot table (`_var_key`) answers from
    keys taken before it, so its slots, exclusions and indices are found
    inside a `keras.StatelessScope`.

    The TensorFlow backend's `_var_key` reads the `tf.Variable` behind a
    Keras variable, which a `StatelessScope` replaces by a tensor; there is
    no public key. Used by `training.stateless` and by the wrappers'
    `stateless_apply` (`optimizers.base`).
    """
    with contextlib.ExitStack() as stack:
        for optimizer in optimizers:
            keys = {id(v): optimizer._var_key(v) for v in built_variables(optimizer)}
            stack.enter_context(instance_methods(
                optimizer, _var_key=lambda variable, keys=keys: keys[id(variable)]))
        yield


# The TensorFlow optimizer's overrides of these send updates through
# `tf.distribute`; the backend-neutral ones run in a `keras.StatelessScope`.
_NEUTRAL = ("assign", "assign_add", "assign_sub", "_backend_update_step",
            "_apply_weight_decay", "_backend_increment_gradient_accumulators")


def neutral_optimizer_class(optimizer):
    """The most basic class of `optimizer` that defines `stateless_apply`
    and `_backend_update_step` (Keras' `BaseOptimizer`), or `None`.

    The TensorFlow backend's optimizer refuses `stateless_apply`, and no
    public route runs Keras' update rules on tensors. Used by
    `training.stateless`.
    """
    for cls in reversed(type(optimizer).__mro__):
        if "stateless_apply" in cls.__dict__ and "_backend_update_step" in cls.__dict__:
            return cls
    return None


def neutral_methods(optimizer):
    """`instance_methods` arguments: `optimizer`'s methods as its
    `neutral_optimizer_class` defines them (see there). Used by
    `training.stateless`."""
    base = neutral_optimizer_class(optimizer)
    return {name: base.__dict__[name].__get__(optimizer) for name in _NEUTRAL
            if name in base.__dict__}
