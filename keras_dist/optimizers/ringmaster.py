"""`Ringmaster`: ignore every gradient whose delay reaches a threshold R."""

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessAwareOptimizer, add

ADAPTIVE = "adaptive"


@keras.saving.register_keras_serializable(package="keras_dist")
class Ringmaster(StalenessAwareOptimizer):
    """Ringmaster ASGD: apply an update only while its delay is below `R`.

    From Maranjyan, Tyurin and Richtarik, "Ringmaster ASGD: The First
    Asynchronous SGD with Optimal Time Complexity", ICML 2025. Its rule for
    the server: an update of delay `tau` is applied with the plain step when
    `tau < R`, and ignored otherwise. With `R` about `sigma^2 / eps` (the
    gradient noise over the target accuracy; `R = max(1, ceil(sigma^2 /
    eps))` in the paper) this is time-optimal under arbitrary, changing
    worker speeds: the slowest workers' gradients are the ones dropped, so
    they cannot drag the weights back.

    The paper's second form also stops a worker's computation as soon as its
    delay reaches `R` and restarts it on fresh weights, so no time is spent
    on gradients that will be ignored. TensorFlow's coordinator cannot stop
    a function in flight, so on a cluster the stale gradient is computed and
    dropped here; `keras_dist.simulate.schedule(..., restart_stale=R)`
    simulates the stopping form.

    `threshold="adaptive"` is the parameter-free threshold of the authors'
    follow-up (Ringmaster LMO, arXiv 2605.18174, with decreasing steps):
    `R_k = max(1, floor(sqrt(k)))` at the server's `k`-th update (counted
    from 1 by this wrapper), so early updates must be nearly fresh and the
    tolerance grows as training settles. Use a learning-rate schedule that
    decreases with it, as that paper does.

    Dropped updates are not seen by the inner optimizer at all (its momentum
    and step count are untouched) and are counted as `dropped_updates` in
    the epoch logs; `ringmaster_scale_mean` is the fraction applied.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` (the paper's is SGD).
        threshold: Integer >= 1, or `"adaptive"`. `R`: updates with
            `tau >= R` are ignored. A usual choice is about the number of
            workers (the paper's experiments tune it among `N, N/4, ...`).
        name: String. Defaults to `"ringmaster"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> from keras_dist.training.update import UpdateInfo
    >>> opt = kd.optimizers.Ringmaster(keras.optimizers.SGD(1.0), threshold=4)
    >>> w = keras.Variable([0.0])
    >>> for tau in (0, 3, 4, 9):   # tau 4 and 9 are ignored
    ...     opt.apply([keras.ops.ones(1)], [w], update=UpdateInfo(staleness=tau))
    >>> w.numpy().tolist(), opt.staleness_logs()["dropped_updates"]
    ([-2.0], 2)

    Raises:
        ValueError: if `threshold` is not an integer >= 1 or `"adaptive"`.
    """

    family = "limit"
    config_fields = ("threshold",)
    count_drops = True

    def __init__(self, inner_optimizer, threshold, name="ringmaster", **kwargs):
        if threshold != ADAPTIVE and (isinstance(threshold, bool) or not isinstance(
                threshold, int) or threshold < 1):
            raise ValueError(
                "`threshold` must be an integer >= 1 (updates with a delay tau >= threshold "
                f"are ignored) or {ADAPTIVE!r} (R = floor(sqrt(k)) at the k-th update). "
                f"Received: threshold={threshold!r}.")
        super().__init__(inner_optimizer, name=name, **kwargs)
        self.threshold = threshold

    def build_state(self, var_list):
        # The updates seen so far (the paper's k), for the adaptive threshold.
        self.updates_seen = self._scalar("updates_seen")

    def transform(self, grads, variables, update):
        if self.threshold == ADAPTIVE:
            k = add(self.updates_seen, 1.0)  # this update's number, from 1
            limit = tf.maximum(1.0, tf.floor(tf.sqrt(k)))
        else:
            limit = tf.constant(float(self.threshold))
        keep = update.staleness < limit
        self.record_scale(tf.cast(keep, tf.float32))
        return grads, keep
