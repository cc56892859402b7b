"""`optimizer.stateless_apply` for Keras optimizers on the TensorFlow backend.

Keras 3's TensorFlow optimizer refuses `stateless_apply` ("incompatible
with tf.distribute"): its updates go through `tf.distribute`'s
`extended.update` on `tf.Variable`s. Local steps on a parameter-server
worker (`keras_dist.training.local_steps`) need exactly that stateless form -- k
steps on tensors, the remote variables untouched -- and there is no public
route to it. This module is the one place that reaches into Keras'
optimizer internals, and says so: for the duration of one call it gives
the optimizer instance the backend-neutral versions of the few methods
the TensorFlow subclass overrides (taken from the class that defines
`stateless_apply`, Keras' `BaseOptimizer`), so Keras' own update rules run
unchanged inside a `keras.StatelessScope`. A test (tests/test_local_steps.py)
checks the result against the optimizer's stateful `apply` for SGD,
momentum, Nesterov, Adam and AdamW.
"""

import contextlib

import keras

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)

_NEUTRAL = ("assign", "assign_add", "assign_sub", "_backend_update_step",
            "_apply_weight_decay", "_backend_increment_gradient_accumulators")


def _base_class(optimizer):
    # The most basic class defining stateless_apply (the backend's subclass
    # overrides it to raise).
    for cls in reversed(type(optimizer).__mro__):
        if "stateless_apply" in cls.__dict__ and "_backend_update_step" in cls.__dict__:
            return cls
    raise TypeError(f"{type(optimizer).__name__} has no backend-neutral stateless_apply.")


def supports(optimizer):
    """Whether `optimizer` can take local steps (a plain Keras optimizer)."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return False
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return False
    if getattr(optimizer, "inner_optimizer", None) is not None:
        return False
    try:
        _base_class(optimizer)
    except TypeError:
        return False
    return True


@contextlib.contextmanager
def _neutral(optimizer):
    base = _base_class(optimizer)
    # Keys of the optimizer's slot table, computed outside the scope (the
    # TensorFlow key reads the tf.Variable, which a scope replaces by a tensor).
    keys = {id(v): optimizer._var_key(v) for v in optimizer._trainable_variables}
    patched = {name: base.__dict__[name].__get__(optimizer) for name in _NEUTRAL
               if name in base.__dict__}
    patched["_var_key"] = lambda variable: keys[id(variable)]
    optimizer.__dict__.update(patched)
    try:
        yield
    finally:
        for name in patched:
            optimizer.__dict__.pop(name, None)


def stateless_apply(optimizer, optimizer_variables, grads, trainable_variables):
    """Keras' `optimizer.stateless_apply`, on the TensorFlow backend.

    Args:
        optimizer: A built Keras optimizer (not a wrapper).
        optimizer_variables: Tensors, one per `optimizer.variables`.
        grads: Gradient tensors, one per trainable variable it was built with.
        trainable_variables: Tensors, the current trainable values.

    Returns:
        `(new trainable values, new optimizer values)`, lists of tensors; an
        entry the step did not change is the input tensor itself.

    Example:

    >>> import keras, tensorflow as tf
    >>> from keras_dist.training.stateless import stateless_apply
    >>> w = keras.Variable([1.0, 2.0])
    >>> opt = keras.optimizers.SGD(0.5)
    >>> opt.build([w])
    >>> new_w, _ = stateless_apply(opt, [v.value for v in opt.variables],
    ...                            [tf.constant([1.0, 1.0])], [w.value])
    >>> new_w[0].numpy().tolist(), w.numpy().tolist()
    ([0.5, 1.5], [1.0, 2.0])
    """
    base = _base_class(optimizer)
    with _neutral(optimizer):
        return base.stateless_apply(optimizer, list(optimizer_variables), list(grads),
                                    list(trainable_variables))
