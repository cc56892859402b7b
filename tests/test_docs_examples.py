"""Every fenced code block of README.md and docs/*.md runs, as written.

A reader copies one block into a fresh file and runs it; so does this test.
Nothing is supplied that the reader does not see on the page: each block
defines its own data, model and imports.

What runs how (by the fence's language):

- **python**: each block runs in a fresh namespace of its own (no name of
  another block is there); every page's blocks share one process
  (`python tests/docblocks.py session`), each page in a fresh work
  directory of its own and with what an earlier page changed (environment,
  working directory, Keras' dtype policy, epoch limit, name counters) reset,
  since a process per page imports TensorFlow again each time. A block marked
  `continue` runs after the page's previous Python block, in that block's
  namespace (for a `file` or `cluster` block: appended to its script); the
  reader is told so by a visible line right above it (see `continue` below). A block that starts with `>>>` is a doctest (its output
  is checked).
- **bash / sh / shell / console**: each block runs with `bash -eo pipefail`
  (for `console`, only its `$ ` lines), in order, in the page's work
  directory: a fresh temporary directory holding a symlink to every
  top-level entry of the repository (`examples/`, `Makefile`, `.venv`, ...)
  and the page's `file` blocks, so commands run as in the clone, but what
  they write stays out of it. A script the page runs is either shown on it
  (a `file` block) or one of the repository's (`python
  examples/train_digits.py`). `.venv/bin` comes first on `PATH` (as after
  `source .venv/bin/activate`), and `make` never reinstalls into the shared
  `.venv` (`--assume-old=.venv/.installed`).
- **json / yaml**: parsed (`json.loads`, `yaml.safe_load_all`).
- **text** (or no language): output, not code; not run.

Any other language fails `test_every_block_has_a_known_kind`: no block is
left out silently.

Every command runs inside private network and PID namespaces (`unshare`,
where permitted): the docs' fixed ports (`localhost:2222`) cannot collide or
be reached, nothing reaches the network, and every process a block starts is
killed with it.

Markers: HTML comments on the lines directly before a block (invisible on
the site), one directive each, several allowed:

- `<!-- docs-test: skip: REASON -->`: not run. The reason is required, and
  `test_skips_are_few_and_explained` prints every skip, page by page.
- `<!-- docs-test: covered: tests/FILE.py::TEST REASON -->`: not run here,
  because the test TEST (a function of tests/FILE.py) runs the same command
  or script shape and checks at least as much; REASON says how. For a test
  of this module, `TEST[ID]` names the job (`test_shell_blocks[README.md]`),
  and each `expect` marker of the covered block must be one of that job's
  too (its output must contain the same text). A test checks that TEST
  exists (and ID) and prints every covered block, apart from the skips (they
  do not count as skips). A covered block cannot be continued; `expect` is
  its only other marker.
- `<!-- docs-test: file NAME -->`: the Python block is written to NAME in the
  page's work directory, for a shell block to run; not run by itself.
- `<!-- docs-test: cluster ARGS -->`: the Python block runs as a script
  under `python -m keras_dist.cluster.launch ARGS -- python SCRIPT`; the launcher
  must exit 0. With ARGS `--workers 2 --ps 1` the script runs instead as a
  scenario of the session's shared cluster of that shape (conftest's
  `SHARED_SCENARIOS`, tests/scripts/docs_block.py: the chief runs it as
  `__main__` in a work directory of its own, with the same epoch limit),
  which must run it to its end.
- `<!-- docs-test: continue -->`: the Python block continues the page's
  previous Python block (same process and namespace, or appended to its
  `file` / `cluster` script). The last sentence of the prose right above
  the block must say so, e.g. `*Continues the previous block.*` or
  `Continuing the script above:` (with `continue`, `continues`, `continued`
  or `continuing`; `test_continue_blocks_say_so`): the reader cannot see
  the marker.
- `<!-- docs-test: complete-script -->`: the block is a complete script, one
  block, as a reader saves it to a file. tests/test_shapes.py runs it, from
  a file in a fresh process, in one process and in three cluster shapes
  (less those its COVERED says another test runs); not here (that would be
  its one-process run again). It cannot be a `continue` block.
- `<!-- docs-test: raises NAME[: TEXT] -->`: the Python block must raise the
  exception class NAME (e.g. `ValueError`), with TEXT in its message if
  given; a block that continues it runs after it.
- `<!-- docs-test: expect TEXT -->`: the output of the shell or `cluster`
  block must contain TEXT (what the docs promise it prints).
- `<!-- docs-test: shells -->`: a shell block of `# shell N` sections, each
  typed into a shell of its own: they run at the same time, each must exit 0.
- `<!-- docs-test: max-epochs N -->`: Keras' `fit`, `kd.fit` and
  `keras_dist.simulate` train at most N epochs, with Keras' "Limiting
  epochs" warning: a shell or `cluster` block runs with `KERAS_MAX_EPOCHS=N`
  in its environment (every process it starts); a Python script (its first
  block; not a `file` block) runs with `keras.config.set_max_epochs(N)`,
  reset after it. Only where nothing the page promises depends on more
  epochs (no `expect` counting epochs or updates, no output it checks): it
  saves the test CPU, the reader's run is unchanged.

The jobs (each Python script, each cluster script, each page's shell
blocks) all start when the first of them is needed, two at a time
(`KD_DOCS_TEST_JOBS=N` to change), and each test waits for its own.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

import docblocks
from conftest import SHARED_SCENARIOS
from docblocks import REPO
from procs import SHARED_TIMEOUT

VENV_BIN = os.path.join(REPO, ".venv", "bin")
PYTHON = os.path.join(VENV_BIN, "python") if os.path.exists(
    os.path.join(VENV_BIN, "python")) else sys.executable
SHELL_TIMEOUT = 240     # seconds per shell block
CLUSTER_TIMEOUT = 240   # seconds per cluster script
SESSION_TIMEOUT = 240   # seconds for the Python scripts' process, plus
PAGE_TIMEOUT = 20       # seconds per page it runs
JOB_WAIT = 600          # seconds a test may wait for its job (queued behind others)

# ---------------------------------------------------------------- collection
ALL, PROBLEMS = [], []   # PROBLEMS: marker errors, reported by test_markers_parse
for _page in docblocks.PAGES:
    try:
        ALL.extend(docblocks.parse_page(_page))
    except ValueError as error:
        PROBLEMS.append(str(error))

SCRIPTS, SCRIPT_PROBLEMS = docblocks.scripts(ALL)
PYTHON_SCRIPTS = {s.where: s for s in SCRIPTS if s.kind == "python"
                  and s.head.marker("complete-script") is None}  # test_shapes runs those
CLUSTERS = {s.where: s for s in SCRIPTS if s.kind == "cluster"}
PYTHON_PAGES = {}
for _script in PYTHON_SCRIPTS.values():
    PYTHON_PAGES.setdefault(_script.head.page, []).append(_script)
SHELLS = {}
for _block in ALL:
    if _block.kind == "shell" and not _block.excluded:
        SHELLS.setdefault(_block.page, []).append(_block)


# ---------------------------------------------------------------- jobs
# Each Python script, each cluster script and each page's shell blocks is
# one job. The jobs of the selected tests start together, when the first of
# those tests runs, two at a time (`KD_DOCS_TEST_JOBS`); each test then waits
# for its own job's result.
class _Workdirs:
    """A fresh work directory per job: symlinks to the clone, plus the page's files."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="docs-test-")

    def make(self, page, job):
        path = os.path.join(self.root, re.sub(r"\W", "_", page) + "-" + job)
        os.makedirs(path)
        docblocks.fill_workdir(path, page, SCRIPTS)
        return path


def _env(block=None):
    """The environment of a job (of `block`'s run: its `max-epochs`)."""
    env = dict(os.environ)
    for name in ("TF_CONFIG", "KERAS_DIST_STRATEGY", "KERAS_DIST_SLOW_WORKER",
                 "KERAS_DIST_SLURM_JOBS", "KERAS_DIST_K8S_JOBS", "PYTHONPATH",
                 "KERAS_MAX_EPOCHS", "KERAS_MAX_STEPS_PER_EPOCH"):
        env.pop(name, None)
    if block is not None and block.marker("max-epochs") is not None:
        env["KERAS_MAX_EPOCHS"] = block.marker("max-epochs")
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = os.path.dirname(VENV_BIN)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _python_job(runner, workdirs, pages):
    """The Python scripts of `pages` (a tuple), page by page, in one process:
    each script (a block and the blocks continuing it) in a fresh namespace
    of its own, each page in a work directory of its own, with Keras' global
    settings and the environment reset between pages (docblocks.run_session).
    One process for all pages, not one per page (or per block): each would
    import TensorFlow again, ~6 CPU-s on 2 cores, 13 pages' worth of it."""
    spec = {"pages": []}
    for page in pages:
        cwd = workdirs.make(page, "python")
        spec["pages"].append({"page": page, "cwd": cwd, "scripts": [
            [{"where": b.where, "code": b.code, "raises": b.marker("raises"),
              "max_epochs": b.marker("max-epochs")} for b in script.blocks]
            for script in PYTHON_PAGES[page]]})
    spec_path = os.path.join(workdirs.root, ".docs-test-session.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    return runner.run(
        [PYTHON, os.path.join(REPO, "tests", "docblocks.py"), "session", spec_path],
        workdirs.root, _env(), SESSION_TIMEOUT + PAGE_TIMEOUT * len(pages))


def _selected_python_pages(session):
    """The pages whose test_python_blocks is selected, in test order."""
    return tuple(item.callspec.params["key"] for item in session.items
                 if item.module is sys.modules[__name__]
                 and item.originalname == "test_python_blocks")


def _cluster_job(runner, workdirs, where):
    script = CLUSTERS[where]
    block = script.head
    cwd = workdirs.make(block.page, f"cluster{block.line}")
    name = f"docs_test_{block.line}.py"
    with open(os.path.join(cwd, name), "w") as f:
        f.write(script.code)
    argv = [PYTHON, "-m", "keras_dist.cluster.launch", *block.marker("cluster").split(),
            "--", "python", name]
    return runner.run(argv, cwd, _env(block), CLUSTER_TIMEOUT)


_SHELL_START = """\
make() { command make --assume-old=.venv/.installed "$@"; }
"""


def _shell_sections(block):
    """A `shells` block's `# shell N` sections, else the whole block."""
    code = docblocks.shell_commands(block)
    if block.marker("shells") is None:
        return [code]
    sections = [s for s in re.split(r"^# shell \d+\s*$", code, flags=re.MULTILINE)
                if s.strip()]
    assert len(sections) >= 2, f"{block.where}: `shells` needs `# shell N` sections"
    return sections


def _shell_job(runner, workdirs, page):
    """Runs the page's shell blocks in order, up to the first that fails."""
    cwd = workdirs.make(page, "shell")
    results = []
    for block in SHELLS[page]:
        scripts = []
        for i, section in enumerate(_shell_sections(block)):
            path = os.path.join(cwd, f".docs-test-{block.line}-{i}.sh")
            with open(path, "w") as f:
                f.write(_SHELL_START + section)
            scripts.append(path)
        if len(scripts) == 1:
            argv = ["bash", "-eo", "pipefail", scripts[0]]
        else:  # the shells run side by side; each must succeed
            argv = ["bash", "-c", "pids=(); " + " ".join(
                f"bash -eo pipefail {s} > {s}.log 2>&1 & pids+=($!);" for s in scripts) +
                " rc=0; for p in ${pids[@]}; do wait $p || rc=$?; done; exit $rc"]
        result = runner.run(argv, cwd, _env(block), SHELL_TIMEOUT)
        if len(scripts) > 1:
            logs = []
            for i, path in enumerate(scripts):
                with open(path + ".log", errors="replace") as f:
                    logs.append(f"\n--- shell {i + 1}\n" + f.read())
            result = result._replace(out=result.out + "".join(logs))
        results.append((block, result))
        if result.rc != 0:
            break
    return results


@pytest.fixture(scope="module")
def jobs(request):
    """Starts the jobs of every selected test of this module; yields the Runner."""
    prefix, reason = docblocks.sandbox_prefix()
    if prefix is None:
        print(f"[docs-test] running without namespaces: {reason}")
    workdirs = _Workdirs()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under xdist (`make test`) the workers are the pool: each test runs
        # its own job when it comes (tests/suite_plan.py orders them).
        runner = docblocks.Runner(prefix, workers=1)
        by_name = {job.__name__: job for job in (_shell_job, _cluster_job, _python_job)}
        submit_and_wait = runner.result

        def result(key):
            if not runner.submitted(key):
                runner.submit(key, by_name[key[0]], workdirs, key[1])
            return submit_and_wait(key)

        runner.result = result
        yield runner
        runner.close()
        shutil.rmtree(workdirs.root, ignore_errors=True)
        return
    runner = docblocks.Runner(prefix, workers=int(os.environ.get("KD_DOCS_TEST_JOBS", "2")))
    wanted = {"test_shell_blocks": (0, _shell_job), "test_cluster_block": (1, _cluster_job)}
    selected = []
    for item in request.session.items:
        if item.module is sys.modules[__name__] and item.originalname in wanted:
            order, job = wanted[item.originalname]
            key = item.callspec.params["key"]
            if job is not _cluster_job or not _in_shared_cluster(key):
                selected.append((order, key, job))
    pages = _selected_python_pages(request.session)
    if pages:
        selected.append((2, pages, _python_job))  # one job for all the pages
    for _, key, job in sorted(selected, key=lambda t: t[0]):  # long jobs first
        runner.submit((job.__name__, key), job, workdirs, key)
    yield runner
    runner.close()
    shutil.rmtree(workdirs.root, ignore_errors=True)


def _report(where, what, result):
    print(f"[docs-test] {where}: {what}, exit {result.rc} in {result.seconds:.1f} s "
          f"({result.cpu:.1f} CPU-s)")


def _tail(text, n=6000):
    return text if len(text) <= n else "...\n" + text[-n:]


def _check_expect(block, output):
    for text in block.markers_of("expect"):
        assert text in output, (f"{block.where}: the docs promise {text!r} in the "
                                f"output; it is not there:\n{_tail(output)}")


# ---------------------------------------------------------------- inventory
def test_markers_parse():
    assert not PROBLEMS, "\n".join(PROBLEMS)


@pytest.mark.parametrize("text, message", [
    ("<!-- docs-test: skip -->\n```bash\nls\n```\n", "needs an argument"),
    ("<!-- docs-test: skip:  -->\n```bash\nls\n```\n", "needs an argument"),
    ("<!-- docs-test: sikp: typo -->\n```bash\nls\n```\n", "unknown docs-test marker"),
    ("<!-- docs-test: continue now -->\n```python\n1\n```\n", "takes no argument"),
    ("<!-- docs-test: max-epochs two -->\n```bash\nls\n```\n", "needs a number of epochs"),
    ("<!-- docs-test: max-epochs 0 -->\n```bash\nls\n```\n", "needs a number of epochs"),
    ("<!-- docs-test: covered: tests/test_x.py::test_y -->\n```bash\nls\n```\n",
     "needs the test that runs the block and why"),
    ("<!-- docs-test: covered: tests/test_x.py::test_y runs it -->\n```bash\nls\n```\n",
     "needs the test that runs the block and why"),
    ("<!-- docs-test: covered: test_x.py::test_y runs it too -->\n```bash\nls\n```\n",
     "needs the test that runs the block and why"),
    ("<!-- docs-test: shells -->\n\nSome prose.\n```bash\nls\n```\n", "directly followed"),
    ("```python\n1\n", "never closed"),
])
def test_bad_markers_are_errors(text, message):
    with pytest.raises(ValueError, match=message):
        docblocks.parse_page("page.md", text)


def test_parser_reads_markers_indented_blocks_and_console():
    blocks = docblocks.parse_page("page.md", (
        "Text.\n\n<!-- docs-test: cluster --workers 2 --ps 1 -->\n"
        "<!-- docs-test: expect done -->\n```python\nprint('done')\n```\n\n"
        "1. A list:\n\n    ```Bash\n    ls\n      cat x\n    ```\n\n"
        "```console\n$ echo hi\nhi\n```\n```\nplain\n```\n"))
    assert [(b.kind, b.line) for b in blocks] == [
        ("python", 5), ("shell", 11), ("shell", 16), ("text", 20)]
    assert blocks[0].markers == [("cluster", "--workers 2 --ps 1"), ("expect", "done")]
    assert blocks[1].code == "ls\n  cat x\n"
    assert docblocks.shell_commands(blocks[2]) == "echo hi\n"
    assert blocks[3].markers == []


def test_max_epochs_sets_keras_max_epochs_for_its_block_alone(monkeypatch):
    monkeypatch.setenv("KERAS_MAX_EPOCHS", "7")  # the caller's own is never passed on
    capped, plain = docblocks.parse_page("page.md", (
        "<!-- docs-test: max-epochs 2 -->\n```bash\nls\n```\n```bash\nls\n```\n"))
    assert _env(capped)["KERAS_MAX_EPOCHS"] == "2"
    assert "KERAS_MAX_EPOCHS" not in _env(plain) and "KERAS_MAX_EPOCHS" not in _env()


def test_every_block_has_a_known_kind():
    unknown = [f"{b.where} ```{b.lang}" for b in ALL if b.kind is None]
    assert not unknown, ("fenced blocks in a language this test does not know how to "
                         "run or check (add it to docblocks.LANGUAGES): " + ", ".join(unknown))


def test_markers_fit_their_blocks():
    problems = []
    for b in ALL:
        directives = [name for name, _ in b.markers]
        if "skip" in directives and len(directives) > 1:
            problems.append(f"{b.where}: `skip` with other markers {directives}")
        if "covered" in directives and set(directives) - {"covered", "expect"}:
            problems.append(f"{b.where}: `covered` with markers other than `expect` "
                            f"{directives}")
        if "covered" in directives and b.kind not in ("python", "shell"):
            problems.append(f"{b.where}: `covered` on a ```{b.lang} block")
        for name in ("file", "cluster", "raises", "continue", "complete-script"):
            if name in directives and b.kind != "python":
                problems.append(f"{b.where}: `{name}` on a ```{b.lang} block")
        if "shells" in directives and b.kind != "shell":
            problems.append(f"{b.where}: `shells` on a ```{b.lang} block")
        if "max-epochs" in directives and not (
                b.kind == "shell" or (b.kind == "python" and not {"file", "continue"} & set(
                    directives))):
            problems.append(f"{b.where}: `max-epochs` needs a shell block or a Python "
                            f"block that starts a script (not `file`, not `continue`)")
        if "expect" in directives and not (b.kind == "shell" or "cluster" in directives):
            problems.append(f"{b.where}: `expect` needs a shell or `cluster` block")
        if b.kind == "text" and directives:
            problems.append(f"{b.where}: markers on a text block (it never runs)")
    assert not problems, "\n".join(problems)


def test_continue_blocks_say_so():
    """Each `continue` block follows a Python block that runs, and the prose says so."""
    assert not SCRIPT_PROBLEMS, "\n".join(SCRIPT_PROBLEMS)


@pytest.mark.parametrize("text, problem", [
    ("```python\nx = 1\n```\n\nThen:\n\n<!-- docs-test: continue -->\n"
     "```python\nprint(x)\n```\n", "needs a visible line"),
    ("```python\nx = 1\n```\n\nTraining continues for a while.\nThen:\n\n"
     "<!-- docs-test: continue -->\n```python\nprint(x)\n```\n", "needs a visible line"),
    ("Some prose.\n\n<!-- docs-test: continue -->\n```python\nprint(x)\n```\n",
     "needs a Python block before it"),
    ("<!-- docs-test: skip: needs a real cluster -->\n```python\nx = 1\n```\n\n"
     "*Continues the previous block.*\n\n<!-- docs-test: continue -->\n"
     "```python\nprint(x)\n```\n", "follows a skipped or covered block"),
    ("<!-- docs-test: covered: tests/test_x.py::test_y runs it as a script -->\n"
     "```python\nx = 1\n```\n\n*Continues the previous block.*\n\n"
     "<!-- docs-test: continue -->\n```python\nprint(x)\n```\n",
     "follows a skipped or covered block"),
    ("```python\nx = 1\n```\n\nContinuing the script above:\n\n"
     "<!-- docs-test: continue -->\n<!-- docs-test: complete-script -->\n"
     "```python\nprint(x)\n```\n", "a complete script is one block"),
], ids=["no_line", "not_the_last_sentence", "first_block", "after_skip", "after_covered",
        "complete_script"])
def test_bad_continuations_are_errors(text, problem):
    _, problems = docblocks.scripts(docblocks.parse_page("page.md", text))
    assert len(problems) == 1 and problem in problems[0], problems


def test_continue_joins_the_previous_script_and_nothing_else_does():
    blocks = docblocks.parse_page("page.md", (
        "```python\nx = 1\n```\n\n*Continues the previous block.*\n\n"
        "<!-- docs-test: continue -->\n```python\nprint(x)\n```\n\n```bash\nls\n```\n\n"
        "<!-- docs-test: file train.py -->\n```python\nimport sys\n```\n\n"
        "Then, continuing the\nscript above:\n<!-- docs-test: continue -->\n"
        "```python\nprint(sys.argv)\n```\n\n```python\nprint(x)\n```\n"))
    scripts, problems = docblocks.scripts(blocks)
    assert not problems
    assert [(s.where, s.kind, [b.line for b in s.blocks]) for s in scripts] == [
        ("page.md:1", "python", [1, 8]), ("page.md:17", "file", [17, 24]),
        ("page.md:28", "python", [28])]
    assert scripts[1].code == "import sys\n\n\nprint(sys.argv)\n"


def test_one_process_runs_the_pages_each_as_in_a_fresh_one(tmp_path):
    """docblocks.run_session: a page's failure stops neither the pages after
    it nor its own next script; the environment, the working directory and
    sys.argv an earlier page changed are back for the next; page_output
    cuts out each page's part."""
    pages = []
    for name, scripts in {
        "a.md": ["import os, sys\nos.environ['KD_PAGE'] = 'a'\nos.chdir('..')\n"
                 "sys.argv.append('x')\nraise ValueError('page a broke')",
                 "print('a again')"],
        "b.md": ["import os, sys\nprint('b sees', os.environ.get('KD_PAGE'), "
                 "os.path.basename(os.getcwd()), 'x' in sys.argv)"],
    }.items():
        (tmp_path / name).mkdir()
        pages.append({"page": name, "cwd": str(tmp_path / name), "scripts": [
            [{"where": f"{name}:{i}", "code": code, "raises": None, "max_epochs": None}]
            for i, code in enumerate(scripts)]})
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"pages": pages}))
    env = {k: v for k, v in os.environ.items() if k != "KD_PAGE"}
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "docblocks.py"),
                           "session", str(spec)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    a, b = (docblocks.page_output(done.stdout, page) for page in ("a.md", "b.md"))
    assert "[docs-test] FAILED a.md:0: ValueError: page a broke" in a
    assert "[docs-test] ok a.md:1" in a and a.endswith("[docs-test] page a.md: failed\n"), a
    assert "b sees None b.md False" in b and b.endswith("[docs-test] page b.md: ok\n"), b
    assert "a again" not in b and docblocks.page_output(done.stdout, "c.md") == ""


def test_skips_are_few_and_explained():
    skips = [(b.page, b.where, b.marker("skip")) for b in ALL if b.marker("skip") is not None]
    code = [b for b in ALL if b.kind in ("python", "shell")]
    lines = [f"{len(skips)} of {len(code)} code blocks skipped:"]
    for page in sorted({page for page, _, _ in skips}):
        mine = [(where, reason) for p, where, reason in skips if p == page]
        lines.append(f"  {page}: {len(mine)}")
        lines.extend(f"    {where}: {reason}" for where, reason in mine)
    print("\n".join(lines))
    assert all(len(reason.split()) >= 3 for _, _, reason in skips), (
        "every skip needs a reason of a few words:\n" + "\n".join(lines))
    assert len(skips) <= len(code) // 4, "more than a quarter of the blocks skipped:\n" + (
        "\n".join(lines))


def _test_functions(path):
    """The names of the module-level functions of the file at `path`."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


# This module's tests that a `covered` marker may name with an ID: their jobs.
_JOBS = {"test_shell_blocks": lambda key: SHELLS.get(key, []),
         "test_cluster_block": lambda key: [CLUSTERS[key].head] if key in CLUSTERS else [],
         "test_python_blocks": lambda key: [b for s in PYTHON_PAGES.get(key, ())
                                            for b in s.blocks]}


def _covered_problems(blocks):
    """What is wrong with the `covered` markers of `blocks`: a test that does
    not exist, or one of this module's jobs that is not there or does not
    check the output for the block's `expect` texts."""
    problems = []
    for b in blocks:
        if b.marker("covered") is None:
            continue
        path, test, key, _ = b.covered_by
        if not os.path.isfile(os.path.join(REPO, path)):
            problems.append(f"{b.where}: no file {path}")
            continue
        if test not in _test_functions(os.path.join(REPO, path)):
            problems.append(f"{b.where}: {path} has no function {test}")
            continue
        if key is None:
            if b.markers_of("expect"):
                problems.append(f"{b.where}: `expect` on a block covered by a test of "
                                f"another module (name one of this module's jobs, whose "
                                f"output this test checks)")
            continue
        if path != "tests/test_docs_examples.py" or test not in _JOBS:
            problems.append(f"{b.where}: an ID ([{key}]) is only for this module's "
                            f"{', '.join(sorted(_JOBS))}")
            continue
        jobs = _JOBS[test](key)
        if not jobs:
            problems.append(f"{b.where}: {test} has no job {key!r}")
            continue
        promised = {text for block in jobs for text in block.markers_of("expect")}
        missing = [text for text in b.markers_of("expect") if text not in promised]
        if missing:
            problems.append(f"{b.where}: {test}[{key}] does not check the output for "
                            f"{missing}: add them to its `expect` markers")
    return problems


def test_covered_blocks_name_their_tests():
    """Each `covered` block names a test that exists; one of this module's
    names its job, whose `expect`s include the block's."""
    covered = [b for b in ALL if b.marker("covered") is not None]
    code = [b for b in ALL if b.kind in ("python", "shell")]
    lines = [f"{len(covered)} of {len(code)} code blocks covered by other tests (not run "
             f"here; not skips):"]
    for b in covered:
        path, test, key, reason = b.covered_by
        lines.append(f"  {b.where}: {path}::{test}{f'[{key}]' if key else ''}: {reason}")
    print("\n".join(lines))
    problems = _covered_problems(ALL)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("target, expect, problem", [
    ("tests/test_nothing_here.py::test_y", None, "no file tests/test_nothing_here.py"),
    ("tests/test_docs_examples.py::test_nothing_here", None, "has no function"),
    ("tests/test_docs_examples.py::test_shell_blocks[no/such/page.md]", None, "has no job"),
    ("tests/test_docs_examples.py::test_markers_parse[README.md]", None, "only for"),
    ("tests/test_docs_examples.py::test_shell_blocks[README.md]", "a promise nobody checks",
     "does not check the output for"),
    ("tests/test_shapes.py::test_a_complete_script_runs_unchanged_in_every_shape",
     "a promise", "`expect` on a block covered by a test of another module"),
], ids=["no_file", "no_test", "no_job", "id_of_another_test", "expect_unchecked",
        "expect_elsewhere"])
def test_bad_covered_targets_are_problems(target, expect, problem):
    text = f"<!-- docs-test: covered: {target} runs this very command -->\n"
    if expect:
        text += f"<!-- docs-test: expect {expect} -->\n"
    problems = _covered_problems(docblocks.parse_page("page.md", text + "```bash\nls\n```\n"))
    assert len(problems) == 1 and problem in problems[0], problems


# ---------------------------------------------------------------- data blocks
@pytest.mark.parametrize("block", [b for b in ALL if b.kind in ("json", "yaml")
                                   and b.marker("skip") is None],
                         ids=lambda b: b.where)
def test_data_block_parses(block):
    if block.kind == "json":
        json.loads(block.code)
    else:
        import yaml

        documents = [d for d in yaml.safe_load_all(block.code) if d is not None]
        assert documents, f"{block.where}: an empty YAML block"


# ---------------------------------------------------------------- python
@pytest.mark.multiprocess
@pytest.mark.timeout(JOB_WAIT)
@pytest.mark.parametrize("key", sorted(PYTHON_PAGES))
def test_python_blocks(key, jobs, request):
    """The page's scripts ran (in the one process that runs every selected
    page's, `_python_job`) and each of its blocks passed."""
    result = jobs.result(("_python_job", _selected_python_pages(request.session)))
    out = docblocks.page_output(result.out, key)
    _report(key, "Python blocks (all pages' process)", result)
    failed = re.findall(r"^\[docs-test\] FAILED .*$", out, flags=re.MULTILINE)
    assert f"[docs-test] page {key}: ok" in out and not failed, (
        f"{key}: Python block(s) failed (the process's exit {result.rc}): {failed}\n"
        f"{_tail(out or result.out)}")
    for script in PYTHON_PAGES[key]:
        for b in script.blocks:
            assert f"[docs-test] ok {b.where}" in out or (
                f"[docs-test] {b.where} raised" in out), (
                f"{b.where} did not run:\n{_tail(out or result.out)}")


# ---------------------------------------------------------------- cluster
# The cluster scripts of the shared cluster's shape run there (a scenario
# each: tests/scripts/docs_block.py), not on a 4-process cluster of their own.
SHARED_SHAPE = ["--workers", "2", "--ps", "1"]


def _in_shared_cluster(key):
    return f"test_docs_examples::test_cluster_block[{key}]" in SHARED_SCENARIOS


def test_the_shared_clusters_shape_runs_there_and_nothing_else():
    """conftest's SHARED_SCENARIOS names each cluster script of that shape
    (by its page and line: a script that moved fails here, naming both)."""
    shaped = {key for key, s in CLUSTERS.items() if s.head.marker("cluster").split() == SHARED_SHAPE}
    listed = {key.split("[", 1)[1][:-1] for key in SHARED_SCENARIOS
              if key.startswith("test_docs_examples::test_cluster_block[")}
    assert shaped == listed, (f"docs cluster scripts of shape {' '.join(SHARED_SHAPE)}: "
                              f"{sorted(shaped)}; in conftest's SHARED_SCENARIOS: {sorted(listed)}")
    assert all(SHARED_SCENARIOS[f"test_docs_examples::test_cluster_block[{key}]"] == (
        "docs_block.py", key) for key in listed)


@pytest.mark.multiprocess
@pytest.mark.timeout(JOB_WAIT + SHARED_TIMEOUT)  # it may be the one that starts the shared cluster
@pytest.mark.parametrize("key", sorted(CLUSTERS))
def test_cluster_block(key, request):
    if _in_shared_cluster(key):
        shared = request.getfixturevalue("shared_cluster")
        shared.ran(request.node)
        output = shared.output
    else:
        result = request.getfixturevalue("jobs").result(("_cluster_job", key))
        _report(key, "cluster", result)
        assert result.rc == 0, (f"{key}: the cluster run failed (exit {result.rc}):\n"
                                f"{_tail(result.out)}")
        output = result.out
    _check_expect(CLUSTERS[key].head, output)


# ---------------------------------------------------------------- shell
@pytest.mark.multiprocess
@pytest.mark.timeout(JOB_WAIT)
@pytest.mark.parametrize("key", sorted(SHELLS))
def test_shell_blocks(key, jobs):
    for block, result in jobs.result(("_shell_job", key)):
        _report(block.where, "shell", result)
        assert result.rc == 0, (f"{block.where}: the shell block failed "
                                f"(exit {result.rc}):\n{_tail(result.out)}")
        _check_expect(block, result.out)
