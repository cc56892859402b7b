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

This is Downpour SGD with n_fetch = n_push = k (Dean et al. 2012), local
SGD (Stich 2019; Lin et al. 2020) in its asynchronous form and, with an
outer optimizer, DiLoCo (Douillard et al. 2023) / async local SGD (Liu et
al. 2024). Round trips to the parameter servers fall k-fold. Staleness
counts pushes: the version is read at the pull and claimed at the push.

One worker without an outer optimizer computes exactly k sequential steps
of the same optimizer (the push adds `w_k - w_0` to `w_0`: equal up to one
float rounding).
"""

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
        ValueError: for local steps under a synchronous strategy, together
            with `steps_per_execution` > 1, with a custom `train_step`, or
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
    if spe > 1 and local_steps > 1:
        raise ValueError(
            f"local_steps={local_steps} with steps_per_execution={spe}: an execution "
            "of local steps is already `local_steps` steps on the worker. Compile with "
            "steps_per_execution=1, or use steps_per_execution alone (every step then "
            "updates the parameter servers).")
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


def local_round(state, batches, worker, faults, outer_optimizer, elastic=None):
    """One pull, `len(batches)` local steps and one push, on a worker.

    `state` is the executor's `_AsyncState`; `elastic` its `ElasticCopies`
    (EASGD) or `None`. Returns the packed `step_report` vector (one tau:
    the push's).
    """
    model, optimizer = state.model, state.model.optimizer
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    metric_vars = state.metrics.variables
    opt_vars = list(optimizer.variables)
    start, batches = step_report.start_clock(batches)
    # The pull: version, weights, other state, optimizer state; one round trip.
    read = state.version.read()
    w0 = [v.value.read_value() for v in trainable]
    nt0 = [v.value.read_value() for v in non_trainable]
    nt = list(nt0)
    opt0 = [v.value.read_value() for v in opt_vars]
    worker_index = tf.cast(worker, tf.int32)
    start_from = elastic.read(worker_index) if elastic is not None else w0
    w, opt = list(start_from), list(opt0)
    metrics = [tf.zeros(v.shape, v.dtype) for v in metric_vars]
    tracker = next((m for m in model.metrics if m.name == "loss"), None)
    examples = tf.constant(0.0, tf.float64)
    logs = {}
    for data in batches:
        w, nt, metrics, opt, logs = _local_step(model, optimizer, data, trainable, w,
                                                non_trainable, nt, metric_vars, metrics,
                                                opt, tracker, worker_index)
        examples += step_report.batch_examples(data)
    delta = [new - old for new, old in zip(w, start_from)]
    ready = after_slowdown(faults, worker, start, delta)  # the round, slowed down
    with tf.control_dependencies(ready):
        one = tf.ones([], tf.int64)
    tau = state.version.claim(read, one)
    if elastic is not None:
        writes, skipped = _push_elastic(state, elastic, trainable, w, w0, start_from,
                                        worker_index, opt_vars, opt, opt0, non_trainable,
                                        nt, nt0)
    else:
        writes, skipped = _push(state, outer_optimizer, trainable, delta, opt_vars, opt, opt0,
                                non_trainable, nt, nt0, tau, worker, w0)
    with tf.control_dependencies([tau]):
        claimed = tf.timestamp() - start
    with tf.control_dependencies(writes + [claimed]):  # claimed <= seconds
        seconds = tf.timestamp() - start
    loss_sum, loss_count = state.metrics.loss_state(metrics)
    logs, names = scalar_logs(logs)
    state.log_names[len(batches)] = names
    return step_report.pack(worker, seconds, examples, loss_sum, loss_count, [tau],
                            logs, names, state=metrics, skipped=skipped, claimed=claimed)


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


def _push(state, outer, trainable, delta, opt_vars, opt, opt0, non_trainable, nt, nt0,
          tau, worker, pulled):
    """Adds the round's change to the parameter servers (or applies it with
    the outer optimizer), under the non-finite policy. Returns `(writes,
    skipped)`: a skipped round (0/1, float64) is reported, not written."""
    policy = state.policy
    finite, skipped, writes = _round_check(policy, delta)
    with tf.control_dependencies(writes):
        if outer is None:
            for v, d in zip(trainable, delta):
                writes.append(v.value.assign_add(tf.where(finite, d, tf.zeros_like(d))))
        else:
            info = update.UpdateInfo(staleness=tau, pulled=pulled, worker=worker)
            pseudo = [-d for d in delta]
            gated = policy.apply(functools.partial(update.apply_with, info, outer.apply),
                                 pseudo, trainable, finite=finite, optimizer=outer, gate=True)
            if gated is None:  # counted by the policy itself
                skipped = tf.constant(0.0, tf.float64)
        writes += _state_writes(opt_vars, opt, opt0, non_trainable, nt, nt0, finite)
    return writes, skipped


def _push_elastic(state, elastic, trainable, x, centre, x_start, worker, opt_vars, opt,
                  opt0, non_trainable, nt, nt0):
    """EASGD's exchange: `e = alpha (x_i - centre)`; the centre gains `e`,
    the worker's copy keeps `x_i - e`. A round that ended non-finite
    changes nothing (or raises): the copy stays `x_start`, as read at the
    pull (only this worker writes its row)."""
    finite, skipped, writes = _round_check(state.policy, x)
    with tf.control_dependencies(writes):
        elastic_moves = [tf.where(finite, elastic.alpha * (xi - c), tf.zeros_like(c))
                         for xi, c in zip(x, centre)]
        for v, e in zip(trainable, elastic_moves):
            writes.append(v.value.assign_add(e))
        writes += elastic.write(worker, [tf.where(finite, xi - e, old)
                                         for xi, e, old in zip(x, elastic_moves, x_start)])
        writes += _state_writes(opt_vars, opt, opt0, non_trainable, nt, nt0, finite)
    return writes, skipped


def _round_check(policy, values):
    """A round's non-finite check, on what it pushes: `(finite, skipped,
    checks)`; `skipped` is the float64 0/1 a skipped round reports, and under
    "raise" `checks` is the check that stops training
    (`keras_dist.training.nonfinite.check`), for the push to wait on."""
    finite = gradients.all_finite(values)
    skipped = tf.cast(tf.logical_not(finite), tf.float64)
    checks = [nonfinite.check(finite, "round")] if policy.mode == "raise" else []
    return finite, skipped, checks


def _state_writes(opt_vars, opt, opt0, non_trainable, nt, nt0, finite):
    """The optimizer's own state and other state after a round. Counters
    (iterations) add their change; slots (momentum, moments) are the pushing
    worker's: last write wins. Adding every worker's slot change summed their
    momentum and made SGD with momentum 0.9 diverge on 2 workers (test
    accuracy 0.56)."""
    writes = []
    for v, new, old in zip(opt_vars, opt, opt0):
        if new is old:
            continue
        if new.dtype.is_floating:
            writes.append(v.value.assign(tf.where(finite, new, old)))
        else:
            writes.append(v.value.assign_add((new - old) * tf.cast(finite, new.dtype)))
    for v, new, old in zip(non_trainable, nt, nt0):
        if new is not old:  # BatchNormalization statistics: last write wins
            writes.append(v.value.assign(tf.where(finite, new, old)))
    return writes


def _current(scope, variable, old):
    new = scope.get_current_value(variable)
    return old if new is None else new
