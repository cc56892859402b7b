"""`make keras-suite`: Keras' own `fit` tests as the judge of `keras_dist.fit`.

Runs the tests of the **installed** Keras version that exercise `fit`
(`keras/src/trainers/trainer_test.py` and the fit-related
`keras/src/callbacks/*_test.py`, see `TEST_FILES`) three times:

- `baseline`: no strategy, Keras' own `fit` (the tests as Keras runs them);
- `mirrored`: every test inside one `tf.distribute.MirroredStrategy` over 2
  logical CPUs, Keras' own `fit`;
- `kd`: the same, with `model.fit` redirected to
  `keras_dist.fit(model, ..., strategy=<that strategy>)`.

The test sources come from Keras' sdist on PyPI (the wheel ships no
`*_test.py`), fetched once with `pip download` into `<env>/keras-suite/`
(the running environment's prefix: the sources follow its Keras version).
Each configuration is one pytest process in a temporary folder holding the
test files, Keras' own pytest settings (its `pyproject.toml`:
`filterwarnings = error`, ...) and a `conftest.py` standing in for the
one in Keras' repository. This module is also the pytest plugin of those
runs (`-p keras_suite`; the hooks at the bottom), set by environment
variables: `KERAS_SUITE_CONFIG` (the configuration) and
`KERAS_SUITE_REPORT` (where each test's outcome goes, as JSON).

Writes `--out` (markdown: counts per configuration, then every test that
passes under `mirrored` but not under `kd`, with its error's first line),
the whole comparison as JSON beside it (`.json`) and each run's pytest log
(`.<config>.log`). Exits non-zero if a run produced no report, and, with
`--strict`, if `kd` fails a test that `mirrored` passes.

Usage:

    python tools/keras_suite.py --out=logs/keras-suite.md
    python tools/keras_suite.py --configs=mirrored,kd --select="fit and not sparse"

Keras' tests that need what keras-dist does not install are left out or
skipped, the same way in every configuration: orbax_checkpoint_test.py is
not run (orbax), and the tests fed data from `jax`, `grain` or `torch` are
skipped where those are not installed (`OPTIONAL`; for jax, imported at the
top of trainer_test.py, a placeholder module stands in).
"""

import datetime
import glob
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import types

import pytest
from absl import app
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_OUT = flags.DEFINE_string(
    "out", os.path.join(ROOT, "logs", "keras-suite.md"),
    "Where the markdown summary goes; the JSON and the logs go beside it.")
_CONFIGS = flags.DEFINE_string(
    "configs", "baseline,mirrored,kd", "Comma-separated configurations to run, in order.")
_SELECT = flags.DEFINE_string(
    "select", "", "A pytest -k expression narrowing the tests (all when empty).")
_TIMEOUT = flags.DEFINE_integer(
    "timeout", 300, "Seconds one test may take (pytest-timeout) before it counts as failed.")
_CACHE = flags.DEFINE_string(
    "cache", "", "Where Keras' sdist is kept (default: <environment>/keras-suite/).")
_STRICT = flags.DEFINE_boolean(
    "strict", False, "Exit non-zero if kd fails a test that mirrored passes.")

# The fit-related test files, as paths inside Keras' sdist (below `keras-<version>/`).
# Left out: orbax_checkpoint_test (needs orbax), the callbacks that never run in
# fit (monitor_callback_test tests a base class with fit too, so it stays).
TEST_FILES = (
    "keras/src/trainers/trainer_test.py",
    "keras/src/callbacks/backup_and_restore_test.py",
    "keras/src/callbacks/callback_test.py",
    "keras/src/callbacks/csv_logger_test.py",
    "keras/src/callbacks/early_stopping_test.py",
    "keras/src/callbacks/lambda_callback_test.py",
    "keras/src/callbacks/learning_rate_scheduler_test.py",
    "keras/src/callbacks/model_checkpoint_test.py",
    "keras/src/callbacks/monitor_callback_test.py",
    "keras/src/callbacks/reduce_lr_on_plateau_test.py",
    "keras/src/callbacks/remote_monitor_test.py",
    "keras/src/callbacks/swap_ema_weights_test.py",
    "keras/src/callbacks/tensorboard_test.py",
    "keras/src/callbacks/terminate_on_nan_test.py",
)

# Packages some of Keras' tests feed data from (its CI installs them, keras-dist
# does not). Where one is missing, the tests with its name as a word of theirs
# (`test_fit_with_data_adapter_grain_dataset`, `test_fit_sparse_jax_eager`) are
# skipped, in every configuration alike.
OPTIONAL = ("jax", "grain", "torch")

CONFIGS = {
    "baseline": "no strategy, Keras' own fit",
    "mirrored": "MirroredStrategy over 2 logical CPUs, Keras' own fit",
    "kd": "the same MirroredStrategy, model.fit redirected to kd.fit",
}

# Tests that cannot run under the suite's strategy in `mirrored` / `kd`, and why.
# They run in `baseline` and count as skipped in the other two.
OWN_STRATEGY = {
    "test_swap_ema_weights_with_tf_distribute":
        "builds its own MirroredStrategy after resetting TensorFlow's context "
        "(tf.distribute refuses a second strategy inside the suite's)",
}

# Written into the run folder: what Keras' repository-level conftest.py gives
# its tests (remote_monitor_test.py imports `skip_if_backend` from it).
CONFTEST = '''\
"""Written by tools/keras_suite.py: Keras' repository conftest, as its tests import it."""
from keras_suite import skip_if_backend  # noqa: F401
'''


# ---------------------------------------------------------------------------
# The driver: fetch the sources, run each configuration, compare.
# ---------------------------------------------------------------------------

def fetch_sdist(version, cache):
    """Keras' sdist for `version`, downloaded once into `cache`; its path."""
    path = os.path.join(cache, f"keras-{version}.tar.gz")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    download = tempfile.mkdtemp(prefix="keras-sdist-", dir=cache)
    try:
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
              "--no-binary", ":all:", "--dest", download, f"keras=={version}"])
        found = glob.glob(os.path.join(download, f"keras-{version}.tar.gz"))
        if not found:
            raise SystemExit(
                f"keras-suite: pip downloaded no keras-{version}.tar.gz into {download} "
                f"(found: {os.listdir(download)}). The tests come from Keras' sdist.")
        os.replace(found[0], path)
    finally:
        shutil.rmtree(download, ignore_errors=True)
    return path


def unpack_tests(sdist, version, work):
    """The selected test files, flat in `work`, with Keras' pytest settings.

    Flat (no `keras/` package folder) so that `import keras` in the tests
    finds the installed Keras, never the sdist's copy.
    """
    prefix = f"keras-{version}/"
    wanted = {prefix + p: os.path.basename(p) for p in TEST_FILES}
    wanted[prefix + "pyproject.toml"] = "pyproject.toml"  # [tool.pytest.ini_options]
    with tarfile.open(sdist) as tar:
        members = {m.name: m for m in tar.getmembers() if m.name in wanted}
        missing = sorted(set(wanted) - set(members))
        if missing:
            raise SystemExit(
                f"keras-suite: {os.path.basename(sdist)} lacks {', '.join(missing)}. "
                "Update TEST_FILES in tools/keras_suite.py to this Keras version's tests.")
        for name, member in members.items():
            target = os.path.join(work, wanted[name])
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    with open(os.path.join(work, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    return [os.path.basename(p) for p in TEST_FILES]


def run_config(config, work, files, stem, select, timeout):
    """One pytest process for `config`; (its report, seconds, exit code)."""
    report = os.path.join(work, f"report-{config}.json")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", KERAS_SUITE_CONFIG=config,
               KERAS_SUITE_REPORT=report,
               PYTHONPATH=os.pathsep.join(
                   [os.path.dirname(os.path.abspath(__file__))]
                   + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "pytest", "-p", "keras_suite", "-p", "no:cacheprovider",
           # --tb=native: pytest's own tracebacks re-parse the test sources, which
           # Python 3.11 can fail at after a deep TensorFlow stack (an INTERNALERROR
           # that ends the whole run: "AST constructor recursion depth mismatch").
           f"--timeout={timeout}", "-rN", "--tb=native", "--durations=15",
           *(["-k", select] if select else []), *files]
    log = f"{stem}.{config}.log"
    print(f"keras-suite: {config} ({CONFIGS[config]}): {' '.join(cmd[1:])} > {log}", flush=True)
    started = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=work, env=env, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - started
    if not os.path.exists(report):
        print(f"keras-suite: {config} wrote no report (pytest exit {code}); see {log}")
        return None, seconds, code
    with open(report) as f:
        return json.load(f), seconds, code


def counts(tests):
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for row in tests.values():
        out[row["outcome"]] = out.get(row["outcome"], 0) + 1
    out["total"] = len(tests)
    return out


def changed(before, after):
    """Tests passing in `before` and not in `after`: [(test, after's row)]."""
    return [(test, after.get(test, {"outcome": "missing", "message": "not run"}))
            for test, row in sorted(before.items())
            if row["outcome"] == "passed" and after.get(test, {}).get("outcome") != "passed"]


def markdown(summary):
    lines = [
        "# Keras' own fit tests under keras-dist",
        "",
        f"Keras {summary['keras']}, TensorFlow {summary['tensorflow']}, "
        f"Python {summary['python']}, {summary['date']}; `{summary['command']}`"
        + (f" (`-k {summary['select']}`)" if summary["select"] else "") + ".",
        "",
        "| configuration | passed | failed | errors | skipped | total | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in summary["configs"].items():
        if run["counts"] is None:
            lines.append(f"| {name}: {CONFIGS[name]} | no report (exit {run['exit_code']}) "
                         f"| | | | | {run['seconds']:.0f} |")
            continue
        c = run["counts"]
        lines.append(f"| {name}: {CONFIGS[name]} | {c['passed']} | {c['failed']} | "
                     f"{c['error']} | {c['skipped']} | {c['total']} | {run['seconds']:.0f} |")
    for key, title in (("kd_regressions", "Pass under `mirrored`, not under `kd`"),
                       ("kd_fixes", "Pass under `kd`, not under `mirrored`"),
                       ("mirrored_regressions", "Pass under `baseline`, not under `mirrored`")):
        if key not in summary:
            continue
        rows = summary[key]
        lines += ["", f"## {title} ({len(rows)})", ""]
        lines += [f"- `{row['test']}`: {row['outcome']}: {_first_line(row['message'])}"
                  for row in rows] or ["None."]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    configs = [c.strip() for c in _CONFIGS.value.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"keras-suite: unknown configuration(s) {unknown}; "
                         f"use some of {', '.join(CONFIGS)}.")
    version = importlib.metadata.version("keras")
    summary = {
        "keras": version, "tensorflow": importlib.metadata.version("tensorflow"),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
        "select": _SELECT.value, "files": list(TEST_FILES), "configs": {},
    }
    out = os.path.abspath(_OUT.value)
    stem = os.path.splitext(out)[0]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    sdist = fetch_sdist(version, _CACHE.value or os.path.join(sys.prefix, "keras-suite"))
    work = tempfile.mkdtemp(prefix="keras-suite-")
    results = {}
    try:
        files = unpack_tests(sdist, version, work)
        for config in configs:
            report, seconds, code = run_config(config, work, files, stem, _SELECT.value,
                                               _TIMEOUT.value)
            tests = report["tests"] if report else None
            results[config] = tests
            summary["configs"][config] = {
                "counts": counts(tests) if tests is not None else None,
                "seconds": round(seconds, 1), "exit_code": code,
                "keras_dist": report and report["keras_dist"], "tests": tests}
            c = summary["configs"][config]["counts"]
            where = report and report["keras_dist"]
            print(f"keras-suite: {config}: {c} in {seconds:.0f} s"
                  + (f" (keras_dist from {where})" if where else ""), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key, before, after in (("kd_regressions", "mirrored", "kd"),
                               ("kd_fixes", "kd", "mirrored"),
                               ("mirrored_regressions", "baseline", "mirrored")):
        if results.get(before) is not None and results.get(after) is not None:
            summary[key] = [dict(test=test, **row)
                            for test, row in changed(results[before], results[after])]
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    text = markdown(summary)
    with open(out, "w") as f:
        f.write(text)
    print("\n" + text)
    print(f"keras-suite: wrote {out}, {stem}.json and the logs {stem}.<config>.log")
    if any(r is None for r in results.values()):
        return 1
    return 1 if _STRICT.value and summary.get("kd_regressions") else 0


def _run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _first_line(message):
    line = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
    return line if len(line) <= 300 else line[:297] + "..."


# ---------------------------------------------------------------------------
# The pytest plugin (`-p keras_suite`), active where KERAS_SUITE_CONFIG is set.
# ---------------------------------------------------------------------------

_STATE = {"config": None, "strategy": None, "tests": {}, "missing": [], "keras_dist": None}
_redirecting = threading.local()  # kd.fit is running: a model.fit inside it is Keras' own


def skip_if_backend(given_backend, reason):
    """The marker of Keras' repository conftest.py."""
    from keras.src.backend import backend
    return pytest.mark.skipif(backend() == given_backend, reason=reason)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_trainable_backend: mark test for trainable backend only")
    config.addinivalue_line(
        "markers", "multi_device: mark test for running with multiple devices only")
    mode = os.environ.get("KERAS_SUITE_CONFIG")
    if mode is None:
        return
    if mode not in CONFIGS:
        raise pytest.UsageError(f"KERAS_SUITE_CONFIG={mode!r}; use one of {', '.join(CONFIGS)}.")
    _STATE["config"] = mode
    if mode != "baseline":
        # Before anything runs on TensorFlow: two logical CPUs.
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    importlib.import_module("keras")  # before the jax placeholder: Keras uses jax where it finds it
    _STATE["missing"] = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
    if "jax" in _STATE["missing"]:
        # trainer_test.py imports jax at its top, for JAX-only tests. A placeholder
        # lets it import; the tests that would use it are skipped (collection below).
        sys.modules["jax"] = types.ModuleType("jax")
    if mode == "baseline":
        return
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    _STATE["strategy"] = strategy
    _enter_scope_in_setup(strategy)
    if mode == "kd":
        _redirect_fit(strategy)


def _enter_scope_in_setup(strategy):
    """Every Keras TestCase runs inside `strategy.scope()` from the end of its
    `setUp` on: `setUp` calls `clear_session`, which resets TF's default graph
    and with it any scope entered earlier."""
    from keras.src.testing import test_case

    original = test_case.TestCase.setUp

    def setUp(self):
        original(self)
        if self._testMethodName in OWN_STRATEGY:
            return
        scope = strategy.scope()
        scope.__enter__()
        self.addCleanup(scope.__exit__, None, None, None)

    test_case.TestCase.setUp = setUp


def _redirect_fit(strategy):
    """`model.fit(...)` calls `kd.fit(model, ..., strategy=strategy)`; a
    `model.fit` that keras_dist itself calls (one-device paths) is Keras' own."""
    import keras
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    import keras_dist as kd

    _STATE["keras_dist"] = os.path.dirname(kd.__file__)
    original = TensorFlowTrainer.fit
    assert keras.Model.fit is original, "keras.Model.fit is not TensorFlowTrainer.fit"
    signature = inspect.signature(original)

    def fit(self, *args, **kwargs):
        if getattr(_redirecting, "active", False):
            return original(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        arguments.pop("self")
        x, y = arguments.pop("x", None), arguments.pop("y", None)
        _redirecting.active = True
        try:
            return kd.fit(self, x, y, strategy=strategy, **arguments)
        finally:
            _redirecting.active = False

    fit.__wrapped__ = original
    TensorFlowTrainer.fit = fit


def pytest_collection_modifyitems(config, items):
    if _STATE["config"] is None:
        return
    for item in items:
        words = set(item.name.split("_"))
        for name in _STATE["missing"]:
            if name in words:
                item.add_marker(pytest.mark.skip(
                    reason=f"{name} is not installed (keras-suite; Keras' own CI has it)"))
        if _STATE["config"] != "baseline" and item.name in OWN_STRATEGY:
            item.add_marker(pytest.mark.skip(reason=OWN_STRATEGY[item.name]))


def pytest_collection_finish(session):
    """Every collected test starts as `error` ("did not finish"): one the run
    never reached (pytest stopped early) is not counted as passed."""
    if _STATE["config"] is None:
        return
    for item in session.items:
        _STATE["tests"][item.nodeid] = {"outcome": "error", "message": _NOT_RUN}


_NOT_RUN = "did not finish: the pytest run stopped before this test's end (see its log)"


def pytest_runtest_logreport(report):
    """One row per test: a skip or failure in any phase decides, else the call."""
    if _STATE["config"] is None:
        return
    row = _STATE["tests"].setdefault(report.nodeid, {"outcome": "error", "message": _NOT_RUN})
    if row["outcome"] in ("failed", "skipped") or (row["outcome"] == "error"
                                                   and row["message"] != _NOT_RUN):
        return  # an earlier phase decided
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        row.update(outcome="skipped", message=reason)
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        row.update(outcome="failed" if report.when == "call" else "error",
                   message="\n".join(message.strip().splitlines()[:5]))
    elif report.when == "call":
        row.update(outcome="passed", message="")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KERAS_SUITE_REPORT")
    if _STATE["config"] is None or not path:
        return
    with open(path, "w") as f:
        json.dump({"config": _STATE["config"], "exitstatus": int(exitstatus),
                   "keras_dist": _STATE["keras_dist"], "tests": _STATE["tests"]}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
