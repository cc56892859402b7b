"""Several chief scripts of tests/scripts/ in one cluster; run by keras-dist-run.

A cluster costs more to start (four processes importing TensorFlow: about
10 s on 2 cores) than most scenarios take to train, so tests that need
nothing of their own from the cluster share one (`shared_cluster` in
tests/conftest.py; tests/procs.py starts it).

argv: plan.json, a list of {"script": "ps_train.py", "args": [out_dir, ...]}.
The chief runs each script as `__main__`, in order, with `sys.argv` set to
its arguments. The strategy is built once, by the first script
(kd.resolve_strategy keeps it per process); before each script the Keras settings a script may change (the
dtype policy) are reset. A script that raises writes the traceback to its
out_dir/error.txt, and the next one runs. Workers and the ps serve.
"""

import json
import os
import runpy
import sys
import time
import traceback

import keras_dist as kd

cluster = kd.ClusterConfig.from_env()
if cluster is not None and cluster.task_type in ("worker", "ps"):
    kd.serve(cluster)
# The chief connects when the first script calls kd.resolve_strategy(), not
# here: that script may make a dataset first, before TensorFlow knows the
# cluster (ps_custom_step.py does: a user's mistake that must still train).

import keras  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    for scenario in plan:
        script, args = os.path.join(HERE, scenario["script"]), scenario["args"]
        name = f"{scenario['script']} {' '.join(args[1:])}".rstrip()
        print(f"[scenario] {name}", flush=True)
        keras.config.set_dtype_policy("float32")
        sys.argv = [script, *args]
        start = time.monotonic()
        try:
            runpy.run_path(script, run_name="__main__")
        except BaseException:  # noqa: BLE001  (SystemExit too: the next one runs)
            with open(os.path.join(args[0], "error.txt"), "w") as f:
                f.write(traceback.format_exc())
        print(f"[scenario] {name}: {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
