"""`fit()`, `evaluate()`, `predict()`: strategy-selecting drop-ins for Keras'.

`fit` builds the run's plan first (`keras_dist.training.plan.RunPlan`: the
strategy, the cluster, fault injection, the non-finite policy, local steps,
every argument checked, the environment read once), makes sure the model
lives in the strategy's scope, and trains by the plan's route (`train`):
Keras' own loop where it works (no strategy, one device), keras_dist's
epoch driver (`keras_dist.training.driver`) elsewhere, with the synchronous
executor where Keras 3's loop fails (several replicas: Mirrored,
MultiWorkerMirrored) and the asynchronous one on parameter servers.
"""

import functools
import inspect
import logging

import keras
import tensorflow as tf

from keras_dist import _compat
from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.cluster import plain_fit
from keras_dist.cluster.serving import serve
from keras_dist.training import driver
from keras_dist.training import nonfinite
from keras_dist.training import staleness
from keras_dist.training.async_executor import AsyncExecutor
from keras_dist.training.async_model import AsyncModel
from keras_dist.training.data import is_dataset_fn
from keras_dist.training.plan import Route, RunPlan, grace_period, needs_own_loop
from keras_dist.training.sync_executor import SyncExecutor

logger = logging.getLogger("keras_dist")


def fit(model, x=None, y=None, *, strategy="auto", cluster=None, nonfinite_updates=None,
        local_steps=1, outer_optimizer=None, elastic=None, variable_partitioner=None,
        **fit_kwargs):
    """Trains a Keras model with the right `tf.distribute` strategy.

    Same arguments and return value as `keras.Model.fit`, plus the choice of
    strategy. The strategy is resolved with `resolve_strategy` (explicit
    argument > `KERAS_DIST_STRATEGY` > `TF_CONFIG` / SLURM cluster > local
    GPUs > default) and one log line says which and why.

    `model` is either

    - a zero-argument function that builds and compiles the model
      (preferred: it is called inside the strategy's scope, so every variable
      is created where the strategy wants it), or
    - an already compiled `keras.Model`. If its variables were not created in
      the strategy's scope it is re-created there: same architecture
      (`keras.models.clone_model`), same current weights, same compile
      settings (`get_compile_config`). The optimizer's slot state (e.g.
      momentum) is not carried over, and the returned History belongs to the
      copy: use `history.model` to reach it.

    `x` may be arrays (or a dict / list / tuple of them: a list is several
    inputs, as in Keras), a `tf.data.Dataset` yielding batches of the
    *global* batch size, a Python generator or `keras.utils.PyDataset` (read
    through Keras' own adapters; not under parameter servers), a
    `tf.distribute.DistributedDataset` made with the same strategy, or a
    `dataset_fn(input_context)` returning per-replica batches (TF's
    `distribute_datasets_from_function` convention; needs `steps_per_epoch`).
    Arrays and datasets are sharded across workers the TF way (a whole batch
    per step is split over all replicas). With `steps_per_epoch`, epochs
    read passes over the input as Keras' do (`keras_dist.training.data.Passes`).

    Args:
        model: A compiled `keras.Model`, or a function returning one.
        x: Input data (see above).
        y: Targets, when `x` is arrays.
        strategy: String or `tf.distribute.Strategy`. See
            `resolve_strategy`. Defaults to `"auto"`.
        cluster: `ClusterConfig`, dict or `None` (read the environment).
        nonfinite_updates: `"skip"`, `"raise"` or `None` for the model's
            `nonfinite_updates` attribute if it has one, else `"skip"`. What
            happens to an update whose gradients are NaN or Inf, the same on
            one device (Keras' own loop, guarded at the optimizer:
            `keras_dist.training.nonfinite`) as on several replicas and parameter
            servers: skip it (weights, optimizer slots and `iterations`
            untouched) and count it (`skipped_nonfinite` in the logs of an
            epoch that skipped one), or raise `NonFiniteUpdateError`. Under
            "skip" the epoch's `loss` averages the batches whose loss was
            finite; a `keras.callbacks.TerminateOnNaN` still sees the
            skipped batch's NaN `loss` and stops (or raises) as in Keras.
            Keras' own `model.fit` applies such an update: the weights
            become NaN.
        local_steps: Integer >= 1. Parameter servers only: each worker pulls
            the weights once, takes `local_steps` steps on its copy and
            pushes the change (Downpour / local SGD, docs/local-steps.md).
            Defaults to 1 (every step updates the parameter servers); more
            raises `ValueError` under any other strategy.
        outer_optimizer: A Keras optimizer or `None`. Parameter servers
            only: applies each push's pseudo-gradient on the parameter
            servers (DiLoCo); `None` adds the change.
        elastic: Float in (0, 1] or `None`. Parameter servers only: EASGD,
            each worker keeps its own weights between rounds and each push
            moves them and the centre `elastic` of the way towards each
            other (docs/local-steps.md).
        variable_partitioner: A `tf.distribute.experimental.partitioners`
            partitioner or `None`. Parameter servers only: splits large
            variables across the parameter servers (docs/sharded-variables.md);
            passed to `resolve_strategy`, so `model` should be a function
            (its variables are then created sharded). `ValueError` under any
            other strategy.
        **fit_kwargs: Any other argument of `keras.Model.fit` (`epochs`,
            `batch_size`, `callbacks`, `validation_data`, ...).

    On a parameter-server cluster (`ps` tasks in `TF_CONFIG`) the chief
    trains asynchronously: the model becomes an `AsyncModel` (same layers and
    weights, `AsyncModel.from_model`) and `steps_per_epoch` counts updates
    from all workers together. On that cluster's `worker` and `ps` tasks this
    function serves and never returns; the launcher or scheduler stops them
    when the chief is done.

    Returns:
        A `keras.callbacks.History`; `history.model` is the trained model.

    Example:

    >>> import numpy as np, keras, keras_dist as kd
    >>> def build_model():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     return model
    >>> x, y = np.ones((64, 4)), np.ones((64, 1))
    >>> history = kd.fit(build_model, x, y, epochs=2, verbose=0)
    >>> len(history.history["loss"])
    2

    Raises:
        TypeError: if `model` is neither a `keras.Model` nor a function
            returning one.
        ValueError: if the model is not compiled, for bad strategy or data
            arguments, or for a `batch_size`, `epochs`, `initial_epoch`,
            `steps_per_epoch`, `validation_steps` or `validation_batch_size`
            that is not an integer in range (Keras accepts `batch_size=0` or
            `epochs=-3` silently); each message names the value and the fix.
    """
    plan = RunPlan.build(strategy, cluster, nonfinite_updates=nonfinite_updates,
                         local_steps=local_steps, outer_optimizer=outer_optimizer,
                         elastic=elastic, variable_partitioner=variable_partitioner,
                         fit_kwargs=fit_kwargs)
    if plan.serving_task:
        # A worker / ps task of a parameter-server cluster: never returns.
        serve(plan.cluster, grace_period=grace_period(fit_kwargs.get("callbacks")))
    model = _model_in_scope(model, plan.strategy)
    if plan.parameter_server and _convertible(model):
        with plan.strategy.scope():
            model = AsyncModel.from_model(model)
    return train(model, plan.for_model(model), x, y, **fit_kwargs)


def train(model, plan, x=None, y=None, keras_fit=None, **fit_kwargs):
    """Trains `model` (in `plan.strategy`'s scope) by the plan's route:
    the asynchronous executor on parameter servers; keras_dist's own loop
    where Keras' fails or a backup may resume mid-epoch; else `keras_fit`
    (Keras' own `fit` of the model, by default `keras.Model.fit`) with the
    non-finite policy inside it (`nonfinite.keras_loop`). `kd.fit` and
    `AsyncModel.fit` both end here."""
    route = plan.route(model, fit_kwargs.get("callbacks"))
    if route is Route.ASYNC:
        history = driver.fit(AsyncExecutor(model, plan), x, y, **fit_kwargs)
        if not isinstance(history.model, AsyncModel):  # a model trained as it is
            _own_fit_evaluate_and_predict(history.model, plan.strategy)
        return history
    with plain_fit.local_fit():  # a strategy chosen on purpose, even on a ps cluster
        if route is Route.SYNC:
            history = driver.fit(SyncExecutor(model, plan), x, y, **fit_kwargs)
            model = history.model
            if needs_own_loop(plan.strategy):  # not on one device (a mid-epoch backup)
                _own_fit_evaluate_and_predict(model, plan.strategy)
        else:
            if is_dataset_fn(x):
                x = plan.strategy.distribute_datasets_from_function(x)
            if keras_fit is None:  # AsyncModel.fit comes back here off parameter servers
                # (The class's fit where an earlier kd.fit made the model's
                # its own, `_own_fit_evaluate_and_predict`: that one comes here.)
                keras_fit = (functools.partial(keras.Model.fit, model)
                             if isinstance(model, AsyncModel)
                             else functools.partial(type(model).fit, model)
                             if _compat.overrides(model, "fit") else model.fit)
            history = nonfinite.keras_loop(model, plan.nonfinite_updates, keras_fit, x, y,
                                           **fit_kwargs)
    staleness.record_synchronous(history.model)
    return history


def evaluate(model, x=None, y=None, *, strategy=None, **evaluate_kwargs):
    """Evaluates a model under its strategy; a drop-in for `keras.Model.evaluate`.

    Needed after `fit` under MultiWorkerMirrored (and Mirrored with uneven
    batches), where Keras 3's own `evaluate` fails for the same reasons as its
    `fit`; elsewhere it simply calls `model.evaluate`. Under MultiWorkerMirrored
    every worker must call it (it is a collective).

    Args:
        model: A compiled `keras.Model` (e.g. `history.model`).
        x: Input data, as for `fit`.
        y: Targets, when `x` is arrays.
        strategy: `tf.distribute.Strategy` or `None` for the strategy the
            model's variables were created under.
        **evaluate_kwargs: Any other argument of `keras.Model.evaluate`.

    Returns:
        Like `keras.Model.evaluate`: a scalar, a list, or a dict with
        `return_dict=True`.

    Example:

    >>> import numpy as np, keras, keras_dist as kd
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    >>> loss = kd.evaluate(model, np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    >>> isinstance(loss, list)  # the loss and the metric
    True
    >>> logs = kd.evaluate(model, np.ones((8, 4)), np.ones((8, 1)), verbose=0,
    ...                    return_dict=True)
    >>> sorted(logs)
    ['loss', 'mae']
    """
    dist = strategy or model.distribute_strategy
    if isinstance(dist, tf.distribute.ParameterServerStrategy):
        return AsyncModel.evaluate(model, x, y, **evaluate_kwargs)
    if needs_own_loop(dist):
        return driver.evaluate(SyncExecutor(model, dist), x, y, **evaluate_kwargs)
    if is_dataset_fn(x):
        x = dist.distribute_datasets_from_function(x)
    # The class's: the model's own may be this function (after a `fit`).
    return type(model).evaluate(model, x, y, **evaluate_kwargs)


def predict(model, x, *, strategy=None, batch_size=None, verbose="auto", steps=None,
            callbacks=None):
    """Predicts with a model under its strategy; a drop-in for `keras.Model.predict`.

    Needed after `fit` under MultiWorkerMirrored and parameter servers (and
    Mirrored with several replicas), where Keras 3's own `predict` fails or
    splits the batches as its `fit` does. There the model's weights are the
    same on every replica, so this process predicts alone, on the batches of
    `x` in order, with one compiled call per batch (traced once; a smaller
    last batch reuses it): under MultiWorkerMirrored each worker that calls
    it gets every prediction, and no worker waits for another. Elsewhere it
    calls `model.predict`.

    Args:
        model: A `keras.Model` (e.g. `history.model`).
        x: Input arrays (or a dict / tuple of them) or a `tf.data.Dataset`
            of batches.
        strategy: `tf.distribute.Strategy` or `None` for the strategy the
            model's variables were created under.
        batch_size: Integer or `None` (32), for arrays.
        verbose: `"auto"`, 0, 1 or 2, as for `keras.Model.predict`.
        steps: Integer or `None`: at most this many batches.
        callbacks: `keras.callbacks.Callback`s; their `on_predict_*` hooks
            are called as Keras calls them.

    Returns:
        NumPy array(s) of predictions, one row per input row, in the
        structure of the model's outputs.

    Example:

    >>> import numpy as np, keras, keras_dist as kd
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> kd.predict(model, np.ones((5, 4)), verbose=0).shape
    (5, 2)
    """
    dist = strategy or model.distribute_strategy
    if not (isinstance(dist, tf.distribute.ParameterServerStrategy) or needs_own_loop(dist)):
        # The class's: the model's own may be this function (after a `fit`).
        return type(model).predict(model, x, batch_size=batch_size, verbose=verbose,
                                   steps=steps, callbacks=callbacks)
    return driver.predict_here(model, x, batch_size=batch_size, verbose=verbose, steps=steps,
                               callbacks=callbacks)


def _own_fit_evaluate_and_predict(model, strategy):
    """Keras' own `fit`, `evaluate` and `predict` fail where keras_dist runs
    its own loop (several replicas, several workers, parameter servers):
    after `fit` there the model's are keras_dist's (`kd.fit` under the same
    strategy, `kd.evaluate`, `kd.predict`), so a script that goes on with
    `model.fit(...)` trains as `kd.fit` did instead of failing in Keras
    (keras-team/keras#20585 under MultiWorkerMirrored)."""
    _compat.override(model, fit=_own_fit(model, strategy),
                     evaluate=functools.partial(evaluate, model, strategy=strategy),
                     predict=functools.partial(predict, model, strategy=strategy))


def _own_fit(model, strategy):
    """`model.fit` with Keras' own signature (positional arguments in
    Keras' order) that trains by `kd.fit` under `strategy`."""
    signature = inspect.signature(type(model).fit)

    def own_fit(*args, **kwargs):
        arguments = signature.bind(model, *args, **kwargs).arguments
        arguments.pop(next(iter(signature.parameters)))  # the model itself
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        return fit(model, strategy=strategy, **arguments)

    own_fit.__doc__ = type(model).fit.__doc__
    return own_fit


def _convertible(model):
    """Whether `model` is re-wrapped by `AsyncModel.from_model`: a plain
    functional or Sequential model with inputs, whose class is Keras' own
    and holds nothing of the user's. Any other model, a functional-style
    subclass with its own `train_step` included, is trained as it is: it
    keeps its class and its methods (docs/custom-train-step.md)."""
    if isinstance(model, AsyncModel):
        return True
    if not _compat.plain_functional_or_sequential(model):
        return False
    try:
        return bool(model.inputs) and bool(model.outputs)
    except (AttributeError, ValueError):
        return False


def _is_model(model):
    """Whether `model` is a model (to train as it is), not a function that
    builds one: a `keras.Model`, or an object with Keras' trainer API
    (`fit`, `compile`, `variables`) that is not a plain function, as the
    trainer-mixin models of Keras' own tests are."""
    if isinstance(model, keras.Model):
        return True
    if inspect.isfunction(model) or inspect.ismethod(model) or isinstance(
            model, functools.partial):
        return False
    return all(hasattr(model, name) for name in ("fit", "compile", "variables"))


def _model_in_scope(model, dist):
    if _is_model(model):
        _check_compiled(model, "The model passed to keras_dist.fit")
        if _created_in_scope(model, dist):
            return model
        return _recreate(model, dist)
    if not callable(model):
        raise TypeError(
            "keras_dist.fit expects a compiled keras.Model or a zero-argument "
            "function that builds and compiles one. Received: "
            f"{type(model).__name__}."
        )
    with dist.scope():
        built = model()
    if not _is_model(built):
        raise TypeError(
            f"The model function {getattr(model, '__name__', model)!r} must "
            f"return a keras.Model; it returned {type(built).__name__}."
        )
    _check_compiled(built, f"The model returned by {getattr(model, '__name__', model)!r}")
    if not _created_in_scope(built, dist):
        return _recreate(built, dist)
    return built


def _check_compiled(model, what):
    if not getattr(model, "compiled", False):
        raise ValueError(
            f"{what} is not compiled. Call `model.compile(optimizer=..., "
            "loss=...)` before training."
        )


def _created_in_scope(model, dist):
    if dist is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        return True  # the default strategy: nothing to place
    variables = model.variables
    if not variables:
        # Not built yet (a Sequential without Input, a subclassed model):
        # Keras keeps the strategy it was created under, and its variables
        # will be created there when it is built.
        return getattr(model, "distribute_strategy", None) is dist
    return all(dist.extended.variable_created_in_scope(v.value) for v in variables)


def _recreate(model, dist):
    try:
        config = model.get_compile_config()
        with dist.scope():
            clone = keras.models.clone_model(model)
            if model.built and not clone.built:
                clone.build(model.input_shape)
            clone.set_weights(model.get_weights())
            clone.compile_from_config(config)
    except Exception as error:  # clone_model / compile config can fail many ways
        raise ValueError(
            f"keras_dist could not re-create model {model.name!r} inside the "
            f"{type(dist).__name__} scope ({type(error).__name__}: {error}). "
            "Pass a function that builds and compiles the model instead; it is "
            "called inside the scope."
        ) from error
    logger.info(
        "keras_dist: re-created model %r inside the %s scope (weights and "
        "compile settings copied; optimizer slot state is not)",
        model.name, type(dist).__name__)
    return clone
