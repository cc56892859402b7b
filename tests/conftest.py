"""Test session set-up: two logical CPUs, so MirroredStrategy has 2 replicas.

This must run before anything starts TensorFlow's runtime, which is why it
lives here and not in a fixture.
"""

import contextlib
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("TF_CONFIG", None)
os.environ.pop("KERAS_DIST_STRATEGY", None)
sys.path.insert(0, os.path.dirname(__file__))  # tests/procs.py

import tensorflow as tf  # noqa: E402

from procs import CPUS  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * len(CPUS))


# ------------------------------------------------------- parallel runs, timing
# `make test` runs the suite on pytest-xdist workers; tests/suite_plan.py
# says how (work units, their order, `alone` tests) and records durations.
_recorder = None
_run_dir = None   # the run's folder (suite_plan.RunDir), under xdist
_turns = None
_CPU_AT_START = pytest.StashKey[float]()


def _xdist_worker(config):
    return hasattr(config, "workerinput")


def pytest_addoption(parser):
    parser.addoption("--durations-json", metavar="PATH", default=None,
                     help="write every test's setup/call/teardown seconds to PATH as JSON "
                          "(tools/durations.py reads it)")


def pytest_configure(config):
    global _recorder, _run_dir
    config.addinivalue_line(
        "markers", "alone: what it asserts depends on the machine's spare CPU; under "
                   "xdist it runs while no other cluster test does (tests/suite_plan.py)")
    config.addinivalue_line(
        "markers", "whole_machine: compares the CPU processes get; under xdist nothing "
                   "else runs beside it (tests/suite_plan.py)")
    config.addinivalue_line(
        "markers", "unit(name): the tests of a module marked with the same name share a "
                   "module-scoped fixture (one cluster for all); under xdist one worker runs "
                   "them, one after the other (tests/suite_plan.py)")
    if _xdist_worker(config):
        _run_dir = config.workerinput.get("keras_dist_run_dir")
        return
    if getattr(config.option, "dist", "no") != "no" and getattr(
            config.option, "numprocesses", None):
        from suite_plan import RunDir

        _run_dir = RunDir.create()
    path = config.getoption("durations_json")
    if path:  # on the xdist controller, or in a plain run
        from suite_plan import DurationRecorder

        _recorder = DurationRecorder(path, getattr(config.option, "numprocesses", None) or 0)


def pytest_unconfigure(config):
    if _run_dir is not None and not _xdist_worker(config):
        from suite_plan import RunDir

        RunDir.remove(_run_dir)


@pytest.fixture(scope="session")
def made_once(tmp_path_factory):
    """`made_once(name, make)`: a folder that `make(folder)` fills once per
    test run, shared by the xdist workers (the first to ask makes it), e.g.
    a reference run several tests compare against. Without xdist, once per
    session."""
    import pathlib

    from suite_plan import made_once as once

    root = _run_dir or str(tmp_path_factory.mktemp("made_once"))
    return lambda name, make: pathlib.Path(once(root, name, make))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(xdist, on the controller) tells each worker the run's folder."""
    if _run_dir is not None:
        node.workerinput["keras_dist_run_dir"] = _run_dir


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if _run_dir is None or config.getoption("dist") != "loadgroup":
        return None
    from suite_plan import make_scheduler

    return make_scheduler(config, log, _run_dir)


def pytest_collection_modifyitems(config, items):
    if _xdist_worker(config) and _run_dir is not None:  # work units, in order
        from suite_plan import RunDir, plan

        RunDir.write_units(_run_dir, plan(items, set(SHARED_SCENARIOS)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _recorder is not None or _xdist_worker(item.config):
        from suite_plan import cpu_seconds

        item.stash[_CPU_AT_START] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        from suite_plan import cpu_seconds

        outcome.get_result().user_properties.append(
            ("cpu_seconds", round(cpu_seconds() - item.stash[_CPU_AT_START], 2)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist: `alone` tests wait until no cluster test runs on another
    worker and keep them out meanwhile; a `multiprocess` test waits while
    `alone` ones run. Around setup too: a module's or the session's
    cluster starts in the first test's setup."""
    global _turns
    if _run_dir is None or not _xdist_worker(item.config):
        yield
        return
    from suite_plan import Turns

    _turns = _turns or Turns(_run_dir)
    whole = item.get_closest_marker("whole_machine") is not None
    alone = whole or item.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as stack:
        waited = 0.0
        if alone or item.get_closest_marker("multiprocess") is not None:
            keep = nextitem is not None and (
                nextitem.get_closest_marker("alone") is not None
                or nextitem.get_closest_marker("whole_machine") is not None)
            waited += stack.enter_context(_turns.turn(alone, keep))
        waited += stack.enter_context(_turns.machine(whole))
        item.user_properties.append(("waited_for_turn", round(waited, 2)))
        yield


# ------------------------------------------------------------------ make compat
# `@pytest.mark.compat("path")` names the tests that `make compat`
# (tools/compat.py) runs against each tested TensorFlow x Keras pair, grouped
# by the user-facing path they exercise. With KD_COMPAT_REPORT set, each
# test's path and outcome are written there as JSON for the runner's table.
_compat_paths = {}
_compat_outcomes = {}


def pytest_collection_finish(session):
    for item in session.items:  # after -m / -k deselection
        marker = item.get_closest_marker("compat")
        if marker is not None:
            if len(marker.args) != 1:
                raise pytest.UsageError(
                    f"{item.nodeid}: @pytest.mark.compat needs one path name, "
                    f"e.g. @pytest.mark.compat('mirrored'); got {marker.args}")
            _compat_paths[item.nodeid] = marker.args[0]


def pytest_runtest_logreport(report):
    if _recorder is not None:
        _recorder.add(report)
    if report.nodeid not in _compat_paths:
        return
    if report.failed or (report.when == "call" and report.outcome != "passed"):
        _compat_outcomes[report.nodeid] = report.outcome
    elif report.when == "call":
        _compat_outcomes.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session, exitstatus):
    if _recorder is not None:
        _recorder.write(exitstatus)
    path = os.environ.get("KD_COMPAT_REPORT")
    if not path:
        return
    import json

    import keras
    import keras_dist

    rows = [{"test": nodeid, "path": _compat_paths[nodeid],
             "outcome": _compat_outcomes.get(nodeid, "not run")}
            for nodeid in _compat_paths]
    with open(path, "w") as f:
        json.dump({"tensorflow": tf.__version__, "keras": keras.version(),
                   "keras_dist": keras_dist.__file__, "tests": rows}, f, indent=1)


# ------------------------------------------------------------ a shared cluster
# Tests whose chief script needs nothing of its own from the cluster (no
# process killed or slowed, no state from before the strategy) share ONE
# `keras-dist-run --workers 2 --ps 1` run: starting a cluster (four
# processes importing TensorFlow, ~10 s on 2 cores) costs more than most of
# these scripts take. "module::test id" -> (script, arguments after out_dir),
# in the order they run. ps_custom_step.py goes first: it makes a dataset
# before the strategy connects the chief; raising NonFiniteUpdateError last.
SHARED_SCENARIOS = {
    "test_async::test_custom_train_step_runs_on_parameter_servers": ("ps_custom_step.py",),
    "test_async::test_async_digits_training[1]": ("ps_train.py", "1"),
    "test_async::test_async_digits_training[5]": ("ps_train.py", "5"),
    "test_async::test_every_staleness_aware_wrapper_trains_asynchronously": (
        "ps_wrappers.py",),
    "test_async::test_wrappers_under_mixed_precision_train_asynchronously": (
        "ps_wrappers.py", "mixed"),
    "test_async::test_no_retracing_under_parameter_servers": ("ps_traces.py",),
    "test_local_steps::test_local_steps_on_a_real_cluster": ("ps_local.py",),
    "test_local_steps::test_a_backup_holds_the_outer_optimizer_and_the_elastic_copies": (
        "ps_local_backup.py",),
    "test_dana::test_dana_on_a_real_cluster": ("ps_dana.py",),
    "test_conformance::test_parameter_server_cells_conform": ("ps_conformance.py",),
    "test_local_wrappers::test_wrappers_in_local_steps_on_a_real_cluster": (
        "ps_local_wrappers.py", "train"),
    # The docs' cluster scripts of this shape (test_docs_examples checks that
    # each of them is here, and nothing else of the docs).
    "test_docs_examples::test_cluster_block[docs/getting-started.md:119]": (
        "docs_block.py", "docs/getting-started.md:119"),
    "test_docs_examples::test_cluster_block[docs/local-steps.md:11]": (
        "docs_block.py", "docs/local-steps.md:11"),
    # The failing scenarios last: each checks the cluster trains again after it.
    "test_local_wrappers::test_nonfinite_raise_with_local_steps_on_a_real_cluster": (
        "ps_local_wrappers.py", "raise"),
    "test_async::test_nonfinite_updates_are_skipped_and_counted_or_raise[skip]": (
        "ps_nonfinite.py", "skip"),
    "test_async::test_nonfinite_updates_are_skipped_and_counted_or_raise[raise]": (
        "ps_nonfinite.py", "raise"),
}


@pytest.fixture(scope="session")
def shared_cluster(request, tmp_path_factory):
    """The session's shared cluster: one run of the `SHARED_SCENARIOS` of the
    tests selected, started by the first test that asks for it."""
    from procs import SharedCluster, scenario_key

    selected = {scenario_key(item) for item in request.session.items}
    scenarios = {key: value for key, value in SHARED_SCENARIOS.items() if key in selected}
    return SharedCluster(tmp_path_factory.mktemp("shared_cluster"), scenarios)


@pytest.fixture(scope="session")
def conformance_references(made_once):
    """Keras' own fit on one device for every model kind of the conformance
    matrix (tests/conformance.py): {kind: record}, made once per test run
    (by the first xdist worker to ask; ~10 CPU-s) and read back as JSON."""
    import json

    import conformance

    def make(folder):
        records = {kind: conformance.record(kind, conformance.keras_train, folder)
                   for kind in conformance.KINDS}
        with open(os.path.join(folder, "references.json"), "w") as f:
            json.dump(records, f)

    with open(made_once("conformance_references", make) / "references.json") as f:
        return json.load(f)


@pytest.fixture
def kd_messages():
    """The messages logged on the "keras_dist" logger during the test, in order."""
    import logging

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("keras_dist")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def _environment_without_putenv(monkeypatch):
    """Every test sees `os.environ` as a private dict copy.

    Setting a variable in the real `os.environ` calls setenv(3), which is
    not safe while TensorFlow's C++ threads call getenv(3): CI once died of
    a segfault right after a test that did. Tests that set variables
    (`monkeypatch.setenv` included) change this copy, which Python code (ours,
    TensorFlow's resolvers) reads; child processes get their environment
    passed explicitly.
    """
    monkeypatch.setattr(os, "environ", dict(os.environ))
