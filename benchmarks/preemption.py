"""Goodput of a job that loses a task every T seconds, against an uninterrupted job.

    python benchmarks/preemption.py            # the driver: launches the runs

Each run is a fresh `keras-dist-run --workers 2 [--ps 1] --max-restarts 100`
job running this script in `--side=task` mode: digits MLP 64-64-10 (Adam,
batch 64), `--epochs` epochs of `--steps` steps, with
`kd.callbacks.BackupAndRestore(save_freq=--save_freq)`. Sides, per strategy
(MultiWorkerMirrored, parameter servers):

  plain:    no backups, no failures;
  steady:   backups, no failures (what backing up costs);
  T=30/60:  backups, and the driver SIGKILLs a random training task (a
            worker; with parameter servers also the chief or the ps) every T
            seconds: no warning, no save, as a machine lost. keras-dist-run
            restarts the job from the newest backup (a parameter-server
            worker alone).

Goodput = the job's steps (the same for every side) per second of wall
time, launch to exit, restarts included; the ratio of a failing side to
`steady` is reported, and to `plain`. Lost work per failure: the steps
between the backup the restart resumed from and where the killed job
stood, and the seconds from the kill until training passed that point
again (restart, start-up and the steps redone).
Targets: goodput >= 0.8 at T = 60 s; lost work <= one save interval.
Writes benchmarks/results/preemption.json.
"""

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

_SIDE = flags.DEFINE_enum("side", None, ["task"], "Run as a cluster task (set by the driver).")
_EPOCHS = flags.DEFINE_integer("epochs", 12, "Epochs per job.")
_STEPS = flags.DEFINE_integer("steps", 1000, "Steps per epoch.")
_SAVE_FREQ = flags.DEFINE_integer("save_freq", 50, "Steps between backups (0: no backups).")
_PERIODS = flags.DEFINE_list("periods", ["60", "30"], "Seconds between failures (T).")
_STRATEGIES = flags.DEFINE_list("strategies", ["multiworker", "ps"], "Strategies to run.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs per side (interleaved; medians).")
_BACKUP = flags.DEFINE_string("backup", None, "Backup directory (set by the driver).")
_PROGRESS = flags.DEFINE_string("progress", None, "Progress file (set by the driver).")
_OUTPUT = flags.DEFINE_string("output", "benchmarks/results/preemption.json",
                              "Where to write the JSON.")
_BATCH = 64


def run_task():
    import keras_dist as kd

    strategy = kd.resolve_strategy()
    import keras
    import tensorflow as tf

    from keras_dist.datasets import load_digits

    if isinstance(strategy, tf.distribute.ParameterServerStrategy):
        def build():
            return compiled(kd.AsyncModel)
    else:
        def build():
            return compiled(keras.Model)

    def compiled(cls):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        model = cls(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    (x, y), _ = load_digits()
    # A repeating dataset read `--steps` batches an epoch (a resumed job
    # skips to its position in it).
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat().batch(
        _BATCH)
    epoch = [0]

    cluster = kd.ClusterConfig.from_env()
    chief = cluster is None or cluster.is_chief

    def note(batch, logs):
        if not chief:
            return
        with open(_PROGRESS.value + ".tmp", "w") as f:
            f.write(f"{epoch[0] * _STEPS.value + batch + 1} {time.time():.6f}")
        os.replace(_PROGRESS.value + ".tmp", _PROGRESS.value)

    class Progress(keras.callbacks.Callback):
        _kd_ignores_batch_logs = True  # reads no batch logs: none are computed for it

        def on_epoch_begin(self, e, logs=None):
            epoch[0] = e

        def on_train_batch_end(self, batch, logs=None):
            note(batch, logs)

    callbacks = [Progress()]
    if _SAVE_FREQ.value:
        callbacks.insert(0, kd.callbacks.BackupAndRestore(_BACKUP.value,
                                                          save_freq=_SAVE_FREQ.value))
    kd.fit(build, data, strategy=strategy, epochs=_EPOCHS.value, steps_per_epoch=_STEPS.value,
           verbose=0, callbacks=callbacks)


def progress(path):
    try:
        with open(path) as f:
            step, _ = f.read().split()
        return int(step)
    except (OSError, ValueError):
        return 0


def run_job(strategy, period, backups):
    """One job; kills a random task every `period` seconds (None: never).
    Returns its wall time and, per failure, the lost work."""
    work = tempfile.mkdtemp(prefix="kd-preempt-bench-")
    prog, backup = os.path.join(work, "progress"), os.path.join(work, "backup")
    launcher = os.path.join(os.path.dirname(sys.executable), "keras-dist-run")
    ps = 1 if strategy == "ps" else 0
    out = open(os.path.join(work, "launcher.txt"), "w+")
    cmd = [launcher, "--workers", "2", "--ps", str(ps), "--max-restarts", "100", "--",
           sys.executable, __file__, "--side=task", f"--epochs={_EPOCHS.value}",
           f"--steps={_STEPS.value}", f"--save_freq={_SAVE_FREQ.value if backups else 0}",
           f"--backup={backup}", f"--progress={prog}"]
    began = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    rng = random.Random(period or 0)
    roles = ("chief", "ps", "worker") if ps else ("worker",)
    failures = []
    try:
        next_kill = began + period if period else None
        while proc.poll() is None:
            time.sleep(0.05)
            if failures and failures[-1].get("back_after") is None and \
                    progress(prog) > failures[-1]["at_step"]:
                failures[-1]["back_after"] = time.monotonic() - failures[-1]["time"]
            if next_kill is None or time.monotonic() < next_kill:
                continue
            out.flush()
            with open(out.name) as f:
                text = f.read()
            tasks = {}
            for task, pid in re.findall(r"started ((?:\w+):\d+) \(pid (\d+)\)", text):
                if task.split(":")[0] in roles:
                    tasks[task] = int(pid)
            task = rng.choice(sorted(tasks))
            at = progress(prog)
            try:
                os.kill(tasks[task], signal.SIGKILL)
            except ProcessLookupError:
                pass
            failures.append({"task": task, "at_step": at, "time": time.monotonic()})
            next_kill = time.monotonic() + period
        wall = time.monotonic() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(out.name) as f:
        text = f.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} T={period} failed (exit {proc.returncode}):\n"
                           f"{text[-4000:]}")
    # One launcher line per failure, in order: the job restarted from a
    # backup, or (parameter servers) a worker restarted alone.
    restarts = re.findall(r"\] (\w+:\d+) (?:was killed by SIGKILL|exited with code -9); "
                          r"restarting (the job|it)[^\n]*?(?:backup-(\d+)-(\d+))?$", text,
                          flags=re.M)
    for failure, (task, what, epoch, step) in zip(failures, restarts):
        failure["restarted"] = "job" if what == "the job" else "worker"
        if what == "it":
            failure["lost_steps"] = 0  # the others went on; TF reran its step
        else:
            position = int(epoch) * _STEPS.value + int(step) if epoch else 0
            failure["lost_steps"] = failure["at_step"] - position
    for failure in failures:
        failure.pop("time")
    shutil.rmtree(work, ignore_errors=True)
    return {"wall": wall, "failures": failures,
            "job_restarts": len(re.findall(r"restarting the job", text)),
            "worker_restarts": len(re.findall(r"restarting it \(", text))}


def main(argv):
    del argv
    if _SIDE.value:
        run_task()
        return
    steps = _EPOCHS.value * _STEPS.value
    report = {"epochs": _EPOCHS.value, "steps": _STEPS.value, "save_freq": _SAVE_FREQ.value,
              "repeats": _REPEATS.value, "strategies": {}}
    for strategy in _STRATEGIES.value:
        # Interleaved: each repeat runs every side once, in turn (a slow
        # spell of this noisy machine spreads over the sides); medians.
        sides = [("plain", None, False), ("steady", None, True)] + [
            (f"T={p}", float(p), True) for p in _PERIODS.value]
        runs = {side: [] for side, _, _ in sides}
        for repeat in range(_REPEATS.value):
            order = sides if repeat % 2 == 0 else sides[::-1]
            for side, period, backups in order:
                runs[side].append(run_job(strategy, period, backups=backups))
        wall = {side: statistics.median(r["wall"] for r in v) for side, v in runs.items()}
        summary = {}
        for side, side_runs in runs.items():
            failures = [f for r in side_runs for f in r["failures"]]
            lost = [f["lost_steps"] for f in failures if "lost_steps" in f]
            back = [f["back_after"] for f in failures if f.get("back_after")]
            summary[side] = {
                "wall_s": round(wall[side], 2), "steps_per_s": round(steps / wall[side], 1),
                "goodput_vs_steady": round(wall["steady"] / wall[side], 3),
                "goodput_vs_plain": round(wall["plain"] / wall[side], 3),
                "failures": len(failures),
                "job_restarts": sum(r["job_restarts"] for r in side_runs),
                "worker_restarts": sum(r["worker_restarts"] for r in side_runs),
                "lost_steps_median": statistics.median(lost) if lost else None,
                "lost_steps_max": max(lost) if lost else None,
                "lost_seconds_median": round(statistics.median(back), 2) if back else None}
            print(f"{strategy} {side}: {summary[side]}", flush=True)
        report["strategies"][strategy] = {"summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(_OUTPUT.value), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    app.run(main)
