"""One worker of a 2-process MultiWorkerMirrored cluster: equivalence cases.

Run by tests/test_equivalence.py with TF_CONFIG set. Trains each case of
tests/equivalence_cases.py's `MWMS_CASES` (or of the comma-separated names
in env MWMS_CASES; "all": every case) with `kd.fit` and writes the weights
and History to out_dir/<task>.json; then the conformance matrix's cells of
this shape (tests/conformance.py: every model kind, and what a user does
after `fit`) to out_dir/<task>-conformance.json. argv: out_dir.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import keras_dist as kd  # noqa: E402

strategy = kd.resolve_strategy()  # first: collective ops start with the process

import conformance  # noqa: E402
from equivalence_cases import CASES, MWMS_CASES, build, fit_arguments  # noqa: E402


def main(out_dir):
    results = {}
    only = os.environ.get("MWMS_CASES")
    cases = (CASES if only == "all" else only.split(",") if only else MWMS_CASES)
    for case in sorted(cases):
        x, y, kwargs = fit_arguments(case)
        history = kd.fit(lambda: build(case), x, y, strategy=strategy, **kwargs)
        results[case] = {"weights": [w.tolist() for w in history.model.get_weights()],
                         "history": history.history}
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = os.path.join(out_dir, f"{task['type']}{task['index']}")
    with open(f"{name}.json", "w") as f:
        json.dump(results, f)
    os.makedirs(f"{name}-conformance")  # each worker saves its own .keras files
    cells = {kind: conformance.record(kind, conformance.kd_train(strategy), f"{name}-conformance")
             for kind in conformance.KINDS}
    with open(f"{name}-conformance.json", "w") as f:
        json.dump(cells, f)


if __name__ == "__main__":
    main(sys.argv[1])
