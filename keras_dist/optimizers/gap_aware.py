"""`GapAware`: penalize each weight's update by how far it drifted meanwhile."""

import keras
import tensorflow as tf

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessAwareOptimizer, add, write


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
    The epoch logs get `gap_aware_scale_mean`: the mean penalty `G`.

    **With momentum** a typical step is `eta * u`, not `eta * g`, where `u`
    is the momentum buffer (`u <- gamma * u + g`). `measure="momentum"`
    averages `u * u` instead of `g * g`, as the paper does for momentum
    optimizers, so the gap is measured in steps that momentum really takes.
    `gamma` is the inner `SGD`'s (or `DANA`'s) momentum unless given.

    **Weight decay.** The inner optimizer's decoupled weight decay (`SGD` /
    `AdamW(weight_decay=...)`) is not scaled by default. With
    `scale_weight_decay=True` it is divided by the same `G`, element by
    element, as in the paper: a weight that drifted is neither pushed nor
    decayed in full.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer`.
        beta: Float in [0, 1). Decay of the average of `g * g`. Defaults to
            `0.999`.
        epsilon: Float > 0. Defaults to `1e-8`.
        measure: `"gradient"` (default) or `"momentum"`: what a typical
            step is measured on.
        momentum: Float in [0, 1) or `None`: `gamma` for
            `measure="momentum"`; `None` takes the inner optimizer's.
        scale_weight_decay: Bool. Divide the inner optimizer's weight
            decay by `G` too. Defaults to `False`.
        name: String. Defaults to `"gap_aware"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.GapAware(keras.optimizers.SGD(0.1))
    >>> opt.beta, opt.epsilon
    (0.999, 1e-08)

    >>> paper = kd.optimizers.GapAware(keras.optimizers.SGD(0.1, momentum=0.9),
    ...                                measure="momentum", scale_weight_decay=True)
    >>> paper.momentum
    0.9

    Raises:
        ValueError: for out-of-range hyperparameters, a `measure="momentum"`
            whose momentum cannot be found, nesting inside another scaling
            wrapper, or when it would see loss-scaled gradients; at `apply`,
            for an update without the pulled weights (`UpdateInfo.pulled`).
    """

    needs_pulled_weights = True
    pulled_weights_for = "measures how far each weight moved since the worker read it"
    family = "scaling"
    config_fields = ("beta", "epsilon", "measure", "momentum", "scale_weight_decay")

    def __init__(self, inner_optimizer, beta=0.999, epsilon=1e-8, measure="gradient",
                 momentum=None, scale_weight_decay=False, name="gap_aware", **kwargs):
        if not 0 <= beta < 1:
            raise ValueError(f"`beta` must be in the range [0, 1). Received: beta={beta}.")
        if not epsilon > 0:
            raise ValueError(f"`epsilon` must be > 0. Received: epsilon={epsilon}.")
        if measure not in MEASURES:
            raise ValueError(f"`measure` must be one of {MEASURES}. Received: "
                             f"measure={measure!r}.")
        if momentum is not None and not 0 <= momentum < 1:
            raise ValueError(f"`momentum` must be in the range [0, 1) or None. Received: "
                             f"momentum={momentum}.")
        super().__init__(inner_optimizer, name=name, **kwargs)
        self.beta, self.epsilon = float(beta), float(epsilon)
        self.measure, self.scale_weight_decay = measure, bool(scale_weight_decay)
        if measure == "momentum" and momentum is None:
            momentum = _inner_momentum(inner_optimizer)
        self.momentum = None if momentum is None else float(momentum)

    def build_state(self, var_list):
        self._second_moments = [self.add_variable_from_reference(v, "gap_second_moment")
                                for v in var_list]
        if self.measure == "momentum":
            self._buffers = [self.add_variable_from_reference(v, "gap_momentum")
                             for v in var_list]
        self._updates = self._scalar("gap_updates")
        self._eta_max = self._scalar("eta_max")

    def transform(self, grads, variables, update):
        t = add(self._updates, 1.0)
        lr = tf.cast(self.learning_rate, tf.float32)
        eta_max = write(self._eta_max, tf.maximum(self._eta_max.value, lr))
        base = _base(self.inner_optimizer)
        wd = getattr(base, "weight_decay", None) if self.scale_weight_decay else None

        def penalize(g, variable, i, w_pulled):
            step = g
            if self.measure == "momentum":
                step = self.momentum * self._buffers[i].value + g
                write(self._buffers[i], step)
            new_v = self.beta * self._second_moments[i].value + (1.0 - self.beta) * step * step
            write(self._second_moments[i], new_v)
            v_hat = new_v / (1.0 - tf.pow(self.beta, t))
            c = tf.cast(eta_max, g.dtype) * (tf.sqrt(v_hat) + self.epsilon)
            w_now = variable.value
            penalty = 1.0 + tf.abs(w_now - w_pulled) / c
            if wd and _compat.uses_weight_decay(base, variable):
                # The inner optimizer decays the weight by lr * wd * w in full
                # (lr as it is before it counts this step); give back the part
                # the penalty takes off: lr * wd * w * (1 - 1/G), w as read now.
                self.add_after_update(variable, tf.cast(lr * wd, w_now.dtype)
                                      * tf.identity(w_now) * (1.0 - 1.0 / penalty))
            return g / penalty, tf.reduce_mean(penalty)

        return self.map_gradients(penalize, grads, variables, update.pulled), None


MEASURES = ("gradient", "momentum")


def _base(optimizer):
    """The innermost optimizer of a wrapper chain (the one that applies)."""
    while isinstance(optimizer, StalenessAwareOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _inner_momentum(optimizer):
    """The momentum of the first optimizer in the chain that has one."""
    while optimizer is not None:
        momentum = getattr(optimizer, "momentum", None)
        if isinstance(momentum, (int, float)) and momentum > 0:
            return float(momentum)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    raise ValueError(
        "GapAware(measure=\"momentum\") measures the gap in momentum steps, and the "
        "optimizer it wraps has no momentum. Pass momentum=..., wrap "
        "keras.optimizers.SGD(lr, momentum=0.9) (or DANA), or use measure=\"gradient\".")
