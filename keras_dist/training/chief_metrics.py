"""The metrics of asynchronous training, summed on the chief."""

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.training import driver
from keras_dist.training import step_report


class ChiefMetrics:
    """The model's metrics during asynchronous training, kept on the chief.

    Each execution returns what its steps added to every metric variable
    (from zero, in a `keras.StatelessScope`); the chief sums these in the
    order results arrive and computes the metrics' results from the sums
    (one compiled call) for the batch logs. Summing is exact for additive
    metric state -- totals and counts, the state of every Keras built-in
    metric -- and costs no round trip to a parameter server; the sums are
    written to the metric variables at the end of each epoch, where Keras'
    epoch logs (and users) read them.

    Example:

    >>> import numpy as np, keras
    >>> from keras_dist.training.chief_metrics import ChiefMetrics
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)  # builds the metrics
    >>> metrics = ChiefMetrics(model)
    >>> [v.path for v in metrics.variables]
    ['loss/total', 'loss/count']
    >>> metrics.add(np.array([6.0, 3.0]))  # one execution: loss 6 summed over 3 examples
    >>> metrics.logs({"loss": 0.0})
    {'loss': 2.0}
    """

    def __init__(self, model):
        self.model = model
        self.variables = metric_variables(model)
        ids = [id(v) for v in self.variables]
        tracker = step_report.loss_tracker(model)
        self._loss = None if tracker is None else [ids.index(id(v)) for v in tracker]
        self._sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.size = sum(self._sizes)
        self._results = self._write = None
        self.reset()

    def reset(self):
        self.values = [np.zeros(v.shape, v.dtype) for v in self.variables]

    def add(self, flat):
        """Adds one execution's flattened additions (float64)."""
        offset = 0
        for i, size in enumerate(self._sizes):
            value = self.values[i]
            delta = flat[offset:offset + size].reshape(value.shape)
            self.values[i] = value + delta.astype(value.dtype)
            offset += size

    def loss_state(self, state):
        """`(loss_sum, loss_count)` float64 tensors of a metric state list."""
        if self._loss is None:
            nan = tf.constant(np.nan, tf.float64)
            return nan, nan
        return tuple(tf.cast(state[i], tf.float64) for i in self._loss)

    def results(self):
        """The metrics' results from the sums (flattened, Python floats): one
        compiled call on the chief, no parameter server read."""
        if not self.variables:
            return {}
        if self._results is None:
            model, variables = self.model, self.variables

            @tf.function(autograph=False)  # nothing to convert: no trace cost for it
            def results(*values):
                with keras.StatelessScope(list(zip(variables, values))):
                    return model.get_metrics_result()

            self._results = results
        return {name: driver.pythonify(value) for name, value in
                driver.flatten_logs(self._results(*self.values)).items()}

    def logs(self, step_logs):
        """`step_logs` with each name that is a metric's result read from the sums."""
        if not self.variables:
            return step_logs
        results = self.results()
        return {name: float(results[name]) if name in results else value
                for name, value in step_logs.items()}

    def compiled_functions(self):
        """The `tf.function`s made so far (results, write)."""
        return [f for f in (self._results, self._write and self._write[1]) if f is not None]

    def write(self, reads=()):
        """Writes the sums to the metric variables, where Keras (and users)
        read them, and reads the variables `reads` (counters on the
        parameter servers) in the same compiled call: the epoch's one round
        trip. Returns the values read, as NumPy."""
        key = tuple(id(v) for v in reads)
        if self._write is None or self._write[0] != key:
            variables = self.variables

            @tf.function(autograph=False)
            def write(values):
                for variable, value in zip(variables, values):
                    variable.assign(value)
                return [v.read_value() for v in reads]

            self._write = (key, write)
        values = [tf.constant(v) for v in self.values]
        return [np.asarray(v) for v in self._write[1](values)]


def metric_variables(model):
    """The variables of `model`'s metrics, each once, in the metrics' order."""
    seen, out = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out
