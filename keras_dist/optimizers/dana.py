"""`DANA`: per-worker momentum with look-ahead weights (Hakimi et al. 2019)."""

import keras
import tensorflow as tf

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import update as update_lib
from keras_dist.optimizers.base import (StalenessAwareOptimizer, _chain, check_workers,
                                        workers_of_strategy, write_rows)


@keras.saving.register_keras_serializable(package="keras_dist")
class DANA(StalenessAwareOptimizer):
    """DANA: one momentum vector per worker, and look-ahead weights.

    From Hakimi, Barkai, Gabel and Schuster, "Taming Momentum in a
    Distributed Asynchronous Environment" (2019). Plain momentum under
    asynchrony keeps one velocity that every worker's stale gradient pushes:
    with many workers the velocity is mostly other workers' old gradients and
    training oscillates. DANA's master keeps a velocity `v_i` per worker and
    sends each worker an estimate of where the weights will be when its
    gradient lands. For an update from worker `i`, learning rate `eta`,
    momentum `gamma`:

        v_i   <- gamma * v_i + g
        theta <- theta - eta * v_i
        sent to the worker: theta_hat = theta - eta * gamma * sum_j v_j

    This wrapper keeps the weights the workers read, `theta_hat`, in the
    model's variables (so a worker's ordinary read *is* the look-ahead, with
    no extra transfer) and the velocities beside them on the parameter
    servers, as one `(workers, *shape)` slot per weight. Subtracting the
    two lines above gives the update of `theta_hat` itself:

        v_i       <- gamma * v_i + g
        theta_hat <- theta_hat - eta * (g + gamma * v_i)

    that is, Nesterov's momentum with each worker's own velocity. The
    gradient handed to the inner `SGD` (learning rate `eta`, no momentum of
    its own) is `g + gamma * v_i`. With one worker this is exactly
    `keras.optimizers.SGD(eta, momentum=gamma, nesterov=True)`; the paper's
    `theta` is `master_weights()`.

    Outside asynchronous training (Keras' own `fit`, synchronous
    strategies) there is no per-update worker: it warns once, like every
    wrapper, and trains as worker 0, that is as Nesterov SGD.

    It works in real asynchronous training (`AsyncModel`, each update's
    worker comes from TensorFlow's coordinator) and in
    `keras_dist.simulate.fit`. To combine it with Gap-Aware, as the paper
    does, wrap it: `GapAware(DANA(SGD(eta), momentum=0.9))` penalizes each
    gradient before it enters the velocity.

    Args:
        inner_optimizer: `keras.optimizers.SGD` with `momentum=0` (DANA
            holds the momentum), or a staleness-aware wrapper around one.
            Its learning rate (and schedule) is `eta`.
        momentum: Float in [0, 1). `gamma`. Defaults to `0.9`.
        workers: Integer >= 1 or `None`. Number of workers (velocity slots).
            `None`: read from the `ParameterServerStrategy`'s cluster when
            the optimizer is built (`simulate.fit` sets it to its N); 1
            under any other strategy.
        name: String. Defaults to `"dana"`.

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.DANA(keras.optimizers.SGD(0.05), momentum=0.9, workers=4)
    >>> opt.build([keras.Variable([[1.0, 2.0]])])
    >>> [tuple(v.shape) for v in opt.velocities]   # one row per worker
    [(4, 1, 2)]

    Raises:
        ValueError: for a `momentum` outside [0, 1), a bad `workers`, an
            inner optimizer that is not momentum-free SGD, or, when built,
            a cluster without workers, or sharded variables.
    """

    needs_worker = True
    sized_by_workers = True
    family = "momentum"
    config_fields = ("momentum", "workers")
    unknown_staleness_means = "it trains as the only worker: Nesterov SGD"

    def __init__(self, inner_optimizer, momentum=0.9, workers=None, name="dana", **kwargs):
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (
                0 <= momentum < 1):
            raise ValueError(f"`momentum` must be a float in [0, 1). Received: "
                             f"momentum={momentum!r}.")
        check_workers(workers)
        super().__init__(inner_optimizer, name=name, **kwargs)
        base = [o for o in _chain(inner_optimizer)
                if not isinstance(o, StalenessAwareOptimizer)][0]
        if type(base) is not keras.optimizers.SGD or float(base.momentum) != 0.0:
            raise ValueError(
                "DANA keeps the momentum itself (one velocity per worker), so the "
                "optimizer it wraps must be keras.optimizers.SGD without momentum, "
                "e.g. DANA(keras.optimizers.SGD(0.05), momentum=0.9). Received: "
                f"{type(base).__name__}" + (f"(momentum={base.momentum})"
                                           if hasattr(base, "momentum") else "") + ".")
        self.momentum = float(momentum)
        self.workers = workers

    def build_state(self, var_list):
        from keras_dist.training import sharded

        if any(sharded.is_sharded(v) for v in var_list):
            raise ValueError("DANA does not support sharded variables (a "
                             "`variable_partitioner`) yet: its velocities are one slot of "
                             "shape (workers, *shape) per weight. Train without a partitioner.")
        if self.workers is None:
            self.workers = workers_of_strategy("DANA")
        self.velocities = [
            self.add_variable(shape=(self.workers,) + tuple(v.shape), initializer="zeros",
                              dtype=v.dtype, name=f"{v.name}_dana_velocity")
            for v in var_list]

    def apply(self, grads, trainable_variables=None, update=None):
        if update is None and update_lib.current_update() is None:
            self._warn_unknown_staleness()
            update = update_lib.UpdateInfo(staleness=0, worker=0)  # one process: worker 0
        return super().apply(grads, trainable_variables, update=update)

    def transform(self, grads, variables, update):
        worker = update.worker
        if worker is None:
            raise ValueError("DANA needs the worker of each update; AsyncModel gives it "
                             "under parameter servers, and simulate.fit in simulation. "
                             "Pass update=UpdateInfo(staleness, worker=...) to apply().")
        worker = tf.reshape(tf.cast(worker, tf.int32), [1])

        def nesterov(g, variable, i, w_pulled):
            velocity = self.momentum * tf.gather(self.velocities[i].value, worker) + g[None]
            write_rows(self.velocities[i], worker, velocity)
            return g + self.momentum * velocity[0], None

        return self.map_gradients(nesterov, grads, variables), None

    def master_weights(self, variables=None):
        """The paper's `theta`: the weights plus `eta * gamma * sum_j v_j`.

        Args:
            variables: The trainable variables, in the order the optimizer
                was built with. Defaults to those.

        Returns:
            A list of tensors, one per variable.
        """
        variables = variables or _compat.built_variables(self)
        eta = tf.cast(self.learning_rate, tf.float32)
        return [v.value + tf.cast(eta * self.momentum, v.dtype)
                * tf.reduce_sum(self.velocities[_compat.variable_index(self, v)].value, axis=0)
                for v in variables]
