"""Digits training with StragglerDetector + PerReplicaMetrics, run on every
task by keras-dist-run: asynchronous with a ps task, MultiWorkerMirrored
without. Slowdowns come from KERAS_DIST_SLOW_WORKER, set by the test.

The chief writes what the tests check to out_dir/result.json.
argv: out_dir epochs window threshold [churn, 0] [batch, 64]. With churn > 0 each step
also does that many 256x256 matrix products with a fixed (non-trainable)
matrix: CPU-bound steps without more gradients to all-reduce.

argv: out_dir phases window threshold PHASES_JSON: one cluster, several
trainings in turn. PHASES_JSON is a list of {"name",
"epochs", "churn", "batch", "slow"}; for each, the chief trains into
out_dir/<name>/ as above, with KERAS_DIST_SLOW_WORKER set to "slow" (as
the launcher passed it with "slow": "launcher"; unset without "slow"),
once the test has made out_dir/<name>/go (it writes
out_dir/<name>/ready first): the test starts and stops its slowdown from
outside in between.
"""

import json
import os
import sys
import time

import keras_dist as kd

# Tests that slow a task from outside (SIGSTOP duty cycles, CPU hogs) find
# its process here: out_dir/pid.<role><index>.
_cluster = kd.ClusterConfig.from_env()
if _cluster is not None:
    with open(os.path.join(sys.argv[1], f"pid.{_cluster.task_type}{_cluster.task_index}"),
              "w") as _f:
        _f.write(str(os.getpid()))

strategy = kd.resolve_strategy()  # MultiWorkerMirrored must come before any TF op

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402


PHASES = sys.argv[2] == "phases"
CHURN = 0 if PHASES or len(sys.argv) <= 5 else int(sys.argv[5])
BATCH = 64 if PHASES or len(sys.argv) <= 6 else int(sys.argv[6])


class Churn(keras.layers.Layer):
    """`repeats` products with a fixed matrix, scaled to keep the values."""

    def __init__(self, repeats, **kwargs):
        super().__init__(**kwargs)
        self.repeats = repeats

    def build(self, input_shape):
        self.fixed = self.add_weight(shape=(input_shape[-1], input_shape[-1]),
                                     initializer="orthogonal", trainable=False)

    def call(self, x):
        y = x
        for _ in range(self.repeats):
            y = keras.ops.matmul(y, self.fixed)
        return x + 0.0 * y


def build_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        *([Churn(CHURN)] if CHURN else []),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.SGD(0.02, momentum=0.9),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class CountSteps(kd.callbacks.ReplicaCallback):
    """Steps each worker has reported so far (listed before the detector)."""

    def __init__(self, out_dir):
        super().__init__()
        self.counts, self.out_dir, self.job_steps = {}, out_dir, 0

    def on_replica_steps(self, batch, steps):
        for step in steps:
            self.counts[step.replica] = self.counts.get(step.replica, 0) + step.steps
        # Synchronous: every replica did the same steps; asynchronous: one worker's.
        self.job_steps += max(s.steps for s in steps)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.is_chief:  # for benchmarks that start a slowdown mid-run
            with open(os.path.join(self.out_dir, "progress.tmp"), "w") as f:
                json.dump({"steps": self.job_steps, "time": time.time()}, f)
            os.replace(os.path.join(self.out_dir, "progress.tmp"),
                       os.path.join(self.out_dir, "progress"))


def main(out_dir, epochs, window, threshold):
    (x, y), _ = load_digits()
    x, y = x[:1280], y[:1280]  # 20 batches of 64 (or 80 of 16): equal on every replica
    counter = CountSteps(out_dir)
    events = []

    started = time.perf_counter()

    def action(worker, cost, logs):
        events.append({"worker": worker, "cost": cost,
                       "flagged": worker in detector.stragglers,
                       "steps_of_worker": counter.counts.get(worker, 0),
                       "counts": dict(counter.counts),
                       "job_steps": counter.job_steps,
                       "seconds": time.perf_counter() - started,
                       "time": time.time(),
                       "scores": dict(detector.scores)})

    detector = kd.callbacks.StragglerDetector(window=window, threshold=threshold,
                                                action=action)
    metrics = kd.callbacks.PerReplicaMetrics(log_dir=os.path.join(out_dir, "tb"))
    history = kd.fit(build_model, x, y, strategy=strategy, epochs=epochs, batch_size=BATCH,
                     verbose=2, callbacks=[counter, detector, metrics])
    if not detector.is_chief:
        return
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({
            "kind": type(strategy).__name__,
            "history": history.history,
            "events": events,
            "detector_events": [list(e) for e in detector.events],
            "scores": detector.scores,
            "costs": detector.costs,
            "seconds": time.perf_counter() - started,
            "totals": metrics.totals,
            "counts": counter.counts,
            "version": getattr(history.model, "version", None),
            # Asynchronous: every step accounted for (procs.check_counts).
            "step_counts": getattr(history.model, "step_counts", None),
            "scheduled": len(history.history["loss"]) * (len(x) // BATCH),
        }, f)


def phases(root, window, threshold, plan):
    global CHURN, BATCH
    # kd.fit reads KERAS_DIST_SLOW_WORKER from os.environ at each call; a
    # private copy, since setenv(3) is not safe beside TensorFlow's threads.
    os.environ = dict(os.environ)
    given = os.environ.get("KERAS_DIST_SLOW_WORKER")
    for phase in plan:
        out_dir = os.path.join(root, phase["name"])
        os.makedirs(out_dir, exist_ok=True)
        CHURN, BATCH = phase.get("churn", 0), phase.get("batch", 64)
        os.environ.pop("KERAS_DIST_SLOW_WORKER", None)
        slow = given if phase.get("slow") == "launcher" else phase.get("slow")
        if slow:
            os.environ["KERAS_DIST_SLOW_WORKER"] = slow
        if _cluster is not None and _cluster.is_chief:  # (worker 1 of a MultiWorkerMirrored
            # job goes on into fit, where it waits for worker 0 at the first collective)
            open(os.path.join(out_dir, "ready"), "w").close()
            deadline = time.monotonic() + 600  # a test that died never says go
            while not os.path.exists(os.path.join(out_dir, "go")):
                if time.monotonic() > deadline:
                    sys.exit(f"no {os.path.join(out_dir, 'go')} within 600 s")
                time.sleep(0.05)
            print(f"[phase] {phase['name']}", flush=True)
        main(out_dir, phase["epochs"], window, threshold)


if __name__ == "__main__":
    if PHASES:
        phases(sys.argv[1], int(sys.argv[3]), float(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
