"""How the suite runs in parallel, and where its time goes.

`make test` runs pytest on pytest-xdist workers (`-n 2 --dist loadgroup`).
Each worker takes whole *work units* from one queue. This module decides
the units and their order, and hands them out (`UnitScheduling`, this
suite's xdist scheduler); tests/conftest.py wires it in. It also records
every test's duration (`--durations-json`, read by tools/durations.py).

Work units (one worker runs all of a unit's tests, in order):

- `@pytest.mark.alone` tests, one unit: what they assert depends on the
  machine's spare CPU (a stopped worker's cost in epoch time, a
  straggler's share of the job's time, epochs during a cut link). While
  it runs, no `multiprocess` test runs on the other worker (`Turns`): only
  tests that start no process, as a CPU hog beside it would.
- tests that share the session's cluster (the shared parameter-server
  cluster of `SHARED_SCENARIOS`): one unit, so the cluster is started
  once, not once per worker
  (a reference run several tests compare against is made once per run by
  conftest's `made_once` instead; the docs examples and test_shapes run
  their own job queues only without xdist: under it, each test runs its
  own job);
- the docs' Python blocks (test_docs_examples' `test_python_blocks`, a test
  per page): one unit, since one process runs every page's;
- the tests of a module marked `@pytest.mark.unit(name)` with the same name:
  one unit, run in a row, so the module-scoped fixture they share (one
  cluster whose phases they check, e.g. test_stalls' duty cycles) is made
  once (pytest tears a module's fixtures down when a test of another module
  comes between);
- every other test is a unit of its own.

A `@pytest.mark.whole_machine` test (it compares the CPU two processes
get, e.g. a worker sharing its core with hogs against one alone) is also
`alone`, and while it runs no test at all runs on the other worker
(`Turns.machine`).

Order: the `alone` unit first (its worker runs it while the other takes the
tests that start no process, which never wait for it), then those tests,
then the cluster units longest first (longest-processing-time first, so no
long unit is left for the end), by the durations of the last recorded run
(tests/durations.json, written by `make durations`); a test not in it
counts as `UNKNOWN_SECONDS`.

(xdist's own `--dist loadgroup` reads `xdist_group` marks by rewriting
`item._nodeid`, which pytest 9 no longer reads: it groups nothing there.
Our scheduler takes the units from a file the workers write instead.)
"""

import contextlib
import fcntl
import json
import os
import resource
import shutil
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = os.path.join(HERE, "durations.json")
UNKNOWN_SECONDS = 1.0
ALONE = "alone"
DOCS_PYTHON = "docs_python"

def expected_durations(path=EXPECTED):
    """{nodeid: seconds} of the last recorded run; {} if there is none."""
    try:
        with open(path) as f:
            return json.load(f)["seconds"]
    except (OSError, ValueError, KeyError):
        return {}


def unit_of(item, shared_keys):
    """The work unit of a test item (None: a unit of its own)."""
    module = item.module.__name__
    if item.get_closest_marker("alone") is not None or item.get_closest_marker(
            "whole_machine") is not None:
        return ALONE
    if f"{module}::{item.name}" in shared_keys:
        return "shared_cluster"
    if module == "test_docs_examples" and item.originalname == "test_python_blocks":
        return DOCS_PYTHON
    marker = item.get_closest_marker("unit")
    if marker is not None:
        return f"{module}:{marker.args[0]}"
    return None


def plan(items, shared_keys, expected=None):
    """Reorders `items` in place (the order above); returns {nodeid: unit}
    for the tests that share a unit."""
    expected = expected_durations() if expected is None else expected
    units, order, named = {}, [], {}
    for item in items:
        unit = unit_of(item, shared_keys)
        if unit is not None:
            named[item.nodeid] = unit
        key = unit or item.nodeid
        if key not in units:
            units[key] = []
            order.append(key)
        units[key].append(item)

    def rank(key):
        tests = units[key]
        cost = sum(expected.get(i.nodeid, UNKNOWN_SECONDS) for i in tests)
        processes = any(i.get_closest_marker("multiprocess") is not None for i in tests)
        return (key != ALONE, processes, -cost)

    order.sort(key=rank)  # stable: ties keep collection order
    items[:] = [item for key in order for item in units[key]]
    return named


# ------------------------------------------------------------- the run's folder
class RunDir:
    """A folder shared by one run's controller and workers: the units the
    workers planned (units.json) and the cluster lock. The controller makes
    it and removes it at the end; workers learn it from `workerinput`."""

    KEY = "keras_dist_run_dir"

    @staticmethod
    def create():
        return tempfile.mkdtemp(prefix="keras-dist-tests-")

    @staticmethod
    def remove(path):
        shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def write_units(path, named):
        """Written whole (a rename), by each worker: they plan alike."""
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".units-")
        with os.fdopen(fd, "w") as f:
            json.dump(named, f)
        os.replace(tmp, os.path.join(path, "units.json"))

    @staticmethod
    def read_units(path):
        with open(os.path.join(path, "units.json")) as f:
            return json.load(f)


def made_once(run_dir, name, make):
    """The folder run_dir/name, made by `make(folder)` once per run: the
    first worker to ask makes it (others wait for it), every one after
    reads it. A `make` that fails leaves no folder: the next asks again."""
    folder = os.path.join(run_dir, name)
    fd = os.open(os.path.join(run_dir, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not os.path.isdir(folder):
            partial = tempfile.mkdtemp(dir=run_dir, prefix=f".{name}-")
            make(partial)
            os.rename(partial, folder)
    finally:
        os.close(fd)
    return folder


def make_scheduler(config, log, run_dir):
    """Our xdist scheduler: xdist's load-scope scheduling (whole units to
    one worker, each worker asking for more when nearly done) over our
    units, in the order the workers collected them."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.units = None

        def _split_scope(self, nodeid):
            if self.units is None:  # every worker has collected (and planned) by now
                self.units = RunDir.read_units(run_dir)
            return self.units.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # keep the planned order
    return UnitScheduling(config, log)


# ------------------------------------------------------------- running alone
class Turns:
    """The run's cluster lock (fcntl; it dies with its process): shared for
    a `multiprocess` test, exclusive for `alone` tests, held from one `alone`
    test to the next when they follow each other on this worker. A waiting
    `alone` test goes first: it holds the gate, which cluster tests pass
    through before they take their share, so a stream of them cannot
    starve it."""

    def __init__(self, run_dir):
        self.path = run_dir
        self.exclusive = None  # (gate fd, lock fd) while held exclusively

    def _open(self, name):
        return os.open(os.path.join(self.path, name), os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def turn(self, alone, keep):
        """Holds the lock around one test; yields the seconds waited.
        `keep`: an `alone` test followed by another keeps it exclusive."""
        started = time.monotonic()
        if alone:
            if self.exclusive is None:
                gate, main = self._open("gate"), self._open("clusters")
                fcntl.flock(gate, fcntl.LOCK_EX)
                fcntl.flock(main, fcntl.LOCK_EX)
                self.exclusive = gate, main
            try:
                yield time.monotonic() - started
            finally:
                if not keep:
                    self.release()
            return
        self.release()
        gate, main = self._open("gate"), self._open("clusters")
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(main, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            yield time.monotonic() - started
        finally:
            os.close(main)  # closing releases the lock
            os.close(gate)

    def release(self):
        if self.exclusive is not None:
            for fd in self.exclusive:
                os.close(fd)
            self.exclusive = None

    @contextlib.contextmanager
    def machine(self, whole):
        """Every test holds the machine lock shared; a `whole_machine` test
        (its assertion compares the CPU two processes get) exclusively, so
        nothing of the other worker runs beside it. Taken after `turn`, so
        the two never wait on each other in opposite orders. Yields the
        seconds waited."""
        started = time.monotonic()
        gate, main = self._open("machine-gate"), self._open("machine")
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(main, fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
            if not whole:
                fcntl.flock(gate, fcntl.LOCK_UN)
            yield time.monotonic() - started
        finally:
            os.close(main)
            os.close(gate)


# ------------------------------------------------------------- durations
def cpu_seconds():
    """CPU seconds (user + system) of this process and of every child
    process it has reaped (and theirs, as they reaped them): a test's
    processes are counted once they have ended."""
    self, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return self.ru_utime + self.ru_stime + children.ru_utime + children.ru_stime


class DurationRecorder:
    """Collects each test's setup, call and teardown seconds (on the xdist
    controller, from every worker's reports) and writes them as JSON."""

    def __init__(self, path, workers):
        self.path, self.workers = path, workers
        self.started = time.time()
        self.tests = {}

    def add(self, report):
        node = getattr(report, "node", None)  # the xdist worker that ran it
        row = self.tests.setdefault(report.nodeid, {
            "setup": 0.0, "call": 0.0, "teardown": 0.0, "outcome": "passed",
            "worker": node.gateway.id if node is not None else None})
        row[report.when] += report.duration
        for name, value in getattr(report, "user_properties", ()):
            if name == "waited_for_turn":
                row["waited"] = value
            elif name == "cpu_seconds":
                row["cpu"] = value
        if report.failed:
            row["outcome"] = "failed"
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"

    def write(self, exitstatus):
        rows = [{"nodeid": nodeid, **row, "total": row["setup"] + row["call"] + row["teardown"]}
                for nodeid, row in self.tests.items()]
        data = {"wall": time.time() - self.started, "workers": self.workers,
                "cores": os.cpu_count(),
                "exitstatus": int(exitstatus), "tests": rows}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(data, f, indent=0)
