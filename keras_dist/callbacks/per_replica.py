"""`PerReplicaMetrics`: each replica's or worker's numbers, not just the average."""

import collections
import importlib.util
import math
import os

import numpy as np

from keras_dist import _runtime  # noqa: F401  (Keras backend and version checks)
from keras_dist.callbacks.base import ReplicaCallback

_FIELDS = ("loss", "step_time", "examples_per_sec", "updates",
           "staleness_mean", "staleness_max")


class _Tally:
    """One worker's sums over an epoch."""

    def __init__(self):
        self.steps = 0
        self.seconds = 0.0
        self.examples = 0
        self.known_examples = True
        self.loss_sum = 0.0
        self.loss_weight = 0.0
        self.taus = []

    def add(self, step):
        self.steps += step.steps
        self.seconds += step.seconds
        if step.examples is None:
            self.known_examples = False
        else:
            self.examples += step.examples
        if not math.isnan(step.loss):
            weight = step.examples if step.examples else step.steps
            self.loss_sum += step.loss * weight
            self.loss_weight += weight
        self.taus.extend(step.staleness)

    def logs(self):
        out = {"updates": self.steps}
        if self.loss_weight:
            out["loss"] = self.loss_sum / self.loss_weight
        if self.steps:
            out["step_time"] = self.seconds / self.steps
        if self.known_examples and self.seconds > 0:
            out["examples_per_sec"] = self.examples / self.seconds
        if self.taus:
            out["staleness_mean"] = float(np.mean(self.taus))
            out["staleness_max"] = int(max(self.taus))
        return out


class PerReplicaMetrics(ReplicaCallback):
    """Per-replica (synchronous) or per-worker (asynchronous) training metrics.

    For each replica or worker, every epoch:

    - `loss`: mean training loss over the examples it trained on;
    - `step_time`: mean seconds per step of its own computation (in
      synchronous training, before the gradient all-reduce);
    - `examples_per_sec`: its examples divided by that computing time;
    - `updates`: updates it contributed (in synchronous training every
      replica contributes to every update);
    - asynchronous training only: `staleness_mean` and `staleness_max` of its
      updates.

    They go into the epoch logs as `<replica>/<name>` (e.g.
    `worker1/step_time`), where Keras' progress bar (`verbose=2`), `History`
    and `CSVLogger` show them; into TensorBoard scalars when `log_dir` is
    given (one run per replica, `log_dir/<replica>`, step = epoch); and, on
    the chief at the end of training, into a table (printed with `rich`).

    Replica names are `"worker<i>"` in asynchronous training and
    `"replica<r>"` in synchronous training (`keras_dist.fit`); under Keras'
    own loop (one device) there is one, `"replica0"`, timed on the host.

    Args:
        log_dir: Optional directory for TensorBoard event files.
        table: Boolean. Print the end-of-training table on the chief.

    Attributes:
        epoch_metrics: Dict `replica -> {name: value}` for the last epoch.
        totals: Dict `replica -> {name: value}` over the whole training.

    Example:

    >>> import numpy as np, keras, keras_dist as kd
    >>> metrics = kd.callbacks.PerReplicaMetrics(table=False)
    >>> model = keras.Sequential([keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> history = model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=16,
    ...                     epochs=2, verbose=0, callbacks=[metrics])
    >>> history.history["replica0/updates"]
    [4, 4]
    >>> metrics.totals["replica0"]["updates"]
    8
    """

    def __init__(self, log_dir=None, table=True):
        super().__init__()
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(
                "PerReplicaMetrics: `log_dir` must be a directory path or None. "
                f"Received: log_dir={log_dir!r}.")
        if log_dir is not None and importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "PerReplicaMetrics(log_dir=...) writes TensorBoard event files, which "
                "needs the `tensorboard` package: pip install tensorboard (the "
                "keras-dist wheel's 'tensorboard' extra has it), or pass log_dir=None.")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.table = bool(table)
        self.epoch_metrics, self.totals = {}, {}
        self._epoch = collections.defaultdict(_Tally)
        self._all = collections.defaultdict(_Tally)
        self._writers = {}

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.epoch_metrics, self.totals = {}, {}
        self._all.clear()
        self._epoch.clear()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch.clear()

    def on_replica_steps(self, batch, steps):
        for step in steps:
            self._epoch[step.replica].add(step)
            self._all[step.replica].add(step)

    def replica_logs(self):
        self.epoch_metrics = {name: tally.logs() for name, tally in sorted(self._epoch.items())}
        return {f"{replica}/{name}": value
                for replica, values in self.epoch_metrics.items()
                for name, value in values.items()}

    def on_epoch_end(self, epoch, logs=None):
        if not self._fed_by_loop and logs and "loss" in logs and "replica0" in self._epoch:
            # Keras' own loop, one replica: its loss is the epoch's loss.
            epoch_tally, all_tally = self._epoch["replica0"], self._all["replica0"]
            epoch_tally.loss_sum, epoch_tally.loss_weight = float(logs["loss"]), 1.0
            all_tally.loss_sum += float(logs["loss"]) * epoch_tally.steps
            all_tally.loss_weight += epoch_tally.steps
        super().on_epoch_end(epoch, logs)
        if not self.epoch_metrics:
            self.replica_logs()
        if self.log_dir is not None and self.is_chief:
            self._write_tensorboard(epoch)

    def on_train_end(self, logs=None):
        self.totals = {name: tally.logs() for name, tally in sorted(self._all.items())}
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
        if self.table and self.is_chief and self.totals:
            self.print_table()

    def _write_tensorboard(self, epoch):
        import tensorflow as tf

        for replica, values in self.epoch_metrics.items():
            if replica not in self._writers:
                self._writers[replica] = tf.summary.create_file_writer(
                    os.path.join(self.log_dir, replica))
            with self._writers[replica].as_default():
                for name, value in values.items():
                    tf.summary.scalar(name, value, step=epoch)
            self._writers[replica].flush()

    def print_table(self, console=None):
        """Prints the whole-training table (`totals`) with `rich`."""
        from rich.console import Console
        from rich.table import Table

        asynchronous = any("staleness_mean" in v for v in self.totals.values())
        who = "worker" if asynchronous else "replica"
        table = Table(title=f"keras_dist: per-{who} training summary")
        columns = [who, "updates", "loss", "step time (ms)", "examples/s"]
        if asynchronous:
            columns += ["staleness mean", "staleness max"]
        for column in columns:
            table.add_column(column, justify="left" if column == who else "right")
        for replica, values in self.totals.items():
            row = [replica, str(values["updates"]),
                   _fmt(values.get("loss"), "{:.4f}"),
                   _fmt(values.get("step_time"), "{:.2f}", 1e3),
                   _fmt(values.get("examples_per_sec"), "{:.0f}")]
            if asynchronous:
                row += [_fmt(values.get("staleness_mean"), "{:.2f}"),
                        _fmt(values.get("staleness_max"), "{}")]
            table.add_row(*row)
        if console is None:
            console = Console()
            if not console.is_terminal:
                console = Console(width=120)  # logs and pipes: do not squeeze columns
        console.print(table)


def _fmt(value, pattern, scale=1):
    return "-" if value is None else pattern.format(value * scale)
