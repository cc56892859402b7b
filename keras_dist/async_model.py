"""`AsyncModel`: a `keras.Model` that trains asynchronously on parameter servers."""

import keras
import numpy as np
import tensorflow as tf

from keras_dist import testing
from keras_dist.cluster import ClusterConfig
from keras_dist.optimizers.base import StalenessAwareOptimizer, apply_if, staleness_aware_in
from keras_dist.serve import serve
from keras_dist.staleness import VersionCounter


def serve_if_serving_task(cluster=None):
    """On a worker / ps task of a parameter-server cluster: serve forever."""
    cluster = cluster or ClusterConfig.from_env()
    if (cluster is not None and cluster.strategy_kind == "parameter_server"
            and cluster.task_type in ("worker", "ps")):
        serve(cluster)


@keras.saving.register_keras_serializable(package="keras_dist")
class AsyncModel(keras.Model):
    """A `keras.Model` whose `fit` trains asynchronously under parameter servers.

    Build it like any Keras model: functionally (`AsyncModel(inputs,
    outputs)`), by subclassing it instead of `keras.Model`, or from an
    existing functional / Sequential model with `AsyncModel.from_model`.
    Create and compile it inside the `ParameterServerStrategy` scope (what
    `keras_dist.resolve_strategy()` returns on a cluster with `ps` tasks): its
    variables then live on the parameter servers, and `fit` schedules
    `train_step` on the workers through TF's `ClusterCoordinator`. Each worker
    applies its update as soon as it has it; nobody waits for anybody.

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

    nonfinite_updates = "skip"
    """What asynchronous training does with an update whose gradients contain
    NaN or Inf: `"skip"` it (it is counted as `skipped_nonfinite` in the epoch
    logs; the parameters are untouched) or `"raise"` (training stops with an
    error). Under a `LossScaleOptimizer` (mixed_float16), that optimizer
    skips them itself. Set it on the model: `model.nonfinite_updates = "raise"`."""

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
    def fit(self, x=None, y=None, **kwargs):
        strategy = self.distribute_strategy
        if isinstance(strategy, tf.distribute.ParameterServerStrategy):
            from keras_dist.async_loop import fit_async

            return fit_async(self, strategy, x, y, **kwargs)
        serve_if_serving_task()
        return super().fit(x, y, **kwargs)

    def build_async_state(self, sample_batch):
        """Creates optimizer, metric and version state before training.

        Under parameter servers variables cannot be created inside the
        scheduled functions, so the chief builds them here from one sample
        batch (metrics are reset afterwards).
        """
        if self.nonfinite_updates not in ("skip", "raise"):
            raise ValueError(
                "`nonfinite_updates` must be 'skip' or 'raise'. Received: "
                f"nonfinite_updates={self.nonfinite_updates!r}.")
        strategy = self.distribute_strategy
        with strategy.scope():
            if getattr(self, "_kd_version", None) is None:
                self._kd_version = VersionCounter()
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(sample_batch)
            y_pred = self(x, training=False)
            if y is not None:
                self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
                self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            sharded = [w.path for w in self.trainable_weights if _sharded(w)]
            if sharded:
                raise ValueError(
                    f"Variables {sharded} were split into shards by the strategy's "
                    "variable_partitioner, but Keras 3's optimizer cannot update a "
                    "sharded variable (its update asks TF to colocate with the "
                    "ShardedVariable: \"ShardedVariable doesn't support being used "
                    "as a reference\"). Build the strategy without "
                    "variable_partitioner (the variables are then placed whole, "
                    "round-robin over the parameter servers).")
            self.optimizer.build(self.trainable_variables)
            self.reset_metrics()

    @property
    def version(self):
        """Integer or `None`. Updates applied so far (the parameter version)."""
        counter = getattr(self, "_kd_version", None)
        return None if counter is None else counter.value

    def async_train_steps(self, iterator, steps):
        """Runs `steps` train steps on one worker with staleness bookkeeping.

        Returns one float64 vector (a single tensor is a single copy back to
        the chief): the metric results after the last step, in the order of
        `async_log_names`, then `worker`, `step_seconds`, `examples`, the
        sum of the steps' losses weighted by their examples, and one tau per
        step.
        """
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        slowed = testing.slow_workers_from_env()
        taus, losses, examples = [], [], []
        start = None
        for _ in range(steps):
            data = next(iterator)
            if start is None:
                with tf.control_dependencies([t for t in tf.nest.flatten(data)
                                              if t is not None]):
                    start = tf.timestamp()
            with tf.control_dependencies([start] + taus):
                tau, updates, loss, batch = self._async_update(data, worker, slowed)
            taus.append(tau)
            losses.append(tf.cast(loss, tf.float64) * tf.cast(batch, tf.float64))
            examples.append(tf.cast(batch, tf.float64))
        with tf.control_dependencies(updates + taus):
            logs = self.get_metrics_result()
            seconds = tf.timestamp() - start
        self.async_log_names = sorted(logs)
        return tf.concat([
            tf.stack([tf.cast(logs[name], tf.float64) for name in self.async_log_names]
                     + [tf.cast(worker, tf.float64), seconds, tf.add_n(examples),
                        tf.add_n(losses)]),
            tf.cast(tf.stack(taus), tf.float64)], axis=0)

    def train_step(self, data):
        """Keras' train step; under parameter servers, with staleness known.

        Outside asynchronous training this is `keras.Model.train_step`.
        Inside it, the step reads the parameter version before its forward
        pass, computes loss and gradients, claims the next version (so its
        staleness tau is known *before* the update is applied), applies the
        update and returns the metrics plus `staleness`.

        Metric state lives on the parameter servers and several workers
        update it at once, but Keras' `Variable.assign_add` is a read then a
        write, which loses updates under that race (seen: accuracy 1.08).
        So each step computes its metric *deltas* statelessly
        (`Metric.stateless_update_state` from zeros) and adds them with TF's
        atomic `assign_add`. That is exact for Keras' built-in metrics, whose
        state is sums and counts. The asynchronous loop calls the same update
        (`async_train_steps`); a subclass that overrides `train_step` keeps
        Keras semantics where it is called.
        """
        if not getattr(self, "_kd_async", False):
            return super().train_step(data)
        tau, updates, _, _ = self._async_update(data)
        with tf.control_dependencies(updates):
            logs = dict(self.get_metrics_result())
        logs["staleness"] = tau
        return logs

    def _async_update(self, data, worker=None, slowed=None):
        """One asynchronous update; returns `(tau, metric update ops, loss,
        examples)`. `worker` and `slowed` (`{index: factor}`, from
        `keras_dist.testing`) inject a slowdown before the update."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        aware = staleness_aware_in(self.optimizer)
        read = self._kd_version.read()
        if slowed:
            with tf.control_dependencies([read]):
                step_start = tf.timestamp()
        after_read = [read]
        pulled = None
        if aware is not None and _needs_pulled(self.optimizer):
            # The weights this gradient is computed on, for DC-ASGD / Gap-Aware:
            # read right after the version and before the forward pass's reads.
            with tf.control_dependencies([read]):
                pulled = [tf.identity(w.value.read_value()) for w in self.trainable_weights]
            after_read = pulled
        with tf.control_dependencies(after_read):  # weights are read after the version
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred,
                                         sample_weight=sample_weight, training=True)
                scaled = self.optimizer.scale_loss(loss)
            batch = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
            weights = self.trainable_weights
            gradients = tape.gradient(scaled, weights)
        grads_ready = [t for t in tf.nest.flatten(gradients, expand_composites=True)
                       if t is not None]
        if slowed:
            with tf.control_dependencies(grads_ready):
                ready = tf.timestamp()
            grads_ready = testing.slow_down(worker, ready - step_start, ready, slowed)
            with tf.control_dependencies(grads_ready):
                gradients = [None if g is None else tf.nest.map_structure(
                    tf.identity, g, expand_composites=True) for g in gradients]
        with tf.control_dependencies(grads_ready):
            tau = self._kd_version.increment() - 1 - read
        if aware is not None:
            aware.set_pending(tau, pulled)  # consumed by its apply, below
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            # It skips non-finite updates itself (and lowers its loss scale).
            self.optimizer.apply_gradients(zip(gradients, weights))
        else:
            finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g))
                                             for g in gradients if g is not None]))
            if self.nonfinite_updates == "raise":
                with tf.control_dependencies([tf.debugging.Assert(finite, [
                        "keras_dist: an update's gradients are not finite (NaN or Inf); "
                        "set model.nonfinite_updates = 'skip' to skip such updates"])]):
                    self.optimizer.apply_gradients(zip(gradients, weights))
            else:
                apply_if(finite, self.optimizer, gradients, weights,
                         self._kd_version.count_skipped)
        updates = []
        for metric in self.metrics:
            if metric.name == "loss":
                updates += _add_atomically(metric, loss, sample_weight=batch)
            elif metric.name == "compile_metrics":
                updates += _add_atomically(metric, y, y_pred, sample_weight=sample_weight)
        return tau, updates, loss, batch

    # --------------------------------------------------------------- inference
    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None,
                 return_dict=False, **kwargs):
        if not isinstance(self.distribute_strategy, tf.distribute.ParameterServerStrategy):
            return super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                    sample_weight=sample_weight, steps=steps,
                                    callbacks=callbacks, return_dict=return_dict,
                                    **kwargs)
        from keras_dist.loop import evaluate_loop

        return evaluate_loop(self, tf.distribute.get_strategy(), x, y,
                             batch_size=batch_size, verbose=verbose,
                             sample_weight=sample_weight, steps=steps,
                             callbacks=callbacks, return_dict=return_dict)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        if not isinstance(self.distribute_strategy, tf.distribute.ParameterServerStrategy):
            return super().predict(x, batch_size=batch_size, verbose=verbose,
                                   steps=steps, callbacks=callbacks)
        dataset = x if isinstance(x, tf.data.Dataset) else tf.data.Dataset.from_tensor_slices(
            x).batch(batch_size or 32)
        if steps is not None:
            dataset = dataset.take(steps)
        predict = tf.function(lambda batch: self(batch, training=False))
        outputs = [predict(keras.utils.unpack_x_y_sample_weight(b)[0]) for b in dataset]
        return tf.nest.map_structure(lambda *parts: np.concatenate(
            [p.numpy() for p in parts]), *outputs)


def _needs_pulled(optimizer):
    while optimizer is not None:
        if isinstance(optimizer, StalenessAwareOptimizer) and optimizer.needs_pulled_weights:
            return True
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return False


def _add_atomically(metric, *args, **kwargs):
    """Adds one batch's contribution to `metric`'s state with atomic adds."""
    zeros = [tf.zeros(v.shape, v.dtype) for v in metric.variables]
    deltas = metric.stateless_update_state(zeros, *args, **kwargs)
    return [v.value.assign_add(d) for v, d in zip(metric.variables, deltas)]


def _sharded(variable):
    """Whether TF's partitioner split this Keras variable into shards."""
    return isinstance(getattr(variable.value, "variables", None), (list, tuple))
