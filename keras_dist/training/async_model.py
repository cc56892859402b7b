"""`AsyncModel`: a `keras.Model` that trains asynchronously on parameter servers."""

import keras
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import sharded
from keras_dist.cluster.serving import serve


def _functional_arguments(args, kwargs):
    """Whether a model is being built functionally, by Keras' own rule."""
    return (len(args) == 2 or (len(args) == 1 and "outputs" in kwargs)
            or ("inputs" in kwargs and "outputs" in kwargs))


_FUNCTIONAL = []
_VARIANTS = {}


def _functional_class():
    """Keras' `Functional` class, which Keras does not export: the class of
    what `keras.Model(inputs, outputs)` returns (made once, no variables; Keras 3.10
    refuses a model whose outputs are its inputs, hence the Identity)."""
    if not _FUNCTIONAL:
        inputs = keras.Input((1,))
        _FUNCTIONAL.append(type(keras.Model(inputs, keras.layers.Identity()(inputs))))
    return _FUNCTIONAL[0]


def _functional_variant(cls):
    """`cls` with Keras' Functional as a further base (made once per class).

    Keras builds a `keras.Model` subclass called with `(inputs, outputs)` by
    rewriting the class's bases to Functional, for good: a subclass of
    `AsyncModel` written with layers in `__init__` and `call` then fails (its
    instances are Functional without inputs). An `AsyncModel` built
    functionally is an instance of this variant instead, and `AsyncModel`
    itself stays as defined. The variant keeps `cls`'s name and, when `cls`
    is registered for Keras serialization, its registered name.
    """
    functional = _functional_class()
    if issubclass(cls, functional):
        return cls
    if cls not in _VARIANTS:
        variant = type(cls.__name__, (cls, functional),
                       {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        registered = keras.saving.get_registered_name(cls)
        if registered != cls.__name__:
            # Saved under `cls`'s registered name; loading it (a functional
            # config) builds this variant again.
            package, _, name = registered.rpartition(">")
            keras.saving.register_keras_serializable(package=package, name=name)(variant)
        _VARIANTS[cls] = variant
    return _VARIANTS[cls]


@keras.saving.register_keras_serializable(package="keras_dist")
class AsyncModel(keras.Model):
    """A `keras.Model` whose `fit` trains asynchronously under parameter servers.

    Build it like any Keras model: functionally (`AsyncModel(inputs,
    outputs)`), by subclassing it instead of `keras.Model`, or from an
    existing functional / Sequential model with `AsyncModel.from_model`.
    Create and compile it inside the `ParameterServerStrategy` scope (what
    `keras_dist.resolve_strategy()` returns on a cluster with `ps` tasks): its
    variables then live on the parameter servers, and `fit` schedules the
    model's own `train_step` -- Keras', or your override -- on the workers
    through TF's `ClusterCoordinator` (`keras_dist.training.async_executor`). Each
    worker applies its update as soon as it has it; nobody waits for
    anybody. What a `train_step` may do there: docs/custom-train-step.md.

    Every step reads the parameter version before its forward pass and
    increments it after its update, so each update knows its staleness tau
    (updates applied by others in between); the epoch logs carry
    `staleness_mean` and `staleness_max`, and `model.staleness_stats` holds
    the last epoch's per-step records (worker, tau, seconds).

    Under any other strategy (or none) an `AsyncModel` is exactly a
    `keras.Model`, so a script runs locally first and on a cluster later
    without change. `evaluate` and `predict` also work under parameter
    servers (Keras' own do not): they run on the chief.

    Example:

    >>> import numpy as np, keras, keras_dist as kd
    >>> inputs = keras.Input((4,))
    >>> model = kd.AsyncModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((32, 4)), np.ones((32, 1)), epochs=1, verbose=0)
    >>> isinstance(model, keras.Model)
    True
    """

    def __new__(cls, *args, **kwargs):
        # Functional arguments: an instance of a subclass that is also Keras'
        # Functional, so Keras need not rewrite this class (see `_functional`).
        if _functional_arguments(args, kwargs):
            cls = _functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        if not _functional_arguments(args, kwargs):
            super().__init__(*args, **kwargs)
            return
        functional = _functional_class()
        if not isinstance(self, functional):  # a subclass passing inputs/outputs up
            self.__class__ = _functional_variant(type(self))
        # What keras.Model.__init__ does for functional arguments, minus its
        # rewrite of this class's bases: the trainer's set-up, then Functional's.
        super(keras.Model, self).__init__()
        functional.__init__(self, *args, **kwargs)

    nonfinite_updates = "skip"
    """What keras_dist's loops do with an update whose gradients contain
    NaN or Inf: `"skip"` it (it is counted as `skipped_nonfinite` in the
    epoch logs; the parameters are untouched) or `"raise"` (training stops
    with an error). Under a `LossScaleOptimizer` (mixed_float16), that
    optimizer skips them itself. Set it on the model
    (`model.nonfinite_updates = "raise"`) or pass it to `keras_dist.fit`."""

    @classmethod
    def from_model(cls, model):
        """An `AsyncModel` sharing the layers (and weights) of `model`.

        Works for functional and Sequential models with defined inputs. If
        `model` is compiled, the copy is compiled with the same settings
        (its optimizer is a fresh one of the same configuration).

        Example:

        >>> import keras, keras_dist as kd
        >>> seq = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> model = kd.AsyncModel.from_model(seq)
        >>> model.layers[-1] is seq.layers[-1]
        True
        """
        if isinstance(model, cls):
            return model
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            inputs = outputs = None
        if not inputs:
            raise ValueError(
                f"AsyncModel.from_model needs a functional or Sequential model "
                f"with defined inputs; {type(model).__name__} {model.name!r} has "
                "none. Subclass kd.AsyncModel instead of keras.Model, or start "
                "the Sequential model with keras.Input(shape).")
        if len(inputs) == 1:
            inputs = inputs[0]
        if len(outputs) == 1:
            outputs = outputs[0]
        async_model = cls(inputs=inputs, outputs=outputs, name=model.name)
        if getattr(model, "compiled", False):
            async_model.compile_from_config(model.get_compile_config())
        return async_model

    # ----------------------------------------------------------------- training
    def fit(self, x=None, y=None, local_steps=1, outer_optimizer=None, elastic=None,
            **kwargs):
        """`keras.Model.fit`, plus local steps under parameter servers.

        Args:
            local_steps: Integer >= 1. Under parameter servers, each worker
                pulls the weights once, takes this many steps on its own
                copy and pushes the change (Downpour / local SGD; see
                docs/local-steps.md). 1 (the default): every step updates
                the parameter servers.
            outer_optimizer: A `keras.optimizers.Optimizer` or `None`. With
                it, a push applies the pseudo-gradient `-(w_local - w_pulled)`
                with this optimizer on the parameter servers (DiLoCo);
                staleness-aware wrappers go here. `None`: the change is added.
            elastic: Float in (0, 1] or `None`. EASGD: each worker keeps its
                own weights between rounds of `local_steps`, and each push
                moves them and the model's weights (the centre) `elastic` of
                the way towards each other (docs/local-steps.md).
            **kwargs: `keras.Model.fit`'s arguments.
        """
        from keras_dist.training import api
        from keras_dist.training import plan as plan_lib
        from keras_dist.training.plan import RunPlan

        plan = RunPlan.build(self.distribute_strategy,
                             nonfinite_updates=self.nonfinite_updates,
                             local_steps=local_steps, outer_optimizer=outer_optimizer,
                             elastic=elastic, fit_kwargs=kwargs)
        if plan.serving_task and not plan.parameter_server:
            # A worker / ps task of the cluster serves here.
            serve(plan.cluster, grace_period=plan_lib.grace_period(kwargs.get("callbacks")))
        # Under parameter servers the asynchronous executor; under any other
        # strategy what `keras_dist.fit` does there (Keras' own loop with the
        # non-finite policy in it, or keras_dist's where Keras' fails), on
        # Keras' own `fit` of this model.
        return api.train(self, plan.for_model(self), x, y, keras_fit=super().fit, **kwargs)

    @property
    def version(self):
        """Integer or `None`. Updates applied so far: the parameter version
        under parameter servers; elsewhere (synchronous training, every
        update applied everywhere at once) the optimizer's `iterations`.
        `None` before the model has an optimizer."""
        counter = getattr(self, "version_counter", None)
        if counter is not None:
            return counter.value
        optimizer = getattr(self, "optimizer", None)
        return None if optimizer is None else int(optimizer.iterations.numpy())

    # --------------------------------------------------------------- inference
    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None,
                 return_dict=False, **kwargs):
        if not isinstance(self.distribute_strategy, tf.distribute.ParameterServerStrategy):
            return super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                    sample_weight=sample_weight, steps=steps,
                                    callbacks=callbacks, return_dict=return_dict,
                                    **kwargs)
        # Keras' `evaluate` takes one private keyword (`fit` passes it for its
        # cached validation data) and refuses any other; so does this one.
        kwargs.pop("_use_cached_eval_dataset", None)
        if kwargs:
            raise ValueError(f"Arguments not recognized: {kwargs}")
        from keras_dist.training import driver
        from keras_dist.training.sync_executor import SyncExecutor

        # On the chief, under the default strategy, reading the weights on
        # the parameter servers (embedding rows only: sharded.prepare).
        sharded.prepare(self)
        return driver.evaluate(SyncExecutor(self, tf.distribute.get_strategy()),
                               x, y,
                               batch_size=batch_size, verbose=verbose,
                               sample_weight=sample_weight, steps=steps,
                               callbacks=callbacks, return_dict=return_dict)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        if not isinstance(self.distribute_strategy, tf.distribute.ParameterServerStrategy):
            return super().predict(x, batch_size=batch_size, verbose=verbose,
                                   steps=steps, callbacks=callbacks)
        from keras_dist.training import driver

        return driver.predict_here(self, x, batch_size=batch_size, verbose=verbose,
                                   steps=steps, callbacks=callbacks)
