"""Training a Keras model as N asynchronous workers would, along a `Schedule`.

`fit` computes each update's gradient on the weights its worker read and
applies it (through any staleness-aware wrapper) when the `Schedule` says it
lands; `epoch_times` turns a replayed schedule into each epoch's simulated end.
"""

import functools
from typing import Dict

import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.simulate import steps as steps_lib
from keras_dist.simulate.async_schedule import Schedule, _check_int, _check_stragglers, schedule
from keras_dist.simulate.synchronous import SyncSchedule


def fit(model, x, y, *, workers, epochs=1, batch_size=32, validation_data=None,
        seed=0, local_steps=1, outer_optimizer=None, elastic=None, dynamic_local_steps=False,
        **schedule_kwargs):
    """Trains a compiled Keras model as N asynchronous workers would.

    Every update's gradient is computed with `Model.stateless_call` on the
    weights its worker read (snapshots kept in a ring by version, only while
    an update still needs them), then applied with `model.optimizer`; a
    keras_dist staleness-aware wrapper receives the update's tau and those
    pulled weights, exactly as under `AsyncModel`. Each update uses one
    batch; an epoch is one pass of batches over `x`.

    Args:
        model: A compiled, built `keras.Model`. Non-trainable state (e.g.
            BatchNormalization statistics, dropout seeds) is read at the
            update's time, not the worker's, and its new value overwrites
            the old one: the last write wins, as on a parameter server.
        x: Array of inputs.
        y: Array of targets.
        workers: Integer. Simulated workers N.
        epochs: Integer. Passes over the data. Defaults to `1`. Capped by
            `keras.config.max_epochs()` (`KERAS_MAX_EPOCHS`), as in Keras'
            `fit`.
        batch_size: Integer. Defaults to `32`.
        validation_data: Tuple `(x_val, y_val)` or `None`; evaluated with
            `model.evaluate` after each epoch.
        seed: Integer. Seeds the batch order and the schedule. Defaults to `0`.
        local_steps: Integer >= 1. As `AsyncModel.fit(local_steps=k)`: each
            update of the schedule is then one push of k local steps (k
            batches) taken from the pulled weights and optimizer state with
            the model's optimizer; the change is added (the step count's
            too; the slots are the pushing worker's), or, with `outer_optimizer`, applied as the
            pseudo-gradient `-change` by that optimizer. Defaults to `1`.
        outer_optimizer: A Keras optimizer or `None`; see `local_steps`.
        elastic: Float in (0, 1] or `None`. As `AsyncModel.fit(elastic=...)`
            (EASGD): each worker's rounds start from its own weights, and a
            push moves them and the centre (the model) `elastic` of the way
            towards each other, with the centre as the worker read it.
        dynamic_local_steps: Boolean. Dynamic local updates (DyLU; Liu et
            al. 2024, eq. 6): each worker's rounds take
            `max(1, floor(k * v_w / max_v))` steps for its speed `v_w`
            (`1 / factor` of `stragglers`), so that slow workers push as
            often as fast ones, with fewer steps. A push of `k_w` steps
            takes `k_w / k` of a round's time. An epoch is still one pass
            of batches; a push that does not fit in what is left of it goes
            to the next. Defaults to `False`.
        **schedule_kwargs: `speed`, `sigma`, `alpha`, `stragglers`,
            `outages`, `gap`, `concurrency`, `restart_stale` (see
            `schedule`).

    Returns:
        `(history, schedule)`: a dict of per-epoch lists (`loss`, and
        `val_*` with validation data) and the `Schedule` that was replayed;
        `epoch_times(schedule, epochs)` gives each epoch's simulated end.

    Example:

    >>> import numpy as np, keras, keras_dist as kd
    >>> from keras_dist import simulate
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(kd.optimizers.DynSGD(keras.optimizers.SGD(0.05)), "mse")
    >>> x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
    >>> history, sched = simulate.fit(model, x, y, workers=8, epochs=2)
    >>> len(history["loss"]), len(sched.staleness)
    (2, 4)
    """
    from keras_dist.training import update as update_lib

    from keras_dist.training.driver import _keras_limit

    epochs = _keras_limit(epochs, "max_epochs", "Limiting epochs to %d")  # as Keras' fit
    steps_per_epoch = len(x) // batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"batch_size={batch_size} is larger than the {len(x)} samples.")
    _check_int(local_steps, "local_steps", 1)
    if not isinstance(dynamic_local_steps, bool) or (dynamic_local_steps and local_steps < 2):
        raise ValueError(
            "`dynamic_local_steps` is True or False, and True needs local_steps >= 2 (each "
            "worker's rounds take a share of them for its speed). Received: "
            f"dynamic_local_steps={dynamic_local_steps!r}, local_steps={local_steps!r}.")
    if local_steps > 1 or outer_optimizer is not None or elastic is not None:
        from keras_dist.training.local_steps import check_elastic

        check_elastic(elastic, outer_optimizer)
        return _fit_local(model, x, y, workers=workers, epochs=epochs, batch_size=batch_size,
                          validation_data=validation_data, seed=seed, k=local_steps,
                          outer=outer_optimizer, elastic=elastic, dynamic=dynamic_local_steps,
                          **schedule_kwargs)
    sched = schedule(workers, epochs * steps_per_epoch, seed=seed, **schedule_kwargs)
    optimizer = model.optimizer
    _set_workers(optimizer, workers)
    optimizer.build(model.trainable_variables)
    variables = model.trainable_variables

    loss_and_grads = steps_lib.loss_and_grads(model, optimizer)

    @tf.function(reduce_retracing=True)
    def apply(grads, pulled, tau, worker):
        update_lib.apply_with(update_lib.UpdateInfo(tau, pulled, worker), optimizer.apply,
                              grads, variables)

    def snapshot():
        return [tf.identity(v.value) for v in variables]

    def run_update(pulled, idx, tau, worker):
        state = [tf.identity(v.value) for v in model.non_trainable_variables]
        loss, grads, new_state = loss_and_grads(pulled, state, x[idx], y[idx])
        for variable, value in zip(model.non_trainable_variables, new_state):
            variable.assign(value)  # the last write wins, as on a parameter server
        apply(grads, pulled, tau, worker)
        return loss

    return _replay(model, sched, epochs, len(x), batch_size, steps_per_epoch, lambda w: 1,
                   seed, validation_data, snapshot, run_update)


def _fit_local(model, x, y, *, workers, epochs, batch_size, validation_data, seed, k, outer,
               elastic=None, dynamic=False, **schedule_kwargs):
    """`fit` with local steps: each scheduled update is one push of k steps
    (`dynamic`: k_w steps for worker w, DyLU)."""
    from keras_dist.training import update as update_lib
    from keras_dist.training.local_steps import check_optimizer, step_on_copy

    optimizer = model.optimizer
    check_optimizer(optimizer)
    steps_per_epoch = len(x) // batch_size
    if steps_per_epoch // k < 1:
        raise ValueError(f"local_steps={k} batches of {batch_size} need more than the "
                         f"{len(x)} samples.")
    steps = {w: k for w in range(workers)}
    if dynamic:
        factors = _check_stragglers(schedule_kwargs.get("stragglers"), workers)
        fastest = max(1.0 / factors.get(w, 1.0) for w in range(workers))
        steps = {w: max(1, int(np.floor(k * (1.0 / factors.get(w, 1.0)) / fastest)))
                 for w in range(workers)}
        # A push of k_w steps takes k_w / k of a k-step round's time.
        schedule_kwargs["stragglers"] = {w: factors.get(w, 1.0) * steps[w] / k
                                         for w in range(workers)}
        updates = epochs * -(-steps_per_epoch // min(steps.values()))  # enough for every epoch
    else:
        updates = epochs * (steps_per_epoch // k)
    sched = schedule(workers, updates, seed=seed, **schedule_kwargs)
    variables = model.trainable_variables
    _set_workers(optimizer, workers)
    optimizer.build(variables)
    if outer is not None:
        _set_workers(outer, workers)
        outer.build(variables)
    opt_vars = list(optimizer.variables)

    rounds = {}  # one compiled round per number of steps (k; DyLU: each k_w)

    def local_round(weights, opt_state, state, xs, ys, worker):
        count = int(xs.shape[0])
        if count not in rounds:
            rounds[count] = tf.function(functools.partial(_round, count),
                                        reduce_retracing=True)
        return rounds[count](weights, opt_state, state, xs, ys, worker)

    def _round(count, weights, opt_state, state, xs, ys, worker):
        losses = []
        for j in range(count):
            with tf.GradientTape() as tape:
                tape.watch(weights)
                y_pred, state = model.stateless_call(weights, state, xs[j], training=True)
                loss = model.compute_loss(x=xs[j], y=ys[j], y_pred=y_pred, training=True)
            grads = tape.gradient(loss, weights)
            weights, opt_state = step_on_copy(optimizer, opt_state, grads, weights, worker)
            losses.append(loss)
        return tf.reduce_mean(tf.stack(losses)), weights, opt_state, state

    @tf.function(reduce_retracing=True)
    def push(delta, opt_delta, opt_new, pulled, tau, worker):
        if outer is None:
            for v, d in zip(variables, delta):
                v.assign_add(d)
        else:
            info = update_lib.UpdateInfo(tau, pulled, worker)
            update_lib.apply_with(info, outer.apply, [-d for d in delta], variables)
        for v, d, new in zip(opt_vars, opt_delta, opt_new):
            if new.dtype.is_floating:
                v.assign(new)  # slots: the pushing worker's (as local_steps)
            else:
                v.assign_add(d)  # the step count

    def snapshot():
        return ([tf.identity(v.value) for v in variables],
                [tf.identity(v.value) for v in opt_vars])

    initial = [tf.identity(v.value) for v in variables]

    copies = {}  # EASGD: each worker's own weights, from the initial ones

    def run_update(pulled_state, idx, tau, worker):
        pulled, pulled_opt = pulled_state
        xs = x[idx].reshape((-1, batch_size) + x.shape[1:])
        ys = y[idx].reshape((-1, batch_size) + y.shape[1:])
        state = [tf.identity(v.value) for v in model.non_trainable_variables]
        start = pulled
        if elastic is not None:
            start = copies.setdefault(int(worker), initial)
        loss, weights, opt_state, new_state = local_round(start, pulled_opt, state, xs, ys,
                                                          worker)
        for variable, value in zip(model.non_trainable_variables, new_state):
            variable.assign(value)
        if elastic is not None:  # e = alpha (x_i - centre as read); both move by e
            moves = [elastic * (a - b) for a, b in zip(weights, pulled)]
            copies[int(worker)] = [a - e for a, e in zip(weights, moves)]
            for v, e in zip(variables, moves):
                v.assign_add(e)
            opt_delta = [a - b for a, b in zip(opt_state, pulled_opt)]
            push([tf.zeros_like(e) for e in moves], opt_delta, opt_state, pulled, tau, worker)
            return loss
        delta = [a - b for a, b in zip(weights, pulled)]
        opt_delta = [a - b for a, b in zip(opt_state, pulled_opt)]
        push(delta, opt_delta, opt_state, pulled, tau, worker)
        return loss

    return _replay(model, sched, epochs, len(x), batch_size, steps_per_epoch,
                   lambda w: steps[w], seed, validation_data, snapshot, run_update)


def _replay(model, sched, epochs, samples, batch_size, steps_per_epoch, batches_of, seed,
            validation_data, snapshot, run_update):
    """Replays `sched`: each update runs `run_update(pulled, batch indices,
    tau, worker)` on the state `snapshot()` took when its worker read the
    weights, with the next `batches_of(worker)` batches of the epoch; an
    epoch ends when the next update's batches do not fit in what is left of
    it.

    Snapshots are kept in a ring by version, each until the last update
    computed on it has been applied: memory is bounded by the versions in
    use (about N), not by the number of updates. Returns `(history, the
    schedule's updates that ran, with their epoch ends)`.
    """
    read_version = np.arange(len(sched.staleness)) - sched.staleness
    last_use = {int(v): u for u, v in enumerate(read_version)}
    snapshots = {0: snapshot()}
    rng = np.random.default_rng(seed)
    history: Dict[str, list] = {"loss": []}
    update, ends = 0, []
    for _ in range(epochs):
        order = rng.permutation(samples)
        losses, used = [], 0
        while update < len(sched.staleness):
            count = batches_of(int(sched.workers[update]))
            if used + count > steps_per_epoch:
                break
            idx = order[used * batch_size:(used + count) * batch_size]
            used += count
            version = int(read_version[update])
            tau = tf.constant(int(sched.staleness[update]), tf.int64)
            worker = tf.constant(int(sched.workers[update]), tf.int32)
            losses.append(float(run_update(snapshots[version], idx, tau, worker)))
            if last_use[version] == update:
                del snapshots[version]
            if update + 1 in last_use:
                snapshots[update + 1] = snapshot()
            update += 1
        ends.append(update)
        history["loss"].append(float(np.mean(losses)))
        if validation_data is not None:
            logs = model.evaluate(*validation_data, return_dict=True, verbose=0)
            for key, value in logs.items():
                history.setdefault("val_" + key, []).append(float(value))
    used = slice(0, update)
    ran = Schedule(sched.workers[used], sched.staleness[used], sched.times[used], sched.stopped,
                   np.array(ends, dtype=np.int64))
    return history, ran


def epoch_times(schedule, epochs):
    """The simulated time at the end of each epoch of a `fit` or `sync_fit` run.

    For a `Schedule` that `fit` returned, epoch e ends when its last update
    lands (its `epoch_ends[e]`-th); for one without epoch ends (from
    `schedule`), at `schedule.times[(e + 1) * U - 1]` with U = updates per
    epoch (pushes with `local_steps`). For a `SyncSchedule` from `sync_fit`,
    when the last update of its `epoch_ends[e]` is applied (0.0 when none
    was).
    Pairs with the history's per-epoch lists, e.g. to plot accuracy against
    simulated time.

    Args:
        schedule: A `Schedule` replayed by `fit`, or the `SyncSchedule`
            returned by `sync_fit`.
        epochs: Integer >= 1. The run's epochs.

    Returns:
        A float array of `epochs` times.

    Example:

    >>> from keras_dist import simulate
    >>> s = simulate.schedule(4, 30, speed="constant")   # fit: 3 epochs of 10 updates
    >>> simulate.epoch_times(s, 3).tolist()
    [3.0, 5.0, 8.0]

    Raises:
        ValueError: if the schedule's updates do not split into `epochs`
            equal epochs, or a `SyncSchedule` has no or other epochs.
    """
    _check_int(epochs, "epochs", 1)
    if isinstance(schedule, SyncSchedule):
        ends = schedule.epoch_ends
        if ends is None or len(ends) != epochs:
            raise ValueError(f"This SyncSchedule has {'no' if ends is None else len(ends)} "
                             f"epochs (sync_fit sets them; sync_schedule does not). "
                             f"Received: epochs={epochs}.")
    elif schedule.epoch_ends is not None:
        ends = schedule.epoch_ends
        if len(ends) != epochs:
            raise ValueError(f"This Schedule has {len(ends)} epochs (fit set them). "
                             f"Received: epochs={epochs}.")
    else:
        updates = len(schedule.times)
        if updates % epochs:
            raise ValueError(f"The schedule's {updates} updates do not split into equal epochs. "
                             f"Received: epochs={epochs}.")
        ends = np.arange(1, epochs + 1) * (updates // epochs)
    return np.concatenate([[0.0], schedule.times])[ends]


def _set_workers(optimizer, workers):
    """Gives optimizers sized by the number of workers (`DANA`,
    `DelayAdaptive`, `DelayedNesterov`) the simulated worker count."""
    from keras_dist.training.update import optimizer_chain

    for o in optimizer_chain(optimizer):
        if hasattr(o, "workers") and getattr(o, "sized_by_workers", False):
            if o.workers is None and not o.built:
                o.workers = workers
            elif o.workers is None or o.workers < workers:
                raise ValueError(
                    f"{type(o).__name__} keeps state for {o.workers} workers and "
                    f"simulate.fit runs workers={workers}. Use a new optimizer, or "
                    f"{type(o).__name__}(..., workers={workers}).")
