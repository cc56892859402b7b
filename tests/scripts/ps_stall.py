"""Asynchronous digits training for stalled-worker tests.

argv: out_dir epochs steps [steps_per_execution [local_steps [idle [mode]]]],
mode "plain" (SGD with momentum), "dana" (`kd.optimizers.DANA`) or
"easgd" (`elastic=0.5`, with local_steps); or, for several runs one after
the other on the one cluster, `phases` PHASES_JSON: a list of {"name",
"mode", "epochs", "steps", "per_call", "local", "idle"} (mode "plain",
per_call, local 1 and idle 0 when left out), each a fit of a fresh model of
its own in out_dir/NAME (its stop file and result.json there), announced
by a line "phase NAME" before it starts. `epochs` is at most: training
stops at the end of the first epoch that finds out_dir/stop (the test
writes it once it has seen what it waits for). The
chief writes out_dir/result.json: the parameter version after `fit`, the
steps its epochs had (epochs run x steps), each epoch's wall time and updates
per worker, test accuracy, and the executor's step counts
(`model.step_counts`). With idle > 0 the chief then sits idle that many
seconds (the cluster connected, nothing running) and trains one epoch more
(`after_idle`: the version and counts after it).
"""

import json
import os
import sys
import time

import tensorflow as tf

import keras_dist as kd

strategy = kd.resolve_strategy()
if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
    kd.serve()

import keras  # noqa: E402

from keras_dist.datasets import load_digits  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from procs import digits_model  # noqa: E402


def main(out_dir, epochs, steps, per_call=1, local=1, idle=0, mode="plain"):
    (x, y), (x_test, y_test) = load_digits()
    with strategy.scope():
        optimizer = (kd.optimizers.DANA(keras.optimizers.SGD(0.02), momentum=0.9)
                     if mode == "dana" else keras.optimizers.SGD(0.02, momentum=0.9))
        model = digits_model(optimizer, cls=kd.AsyncModel, seed=0,
                             steps_per_execution=per_call)
    per_epoch, times = [], []

    def begin(epoch, logs):
        times.append([time.time()])

    def end(epoch, logs):
        times[-1].append(time.time())
        per_epoch.append({str(k): v for k, v in
                          model.staleness_stats.updates_per_worker().items()})
        print(f"epoch {epoch + 1} ended at {times[-1][1]:.3f}, updates "
              f"{json.dumps(per_epoch[-1], sort_keys=True)}", flush=True)
        if os.path.exists(os.path.join(out_dir, "stop")):
            model.stop_training = True

    record = keras.callbacks.LambdaCallback(on_epoch_begin=begin, on_epoch_end=end)
    kwargs = {"local_steps": local} if local > 1 else {}
    if mode == "easgd":
        kwargs["elastic"] = 0.5
    history = model.fit(x, y, epochs=epochs, steps_per_epoch=steps, batch_size=32, verbose=2,
                        callbacks=[record], **kwargs)
    version, counts, extra = model.version, model.step_counts, None
    if idle:
        time.sleep(idle)
        model.fit(x, y, epochs=1, steps_per_epoch=steps, batch_size=32, verbose=2, **kwargs)
        extra = {"version": model.version, "step_counts": model.step_counts}
    accuracy = model.evaluate(x_test, y_test, return_dict=True, verbose=0)["accuracy"]
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"version": version, "scheduled": len(times) * steps, "after_idle": extra,
                   "test_accuracy": accuracy, "history": history.history,
                   "epoch_times": times, "updates_per_epoch": per_epoch,
                   "step_counts": counts}, f)


def phases(out_dir, plan):
    for phase in plan:
        phase_dir = os.path.join(out_dir, phase["name"])
        os.makedirs(phase_dir, exist_ok=True)
        print(f"phase {phase['name']}", flush=True)
        main(phase_dir, phase["epochs"], phase["steps"], phase.get("per_call", 1),
             phase.get("local", 1), phase.get("idle", 0), phase.get("mode", "plain"))


if __name__ == "__main__":
    if sys.argv[2] == "phases":
        phases(sys.argv[1], json.loads(sys.argv[3]))
    else:
        main(sys.argv[1], *[int(a) for a in sys.argv[2:7]], *sys.argv[7:])
