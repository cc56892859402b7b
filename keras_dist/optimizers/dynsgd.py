"""`DynSGD`: divide each gradient by its staleness plus one."""

import keras

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessScaling


@keras.saving.register_keras_serializable(package="keras_dist")
class DynSGD(StalenessScaling):
    """Scales each update by `1 / (tau + 1)` (DynSGD).

    From Jiang, Cui, Zhang and Yu, "Heterogeneity-aware Distributed Parameter
    Servers", SIGMOD 2017: an update computed `tau` versions ago is damped in
    proportion, so a slow worker's stale gradient moves the weights less.
    Safe at `tau = 0` (scale 1: exactly the inner optimizer). dist-keras'
    version read its clock outside its lock; here tau comes from an atomic
    version counter on the parameter servers.

        g <- g / (tau + 1)

    Use it when workers differ in speed and you want a rule with no
    hyperparameter. The epoch logs get `dyn_sgd_scale_mean`.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` that applies the
            scaled gradients (SGD, Adam, ...).
        name: String. Defaults to `"dyn_sgd"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.DynSGD(keras.optimizers.Adam(1e-3))
    >>> opt.get_config()["inner_optimizer"]["class_name"]
    'Adam'
    """

    default_name = "dyn_sgd"

    def scale(self, staleness):
        return 1.0 / (staleness + 1.0)
