"""`StalenessScaled`: divide each gradient by its staleness (at least 1)."""

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessScaling


@keras.saving.register_keras_serializable(package="keras_dist")
class StalenessScaled(StalenessScaling):
    """Staleness-aware ASGD: learning rate divided by `max(tau, 1)`.

    From Zhang, Gupta, Lian and Liu, "Staleness-aware Async-SGD for
    Distributed Deep Learning", IJCAI 2016, which sets the learning rate of
    an update to `alpha_0 / tau`. Updates with tau 0 or 1 are applied
    unchanged, so it is gentler than `DynSGD` at small staleness (DynSGD
    halves a tau-1 update, this does not).

        g <- g / max(tau, 1)

    The paper's n-softsync protocol (the server waits for a fraction of the
    workers) is a different training mode and not part of this wrapper. The
    epoch logs get `staleness_scaled_scale_mean`.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` that applies the
            scaled gradients.
        name: String. Defaults to `"staleness_scaled"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.StalenessScaled(keras.optimizers.SGD(0.1, momentum=0.9))
    >>> opt.name
    'staleness_scaled'
    """

    default_name = "staleness_scaled"

    def scale(self, staleness):
        return 1.0 / tf.maximum(staleness, 1.0)
