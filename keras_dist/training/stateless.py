"""`optimizer.stateless_apply` for Keras optimizers on the TensorFlow backend.

Keras 3's TensorFlow optimizer refuses `stateless_apply` ("incompatible
with tf.distribute"): its updates go through `tf.distribute`'s
`extended.update` on `tf.Variable`s. Local steps on a parameter-server
worker (`keras_dist.training.local_steps`) need exactly that stateless form -- k
steps on tensors, the remote variables untouched -- and there is no public
route to it. For the duration of one call this module gives the optimizer
instance the backend-neutral versions of the few methods the TensorFlow
subclass overrides (taken from the class that defines `stateless_apply`,
Keras' `BaseOptimizer`; the private names go through `keras_dist._compat`),
so Keras' own update rules run unchanged inside a `keras.StatelessScope`.
A staleness-aware wrapper (`keras_dist.optimizers`) has a `stateless_apply`
of its own, over its inner optimizer's (this one), as Keras'
`LossScaleOptimizer` does. A test (tests/test_local_steps.py) checks the
result against the optimizer's stateful `apply` for SGD, momentum,
Nesterov, Adam and AdamW, and tests/test_local_wrappers.py each wrapper's.
"""

import keras

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)


def supports(optimizer):
    """Whether `optimizer` can step on tensors (take local steps): a Keras
    optimizer, or a staleness-aware wrapper around one; not a
    `LossScaleOptimizer`."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return False
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return False
    if _wrapper(optimizer):
        return supports(optimizer.inner_optimizer)
    if getattr(optimizer, "inner_optimizer", None) is not None:
        return False
    return _compat.neutral_optimizer_class(optimizer) is not None


def _wrapper(optimizer):
    """A wrapper with a `stateless_apply` of its own (over its inner
    optimizer's): keras_dist's staleness-aware ones."""
    return (getattr(optimizer, "inner_optimizer", None) is not None
            and type(optimizer).stateless_apply is not keras.optimizers.Optimizer.stateless_apply
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer))


def stateless_apply(optimizer, optimizer_variables, grads, trainable_variables):
    """Keras' `optimizer.stateless_apply`, on the TensorFlow backend.

    Args:
        optimizer: A built Keras optimizer, or a staleness-aware wrapper
            (its own `stateless_apply`; the update's data is the current
            update, `keras_dist.training.update.apply_with`).
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
    if _wrapper(optimizer):
        return optimizer.stateless_apply(list(optimizer_variables), list(grads),
                                         list(trainable_variables))
    base = _compat.neutral_optimizer_class(optimizer)
    if base is None:
        raise TypeError(f"{type(optimizer).__name__} has no backend-neutral stateless_apply.")
    # The slot table's keys are taken outside the scope (the TensorFlow key
    # reads the tf.Variable, which the scope replaces by a tensor).
    with _compat.stateless_variable_keys(optimizer), \
            _compat.instance_methods(optimizer, **_compat.neutral_methods(optimizer)):
        return base.stateless_apply(optimizer, list(optimizer_variables), list(grads),
                                    list(trainable_variables))
