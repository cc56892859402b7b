"""`GapAware`: penalize each weight's update by how far it drifted meanwhile."""

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessAwareOptimizer


@keras.saving.register_keras_serializable(package="keras_dist")
class GapAware(StalenessAwareOptimizer):
    """Gap-Aware: divide each gradient element by its normalized gap.

    From Barkai, Hakimi and Schuster, "Gap-Aware Mitigation of Gradient
    Staleness", ICLR 2020. Instead of counting versions, it measures how far
    each weight actually moved since the worker read it, in units of a
    typical step:

        gap      = |w_now - w_pulled|                         (elementwise)
        C        = eta_max * (sqrt(v_hat) + epsilon)
        G        = 1 + gap / C                                 (>= 1)
        g       <- g / G

    where `v` is an exponential average (decay `beta`) of `g * g`, bias
    corrected to `v_hat`, and `eta_max` is the largest learning rate seen so
    far. With tau = 0 the gap is 0, `G = 1`, and the update is the inner
    optimizer's. Unlike DynSGD it damps only the weights that really moved.
    The inner optimizer's decoupled weight decay is not scaled. The epoch
    logs get `gap_aware_scale_mean`: the mean penalty `G`.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer`.
        beta: Float in [0, 1). Decay of the average of `g * g`. Defaults to
            `0.999`.
        epsilon: Float > 0. Defaults to `1e-8`.
        name: String. Defaults to `"gap_aware"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.GapAware(keras.optimizers.SGD(0.1))
    >>> opt.beta, opt.epsilon
    (0.999, 1e-08)

    Raises:
        ValueError: for out-of-range hyperparameters, nesting inside another
            scaling wrapper, or when it would see loss-scaled gradients.
    """

    needs_pulled_weights = True
    family = "scaling"

    def __init__(self, inner_optimizer, beta=0.999, epsilon=1e-8, name="gap_aware",
                 **kwargs):
        if not 0 <= beta < 1:
            raise ValueError(f"`beta` must be in the range [0, 1). Received: beta={beta}.")
        if not epsilon > 0:
            raise ValueError(f"`epsilon` must be > 0. Received: epsilon={epsilon}.")
        super().__init__(inner_optimizer, name=name, **kwargs)
        self.beta, self.epsilon = float(beta), float(epsilon)

    def build_state(self, var_list):
        self._second_moments = [self.add_variable_from_reference(v, "gap_second_moment")
                                for v in var_list]
        self._updates = self._scalar("gap_updates")
        self._eta_max = self._scalar("eta_max")

    def transform(self, grads, variables, staleness, pulled):
        t = self._updates.value.assign_add(1.0)
        lr = tf.cast(self.learning_rate, tf.float32)
        eta_max = self._eta_max.value.assign(tf.maximum(self._eta_max.value, lr))
        out, penalties = [], []
        for i, (g, variable, w_pulled) in enumerate(zip(grads, variables, pulled)):
            if g is None:
                out.append(None)
                continue
            g = tf.convert_to_tensor(g)
            v = self._second_moments[i].value
            new_v = self.beta * v + (1.0 - self.beta) * g * g
            v.assign(new_v)
            v_hat = new_v / (1.0 - tf.pow(self.beta, t))
            c = tf.cast(eta_max, g.dtype) * (tf.sqrt(v_hat) + self.epsilon)
            penalty = 1.0 + tf.abs(variable.value - w_pulled) / c
            penalties.append(tf.reduce_mean(penalty))
            out.append(g / penalty)
        if penalties:
            self.record_scale(tf.reduce_mean(tf.stack(penalties)))
        return out, None

    def get_config(self):
        return {**super().get_config(), "beta": self.beta, "epsilon": self.epsilon}
