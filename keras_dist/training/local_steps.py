"""Local steps on parameter-server workers: Downpour / local SGD / DiLoCo.

With `local_steps=k`, each scheduled execution on a worker

1. pulls the weights, the non-trainable state and the optimizer's state
   once (one round trip, together with the parameter version);
2. runs k training steps on that copy with Keras 3's stateless API
   (`keras.StatelessScope` around the model, `stateless_apply` for the
   optimizer -- see `keras_dist.training.stateless`): Keras' own loss, metrics and
   update rules, no round trip;
3. pushes the change `delta = w_k - w_pulled` with TF's atomic
   `assign_add` (the optimizer's step count adds k; its slots are the
   pushing worker's, last write wins), or,
   with an `outer_optimizer`, applies the pseudo-gradient `-delta` with
   that optimizer on the parameter servers (DiLoCo, async local SGD).

With `elastic=alpha` (EASGD, Zhang, Choromanska and LeCun 2015, in its
asynchronous form) each worker keeps its own weights `x_i` between rounds
(on the parameter servers, one row per worker, beside the weights): a
round starts from `x_i` instead of the pulled weights, and its push moves
the centre (the model's weights) and `x_i` towards each other,

    e = alpha * (x_i - centre_pulled);   x_i <- x_i - e;   centre <- centre + e

so the sum of the centre and every `x_i` changes only by local gradient
steps. The centre is read at the pull, a round before the exchange (the
paper reads it at the exchange; this saves a round trip).

With `steps_per_execution` a multiple of k, one execution chains several
rounds on its worker, with no round trip to the chief between them.

This is Downpour SGD with n_fetch = n_push = k (Dean et al. 2012), local
SGD (Stich 2019; Lin et al. 2020) in its asynchronous form and, with an
outer optimizer, DiLoCo (Douillard et al. 2023) / async local SGD (Liu et
al. 2024). Round trips to the parameter servers fall k-fold. Staleness
counts pushes: the version is read at the pull and claimed at the push.

One worker without an outer optimizer computes exactly k sequential steps
of the same optimizer (the push adds `w_k - w_0` to `w_0`: equal up to one
float rounding).
"""

import contextlib
import functools

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import driver
from keras_dist.training import gradients
from keras_dist.training import nonfinite
from keras_dist.training import stateless
from keras_dist.training import step_report
from keras_dist.training import steps as steps_lib
from keras_dist.training import update


def check_args(local_steps, outer_optimizer, elastic=None):
    """Validates the local-steps arguments on their own; returns a
    `keras_dist.training.plan.LocalSteps` (what `RunPlan.build` calls).

    Example:

    >>> from keras_dist.training import local_steps
    >>> local_steps.check_args(4, None)
    LocalSteps(steps=4, outer_optimizer=None, elastic=None)
    >>> local_steps.check_args(4, None, elastic=1.5)
    Traceback (most recent call last):
    ...
    ValueError: `elastic` must be a float in (0, 1] ... Received: elastic=1.5.

    Raises:
        ValueError: for `local_steps` < 1 or not an integer, an `elastic`
            outside (0, 1] or together with an outer optimizer, or an outer
            optimizer that is not a Keras optimizer.
    """
    from keras_dist.training.plan import LocalSteps

    if isinstance(local_steps, bool) or not isinstance(local_steps, (int, np.integer)) \
            or local_steps < 1:
        raise ValueError(
            f"`local_steps` must be an integer >= 1 (1: every step updates the "
            f"parameter servers). Received: local_steps={local_steps!r}.")
    check_elastic(elastic, outer_optimizer)
    if outer_optimizer is not None and not isinstance(outer_optimizer,
                                                      keras.optimizers.Optimizer):
        raise ValueError(
            "`outer_optimizer` must be a keras.optimizers.Optimizer instance (e.g. "
            "keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)). Received: "
            f"outer_optimizer={outer_optimizer!r}.")
    return LocalSteps(int(local_steps), outer_optimizer,
                      None if elastic is None else float(elastic))


def check_model(model, strategy, local):
    """Validates local steps (`local`, a `LocalSteps` that is `active`)
    against the strategy and the model (what `RunPlan.for_model` calls).

    Example:

    >>> import keras, tensorflow as tf
    >>> from keras_dist.training import local_steps
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> local_steps.check_model(model, tf.distribute.get_strategy(),
    ...                         local_steps.check_args(4, None))
    Traceback (most recent call last):
    ...
    ValueError: local_steps=4, outer_optimizer and elastic need parameter servers ...

    Raises:
        ValueError: for local steps under a synchronous strategy, with a
            `steps_per_execution` > 1 that is not a multiple of `local_steps`,
            with a custom `train_step`, or
            with an optimizer that cannot step on tensors (a
            `LossScaleOptimizer`).
    """
    local_steps = local.steps
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        raise ValueError(
            f"local_steps={local_steps}, outer_optimizer and elastic need parameter servers "
            f"(ParameterServerStrategy); the strategy is {type(strategy).__name__}. "
            "Under a synchronous strategy every step is already averaged over all "
            "replicas: drop `local_steps` / `outer_optimizer` / `elastic` there (a script that "
            "runs both ways can pass local_steps only when "
            "isinstance(strategy, tf.distribute.ParameterServerStrategy)).")
    spe = steps_lib.steps_per_execution(model)
    if spe > 1 and spe % local_steps:
        raise ValueError(
            f"local_steps={local_steps} with steps_per_execution={spe}: an execution "
            "runs whole rounds of local steps, so steps_per_execution must be 1 (one "
            f"round per execution) or a multiple of local_steps (e.g. {4 * local_steps}: "
            "4 rounds chained on the worker, with no round trip to the chief between "
            "them).")
    if type(model).train_step is not keras.Model.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides train_step; local steps run Keras' "
            "default step on tensors (the variables stay on the parameter servers) and "
            "cannot run a custom one. Train with local_steps=1 (your train_step then "
            "runs on every update), or move the custom logic into compute_loss.")
    check_optimizer(model.optimizer)


def check_optimizer(optimizer):
    """Raises `ValueError` for a model's optimizer that cannot take local
    steps (step on the worker's copy, on tensors; `check_model` and
    `keras_dist.simulate.fit` check it)."""
    if not stateless.supports(optimizer):
        raise ValueError(
            "Local steps need an optimizer that steps on the worker's copy (on tensors): "
            "a Keras optimizer, or a staleness-aware wrapper around one "
            f"(kd.optimizers); got {type(optimizer).__name__}. A LossScaleOptimizer "
            "(what Keras' compile adds under mixed_float16) cannot: train it with "
            "local_steps=1.")


def check_elastic(elastic, outer_optimizer):
    """Raises `ValueError` for an `elastic` (EASGD's alpha) that is not in
    (0, 1], or one given together with an outer optimizer."""
    if elastic is None:
        return
    if isinstance(elastic, bool) or not isinstance(elastic, (int, float)) or not (
            0 < elastic <= 1):
        raise ValueError(
            "`elastic` must be a float in (0, 1] (EASGD's moving rate alpha; the paper "
            f"suggests 0.9 / workers) or None. Received: elastic={elastic!r}.")
    if outer_optimizer is not None:
        raise ValueError(
            "`elastic` and `outer_optimizer` are two ways to push a round: EASGD moves "
            "the centre by alpha * (x_i - centre), an outer optimizer applies the "
            "pseudo-gradient. Pass one of them.")


def build_outer(outer_optimizer, model, strategy):
    """`outer_optimizer`, built for the model's trainable variables on the
    parameter servers. One created outside the strategy's scope (Keras
    optimizers make their step counter when constructed) is re-created from
    its config inside it; the returned optimizer is the one that trains."""
    if outer_optimizer is None or outer_optimizer.built:
        return outer_optimizer
    with strategy.scope():
        try:
            outer_optimizer.build(model.trainable_variables)
        except RuntimeError:  # "Mixing different tf.distribute.Strategy objects"
            outer_optimizer = type(outer_optimizer).from_config(outer_optimizer.get_config())
            outer_optimizer.build(model.trainable_variables)
    return outer_optimizer


class ElasticCopies:
    """EASGD's per-worker weights `x_i`: one `(workers, *shape)` variable per
    trainable weight, on the parameter servers, each row starting at the
    weights as they are when training begins.

    Example:

    >>> from keras_dist.training.local_steps import ElasticCopies
    >>> import keras
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> copies = ElasticCopies(model, workers=4, alpha=0.2)
    >>> [tuple(v.shape) for v in copies.variables]
    [(4, 3, 2), (4, 2)]
    """

    def __init__(self, model, workers, alpha):
        self.alpha, self.workers = float(alpha), int(workers)
        self.variables = [
            tf.Variable(tf.tile(v.value[None], [workers] + [1] * len(v.shape)),
                        trainable=False, name=f"elastic_{v.name}")
            for v in model.trainable_variables]

    def read(self, worker):
        return [tf.gather(c, worker[None])[0] for c in self.variables]

    def write(self, worker, values):
        return [c.scatter_update(tf.IndexedSlices(x[None], worker[None]))
                for c, x in zip(self.variables, values)]


def local_round(state, batches, worker, faults, outer_optimizer, elastic=None,
                per_round=None):
    """Rounds of local steps on a worker: `len(batches)` steps in rounds of
    `per_round` (default: all of them, one round), each one pull, its steps
    and one push, with no chief round trip between rounds.

    `state` is the executor's `WorkerStep`; `elastic` its `ElasticCopies`
    (EASGD) or `None`. When every variable a round reads and writes lives
    on one parameter server (`gradients.home_device`), the pull and the push
    are one transfer each (`gradients.Packed`) and the push's math runs
    there. A round's steps after its first run in a `tf.while_loop` on the
    worker (`_LocalSteps`); the rounds are unrolled, each pull after the
    previous push (TF orders a variable's reads after its writes). Returns
    the packed `step_report` vector (one tau per round, and the rounds'
    pull, step and push times).
    """
    model = state.model
    variables = _RoundVariables(model, state, elastic)
    n = len(batches)
    per_round = n if per_round is None else max(1, min(n, int(per_round)))
    start, batches = step_report.start_clock(batches)
    worker_index = tf.cast(worker, tf.int32)
    metrics = [tf.zeros(v.shape, v.dtype) for v in state.metrics.variables]
    examples = tf.constant(0.0, tf.float64)
    taus, skips, logs, round_start = [], [], {}, start
    phases = [tf.constant(0.0, tf.float64)] * 3  # pull, compute, push
    for first in range(0, n, per_round):
        pulled = variables.pull(worker_index)
        with tf.control_dependencies(pulled.start + pulled.opt):
            pulled_at = tf.timestamp()
        steps = _LocalSteps(model, variables, worker_index)
        w, nt, metrics, opt, logs, examples = steps.run(
            batches[first:first + per_round], pulled.start, pulled.nt, metrics, pulled.opt,
            examples)
        with tf.control_dependencies(w):
            stepped_at = tf.timestamp()
        tau, skipped = variables.push(pulled, w, nt, opt, outer_optimizer, worker,
                                      worker_index, faults, round_start)
        taus.append(tau)
        skips.append(skipped)
        with tf.control_dependencies([tau]):
            pushed_at = tf.timestamp()
        phases = [phases[0] + pulled_at - round_start, phases[1] + stepped_at - pulled_at,
                  phases[2] + pushed_at - stepped_at]
        round_start = pushed_at  # the next round's clock (slowed rounds)
    # The last push's writes are done when its tau is back: the execution's
    # seconds end there, at its last claim.
    seconds = claimed = round_start - start
    loss_sum, loss_count = state.metrics.loss_state(metrics)
    logs, names = scalar_logs(logs)
    state.log_names[n] = names
    return step_report.pack(worker, seconds, examples, loss_sum, loss_count, taus,
                            logs, names, state=metrics, skipped=tf.add_n(skips),
                            claimed=claimed, phases=phases)


class _LocalSteps:
    """A round's steps on the worker's copy: the first one traced as it is,
    the others in a `tf.while_loop` (nothing in it crosses to another
    device), so the graph holds two steps however long the round."""

    def __init__(self, model, variables, worker_index):
        self.model, self.variables, self.worker = model, variables, worker_index

    def step(self, data, w, nt, metrics, opt):
        v = self.variables
        return _local_step(self.model, self.model.optimizer, data, v.trainable, w,
                           v.non_trainable, nt, v.state.metrics.variables, metrics, opt,
                           v.tracker, self.worker)

    def run(self, batches, w, nt, metrics, opt, examples):
        nt0, opt0 = list(nt), list(opt)
        w, nt, metrics, opt, logs = self.step(batches[0], list(w), nt0, metrics, opt0)
        examples += step_report.batch_examples(batches[0])
        if len(batches) == 1:
            return w, nt, metrics, opt, logs, examples
        # State a step leaves as it was (a learning rate) stays that very
        # tensor: the push writes back only what changed.
        nt_moves = [new is not old for new, old in zip(nt, nt0)]
        opt_moves = [new is not old for new, old in zip(opt, opt0)]
        readable = _Batches(batches[1:])
        state = (w, _moving(nt, nt_moves), metrics, _moving(opt, opt_moves), logs, examples)

        def body(i, *flat):
            w, nt, metrics, opt, logs, examples = tf.nest.pack_sequence_as(state, list(flat))
            data = readable.read(i)
            w, nt, metrics, opt, logs = self.step(data, w, _whole(nt, nt0, nt_moves), metrics,
                                                  _whole(opt, opt0, opt_moves))
            new = (w, _moving(nt, nt_moves), metrics, _moving(opt, opt_moves), logs,
                   examples + step_report.batch_examples(data))
            return (i + 1,) + tuple(tf.nest.flatten(new))

        _, *flat = tf.while_loop(lambda i, *_: i < len(batches) - 1, body,
                                 (tf.constant(0),) + tuple(tf.nest.flatten(state)))
        w, nt, metrics, opt, logs, examples = tf.nest.pack_sequence_as(state, flat)
        return (w, _whole(nt, nt0, nt_moves), metrics, _whole(opt, opt0, opt_moves), logs,
                examples)


def _moving(values, moves):
    return [v for v, moved in zip(values, moves) if moved]


def _whole(moving, originals, moves):
    moving = iter(moving)
    return [next(moving) if moved else original for original, moved in zip(originals, moves)]


class _Batches:
    """An execution's batches, readable by a loop index: one `TensorArray`
    per component (a last smaller batch included)."""

    def __init__(self, batches):
        self.structure = batches[0]
        flat = [tf.nest.flatten(b) for b in batches]
        self.shapes, self.arrays = [], []
        for j, first in enumerate(flat[0]):
            if first is None:
                self.shapes.append(None), self.arrays.append(None)
                continue
            shape = first.shape
            for other in flat[1:]:
                shape = shape.most_specific_compatible_shape(other[j].shape)
            array = tf.TensorArray(first.dtype, size=len(batches), infer_shape=False)
            for i, f in enumerate(flat):
                array = array.write(i, f[j])
            self.shapes.append(shape), self.arrays.append(array)

    def read(self, index):
        values = []
        for array, shape in zip(self.arrays, self.shapes):
            if array is None:
                values.append(None)
                continue
            value = array.read(index)
            value.set_shape(shape)
            values.append(value)
        return tf.nest.pack_sequence_as(self.structure, values)


class _Pulled:
    """What a round's pull read: on the worker (`start`, the weights the
    steps start from; `w0`, the model's weights; `nt`, `opt`) and where the
    values live (`remote`: the same reads on the parameter server, for the
    push's math there; the worker's copies when nothing was packed)."""

    def __init__(self, read, w0, nt, opt, x_start, remote):
        self.read, self.w0, self.nt, self.opt, self.x_start = read, w0, nt, opt, x_start
        self.start = x_start if x_start is not None else w0
        self.remote = remote


class _RoundVariables:
    """The variables a round of local steps pulls and pushes, and where."""

    def __init__(self, model, state, elastic):
        self.state, self.elastic = state, elastic
        self.trainable = list(model.trainable_variables)
        self.non_trainable = list(model.non_trainable_variables)
        self.opt_vars = list(model.optimizer.variables)
        self.tracker = next((m for m in model.metrics if m.name == "loss"), None)
        held = self.trainable + self.non_trainable + self.opt_vars
        if elastic is not None:
            held = held + list(elastic.variables)
        # One parameter server holds them all: pull and push in one transfer
        # each, the push's math there. Else (several servers, sharded
        # weights) every variable is read and written on its own.
        self.home = gradients.home_device(held) if state.options.ship_gradients else None

    def _device(self):
        return tf.device(self.home) if self.home is not None else contextlib.nullcontext()

    def pull(self, worker_index):
        """The version, weights, other state, optimizer state (and EASGD's
        copy): one round trip."""
        read = self.state.version.read()
        with self._device():
            values = [v.value.read_value() for v in self.trainable + self.non_trainable
                      + self.opt_vars]
            if self.elastic is not None:
                values += self.elastic.read(worker_index)
            packed = gradients.Packed(values) if self.home is not None else None
        local = packed.unpack() if packed is not None else values
        n, m, o = len(self.trainable), len(self.non_trainable), len(self.opt_vars)
        x_start = local[n + m + o:] if self.elastic is not None else None
        return _Pulled(read, local[:n], local[n:n + m], local[n + m:n + m + o], x_start,
                       remote=values)

    def push(self, pulled, w, nt, opt, outer, worker, worker_index, faults, round_start):
        """Adds the round's change to the parameter servers (or applies it
        with the outer optimizer; EASGD: exchanges it with the centre), under
        the non-finite policy. Returns `(tau, skipped)` on the worker: a
        skipped round (float64 0/1) is reported, not written."""
        n, m = len(self.trainable), len(self.non_trainable)
        moved = w if self.elastic is not None else [a - b for a, b in zip(w, pulled.start)]
        finite = gradients.all_finite(moved)
        skipped = tf.cast(tf.logical_not(finite), tf.float64)
        ready = after_slowdown(faults, worker, round_start, moved)  # the round, slowed down
        checks = ([nonfinite.check(finite, "round")] if self.state.policy.mode == "raise"
                  else [])
        # Only the state the steps changed goes back (a learning rate does not).
        state_vars, state_new, state_old, counters = [], [], [], []
        for variables, new, old, remote, optimizer_state in (
                (self.non_trainable, nt, pulled.nt, pulled.remote[n:n + m], False),
                (self.opt_vars, opt, pulled.opt, pulled.remote[n + m:], True)):
            for v, a, b, r in zip(variables, new, old, remote):
                if a is not b:
                    state_vars.append(v), state_new.append(a), state_old.append(r)
                    counters.append(optimizer_state and not a.dtype.is_floating)
        with tf.control_dependencies(ready + checks):
            flags = tf.stack([tf.cast(finite, tf.float32), tf.cast(worker_index, tf.float32)])
            sent = [tf.identity(t) for t in moved + state_new] + [flags]
        if self.home is not None:
            packed = gradients.Packed(sent)
        with self._device():
            arrived = packed.unpack() if self.home is not None else sent
            moved, state_new = arrived[:n], arrived[n:-1]
            finite = arrived[-1][0] > 0.5
            where = tf.cast(arrived[-1][1], tf.int32)
            w0 = pulled.remote[:n]
            with tf.control_dependencies([arrived[-1]]):
                one = tf.ones([], tf.int64)
            tau = self.state.version.claim(pulled.read, one)
            if self.elastic is not None:
                writes = self._exchange(moved, w0, pulled.remote[-n:], where, finite)
            elif outer is None:
                writes = [v.value.assign_add(tf.where(finite, d, tf.zeros_like(d)))
                          for v, d in zip(self.trainable, moved)]
            else:
                writes = []  # done before the function returns, like every write
                if self._outer(outer, moved, w0, tau, worker, finite):
                    skipped = tf.constant(0.0, tf.float64)  # the policy counted it
            writes += _state_writes(state_vars, state_new, state_old, counters, finite)
            with tf.control_dependencies(writes):
                tau = tf.identity(tau)  # back once every write is done
        return tau, skipped

    def _outer(self, outer, delta, pulled, tau, worker, finite):
        """Applies the pseudo-gradient `-delta` with the outer optimizer;
        returns whether the policy counts a skipped round itself (else the
        worker's report does)."""
        info = update.UpdateInfo(staleness=tau, pulled=pulled, worker=worker)
        policy = self.state.policy
        gated = policy.apply(functools.partial(update.apply_with, info, outer.apply),
                             [-d for d in delta], self.trainable, finite=finite,
                             optimizer=outer, gate=True)
        return gated is None

    def _exchange(self, x, centre, x_start, worker, finite):
        """EASGD's exchange: `e = alpha (x_i - centre)`; the centre gains `e`,
        the worker's copy keeps `x_i - e`. A round that ended non-finite
        changes nothing: the copy stays `x_start`, as read at the pull (only
        this worker writes its row)."""
        elastic = self.elastic
        moves = [tf.where(finite, elastic.alpha * (xi - c), tf.zeros_like(c))
                 for xi, c in zip(x, centre)]
        writes = [v.value.assign_add(e) for v, e in zip(self.trainable, moves)]
        writes += elastic.write(worker, [tf.where(finite, xi - e, old)
                                         for xi, e, old in zip(x, moves, x_start)])
        return writes


def _local_step(model, optimizer, data, trainable, w, non_trainable, nt, metric_vars,
                metrics, opt, tracker, worker):
    """Keras' default `train_step` on tensors: returns the new state."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mapping = (list(zip(trainable, w)) + list(zip(non_trainable, nt))
               + list(zip(metric_vars, metrics)))
    with tf.GradientTape() as tape:
        tape.watch(w)
        with keras.StatelessScope(mapping, collect_losses=True) as scope:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                      training=True)
            if tracker is not None:
                first = next(t for t in tf.nest.flatten(x) if t is not None)
                tracker.update_state(loss, sample_weight=tf.shape(first)[0])
            logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    grads = tape.gradient(loss, w)
    w, opt = step_on_copy(optimizer, opt, grads, w, worker)
    nt = [_current(scope, v, old) for v, old in zip(non_trainable, nt)]
    metrics = [_current(scope, v, old) for v, old in zip(metric_vars, metrics)]
    return list(w), nt, metrics, list(opt), driver.flatten_logs(logs or {})


def scalar_logs(logs):
    """The scalar entries of a step's logs, flattened (`driver.flatten_logs`),
    and their names in order: what a worker's report carries."""
    logs = {name: value for name, value in driver.flatten_logs(logs).items()
            if tf.is_tensor(value) and value.shape.rank == 0 or isinstance(value, (int, float))}
    return logs, sorted(logs)


def after_slowdown(faults, worker, start, ready):
    """`ready` (tensors), or, when injected faults slow `worker` down, what
    is ready once it has slept `factor - 1` times the time since `start`
    (so the step or round takes `factor` times as long)."""
    if not (faults and faults.slowed):
        return list(ready)
    with tf.control_dependencies(ready):
        now = tf.timestamp()
    return faults.slow_down(worker, now - start, now) or list(ready)


def step_on_copy(optimizer, optimizer_state, grads, weights, worker):
    """One local step's update of the worker's copy, on tensors: `(new
    weights, new optimizer state)`.

    The update has staleness 0 and the copy as its pulled weights: nothing
    but this worker writes its copy. So a staleness-aware wrapper as the
    model's optimizer steps exactly as its inner optimizer (DANA: as
    Nesterov SGD with this worker's velocity); it corrects for staleness as
    the outer optimizer, which applies whole pushes.
    """
    info = update.UpdateInfo(staleness=0, pulled=weights, worker=worker)
    return update.apply_with(info, stateless.stateless_apply, optimizer, optimizer_state,
                             grads, weights)


def _state_writes(variables, new_values, old_values, counters, finite):
    """The optimizer's own state and other state after a round. Counters
    (the optimizer's integer state: iterations) add their change; slots
    (momentum, moments) and other state (BatchNormalization statistics)
    are the pushing worker's: last write wins. Adding every worker's slot
    change summed their momentum and made SGD with momentum 0.9 diverge on
    2 workers (test accuracy 0.56)."""
    writes = []
    for v, new, old, counter in zip(variables, new_values, old_values, counters):
        if counter:
            writes.append(v.value.assign_add((new - old) * tf.cast(finite, new.dtype)))
        else:
            writes.append(v.value.assign(tf.where(finite, new, old)))
    return writes


def _current(scope, variable, old):
    new = scope.get_current_value(variable)
    return old if new is None else new
