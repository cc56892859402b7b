"""The private TensorFlow and Keras names keras_dist uses, in one place.

Each entry says why there is no public route and where it is used, so that
a new TensorFlow or Keras release that renames one breaks here, in one
function, and not in the middle of a training loop.

Optimizers: Keras 3 keeps the table from a trainable variable to its slots
(`_var_key`, `_get_variable_index`), the list an optimizer was built with,
the weight-decay exclusions and the backend-neutral update methods private;
keras_dist's staleness-aware wrappers (`keras_dist.optimizers`) look up
their own slots with them, `keras_dist.training.stateless` runs Keras'
update rules on tensors with them, and `keras_dist.training.update` swaps
an optimizer's `apply` and state writes while a step is traced.
"""

import contextlib

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)


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
    `optimizers.dana`, `optimizers.dcasgd` and `optimizers.gap_aware`.
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
