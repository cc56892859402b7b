"""`DCASGD`: delay-compensated asynchronous SGD."""

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessAwareOptimizer, write

MODES = ("constant", "adaptive")


@keras.saving.register_keras_serializable(package="keras_dist")
class DCASGD(StalenessAwareOptimizer):
    """Delay compensation: corrects a stale gradient towards the current weights.

    From Zheng, Meng, Wang, Chen, Yu, Ma and Liu, "Asynchronous Stochastic
    Gradient Descent with Delay Compensation", ICML 2017. A gradient `g`
    computed on the weights the worker pulled, `w_pulled`, is moved towards
    the gradient at the current weights `w_now` with a cheap diagonal
    approximation of the Hessian:

        g <- g + lambda * g * g * (w_now - w_pulled)          (elementwise)

    `w_pulled` is the exact copy this worker read for this gradient (the
    paper's per-worker backup), not the weight one step back as in MXNet's
    `dcasgd`. With tau = 0 nothing moved in between and `g` is unchanged.

    - `mode="constant"` (DC-ASGD-c): `lambda = lambda_`, default 0.04 (MXNet's).
    - `mode="adaptive"` (DC-ASGD-a): `lambda_t = lambda0 / sqrt(MS_t + epsilon)`
      with `MS_t = momentum * MS_{t-1} + (1 - momentum) * g * g` kept per
      weight on the parameter servers; defaults lambda0 = 2, momentum = 0.95,
      epsilon = 1e-7. The lambda is computed fresh each step, never compounded.

    The epoch logs get `dcasgd_scale_mean`: the mean relative size of the
    correction, `|lambda g g (w_now - w_pulled)| / |g|` (0 means none).

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` that applies the
            corrected gradients.
        mode: String. `"constant"` or `"adaptive"`. Defaults to `"constant"`.
        lambda_: Float >= 0. The constant-mode variance-control factor.
            Defaults to `0.04`.
        lambda0: Float >= 0. The adaptive-mode factor. Defaults to `2.0`.
        momentum: Float in [0, 1). Adaptive mode: decay of `MS`. Defaults to
            `0.95`.
        epsilon: Float > 0. Adaptive mode: added under the square root.
            Defaults to `1e-7`.
        name: String. Defaults to `"dcasgd"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.DCASGD(keras.optimizers.SGD(0.1), mode="adaptive")
    >>> opt.mode, opt.lambda0, opt.momentum
    ('adaptive', 2.0, 0.95)

    Raises:
        ValueError: for an unknown mode or out-of-range hyperparameters, or
            when it would see loss-scaled gradients (wrap it in the
            `LossScaleOptimizer`, not the other way round); at `apply`, for
            an update without the pulled weights (`UpdateInfo.pulled`).
    """

    needs_pulled_weights = True
    pulled_weights_for = ("corrects each gradient by how far its weight moved since the "
                          "worker read it (w_now - w_pulled)")
    family = "compensation"
    config_fields = ("mode", "lambda_", "lambda0", "momentum", "epsilon")

    def __init__(self, inner_optimizer, mode="constant", lambda_=0.04, lambda0=2.0,
                 momentum=0.95, epsilon=1e-7, name="dcasgd", **kwargs):
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}.")
        for field, value in (("lambda_", lambda_), ("lambda0", lambda0)):
            if not value >= 0:
                raise ValueError(f"`{field}` must be >= 0. Received: {field}={value}.")
        if not 0 <= momentum < 1:
            raise ValueError(
                f"`momentum` must be in the range [0, 1). Received: momentum={momentum}.")
        if not epsilon > 0:
            raise ValueError(f"`epsilon` must be > 0. Received: epsilon={epsilon}.")
        super().__init__(inner_optimizer, name=name, **kwargs)
        self.mode, self.lambda_, self.lambda0 = mode, float(lambda_), float(lambda0)
        self.momentum, self.epsilon = float(momentum), float(epsilon)

    def build_state(self, var_list):
        self._mean_squares = []
        if self.mode == "adaptive":
            self._mean_squares = [self.add_variable_from_reference(v, "mean_square")
                                  for v in var_list]

    def transform(self, grads, variables, update):
        def compensate(g, variable, i, w_pulled):
            if self.mode == "adaptive":
                ms = self._mean_squares[i]
                new_ms = self.momentum * ms.value + (1.0 - self.momentum) * g * g
                write(ms, new_ms)
                lam = self.lambda0 / tf.sqrt(new_ms + self.epsilon)
            else:
                lam = self.lambda_
            correction = lam * g * g * (variable.value - w_pulled)
            return g + correction, tf.norm(correction) / (tf.norm(g) + 1e-12)

        return self.map_gradients(compensate, grads, variables, update.pulled), None
