"""The conformance matrix's parameter-server column (tests/conformance.py).

Every model kind trained with `kd.fit` on the cluster (chief, 2 workers,
1 ps), then each thing a user does after `fit`; the chief writes
out_dir/result.json, {kind: record}, which tests/test_conformance.py holds
to Keras' own fit on one device. A scenario of the shared cluster.
argv: out_dir.
"""

import json
import os
import sys

import keras_dist as kd

strategy = kd.resolve_strategy()
if kd.ClusterConfig.from_env().task_type in ("worker", "ps"):
    kd.serve()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import conformance  # noqa: E402


def main(out_dir):
    cells = {kind: conformance.record(kind, conformance.kd_train(strategy), out_dir)
             for kind in conformance.KINDS}
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(cells, f)


if __name__ == "__main__":
    main(sys.argv[1])
