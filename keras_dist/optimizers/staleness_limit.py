"""`StalenessLimit`: drop updates that are too stale (bounded staleness)."""

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessAwareOptimizer


@keras.saving.register_keras_serializable(package="keras_dist")
class StalenessLimit(StalenessAwareOptimizer):
    """Drops every update whose staleness exceeds `max_staleness`.

    Bounded staleness: an update computed more than `max_staleness` versions
    ago is not applied at all (the inner optimizer does not see it, so its
    momentum and step count are untouched). Dropped updates are counted and
    reported as `dropped_updates` in the epoch logs. A common choice is
    `max_staleness = 2 * num_workers`.

    It composes with the scaling wrappers in either order, e.g.
    `StalenessLimit(DynSGD(keras.optimizers.SGD(0.1)), max_staleness=8)`
    drops the stalest updates and damps the rest.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` (or another wrapper)
            that applies the updates that are kept.
        max_staleness: Integer >= 0. Largest tau still applied.
        name: String. Defaults to `"staleness_limit"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.StalenessLimit(keras.optimizers.SGD(0.1), max_staleness=4)
    >>> opt.max_staleness
    4

    Raises:
        ValueError: if `max_staleness` is negative or not an integer.
    """

    family = "limit"
    config_fields = ("max_staleness",)
    count_drops = True

    def __init__(self, inner_optimizer, max_staleness, name="staleness_limit", **kwargs):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or (
                max_staleness < 0):
            raise ValueError(
                "`max_staleness` must be an integer >= 0 (updates with a larger tau "
                f"are dropped). Received: max_staleness={max_staleness!r}.")
        super().__init__(inner_optimizer, name=name, **kwargs)
        self.max_staleness = max_staleness

    def transform(self, grads, variables, update):
        return grads, update.staleness <= tf.cast(self.max_staleness, update.staleness.dtype)
