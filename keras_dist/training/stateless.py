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

import keras

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)


def supports(optimizer):
    """Whether `optimizer` can take local steps (a plain Keras optimizer)."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return False
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return False
    if getattr(optimizer, "inner_optimizer", None) is not None:
        return False
    return _compat.neutral_optimizer_class(optimizer) is not None


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
    base = _compat.neutral_optimizer_class(optimizer)
    if base is None:
        raise TypeError(f"{type(optimizer).__name__} has no backend-neutral stateless_apply.")
    # The slot table's keys are taken outside the scope (the TensorFlow key
    # reads the tf.Variable, which the scope replaces by a tensor).
    with _compat.stateless_variable_keys(optimizer), \
            _compat.instance_methods(optimizer, **_compat.neutral_methods(optimizer)):
        return base.stateless_apply(optimizer, list(optimizer_variables), list(grads),
                                    list(trainable_variables))
