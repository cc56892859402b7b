"""The order and staleness of N asynchronous workers' updates, simulated.

`schedule` draws each worker's step times from a speed model and returns a
`Schedule`: which worker lands each update, with what staleness, at what
simulated time. The speed model's checks and sampler serve
`keras_dist.simulate.synchronous` too.
"""

import collections
import dataclasses
import heapq
from typing import Optional

import numpy as np

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
