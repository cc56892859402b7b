"""`DelayedNesterov`: the outer optimizer of asynchronous local SGD (Liu et al. 2024)."""

import keras
from keras import ops

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.optimizers.base import check_workers, workers_of_strategy


@keras.saving.register_keras_serializable(package="keras_dist")
class DelayedNesterov(keras.optimizers.Optimizer):
    """Delayed Nesterov momentum, an outer optimizer for asynchronous local steps.

    From Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam and Ranzato,
    "Asynchronous Local-SGD Training for Language Modeling" (2024),
    Algorithm 3. With local steps each push is a pseudo-gradient `g_t`
    (minus the worker's change) for an outer optimizer, as in DiLoCo. Plain
    outer Nesterov momentum is what asynchrony hurts most: every stale push
    moves the momentum at once. Delayed Nesterov applies each push at
    `1 / N` of its size right away and folds the pushes into the momentum
    only once every `N`, averaged. For outer learning rate `eps`, momentum
    `beta`, period `N` and `c` in `[0, 1 / N]`, at the `t`-th push (from 0):

        delta <- delta + g_t
        if (t + 1) % N == 0:
            m     <- beta * m + delta / N
            theta <- theta - eps * ((1 - c * N + c) * beta * m + g_t / N)
            delta <- 0
        else:
            theta <- theta - eps * (c * beta * m + g_t / N)

    With `c = 0` (the paper's default) `N` pushes move the weights exactly
    as one Nesterov step on their average: synchronous DiLoCo's outer step
    when the `N` pushes are the `N` workers' rounds.

    Use it as `kd.fit(..., local_steps=k, outer_optimizer=DelayedNesterov())`
    (or `AsyncModel.fit`, `keras_dist.simulate.fit`). It sees the staleness
    of a push like any outer optimizer, and can be wrapped by a
    staleness-aware wrapper. The paper pairs it with AdamW as the inner
    optimizer and with dynamic local steps (each worker's `k` in proportion
    to its speed: `keras_dist.simulate.fit(..., dynamic_local_steps=True)`
    in simulation).

    Args:
        learning_rate: Float or schedule. `eps`. Defaults to `0.7`, DiLoCo's
            outer learning rate (Douillard et al. 2023), which the
            `1 / N` scaling keeps per `N` pushes.
        momentum: Float in [0, 1). `beta`. Defaults to `0.9`.
        workers: Integer >= 1 or `None`. `N`, the period of the momentum
            update (the paper sets it to the number of workers). `None`
            (default): the number of worker tasks of the
            `ParameterServerStrategy`'s cluster when built (`simulate.fit`
            sets its N); 1 under any other strategy, where it is Nesterov
            SGD.
        c: Float in `[0, 1 / N]`. The share of the momentum applied at every
            push in between. Defaults to `0.0`, the paper's default (it found
            no difference with 0.1).
        name: String. Defaults to `"delayed_nesterov"`.
        **kwargs: Keras' base optimizer arguments (`clipnorm`, ...).

    Example:

    >>> import keras, keras_dist as kd
    >>> opt = kd.optimizers.DelayedNesterov(learning_rate=1.0, momentum=0.5, workers=2)
    >>> w = keras.Variable([0.0])
    >>> for g in (1.0, 3.0):   # the second push updates the momentum: m = 2
    ...     opt.apply([keras.ops.convert_to_tensor([g])], [w])
    >>> w.numpy().tolist()   # -(1/2) - (0.5 * 2 + 3/2)
    [-3.0]

    Raises:
        ValueError: for a `momentum` outside [0, 1), a bad `workers`, or a
            `c` outside [0, 1 / N].
    """

    sized_by_workers = True

    def __init__(self, learning_rate=0.7, momentum=0.9, workers=None, c=0.0,
                 name="delayed_nesterov", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (
                0 <= momentum < 1):
            raise ValueError(f"`momentum` must be a float in [0, 1). Received: "
                             f"momentum={momentum!r}.")
        check_workers(workers)
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 or (
                workers is not None and c * workers > 1):
            raise ValueError(
                "`c` must be a float in [0, 1 / workers] (the share of the momentum applied "
                f"between its updates; 0 is the paper's default). Received: c={c!r}"
                + (f" with workers={workers}." if workers is not None else "."))
        self.momentum = float(momentum)
        self.workers = workers
        self.c = float(c)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        if self.workers is None:
            self.workers = workers_of_strategy(type(self).__name__)
        if self.c * self.workers > 1:
            raise ValueError(
                f"`c` must be at most 1 / workers = 1 / {self.workers}. Received: c={self.c}.")
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in var_list]
        self.buffers = [self.add_variable_from_reference(v, "push_sum") for v in var_list]

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        learning_rate = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        i = _compat.variable_index(self, variable)
        m, buffer = self.momentums[i], self.buffers[i]
        n = float(self.workers)
        # 1.0 at every N-th push (t + 1 = N, 2N, ...), else 0.0.
        step = ops.cast(self.iterations + 1, "int64")
        update = ops.cast(ops.equal(ops.mod(step, int(self.workers)), 0), dtype)
        total = ops.add(buffer, gradient)
        new_m = ops.add(m, update * (ops.add((self.momentum - 1.0) * m, total / n)))
        share = self.c + update * (1.0 - self.c * n)
        self.assign(m, new_m)
        self.assign(buffer, (1.0 - update) * total)
        self.assign_sub(variable, learning_rate * ops.add(share * self.momentum * new_m,
                                                          gradient / n))

    def get_config(self):
        config = super().get_config()
        config.update({"momentum": self.momentum, "workers": self.workers, "c": self.c})
        return config
