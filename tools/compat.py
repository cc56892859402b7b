"""`make compat`: keras-dist's fast subset on every tested TensorFlow x Keras pair.

For each pair of `keras_dist/versions.py`'s TESTED_PAIRS (or those named
with `--pairs`), this

1. keeps a virtual environment in `.compat/tf<X>-keras<Y>/`, created on
   first use and reused afterwards (pip then only checks it);
2. installs the built wheel from `dist/` there (`make dist`), with its
   `test` extra and TensorFlow / Keras pinned to the pair, so pip also
   checks that keras-dist's declared ranges admit the pair;
3. copies `tests/` to a temporary folder outside the source tree and runs
   the tests marked `@pytest.mark.compat("<path>")` with that environment's
   Python, so they import the installed wheel, not the checkout;
4. prints one table, pair x path (`pass` / `FAIL`), and exits non-zero if
   anything failed.

Usage:

    python tools/compat.py                   # every tested pair
    python tools/compat.py --pairs oldest    # oldest | middle | newest | 2.18.1/3.12.4
    python tools/compat.py --list            # the pairs, then exit
    python tools/compat.py --pairs oldest --prepare-only
                                             # step 1 with the wheel's requirements
                                             # but not the wheel: no `make dist` needed

`--prepare-only` lets `.ci/run` build an environment (downloads and unpacks
TensorFlow: about 90 s, mostly waiting) while the main suite runs; the run
after it finds every requirement in place and installs only the wheel.

This tool imports neither TensorFlow nor keras_dist; the pairs are read
from keras_dist/versions.py's source.
"""

import argparse
import ast
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tested_pairs():
    """TESTED_PAIRS from keras_dist/versions.py, without importing it."""
    with open(os.path.join(ROOT, "keras_dist", "versions.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "TESTED_PAIRS" for t in node.targets):
            return [tuple(p) for p in ast.literal_eval(node.value)]
    raise SystemExit("compat: TESTED_PAIRS not found in keras_dist/versions.py")


def select(pairs, spec):
    """`oldest,newest` or `2.18.1/3.12.4` -> the matching pairs, in order."""
    if spec in (None, "", "all"):
        return pairs
    named = {"oldest": pairs[0], "middle": pairs[len(pairs) // 2], "newest": pairs[-1]}
    chosen = []
    for item in spec.split(","):
        item = item.strip()
        if item in named:
            pair = named[item]
        elif "/" in item and tuple(item.split("/", 1)) in pairs:
            pair = tuple(item.split("/", 1))
        else:
            raise SystemExit(
                f"compat: unknown pair {item!r}. Use oldest, middle, newest, all or "
                f"TF/KERAS, one of: {', '.join('/'.join(p) for p in pairs)}")
        if pair not in chosen:
            chosen.append(pair)
    return chosen


def run(cmd, **kwargs):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def find_wheel(dist_dir):
    wheels = sorted(glob.glob(os.path.join(dist_dir, "keras_dist-*.whl")), key=os.path.getmtime)
    if not wheels:
        raise SystemExit(f"compat: no keras_dist wheel in {dist_dir}: run `make dist` first")
    return wheels[-1]


def wheel_requirements():
    """pyproject.toml's dependencies and `test` extra (what `wheel[test]`
    asks for), or [] where this Python cannot read TOML (before 3.11)."""
    try:
        import tomllib
    except ImportError:
        return []
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["test"]]


def environment(pair, cache):
    """The pair's environment, created on first use; returns its python."""
    tf_version, keras_version = pair
    env = os.path.join(cache, f"tf{tf_version}-keras{keras_version}")
    python = os.path.join(env, "bin", "python")
    if not os.path.exists(python):
        run([sys.executable, "-m", "venv", "--clear", env])
        run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    return python


def prepare_requirements(pair, cache):
    """The pair's environment with everything the wheel will ask for but
    the wheel itself (`--prepare-only`)."""
    python = environment(pair, cache)
    tf_version, keras_version = pair
    pinned = [r for r in wheel_requirements()
              if not r.lower().startswith(("tensorflow", "keras"))]
    run([python, "-m", "pip", "install", "--quiet", *pinned,
         f"tensorflow=={tf_version}", f"keras=={keras_version}"])
    return python


def prepare(pair, cache, wheel):
    """The pair's environment, with the wheel installed; returns its python."""
    tf_version, keras_version = pair
    python = environment(pair, cache)
    # A fresh environment has no keras-dist yet; pip's notice says so.
    run([python, "-m", "pip", "uninstall", "--quiet", "--yes", "keras-dist"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run([python, "-m", "pip", "install", "--quiet", f"{wheel}[test]",
         f"tensorflow=={tf_version}", f"keras=={keras_version}"])
    return python


def run_subset(python, work, extra_args):
    """The compat-marked tests from `work` (outside the checkout); the report."""
    report = os.path.join(work, "report.json")
    env = dict(os.environ, KD_COMPAT_REPORT=report, KD_COMPAT_INSTALLED="1")
    env.pop("PYTHONPATH", None)
    # On the suite's xdist workers and its own schedule, as `make test` runs
    # (tests/suite_plan.py; pytest-xdist comes with the test extra).
    cmd = [python, "-m", "pytest", "-m", "compat", "-p", "no:cacheprovider", "-q",
           "-n", os.environ.get("TEST_WORKERS", "2"), "--dist", "loadgroup",
           "--no-loadscope-reorder", "--durations=5", *extra_args]
    print("+", " ".join(cmd), f"(in {work})", flush=True)
    code = subprocess.run(cmd, cwd=work, env=env).returncode
    if not os.path.exists(report):
        return code, None
    with open(report) as f:
        return code, json.load(f)


# Columns in this order; paths not listed follow in the order first seen.
PATHS = ("default", "mirrored", "multiworker", "async", "local steps", "sharded",
         "wrappers", "callbacks", "wheel")


def table(results):
    """Pair x path: `pass N`, `FAIL bad/N` or `-` (not run)."""
    paths = list(PATHS)
    for _, data in results:
        for row in (data or {}).get("tests", []):
            if row["path"] not in paths:
                paths.append(row["path"])
    seen = {row["path"] for _, data in results for row in (data or {}).get("tests", [])}
    paths = [p for p in paths if p in seen]
    header = ["TensorFlow / Keras"] + paths
    lines = []
    for (pair, data) in results:
        cells = ["/".join(pair)]
        for path in paths:
            rows = [r for r in (data or {}).get("tests", []) if r["path"] == path]
            bad = [r for r in rows if r["outcome"] != "passed"]
            if not rows:
                cells.append("-")
            elif bad:
                cells.append(f"FAIL {len(bad)}/{len(rows)}")
            else:
                cells.append(f"pass {len(rows)}")
        if data is None:
            cells += ["no report (see the log above)"]
        lines.append(cells)
    widths = [max(len(str(row[i])) for row in [header] + lines if i < len(row))
              for i in range(max(len(r) for r in [header] + lines))]
    fmt = lambda row: "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    out = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths[:len(header)]) + "|"]
    return "\n".join(out + [fmt(row) for row in lines])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="all",
                        help="oldest, middle, newest, all (default), or TF/KERAS; comma-separated")
    parser.add_argument("--cache", default=os.path.join(ROOT, ".compat"),
                        help="where the per-pair environments live (default: .compat/)")
    parser.add_argument("--dist", default=os.path.join(ROOT, "dist"),
                        help="folder holding the built wheel (default: dist/)")
    parser.add_argument("--list", action="store_true", help="print the pairs and exit")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only create the environments, with the wheel's requirements "
                             "but not the wheel (no `make dist` needed), then exit")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args(argv)
    pairs = select(tested_pairs(), args.pairs)
    if args.list:
        for pair in pairs:
            print("/".join(pair))
        return 0
    if args.prepare_only:
        for pair in pairs:
            started = time.monotonic()
            prepare_requirements(pair, args.cache)
            print(f"compat: {'/'.join(pair)} prepared in {time.monotonic() - started:.0f} s",
                  flush=True)
        return 0
    wheel = find_wheel(args.dist)
    print(f"compat: {os.path.basename(wheel)} on {', '.join('/'.join(p) for p in pairs)}")
    results, failed = [], False
    for pair in pairs:
        started = time.monotonic()
        print(f"\n=== TensorFlow {pair[0]}, Keras {pair[1]} ===", flush=True)
        work = tempfile.mkdtemp(prefix="kd-compat-")
        try:
            python = prepare(pair, args.cache, wheel)
            shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(work, "tests"),
                            ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy(os.path.join(ROOT, "setup.cfg"), work)  # pytest's settings
            code, data = run_subset(python, work, args.pytest_args)
        except subprocess.CalledProcessError as error:
            code, data = error.returncode, None
        finally:
            shutil.rmtree(work, ignore_errors=True)
        source = os.path.join(ROOT, "keras_dist")
        if data is not None and os.path.commonpath(
                [os.path.abspath(data["keras_dist"]), source]) == source:
            print(f"compat: the tests imported keras_dist from the checkout "
                  f"({data['keras_dist']}), not from the installed wheel")
            code = code or 1
        failed = failed or code != 0
        results.append((pair, data))
        print(f"=== {'/'.join(pair)}: {'ok' if code == 0 else 'FAILED'} "
              f"in {time.monotonic() - started:.0f} s ===", flush=True)
    print("\n" + table(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
