"""The supported range is stated once and kept consistent; the compat tool's
selection and table; the warning outside the tested range."""

import os
import re
import subprocess
import sys
import warnings

import keras
import pytest
import tensorflow as tf

from keras_dist import versions
from procs import REPO, load_tool


def load_compat_tool():
    return load_tool("compat")


def declared_minimum(package):
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        text = f.read()
    dependencies = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    match = re.search(rf'"{package}>=([0-9.]+)"', dependencies)
    assert match, f"no {package}>= lower bound in pyproject.toml's dependencies"
    return versions.parse(match.group(1))


def test_declared_lower_bounds_are_the_oldest_tested_pair():
    oldest_tf, oldest_keras = versions.TESTED_PAIRS[0]
    assert declared_minimum("tensorflow") == versions.parse(oldest_tf)[:2]
    assert declared_minimum("keras") == versions.parse(oldest_keras)[:2]


def test_the_installed_pair_is_in_the_tested_range():
    # The main suite runs on a tested pair: no warning here.
    assert versions.outside_tested_range() == [], (tf.__version__, keras.version())


def test_compat_tool_reads_the_pairs_from_the_package_source():
    tool = load_compat_tool()
    pairs = tool.tested_pairs()
    assert pairs == [tuple(p) for p in versions.TESTED_PAIRS]
    assert tool.select(pairs, "oldest") == [pairs[0]]
    assert tool.select(pairs, "newest,oldest") == [pairs[-1], pairs[0]]
    assert tool.select(pairs, "all") == pairs
    assert tool.select(pairs, "/".join(pairs[1])) == [pairs[1]]
    with pytest.raises(SystemExit, match="unknown pair '2.99/3.0'"):
        tool.select(pairs, "2.99/3.0")


def test_compat_table_marks_each_failing_path():
    tool = load_compat_tool()
    ok = {"tests": [{"test": "a", "path": "mirrored", "outcome": "passed"},
                    {"test": "b", "path": "wheel", "outcome": "passed"}]}
    bad = {"tests": [{"test": "a", "path": "mirrored", "outcome": "failed"},
                     {"test": "c", "path": "mirrored", "outcome": "passed"},
                     {"test": "b", "path": "wheel", "outcome": "passed"}]}
    lines = tool.table([(("2.16.2", "3.10.0"), bad), (("2.21.0", "3.15.1"), ok),
                        (("2.18.1", "3.12.4"), None)]).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "TensorFlow / Keras", "mirrored", "wheel"]
    assert "FAIL 1/2" in lines[2] and "pass 1" in lines[2]
    assert "pass 1" in lines[3] and "FAIL" not in lines[3]
    assert "no report" in lines[4]


def test_an_untested_version_warns_once(monkeypatch):
    monkeypatch.setattr(keras, "version", lambda: "3.99.0")
    monkeypatch.setattr(versions, "_warned", [])
    low, high = versions.TESTED_RANGE["keras"]
    expected = f"keras 3.99.0 (tested: {low} to {high})"
    with pytest.warns(RuntimeWarning, match=re.escape(expected)):
        assert versions.warn_if_untested() == [expected]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.warn_if_untested()  # the second time: no warning


def test_a_version_below_the_minimum_says_what_goes_wrong(monkeypatch):
    monkeypatch.setattr(keras, "version", lambda: "3.9.2")
    monkeypatch.setattr(versions, "_warned", [])
    low = versions.TESTED_RANGE["keras"][0]
    with pytest.warns(RuntimeWarning, match=re.escape(
            f"keras 3.9.2 (below the supported minimum {low})") + ".*known to go wrong"):
        versions.warn_if_untested()


@pytest.mark.multiprocess
def test_the_untested_version_warning_points_at_the_users_line(tmp_path):
    # keras_dist loads its TensorFlow side on first use, through the import
    # machinery: the warning must still name the user's line, not ours.
    script = tmp_path / "train.py"
    script.write_text(
        "import keras_dist.versions as v\n"
        "v.TESTED_RANGE = {'tensorflow': ('9.0', '9.1'), 'keras': ('9.0', '9.1')}\n"
        "import keras_dist as kd\n"
        "fit = kd.fit\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{script}:4: RuntimeWarning: keras_dist has not been tested with" in proc.stderr
