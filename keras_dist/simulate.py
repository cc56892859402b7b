"""Discrete-event simulation of asynchronous workers, in one process.

A real cluster on a 2-core machine shows two workers; users run 8 to 256.
This module replays what N asynchronous workers do to a model -- the order
in which their updates land and the staleness of each -- and trains a real
Keras model exactly that way: every gradient is computed on the weights its
worker pulled when it started, and applied (through any keras_dist
staleness-aware wrapper) when that worker finishes.

What it models: the order of updates, each update's staleness, slow
workers, and workers that stop and come back. What it does not model:
network bandwidth and latency, parameter-server load, or the time the
updates themselves take. Deterministic for a given seed.
"""

import collections
import dataclasses
import functools
import heapq
from typing import Dict, Optional, Optional

import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)

SPEEDS = ("constant", "lognormal", "pareto")


@dataclasses.dataclass
class Schedule:
    """The simulated order of updates.

    Attributes:
        workers: Int array, the worker that produced each update, in order.
        staleness: Int array, each update's tau (updates applied between its
            worker's read and its own).
        times: Float array, the simulated time each update lands.
        stopped: Integer. Computations stopped before they landed and
            started again on fresh weights (`restart_stale`); 0 otherwise.
        epoch_ends: Int array or `None`. Set by `fit`: the number of
            updates applied by the end of each epoch.
    """

    workers: np.ndarray
    staleness: np.ndarray
    times: np.ndarray
    stopped: int = 0
    epoch_ends: Optional[np.ndarray] = None

    @property
    def mean_staleness(self):
        return float(self.staleness.mean()) if len(self.staleness) else 0.0


def schedule(workers, updates, *, speed="lognormal", sigma=0.2, alpha=2.5, stragglers=None,
             outages=None, gap=0.0, concurrency=None, restart_stale=None, seed=0):
    """Simulates which worker lands each update, and its staleness.

    Each worker repeats: read the weights, compute for one step time, apply,
    then wait `gap` before reading again. Step times are drawn afresh for
    every step: 1 (`speed="constant"`), log-normal with median 1 and spread
    `sigma` (`"lognormal"`), or heavy-tailed, Pareto with shape `alpha` and
    mean 1 (`"pareto"`, below); a straggler's are multiplied by its factor;
    a worker in an outage `(start, end)` (simulated time) loses the step in
    progress and starts afresh at `end` with newly read weights.

    `speed="pareto"` draws `x_m * (1 + Lomax(alpha))`, the Pareto law with
    minimum `x_m = (alpha - 1) / alpha` and mean 1: no step is faster than
    `x_m`, and `P(T > t) = (x_m / t) ** alpha` above it, a power-law tail as
    in the straggler literature. The default `alpha=2.5` has a finite
    variance (so a run's mean step time settles as it grows) and still a
    long tail: 0.9% of steps take over 4 units, and the slowest of 64
    workers' steps takes 4.7 on average (1.6 with log-normal `sigma=0.2`).
    Smaller `alpha` (down to just above 1) gives heavier tails.

    The gap is the time between an update and the worker's next read that
    no other update can make stale: on a real cluster, handing the worker
    its next function and returning its result. Updates that land in a
    worker's gap do not count in its next update's staleness, so with equal
    workers the mean staleness is about `(N - 1) / (1 + gap)` instead of
    `N - 1`. `benchmarks/simulator_validation.py` measures it on real
    clusters.

    Args:
        workers: Integer >= 1. Number of workers N.
        updates: Integer >= 0. Number of updates to simulate.
        speed: String. `"constant"`, `"lognormal"` or `"pareto"`. Defaults
            to `"lognormal"`.
        sigma: Float >= 0. Log-normal spread (`speed="lognormal"` only).
            Defaults to `0.2`.
        alpha: Float > 1. Pareto shape (`speed="pareto"` only); the mean
            step time is 1 whatever `alpha`. Defaults to `2.5`.
        stragglers: Dict or `None`. Worker index to slowdown factor (> 0),
            e.g. `{0: 4.0}`: every step of that worker takes `factor` times
            its draw (a persistently slow worker, on top of the per-step
            draws).
        outages: Dict or `None`. Worker index to `(start, end)` times.
        gap: Float >= 0, or a dict of worker index to float. Time between a
            worker's update and its next read, in step times. Defaults to
            `0.0` (workers compute all the time).
        concurrency: Integer >= 1 or `None`. At most this many workers are
            between their read and their update at once (workers sharing
            CPU cores or an accelerator); a worker ready to start waits for
            a free slot, first come first served, and reads the weights when
            it gets one. `None` (default): no limit.
        restart_stale: Integer >= 1, `"adaptive"` or `None`. Ringmaster
            ASGD's stopping form (Maranjyan et al. 2025; the wrapper is
            `kd.optimizers.Ringmaster`): as soon as a worker's computation
            has `R` updates landed since its read, it is stopped and starts
            again on the weights of that moment (a fresh step time), so
            every update lands with `tau < R` and no time goes into a
            gradient that would be ignored. `"adaptive"`: `R = max(1,
            floor(sqrt(k)))` for the `k`-th update. The stopped count is
            `Schedule.stopped`. Not with `outages`, `gap` or `concurrency`.
            `None` (default): nothing is stopped.
        seed: Integer. Defaults to `0`.

    Returns:
        A `Schedule`.

    Example:

    >>> from keras_dist import simulate
    >>> s = simulate.schedule(4, 100, speed="constant")
    >>> sorted(set(s.staleness[4:].tolist()))   # equal workers: N - 1 each
    [3]
    >>> s = simulate.schedule(4, 100, speed="constant", gap=1.0)
    >>> float(s.staleness[4:].mean())   # (N - 1) / (1 + gap)
    1.5
    >>> s = simulate.schedule(16, 4000, speed="pareto", alpha=2.5)
    >>> round(float(np.diff(s.times).mean() * 16), 1)   # mean step time 1
    1.0

    Raises:
        ValueError: for bad counts, speeds, spreads, shapes, factors,
            outages, gaps or concurrency.
    """
    _check_int(workers, "workers", 1)
    _check_int(updates, "updates", 0)
    stragglers = _check_stragglers(stragglers, workers)
    duration = _step_time_sampler(speed, sigma, alpha, stragglers, np.random.default_rng(seed))
    outages = dict(outages or {})
    for worker, (start, end) in outages.items():
        if not 0 <= worker < workers or not 0 <= start < end:
            raise ValueError(
                f"`outages` maps a worker index in [0, {workers}) to (start, end) with "
                f"0 <= start < end. Received: {{{worker!r}: ({start!r}, {end!r})}}.")
    gaps = dict(gap) if isinstance(gap, dict) else {w: gap for w in range(workers)}
    for worker, value in gaps.items():
        if (isinstance(value, bool) or not isinstance(value, (int, float, np.floating))
                or not 0 <= value < np.inf or not 0 <= worker < workers):
            raise ValueError(
                f"`gap` is a time >= 0, or a dict mapping a worker index in [0, {workers}) "
                f"to one. Received: gap={gap!r}.")
    if concurrency is not None:
        _check_int(concurrency, "concurrency", 1)
    if restart_stale is not None:
        if restart_stale != "adaptive":
            _check_int(restart_stale, "restart_stale", 1)
        if outages or any(gaps.values()) or concurrency is not None:
            raise ValueError(
                "`restart_stale` simulates workers that compute all the time and restart on "
                "fresh weights; it does not combine with `outages`, `gap` or `concurrency`. "
                f"Received: restart_stale={restart_stale!r} with outages={outages or None!r}, "
                f"gap={gap!r}, concurrency={concurrency!r}.")
        return _restarting_schedule(workers, updates, duration, restart_stale)
    if concurrency is not None:
        return _limited_schedule(workers, updates, duration, outages, gaps, concurrency)
    finish = np.array([duration(w) for w in range(workers)])
    read_at = np.zeros(workers, dtype=np.int64)
    order = np.empty(updates, dtype=np.int64)
    taus = np.empty(updates, dtype=np.int64)
    times = np.empty(updates)
    pending_reads = {}  # worker -> time it reads the weights (after an outage or a gap)
    for version in range(updates):
        while True:
            w = int(np.argmin(finish))  # ties: lowest index (round-robin)
            outage = outages.get(w)
            if outage and finish[w] > outage[0]:
                # Down during this step: the step is lost; it reads the weights
                # afresh when it comes back and starts over.
                pending_reads[w] = outage[1]
                finish[w] = outage[1] + duration(w)
                outages.pop(w)
                continue
            break
        for worker, read_time in list(pending_reads.items()):
            if read_time < finish[w]:  # every update up to read_time is known now
                read_at[worker] = _version_at(times[:version], read_time)
                del pending_reads[worker]
        order[version], taus[version], times[version] = w, version - read_at[w], finish[w]
        wait = gaps.get(w, 0.0)
        if wait:  # it reads after its gap: the version then is known later
            pending_reads[w] = finish[w] + wait
            finish[w] += wait + duration(w)
        else:
            read_at[w] = version + 1
            finish[w] += duration(w)
    return Schedule(order, taus, times)


def _restarting_schedule(workers, updates, duration, threshold):
    """`schedule` whose workers are stopped and restart on fresh weights once
    their computation's delay reaches the threshold (Ringmaster's stops)."""
    order = np.empty(updates, dtype=np.int64)
    taus = np.empty(updates, dtype=np.int64)
    times = np.empty(updates)
    finish = np.array([duration(w) for w in range(workers)])
    read_at = np.zeros(workers, dtype=np.int64)
    stopped = 0
    for version in range(updates):
        w = int(np.argmin(finish))
        order[version], taus[version], times[version] = w, version - read_at[w], finish[w]
        now, landed = finish[w], version + 1
        read_at[w] = landed
        finish[w] = now + duration(w)
        # The next update is the (landed + 1)-th: whoever would land it with
        # tau >= R stops now and starts again on these weights.
        limit = (max(1, int(np.sqrt(landed + 1))) if threshold == "adaptive"
                 else threshold)
        for other in np.flatnonzero(landed - read_at >= limit):
            read_at[other] = landed
            finish[other] = now + duration(int(other))
            stopped += 1
    return Schedule(order, taus, times, stopped)


def _limited_schedule(workers, updates, duration, outages, gaps, concurrency):
    """`schedule` with at most `concurrency` workers computing at once, as
    events in time order: a worker's update lands (kind 0), or a worker is
    ready to start a step (kind 1; after its gap or an outage). Step times
    are drawn when a step is scheduled, in the same order as `schedule`
    draws them, so `concurrency >= workers` gives `schedule`'s result."""
    order = np.empty(updates, dtype=np.int64)
    taus = np.empty(updates, dtype=np.int64)
    times = np.empty(updates)
    read_at = np.zeros(workers, dtype=np.int64)
    step = {w: duration(w) for w in range(workers)}  # each worker's next step time
    events, waiting = [], collections.deque()
    state = {"landed": 0, "computing": 0}

    def start(w, now):  # it reads the weights now: every update landed so far
        state["computing"] += 1
        read_at[w] = state["landed"]
        heapq.heappush(events, (now + step.pop(w), 0, w))

    def fill(now):
        while waiting and state["computing"] < concurrency:
            start(waiting.popleft(), now)

    waiting.extend(range(workers))
    fill(0.0)
    while state["landed"] < updates:
        now, kind, w = heapq.heappop(events)
        if kind == 1:
            waiting.append(w)
            fill(now)
            continue
        state["computing"] -= 1
        outage = outages.get(w)
        if outage and now > outage[0]:  # down during this step: lost; back at the end
            outages.pop(w)
            step[w] = duration(w)
            heapq.heappush(events, (outage[1], 1, w))
        else:
            u = state["landed"]
            order[u], taus[u], times[u] = w, u - read_at[w], now
            state["landed"] += 1
            step[w] = duration(w)
            wait = gaps.get(w, 0.0)
            if wait:
                heapq.heappush(events, (now + wait, 1, w))
            else:
                waiting.append(w)
        fill(now)
    return Schedule(order, taus, times)


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
        epochs: Integer. Passes over the data. Defaults to `1`.
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

    @tf.function(reduce_retracing=True)
    def loss_and_grads(weights, state, xb, yb):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            y_pred, new_state = model.stateless_call(weights, state, xb, training=True)
            loss = model.compute_loss(x=xb, y=yb, y_pred=y_pred, training=True)
            scaled = optimizer.scale_loss(loss)  # a LossScaleOptimizer unscales in apply
        return loss, tape.gradient(scaled, weights), new_state

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
            to `1`.
        batch_size: Integer. Each worker's batch. Defaults to `32`.
        validation_data: Tuple `(x_val, y_val)` or `None`; evaluated with
            `model.evaluate` at each epoch's end.
        seed: Integer. Seeds the batch order and the step times. Defaults
            to `0`.
        lr_scaling: String. `"linear"`, `"sqrt"` or `"none"`. Defaults to
            `"linear"`.
        warmup: Float in [0, 1]. Fraction of the updates (at least one when
            above 0) over which the rate ramps up. Defaults to `0.1`.
        speed, sigma, alpha, stragglers: the speed model (see
            `sync_schedule`).

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

    @tf.function(reduce_retracing=True)
    def loss_and_grads(weights, state, xb, yb):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            y_pred, new_state = model.stateless_call(weights, state, xb, training=True)
            loss = model.compute_loss(x=xb, y=yb, y_pred=y_pred, training=True)
            scaled = optimizer.scale_loss(loss)  # a LossScaleOptimizer unscales in apply
        return loss, tape.gradient(scaled, weights), new_state

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


def _check_stragglers(stragglers, workers):
    stragglers = dict(stragglers or {})
    for worker, factor in stragglers.items():
        if not 0 <= worker < workers or not factor > 0:
            raise ValueError(
                f"`stragglers` maps a worker index in [0, {workers}) to a slowdown "
                f"factor > 0. Received: {{{worker!r}: {factor!r}}}.")
    return stragglers


def _step_time_sampler(speed, sigma, alpha, stragglers, rng):
    """`duration(worker)`: one step time of `worker`, drawn from `rng` (no
    draw for `"constant"`), times its straggler factor. Validates the speed
    model's arguments."""
    if speed not in SPEEDS:
        raise ValueError(f"`speed` must be one of {SPEEDS}. Received: speed={speed!r}.")
    if (isinstance(sigma, bool) or not isinstance(sigma, (int, float, np.floating))
            or not 0 <= sigma < np.inf):
        raise ValueError(f"`sigma` must be a float >= 0. Received: sigma={sigma!r}.")
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating))
            or not 1 < alpha < np.inf):
        raise ValueError(f"`alpha` must be a float > 1 (the Pareto mean is infinite "
                         f"at 1 and below). Received: alpha={alpha!r}.")
    minimum = (alpha - 1.0) / alpha  # Pareto scale x_m: the mean alpha x_m / (alpha - 1) is 1

    def duration(worker):
        if speed == "constant":
            base = 1.0
        elif speed == "lognormal":
            base = rng.lognormal(0.0, sigma)
        else:  # numpy's pareto is Lomax (Pareto II); 1 + it is Pareto I with minimum 1
            base = minimum * (1.0 + rng.pareto(alpha))
        return base * stragglers.get(worker, 1.0)

    return duration


def _version_at(times, t):
    """How many updates landed by simulated time `t`."""
    return int(np.searchsorted(times, t, side="right"))


def _check_int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}.")


__all__ = ["Schedule", "SyncSchedule", "epoch_times", "fit", "schedule", "sync_fit",
           "sync_schedule"]
