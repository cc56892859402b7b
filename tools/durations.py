"""Where the test suite's time goes, from a run's `--durations-json` file.

`make test` writes logs/test-durations.json (tests/conftest.py's
`--durations-json`) and prints the slowest tests with this tool;
`make durations` also rewrites tests/DURATIONS.md (the report, committed)
and tests/durations.json (each test's seconds, which tests/suite_plan.py
uses to hand out the longest work first).

Usage:

    python tools/durations.py logs/test-durations.json            # the 20 slowest
    python tools/durations.py logs/test-durations.json --top 40
    python tools/durations.py logs/test-durations.json --write    # DURATIONS.md + durations.json

Seconds are each test's setup + call + teardown on its xdist worker (a
module's or the session's shared cluster is charged to the first test that
uses it); time a test spent waiting for its turn (`alone` tests, and cluster
tests while one runs) is not in them but in the "waited" column.
"""

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path):
    with open(path) as f:
        return json.load(f)


def slowest(data, top):
    return sorted(data["tests"], key=lambda row: -row["total"])[:top]


def text_table(data, top):
    rows = slowest(data, top)
    total = sum(row["total"] for row in data["tests"])
    cpu = sum(row.get("cpu", 0) for row in data["tests"])
    lines = [f"{len(data['tests'])} tests, {total:.0f} s of test time ({cpu:.0f} CPU-s) in "
             f"{data['wall']:.0f} s of wall time ({data['workers'] or 1} worker(s)); "
             f"the {len(rows)} slowest:"]
    for row in rows:
        waited = f", waited {row['waited']:.0f} s" if row.get("waited", 0) >= 1 else ""
        cpu = f"{row['cpu']:7.1f} CPU-s" if "cpu" in row else ""
        lines.append(f"{row['total']:8.1f} s {cpu}  {row['nodeid']} ({row['outcome']}{waited})")
    return "\n".join(lines)


def markdown(data, top=40):
    tests = data["tests"]
    total = sum(row["total"] for row in tests)
    cpu = sum(row.get("cpu", 0) for row in tests)
    cores = data.get("cores") or data["workers"] or 1
    heavy = [row for row in tests if row.get("cpu", 0) >= 10]
    heavy_cpu = sum(row["cpu"] for row in heavy)
    by_module = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for row in tests:
        module = row["nodeid"].split("::")[0]
        by_module[module][0] += 1
        by_module[module][1] += row["total"]
        by_module[module][2] += row.get("cpu", 0)
    by_worker = collections.defaultdict(float)
    for row in tests:
        by_worker[row.get("worker") or "-"] += row["total"]
    lines = [
        "# Where the test suite's time goes",
        "",
        "Written by `make durations` from the last `make test` run "
        "(logs/test-durations.json); do not edit by hand. Seconds are setup + call + "
        "teardown of each test on its xdist worker; a shared cluster is charged to the "
        "first test that uses it. CPU seconds are the test's worker process and every "
        "process it started (counted when they end).",
        "",
        f"- **{len(tests)} tests**, {total:.0f} s of test time and {cpu:.0f} CPU-s in "
        f"**{data['wall']:.0f} s** of wall time on {data['workers'] or 1} worker(s); exit "
        f"status {data['exitstatus']}.",
        "- Per worker: " + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(by_worker.items())),
        f"- The CPU bound: {cpu:.0f} CPU-s on {cores} cores take at least {cpu / cores:.0f} s "
        f"whatever the scheduling. The {len(heavy)} tests of 10 CPU-s or more (clusters, "
        f"launcher runs, scripts in fresh processes) use {heavy_cpu:.0f} of them; a Python "
        "process costs about 5 CPU-s to `import tensorflow` (which imports Keras and, through "
        "`keras.wrappers`, scikit-learn and SciPy; with ml_dtypes < 0.7 and scipy < 1.16: "
        "constraints.txt), and a cluster task 7-9 CPU-s before it trains (the median of ~150 "
        "in one run, sampled from /proc): fewer processes is what makes the suite faster; "
        "tests that share a cluster train its phases in turn (e.g. test_stalls, "
        "test_stragglers, the shared parameter-server cluster).",
        "",
        f"## The {top} slowest tests",
        "",
        "| seconds | CPU-s | waited | test |",
        "|---:|---:|---:|---|",
    ]
    for row in slowest(data, top):
        lines.append(f"| {row['total']:.1f} | {row.get('cpu', 0):.0f} | "
                     f"{row.get('waited', 0):.0f} | `{row['nodeid']}` |")
    lines += ["", "## By module", "", "| seconds | CPU-s | tests | module |",
              "|---:|---:|---:|---|"]
    for module, (count, seconds, module_cpu) in sorted(by_module.items(),
                                                        key=lambda kv: -kv[1][1]):
        lines.append(f"| {seconds:.0f} | {module_cpu:.0f} | {count} | `{module}` |")
    return "\n".join(lines) + "\n"


def expected(data):
    """{nodeid: seconds}, rounded: what tests/suite_plan.py schedules by."""
    return {"seconds": {row["nodeid"]: round(row["total"], 1)
                        for row in sorted(data["tests"], key=lambda r: r["nodeid"])
                        if row["total"] >= 0.5}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a --durations-json file (make test: "
                                     "logs/test-durations.json)")
    parser.add_argument("--top", type=int, default=20, help="how many to print (default 20)")
    parser.add_argument("--write", action="store_true",
                        help="rewrite tests/DURATIONS.md and tests/durations.json from it")
    args = parser.parse_args(argv)
    if not os.path.exists(args.path):
        print(f"durations: {args.path} does not exist: run `make test` first", file=sys.stderr)
        return 2
    data = load(args.path)
    print(text_table(data, args.top))
    if args.write:
        with open(os.path.join(ROOT, "tests", "DURATIONS.md"), "w") as f:
            f.write(markdown(data))
        with open(os.path.join(ROOT, "tests", "durations.json"), "w") as f:
            json.dump(expected(data), f, indent=0, sort_keys=True)
            f.write("\n")
        print("durations: wrote tests/DURATIONS.md and tests/durations.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
