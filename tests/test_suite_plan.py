"""The suite's own parallel run (tests/suite_plan.py) and its durations report
(tools/durations.py): the order work goes out in, the lock `alone` tests
hold, reference runs made once, and the report's numbers."""

import json
import os
import subprocess
import sys
import types

import pytest

import suite_plan
from procs import load_tool


class FakeItem:
    """What `suite_plan.plan` reads of a pytest item."""

    def __init__(self, module, name, *markers):
        self.module = types.SimpleNamespace(__name__=module)
        self.name = name
        self.nodeid = f"tests/{module}.py::{name}"
        self.markers = set(markers)

    def get_closest_marker(self, name):
        for marker in self.markers:  # a name, or (name, argument) for `unit`
            if marker == name:
                return object()
            if isinstance(marker, tuple) and marker[0] == name:
                return types.SimpleNamespace(args=marker[1:])
        return None


def test_alone_tests_go_first_then_those_without_processes_then_clusters_longest_first():
    items = [
        FakeItem("test_a", "short_cluster", "multiprocess"),
        FakeItem("test_a", "in_process_1"),
        FakeItem("test_b", "shared_1", "multiprocess"),
        FakeItem("test_c", "timed", "multiprocess", "alone"),
        FakeItem("test_a", "long_cluster", "multiprocess"),
        FakeItem("test_b", "shared_2", "multiprocess"),
        FakeItem("test_e", "tiny_cluster", "multiprocess"),
        FakeItem("test_a", "in_process_2"),
        FakeItem("test_d", "timed_too", "multiprocess", "alone"),
    ]
    expected = {"tests/test_a.py::short_cluster": 10, "tests/test_a.py::long_cluster": 50,
                "tests/test_b.py::shared_1": 30, "tests/test_b.py::shared_2": 30,
                "tests/test_e.py::tiny_cluster": 5, "tests/test_a.py::in_process_2": 3}
    named = suite_plan.plan(items, {"test_b::shared_1", "test_b::shared_2"}, expected)
    assert [i.name for i in items] == [
        "timed", "timed_too",                # the alone unit, in collected order
        "in_process_2", "in_process_1",      # no processes: longest first
        "shared_1", "shared_2",              # 60 s as one unit
        "long_cluster", "short_cluster", "tiny_cluster"]
    assert named == {"tests/test_c.py::timed": "alone", "tests/test_d.py::timed_too": "alone",
                     "tests/test_b.py::shared_1": "shared_cluster",
                     "tests/test_b.py::shared_2": "shared_cluster"}


def test_tests_marked_with_one_unit_run_in_a_row_on_one_worker():
    """Their module-scoped fixture (one cluster for all) is then made once:
    pytest tears it down when a test of another module comes between."""
    items = [
        FakeItem("test_a", "phase_1", "multiprocess", ("unit", "cycles")),
        FakeItem("test_b", "other", "multiprocess"),
        FakeItem("test_a", "phase_2", "multiprocess", ("unit", "cycles")),
        FakeItem("test_c", "same_name_elsewhere", "multiprocess", ("unit", "cycles")),
    ]
    expected = {"tests/test_b.py::other": 50, "tests/test_a.py::phase_1": 20,
                "tests/test_a.py::phase_2": 20, "tests/test_c.py::same_name_elsewhere": 30}
    named = suite_plan.plan(items, set(), expected)
    assert [i.name for i in items] == ["other", "phase_1", "phase_2", "same_name_elsewhere"]
    assert named == {"tests/test_a.py::phase_1": "test_a:cycles",
                     "tests/test_a.py::phase_2": "test_a:cycles",
                     "tests/test_c.py::same_name_elsewhere": "test_c:cycles"}


_TRY_SHARED = """
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], "clusters"), os.O_RDWR | os.O_CREAT)
try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    print("got it")
except BlockingIOError:
    print("blocked")
"""


def _other_process_gets_a_share(run_dir):
    out = subprocess.run([sys.executable, "-c", _TRY_SHARED, str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() == "got it"


def test_alone_tests_hold_the_lock_from_one_to_the_next_and_let_it_go_after_the_last(tmp_path):
    turns = suite_plan.Turns(str(tmp_path))
    with turns.turn(alone=True, keep=True):
        assert not _other_process_gets_a_share(tmp_path)
    assert not _other_process_gets_a_share(tmp_path)  # kept for the next alone test
    with turns.turn(alone=True, keep=False):
        assert not _other_process_gets_a_share(tmp_path)
    assert _other_process_gets_a_share(tmp_path)
    with turns.turn(alone=False, keep=False):  # a cluster test shares it
        assert _other_process_gets_a_share(tmp_path)


def test_a_reference_is_made_once_and_a_failed_one_not_at_all(tmp_path):
    calls = []

    def make(folder):
        calls.append(folder)
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump({"n": len(calls)}, f)

    first = suite_plan.made_once(str(tmp_path), "reference", make)
    again = suite_plan.made_once(str(tmp_path), "reference", make)
    assert first == again and len(calls) == 1
    with open(os.path.join(first, "result.json")) as f:
        assert json.load(f) == {"n": 1}

    def fail(folder):
        raise RuntimeError("the reference run failed")

    with pytest.raises(RuntimeError, match="reference run failed"):
        suite_plan.made_once(str(tmp_path), "broken", fail)
    assert not os.path.exists(os.path.join(tmp_path, "broken"))


def test_the_report_sums_seconds_and_cpu_and_states_the_cpu_bound():
    tool = load_tool("durations")
    data = {"wall": 100.0, "workers": 2, "cores": 2, "exitstatus": 0, "tests": [
        {"nodeid": "tests/test_a.py::x", "total": 60.0, "cpu": 80.0, "worker": "gw0"},
        {"nodeid": "tests/test_a.py::y", "total": 10.0, "cpu": 4.0, "worker": "gw1"},
        {"nodeid": "tests/test_b.py::z", "total": 50.0, "cpu": 40.0, "worker": "gw1",
         "waited": 3.0}]}
    text = tool.markdown(data, top=2)
    assert "**3 tests**, 120 s of test time and 124 CPU-s in **100 s**" in text
    assert "124 CPU-s on 2 cores take at least 62 s" in text
    assert "The 2 tests of 10 CPU-s or more" in text and "use 120 of them" in text
    assert "| 60.0 | 80 | 0 | `tests/test_a.py::x` |" in text
    assert "| 50.0 | 40 | 3 | `tests/test_b.py::z` |" in text
    assert "tests/test_a.py::y` |" not in text.split("## By module")[0]  # not in the top 2
    assert "| 70 | 84 | 2 | `tests/test_a.py` |" in text
    assert tool.expected(data) == {"seconds": {"tests/test_a.py::x": 60.0,
                                               "tests/test_a.py::y": 10.0,
                                               "tests/test_b.py::z": 50.0}}


def _other_process_gets_the_machine(run_dir):
    code = _TRY_SHARED.replace('"clusters"', '"machine"')
    out = subprocess.run([sys.executable, "-c", code, str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() == "got it"


def test_a_whole_machine_test_keeps_every_other_test_out(tmp_path):
    turns = suite_plan.Turns(str(tmp_path))
    with turns.machine(whole=True):
        assert not _other_process_gets_the_machine(tmp_path)
    with turns.machine(whole=False):  # any other test shares it
        assert _other_process_gets_the_machine(tmp_path)
    assert _other_process_gets_the_machine(tmp_path)
