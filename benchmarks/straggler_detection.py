"""How fast StragglerDetector names a straggler, and how often it names nobody wrongly.

    python benchmarks/straggler_detection.py      # ~5 minutes on 2 cores

Local clusters started with `keras-dist-run` run tests/scripts/straggler_train.py
(digits MLP, 20 steps an epoch, detector with its default threshold 0.2 over
50-step windows), synchronously (2 MultiWorkerMirrored workers) and
asynchronously (chief, 2 workers, 1 ps). Slowdowns of worker 1:

  throttle   stopped and continued from outside (SIGSTOP/SIGCONT, 100 ms
             period, stopped 50%), started once the job has done 3 epochs
             (60 steps sync, 60 updates async), so the latency is measured
             from the start of the slowdown: job steps and seconds to the flag;
  in-graph   KERAS_DIST_SLOW_WORKER=1:10 from the start: latency from the
             start of training (the detector judges nobody before a full
             window);
  none       equal workers, with a CPU-bound process loading the machine,
             repeated: false positives (runs with any flag, and flags per
             1,000 judged steps).

Writes benchmarks/results/straggler_detection.json.
"""

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(REPO, "tests", "scripts", "straggler_train.py")
WINDOW, THRESHOLD = 50, 0.2
sys.path.insert(0, REPO)

import keras_dist.testing as kd_testing  # noqa: E402  (no TensorFlow needed here)


def run(mode, slowdown, epochs, out_dir):
    ps = 1 if mode == "async" else 0
    env = dict(os.environ)
    env.pop("KERAS_DIST_SLOW_WORKER", None)
    if slowdown == "in-graph":
        env["KERAS_DIST_SLOW_WORKER"] = "1:10"
    cmd = [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "2", "--ps", str(ps), "--",
           sys.executable, SCRIPT, out_dir, str(epochs), str(WINDOW), str(THRESHOLD)]
    started = None
    with open(os.path.join(out_dir, "out.txt"), "w") as out, subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True) as proc, contextlib.ExitStack() as stack:
        if slowdown == "none":
            stack.enter_context(kd_testing.cpu_hog(1))
        if slowdown == "throttle":
            while proc.poll() is None:
                progress = _read(os.path.join(out_dir, "progress"))
                if progress and progress["steps"] >= 60:
                    pid = int(open(os.path.join(out_dir, "pid.worker1")).read())
                    started = {"time": time.time(), "steps": progress["steps"]}
                    stack.enter_context(kd_testing.throttle(pid, period=0.1, stopped=0.5))
                    break
                time.sleep(0.01)
        proc.wait(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(open(os.path.join(out_dir, "out.txt")).read()[-3000:])
    result = _read(os.path.join(out_dir, "result.json"))
    flags = [e for e in result["events"] if e["flagged"]]
    wrong = [e for e in flags if not e["worker"].endswith("1")]
    right = [e for e in flags if e["worker"].endswith("1")]
    row = {"mode": mode, "slowdown": slowdown, "flags": len(flags), "wrong_flags": len(wrong),
           "judged_steps": max(0, sum(result["counts"].values()) // (1 if ps else 2) - WINDOW)}
    if right and slowdown != "none":
        first = right[0]
        since_steps = first["job_steps"] - (started["steps"] if started else 0)
        since_s = first["time"] - started["time"] if started else first["seconds"]
        row.update(latency_steps=since_steps, latency_s=round(since_s, 2),
                   cost=round(first["cost"], 3), from_=("slowdown start" if started
                                                          else "training start"))
    return row


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="equal-worker runs per mode (false positives)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(m, s) for m in ("sync", "async") for s in ("throttle", "in-graph")]
        cases += [(m, "none") for _ in range(args.repeats) for m in ("sync", "async")]
        for i, (mode, slowdown) in enumerate(cases):
            out_dir = os.path.join(tmp, str(i))
            os.makedirs(out_dir)
            epochs = 16 if mode == "async" else 10
            row = run(mode, slowdown, epochs, out_dir)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| mode | slowdown | flagged after (steps) | after (s) | cost when flagged | measured from |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["slowdown"] != "none":
            print(f"| {r['mode']} | {r['slowdown']} | {r.get('latency_steps', 'never')} | "
                  f"{r.get('latency_s', '-')} | {r.get('cost', '-')} | {r.get('from_', '-')} |")
    print()
    print("| mode | equal-worker runs (CPU hog beside) | runs with a flag | judged steps | flags per 1,000 judged steps |")
    print("|---|---|---|---|---|")
    for mode in ("sync", "async"):
        equal = [r for r in rows if r["mode"] == mode and r["slowdown"] == "none"]
        judged = sum(r["judged_steps"] for r in equal)
        flags = sum(r["flags"] for r in equal)
        print(f"| {mode} | {len(equal)} | {sum(1 for r in equal if r['flags'])} | {judged} | "
              f"{1000 * flags / max(1, judged):.1f} |")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "straggler_detection.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
