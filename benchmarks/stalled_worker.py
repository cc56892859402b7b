"""Asynchronous training while one of two workers is stopped, against one worker alone.

    python benchmarks/stalled_worker.py            # the driver: launches the runs

Two sides, each a fresh local cluster running this script in `--side` mode
(digits MLP 64-64-10, SGD 0.05 with momentum 0.9, batch 32, `--epochs`
epochs of `--steps` updates, steps_per_execution `--spe`):

  (a) frozen: `keras-dist-run --workers 2 --ps 1`; after `--warmup` epochs
      the driver stops worker 1 (SIGSTOP) and continues it (SIGCONT) only
      once `fit` is over: a long GC pause, a VM live migration, a frozen
      container;
  (b) alone: `keras-dist-run --workers 1 --ps 1`, the same epochs.

The rate of a run is the examples/s of the epochs after the warm-up (for
(a): everything from the moment worker 1 stopped, its stuck step, its
replacement and TF declaring it lost included). The sides alternate,
`--repeats` times each; the ratio of the medians is reported.
Target: (a) / (b) >= 0.9 (before issue 30, about 0.1: the job waited for
the stopped worker's step). Writes benchmarks/results/stalled_worker.json.
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

_SIDE = flags.DEFINE_enum("side", None, ["frozen", "alone"],
                          "Run one side as a cluster task (set by the driver).")
_EPOCHS = flags.DEFINE_integer("epochs", 11, "Epochs per run.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Epochs before the measured ones (and the stop).")
_STEPS = flags.DEFINE_integer("steps", 1000, "Updates per epoch.")
_SPE = flags.DEFINE_integer("spe", 1, "steps_per_execution.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per side.")
_OUTPUT = flags.DEFINE_string("output", "benchmarks/results/stalled_worker.json",
                              "Where to write the JSON.")
_MARK = "KD_STALL_EPOCH_END"
_BATCH = 32


def run_side():
    import tensorflow as tf

    import keras_dist as kd

    strategy = kd.resolve_strategy()
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        kd.serve()  # worker and ps tasks serve until the launcher stops them
    import keras

    from keras_dist.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        model = kd.AsyncModel(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                      "sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=_SPE.value)
    marks = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: print(f"{_MARK} {epoch} {time.time():.6f}",
                                               flush=True),
        on_train_begin=lambda logs: print(f"{_MARK} -1 {time.time():.6f}", flush=True))
    model.fit(x, y, batch_size=_BATCH, epochs=_EPOCHS.value, steps_per_epoch=_STEPS.value,
              verbose=0, callbacks=[marks])
    accuracy = model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    print(f"KD_STALL_RESULT {json.dumps({'accuracy': accuracy, 'counts': model.step_counts})}",
          flush=True)


def launch(side):
    """One run of `side`; returns its measured examples/s and what it reported."""
    launcher = os.path.join(os.path.dirname(sys.executable), "keras-dist-run")
    workers = 2 if side == "frozen" else 1
    env = {k: v for k, v in os.environ.items() if k != "TF_GRPC_DEFAULT_OPTIONS"}
    cmd = [launcher, "--workers", str(workers), "--ps", "1", "--", sys.executable, __file__,
           f"--side={side}", f"--epochs={_EPOCHS.value}", f"--steps={_STEPS.value}",
           f"--spe={_SPE.value}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines, ends, stopped, result = [], {}, None, None
    try:
        for line in proc.stdout:
            lines.append(line)
            if _MARK in line:
                epoch, stamp = line.split(_MARK)[1].split()
                ends[int(epoch)] = float(stamp)
                if side == "frozen" and stopped is None and int(epoch) == _WARMUP.value - 1:
                    stopped = int(re.findall(r"started worker:1 \(pid (\d+)\)",
                                             "".join(lines))[-1])
                    os.kill(stopped, signal.SIGSTOP)
                if int(epoch) == _EPOCHS.value - 1 and stopped is not None:
                    os.kill(stopped, signal.SIGCONT)
                    stopped = -1
            elif "KD_STALL_RESULT" in line:
                result = json.loads(line.split("KD_STALL_RESULT", 1)[1])
        proc.wait(600)
    finally:
        if stopped and stopped > 0:
            os.kill(stopped, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"{side} failed (exit {proc.returncode}):\n{''.join(lines)[-4000:]}")
    first, last = _WARMUP.value - 1, _EPOCHS.value - 1
    examples = (last - first) * _STEPS.value * _BATCH
    result["examples_per_second"] = examples / (ends[last] - ends[first])
    result["epoch_seconds"] = [ends[e] - ends[e - 1] for e in range(first + 1, last + 1)]
    return result


def main(argv):
    del argv
    if _SIDE.value:
        run_side()
        return
    runs = {"frozen": [], "alone": []}
    for repeat in range(_REPEATS.value):
        order = ["frozen", "alone"] if repeat % 2 == 0 else ["alone", "frozen"]
        for side in order:
            runs[side].append(launch(side))
            run = runs[side][-1]
            print(f"{side}: {run['examples_per_second']:.0f} examples/s, "
                  f"accuracy {run['accuracy']:.3f}, {run['counts']}", flush=True)
    med = {side: statistics.median(r["examples_per_second"] for r in v)
           for side, v in runs.items()}
    ratio = med["frozen"] / med["alone"]
    print(f"examples/s, median of {_REPEATS.value}: one of two workers stopped "
          f"{med['frozen']:.0f}, one worker alone {med['alone']:.0f}; ratio {ratio:.3f} "
          "(target >= 0.9)")
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump({"runs": runs, "median_examples_per_second": med, "ratio": ratio,
                   "epochs": _EPOCHS.value, "warmup": _WARMUP.value, "steps": _STEPS.value,
                   "spe": _SPE.value, "stopped_seconds": statistics.median(
                       sum(r["epoch_seconds"]) for r in runs["frozen"])}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
