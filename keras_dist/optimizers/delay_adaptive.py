"""`DelayAdaptive`: the full step up to a delay of N, scaled by N / tau beyond."""

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import StalenessScaling, check_workers, workers_of_strategy


@keras.saving.register_keras_serializable(package="keras_dist")
class DelayAdaptive(StalenessScaling):
    """Delay-adaptive step size: `lr * min(1, N / tau)` for an update of delay `tau`.

    From Koloskova, Stich and Jaggi, "Sharper Convergence Guarantees for
    Asynchronous SGD for Distributed and Federated Learning", NeurIPS 2022
    (Theorem 8: the full step `eta` while `tau <= tau_C`, the concurrency,
    at most `min(eta, 1 / (4 L tau))` beyond; their practical advice: tune
    `eta` only and shrink the step of an update with `tau > tau_C` as
    `1 / tau`), and Mishchenko, Bach, Even and Woodworth, "Asynchronous SGD
    Beats Minibatch SGD Under Arbitrary Delays", NeurIPS 2022. With `N`
    workers always busy (`tau_C = N`) this wrapper implements the rule of
    the latter's published code:

        g <- g * N / max(N, tau)

    Updates no staler than the number of workers, the usual case with equal
    workers (mean `tau` about `N - 1`), are applied unchanged; only the
    outliers, a slow worker's or one that came back from a pause, are
    damped, in proportion to their delay. Both papers show that with it
    asynchronous SGD converges at a rate set by the number of workers, not
    by the largest delay, and Koloskova et al. that it is then never slower
    than mini-batch SGD. There is no hyperparameter beyond the learning
    rate: `N` comes from the cluster. The epoch logs get
    `delay_adaptive_scale_mean`.

    Args:
        inner_optimizer: A `keras.optimizers.Optimizer` that applies the
            scaled gradients (the papers' is SGD).
        workers: Integer >= 1 or `None`. `N`, the concurrency: the delay up
            to which updates keep the full step. `None` (default): the
            number of worker tasks of the `ParameterServerStrategy`'s
            cluster when the optimizer is built (`simulate.fit` sets its
            N); 1 under any other strategy.
        name: String. Defaults to `"delay_adaptive"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> from keras_dist.training.update import UpdateInfo
    >>> opt = kd.optimizers.DelayAdaptive(keras.optimizers.SGD(1.0), workers=4)
    >>> w = keras.Variable([0.0, 0.0])
    >>> for tau in (3, 8):   # full step at tau 3 <= 4; half of it at tau 8
    ...     opt.apply([keras.ops.ones(2)], [w], update=UpdateInfo(staleness=tau))
    >>> w.numpy().tolist()
    [-1.5, -1.5]

    Raises:
        ValueError: if `workers` is not an integer >= 1 or `None`.
    """

    default_name = "delay_adaptive"
    sized_by_workers = True
    config_fields = ("workers",)

    def __init__(self, inner_optimizer, workers=None, name=None, **kwargs):
        check_workers(workers)
        super().__init__(inner_optimizer, name=name, **kwargs)
        self.workers = workers

    def build_state(self, var_list):
        if self.workers is None:
            self.workers = workers_of_strategy(type(self).__name__)

    def scale(self, staleness):
        workers = tf.constant(float(self.workers), staleness.dtype)
        return workers / tf.maximum(workers, staleness)
