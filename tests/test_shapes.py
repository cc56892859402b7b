"""One script, every cluster shape (issue 32, item 1).

Each "complete script" of the docs (a block marked
`<!-- docs-test: complete-script -->` in README.md and docs/) runs unchanged

- in one process with no cluster,
- with Mirrored over 2 logical CPUs (`KERAS_DIST_STRATEGY=mirrored
  KERAS_DIST_CPU_REPLICAS=2`),
- under `keras-dist-run --workers 2` (MultiWorkerMirrored),
- under `keras-dist-run --workers 2 --ps 1` (parameter servers),

(less the pairs in COVERED: each of them is run by its page's own shell
block, by another script's run here in the same shape, or by a test, as
COVERED says) and must exit 0 with its test accuracy (a dict it prints, or
the evaluation's progress line) in what the chief (or the single process)
printed last. Every script keeps its one-process run, README's script every
shape. The runs train at most `MAX_EPOCHS` epochs (Keras' `KERAS_MAX_EPOCHS`,
which kd.fit honours too): nothing here depends on more. The runs start
together, two at a time, when the first test needs them (a cluster run takes
~20-40 s here); under pytest-xdist (`make test`) each test runs its own, the
workers being the pool.
"""

import ast
import collections
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile

import pytest

import docblocks
from docblocks import REPO

pytestmark = pytest.mark.multiprocess

SHAPES = {
    "one_process": ([], {}),
    "mirrored": ([], {"KERAS_DIST_STRATEGY": "mirrored", "KERAS_DIST_CPU_REPLICAS": "2"}),
    "multi_worker": (["--workers", "2"], {}),
    "parameter_server": (["--workers", "2", "--ps", "1"], {}),
}
TIMEOUT = 300
# The chief's (or the only process's) accuracy: a printed dict, or Keras'
# evaluation progress line ("... accuracy: 0.9611 - loss: 0.1302").
ACCURACY = re.compile(r"['\"]?accuracy['\"]?\s*:\s*(0\.\d+|1\.0+)")


def _complete_scripts():
    found = []
    for page in docblocks.PAGES:
        for block in docblocks.parse_page(page):
            if block.kind == "python" and block.marker("complete-script") is not None:
                found.append(block)
    return found


SCRIPTS = _complete_scripts()


class Shell(collections.namedtuple("Shell", "page command")):
    """A shell block of `page` that runs the script as the page shows it,
    checking more of the output than this test does: it contains `command`."""


class Shape(collections.namedtuple("Shape", "page shape")):
    """`page`'s complete script, run here in `shape`."""


class ByTest(collections.namedtuple("ByTest", "path name")):
    """The test function `name` of tests/`path`."""


_ASYNC_SHELL = Shell("docs/asynchronous-training.md",
                     "keras-dist-run --workers 2 --ps 1 -- python train.py")
_SHELLS_MULTI_WORKER = Shell("docs/getting-started.md",
                             '"task": {"type": "worker", "index": 1}}\'\npython train.py')
# (script, shape) pairs not run here: why, and what runs them instead
# (test_covered_pairs_are_still_run_by_the_docs checks that each still does).
# Getting started's and asynchronous training's scripts are one script
# but for `fit`'s arguments and what is printed after it (as the latter
# page says): each page's shell block runs it in one cluster shape.
COVERED = {
    ("docs/asynchronous-training.md", "parameter_server"): (
        "the page's shell block runs it so, and checks more of the output", [_ASYNC_SHELL]),
    ("docs/getting-started.md", "multi_worker"): (
        "the page's `shells` block runs it so, and checks more of the output",
        [_SHELLS_MULTI_WORKER]),
    ("docs/getting-started.md", "parameter_server"): (
        "asynchronous training's script (this one but for fit's arguments and one print) "
        "runs so in that page's shell block; README's script runs so here",
        [_ASYNC_SHELL, Shape("README.md", "parameter_server")]),
    ("docs/asynchronous-training.md", "multi_worker"): (
        "getting started's script (this one but for fit's arguments and one print) runs so "
        "in that page's `shells` block; README's script (validation_data too) runs so here; "
        "validation, kd.evaluate's dict and model.version there: test_fit_multiworker",
        [_SHELLS_MULTI_WORKER, Shape("README.md", "multi_worker"),
         ByTest("test_fit_multiworker.py", "test_two_workers_train_in_sync")]),
    ("docs/getting-started.md", "mirrored"): (
        "README's script runs so here (the same calls: resolve_strategy, kd.fit of a "
        "build function, kd.evaluate)", [Shape("README.md", "mirrored")]),
    ("docs/asynchronous-training.md", "mirrored"): (
        "README's script runs so here (the same calls, validation_data too; kd.evaluate's "
        "dict under Mirrored: test_fit)",
        [Shape("README.md", "mirrored"),
         ByTest("test_fit.py", "test_evaluate_uses_the_models_strategy")]),
}
MAX_EPOCHS = 2
_TF_LOG = re.compile(r"^([IWE]\d{4} |WARNING: All log messages|\[keras-dist-run\])")
_jobs = {}


def _run(block, shape):
    args, extra = SHAPES[shape]
    work = tempfile.mkdtemp(prefix="kd-shape-")
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(block.code)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CONFIG", "KERAS_DIST_STRATEGY", "KERAS_DIST_CPU_REPLICAS")}
    env.update(extra, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               KERAS_MAX_EPOCHS=str(MAX_EPOCHS),
               PYTHONPATH=os.pathsep.join([REPO, env.get("PYTHONPATH", "")]))
    if args:
        command = [sys.executable, "-m", "keras_dist.cluster.launch", *args, "--max-restarts", "0",
                   "--", sys.executable, script]
    else:
        command = [sys.executable, script]
    try:
        out = subprocess.run(command, cwd=work, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
                             start_new_session=True)
    except subprocess.TimeoutExpired as error:
        return None, f"timed out after {TIMEOUT} s:\n{error.stdout}"
    return out.returncode, out.stdout


def _job(block, shape):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: the xdist workers are the pool
        return _run(block, shape)
    if not _jobs:
        pool = concurrent.futures.ThreadPoolExecutor(2)
        for b in SCRIPTS:
            for s in SHAPES:
                if (b.page, s) not in COVERED:
                    _jobs[(b.where, s)] = pool.submit(_run, b, s)
        pool.shutdown(wait=False)
    return _jobs[(block.where, shape)].result()


def _leader_lines(output, shape):
    """What the chief (or the single process) printed, in order."""
    lines = output.splitlines()
    if shape in ("one_process", "mirrored"):
        return lines
    leader = "[chief:0] " if shape == "parameter_server" else "[worker:0] "
    return [line[len(leader):] for line in lines if line.startswith(leader)]


def test_the_docs_have_complete_scripts():
    pages = sorted({b.page for b in SCRIPTS})
    assert {"README.md", "docs/getting-started.md",
            "docs/asynchronous-training.md"} <= set(pages), pages


def test_covered_pairs_are_still_run_by_the_docs():
    """A pair left out here is run by what COVERED names: its page's shell
    block (tests/test_docs_examples.py), another script's run here, or a
    test function that exists."""
    pages = {b.page for b in SCRIPTS}
    assert {page for page, _ in COVERED} <= pages, "COVERED names a page with no complete script"
    assert not {p for p, s in COVERED if s == "one_process"}, "every script runs in one process"
    assert not {s for p, s in COVERED if p == "README.md"}, "README's script runs every shape"
    for (page, shape), (reason, runners) in COVERED.items():
        assert len(reason.split()) >= 5 and runners, (page, shape)
        for runner in runners:
            if isinstance(runner, Shell):
                shells = [b for b in docblocks.parse_page(runner.page)
                          if b.kind == "shell" and not b.excluded]
                assert any(runner.command in b.code for b in shells), (
                    f"{runner.page}: no shell block runs its complete script as {shape} "
                    f"({runner.command!r}); COVERED[{page!r}, {shape!r}] relies on it")
            elif isinstance(runner, Shape):
                assert runner.shape == shape and runner.page in pages, (page, shape, runner)
                assert (runner.page, runner.shape) not in COVERED, (
                    f"COVERED[{page!r}, {shape!r}] relies on {runner}, which is not run here")
            else:
                path = os.path.join(REPO, "tests", runner.path)
                with open(path, encoding="utf-8") as f:
                    names = {node.name for node in ast.parse(f.read()).body
                             if isinstance(node, ast.FunctionDef)}
                assert runner.name in names, (
                    f"COVERED[{page!r}, {shape!r}] relies on tests/{runner.path}::"
                    f"{runner.name}, which is not there")


@pytest.mark.parametrize("block,shape", [
    pytest.param(b, s, id=f"{b.where}-{s}") for b in SCRIPTS for s in SHAPES
    if (b.page, s) not in COVERED])
def test_a_complete_script_runs_unchanged_in_every_shape(block, shape):
    code, output = _job(block, shape)
    assert code == 0, f"{block.where} as {shape}: exit {code}\n{output[-6000:]}"
    lines = [line for line in _leader_lines(output, shape)
             if line.strip() and not _TF_LOG.match(line)]
    tail = lines[-3:]
    assert any(ACCURACY.search(line) for line in tail), (
        f"{block.where} as {shape}: no accuracy in the last lines:\n" + "\n".join(tail)
        + "\n---\n" + output[-4000:])
    expected = {"one_process": "using default strategy", "mirrored": "using mirrored strategy",
                "multi_worker": "using multi_worker strategy",
                "parameter_server": "using parameter_server strategy"}[shape]
    assert expected in output, output[-4000:]
