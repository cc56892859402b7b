"""Synchronous SGD with backup workers (Chen et al. 2016), simulated.

`sync_schedule` times each step as the N-th fastest of N + b workers;
`sync_fit` trains a Keras model along it, averaging the N kept gradients.
"""

import dataclasses
from typing import Dict, Optional

import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.simulate import steps as steps_lib
from keras_dist.simulate.async_schedule import _check_int, _check_stragglers, _step_time_sampler


@dataclasses.dataclass
class SyncSchedule:
    """The simulated steps of synchronous SGD with backup workers.

    Attributes:
        workers: Integer N, the gradients averaged in each update.
        backup: Integer b, the backup workers: N + b compute every step.
        times: Float array, the simulated time each update is applied: the
            sum of the steps' times so far, each the N-th fastest of its
            N + b workers' step times.
        dropped: Int array of shape `(updates, backup)`, the workers whose
            gradients each update dropped (the b slowest), slowest last.
        epoch_ends: Int array or `None`. Set by `sync_fit`: for each epoch,
            the number of updates applied by its end (see `sync_fit`).
    """

    workers: int
    backup: int
    times: np.ndarray
    dropped: np.ndarray
    epoch_ends: Optional[np.ndarray] = None

    @property
    def step_times(self):
        """Float array, the simulated duration of each step."""
        return np.diff(self.times, prepend=0.0)

    @property
    def batches_applied(self):
        """Batches whose gradients were applied: N per update."""
        return len(self.times) * self.workers

    @property
    def batches_consumed(self):
        """Batches taken from the data: N + b per update, dropped ones included."""
        return len(self.times) * (self.workers + self.backup)


def sync_schedule(workers, updates, *, backup=0, speed="lognormal", sigma=0.2, alpha=2.5,
                  stragglers=None, seed=0):
    """Simulates the steps of synchronous SGD with backup workers.

    Chen et al. 2016, "Revisiting Distributed Synchronous SGD": every step,
    N + b workers compute a gradient on the same weights; the update
    averages the first N to arrive and drops the b late ones, so the step
    lasts as long as the N-th fastest worker, not the slowest. Step times
    are drawn afresh for every worker and step from the same speed model as
    `schedule` (`speed`, `sigma`, `alpha`, `stragglers`); nothing else takes
    time (no communication, no aggregation).

    Args:
        workers: Integer >= 1. Gradients averaged per update, N.
        updates: Integer >= 0. Number of steps to simulate.
        backup: Integer >= 0. Backup workers b. Chen et al. use about 5%
            of N. Defaults to `0` (plain synchronous SGD, which waits for
            the slowest).
        speed: String. `"constant"`, `"lognormal"` or `"pareto"` (see
            `schedule`). Defaults to `"lognormal"`.
        sigma: Float >= 0. Log-normal spread. Defaults to `0.2`.
        alpha: Float > 1. Pareto shape. Defaults to `2.5`.
        stragglers: Dict or `None`. Worker index in [0, N + b) to a slowdown
            factor (> 0) on all its step times.
        seed: Integer. Defaults to `0`.

    Returns:
        A `SyncSchedule` (its `epoch_ends` is `None`).

    Example:

    >>> from keras_dist import simulate
    >>> plain = simulate.sync_schedule(64, 200, speed="pareto")
    >>> backed = simulate.sync_schedule(64, 200, backup=3, speed="pareto")
    >>> bool(backed.times[-1] < 0.6 * plain.times[-1])   # waits for the 64th of 67
    True
    >>> s = simulate.sync_schedule(3, 5, backup=1, stragglers={1: 10.0})
    >>> s.dropped.ravel().tolist()   # the slowest worker is dropped every step
    [1, 1, 1, 1, 1]

    Raises:
        ValueError: for bad counts, speeds, spreads, shapes or factors.
    """
    _check_int(workers, "workers", 1)
    _check_int(updates, "updates", 0)
    _check_int(backup, "backup", 0)
    total = workers + backup
    stragglers = _check_stragglers(stragglers, total)
    duration = _step_time_sampler(speed, sigma, alpha, stragglers, np.random.default_rng(seed))
    times = np.empty(updates)
    dropped = np.empty((updates, backup), dtype=np.int64)
    now = 0.0
    for u in range(updates):
        steps = np.array([duration(w) for w in range(total)])
        order = np.argsort(steps, kind="stable")  # ties: the lower index arrives first
        now += steps[order[workers - 1]]
        times[u], dropped[u] = now, order[workers:]
    return SyncSchedule(workers, backup, times, dropped)


LR_SCALINGS = ("linear", "sqrt", "none")


def sync_fit(model, x, y, *, workers, backup=0, epochs=1, batch_size=32, validation_data=None,
             seed=0, lr_scaling="linear", warmup=0.1, speed="lognormal", sigma=0.2, alpha=2.5,
             stragglers=None):
    """Trains a compiled Keras model by synchronous SGD with backup workers.

    Replays a `sync_schedule`: each update, N + b workers each take the
    next batch of the data and compute its gradient on the current weights
    (`Model.stateless_call`); the gradients of the N that finish first are
    averaged and applied with `model.optimizer`, those of the b slowest are
    dropped (and not computed: nothing uses them). With `backup=0` this is
    synchronous SGD over N batches, the same as one step on their
    concatenation when the loss is a mean over examples.

    Examples are counted by the applied batches: there are
    `epochs * (len(x) // batch_size) // workers` updates of N batches,
    whatever `backup` is, so runs with and without backups (and `fit`'s
    asynchronous runs) apply the same number of examples. The data are read
    as a stream of shuffled passes (a new permutation per pass, as `fit`),
    N + b batches per update: a dropped batch is lost, as in Chen et al.,
    and the backups read further into the stream (more passes when needed).
    `SyncSchedule.batches_applied` and `batches_consumed` count both.

    The learning rate is the optimizer's (the base, one-batch rate) times
    N (`lr_scaling="linear"`, Goyal et al. 2017), `sqrt(N)` or 1, reached
    by a linear ramp from the base rate over the first `warmup` fraction of
    the updates; it is set back to the base rate at the end.

    Args:
        model: A compiled, built `keras.Model` whose optimizer has a float
            learning rate (not a schedule) unless `lr_scaling="none"` and
            `warmup=0`. Non-trainable state (BatchNormalization statistics,
            dropout seeds) passes from one kept worker's forward pass to the
            next, as from one update to the next in `fit`.
        x: Array of inputs.
        y: Array of targets.
        workers: Integer >= 1. Gradients averaged per update, N.
        backup: Integer >= 0. Backup workers b. Defaults to `0`.
        epochs: Integer >= 1. Passes' worth of applied examples. Defaults
            to `1`. Capped by `keras.config.max_epochs()`
            (`KERAS_MAX_EPOCHS`), as in Keras' `fit`.
        batch_size: Integer. Each worker's batch. Defaults to `32`.
        validation_data: Tuple `(x_val, y_val)` or `None`; evaluated with
            `model.evaluate` at each epoch's end.
        seed: Integer. Seeds the batch order and the step times. Defaults
            to `0`.
        lr_scaling: String. `"linear"`, `"sqrt"` or `"none"`. Defaults to
            `"linear"`.
        warmup: Float in [0, 1]. Fraction of the updates (at least one when
            above 0) over which the rate ramps up. Defaults to `0.1`.
        speed: String. The step-time model, as `sync_schedule`'s.
        sigma: Float. Log-normal spread, as `sync_schedule`'s.
        alpha: Float. Pareto shape, as `sync_schedule`'s.
        stragglers: Dict or `None`. Worker index (in `[0, N + b)`) to
            slowdown factor, as `sync_schedule`'s.

    Returns:
        `(history, schedule)`: a dict of per-epoch lists and the
        `SyncSchedule` replayed, with its `epoch_ends`. An epoch ends after
        the last update whose N batches all fall within that many passes'
        worth of batches (`epoch_ends[e] = (e + 1) * steps // N`, steps the
        batches per pass); `loss` is the mean training loss of that epoch's
        updates (NaN when N batches span more than one epoch and none
        ended in it), `val_*` the validation metrics then. `epoch_times`
        gives each epoch's simulated end.

    Example:

    >>> import numpy as np, keras
    >>> from keras_dist import simulate
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(0.01), "mse")
    >>> x, y = np.ones((256, 4), "float32"), np.ones((256, 1), "float32")
    >>> history, sched = simulate.sync_fit(model, x, y, workers=4, backup=1, epochs=2,
    ...                                    speed="pareto")
    >>> len(history["loss"]), len(sched.times), sched.batches_consumed
    (2, 4, 20)
    >>> simulate.epoch_times(sched, 2).round(2).tolist()
    [2.64, 5.22]

    Raises:
        ValueError: for bad counts, scalings, warm-ups or speed arguments,
            too few batches for one update, or a learning-rate schedule the
            scaling would have to overwrite.
    """
    _check_int(workers, "workers", 1)
    _check_int(backup, "backup", 0)
    _check_int(epochs, "epochs", 1)
    from keras_dist.training.driver import _keras_limit

    epochs = _keras_limit(epochs, "max_epochs", "Limiting epochs to %d")  # as Keras' fit
    _check_int(batch_size, "batch_size", 1)
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(f"`lr_scaling` must be one of {LR_SCALINGS}. "
                         f"Received: lr_scaling={lr_scaling!r}.")
    if (isinstance(warmup, bool) or not isinstance(warmup, (int, float, np.floating))
            or not 0 <= warmup <= 1):
        raise ValueError(f"`warmup` must be a fraction of the updates in [0, 1]. "
                         f"Received: warmup={warmup!r}.")
    steps = len(x) // batch_size
    updates = epochs * steps // workers
    if updates < 1:
        raise ValueError(f"One update takes workers={workers} batches; {epochs} epoch(s) of "
                         f"{len(x)} samples in batches of {batch_size} hold {epochs * steps}. "
                         f"Train for more epochs or use fewer workers.")
    sched = sync_schedule(workers, updates, backup=backup, speed=speed, sigma=sigma, alpha=alpha,
                          stragglers=stragglers, seed=seed)
    ends = np.minimum(updates, np.arange(1, epochs + 1) * steps // workers)
    sched = dataclasses.replace(sched, epoch_ends=ends)
    total = workers + backup
    rng, stream = np.random.default_rng(seed), []
    while len(stream) < updates * total:  # shuffled passes, as many as the backups need
        order = rng.permutation(len(x))
        stream += [order[i * batch_size:(i + 1) * batch_size] for i in range(steps)]

    optimizer = model.optimizer
    variables = model.trainable_variables
    optimizer.build(variables)
    base_lr = float(optimizer.learning_rate)
    top = {"linear": workers, "sqrt": float(np.sqrt(workers)), "none": 1}[lr_scaling]
    ramp = 0 if warmup == 0 else max(1, int(np.floor(warmup * updates + 1e-9)))
    set_rate = lr_scaling != "none" or ramp > 0

    loss_and_grads = steps_lib.loss_and_grads(model, optimizer)

    @tf.function(reduce_retracing=True)
    def apply(grads):
        optimizer.apply(grads, variables)

    def run_update(u):
        if set_rate:
            scale = top if u >= ramp else 1 + (top - 1) * u / ramp
            _set_learning_rate(optimizer, base_lr * scale)
        weights = [tf.identity(v.value) for v in variables]
        state = [tf.identity(v.value) for v in model.non_trainable_variables]
        late = set(sched.dropped[u].tolist())
        total_grads, losses = None, []
        for w in range(total):
            if w in late:
                continue
            idx = stream[u * total + w]
            loss, grads, state = loss_and_grads(weights, state, x[idx], y[idx])
            losses.append(float(loss))
            total_grads = grads if total_grads is None else [
                a + b for a, b in zip(total_grads, grads)]
        for variable, value in zip(model.non_trainable_variables, state):
            variable.assign(value)
        apply([g / workers for g in total_grads])
        return float(np.mean(losses))

    history: Dict[str, list] = {"loss": []}
    done, logs = 0, None
    try:
        for end in ends:
            losses = [run_update(u) for u in range(done, int(end))]
            history["loss"].append(float(np.mean(losses)) if losses else float("nan"))
            if validation_data is not None:
                if logs is None or losses:  # no update since the last evaluation: the same
                    logs = model.evaluate(*validation_data, return_dict=True, verbose=0)
                for key, value in logs.items():
                    history.setdefault("val_" + key, []).append(float(value))
            done = int(end)
    finally:
        if set_rate:
            _set_learning_rate(optimizer, base_lr)
    return history, sched


def _set_learning_rate(optimizer, value):
    try:
        optimizer.learning_rate = value
    except TypeError as error:  # a LearningRateSchedule cannot be set
        raise ValueError(
            "sync_fit scales and warms up the learning rate, and this optimizer's is a "
            "schedule it cannot set. Use a float learning rate, or "
            "lr_scaling=\"none\" and warmup=0 to keep the schedule.") from error
