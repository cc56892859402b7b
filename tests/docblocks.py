"""The fenced code blocks of README.md and docs/*.md, and how each one runs.

Used by tests/test_docs_examples.py, whose docstring describes the markers.
This module parses the pages (`parse_page`), groups a page's Python blocks
into scripts (`scripts`: a block and the `continue` blocks after it), runs
a page's scripts (`python tests/docblocks.py session BLOCKS.json`, one
process per page, a fresh namespace per script) and runs shell commands in a sandbox (`Runner`).
"""

import collections
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (Empty when tests/ runs outside the checkout, as `make compat` runs it.)
PAGES = [page for page in ["README.md"] + sorted(
    os.path.join("docs", name)
    for name in (os.listdir(os.path.join(REPO, "docs"))
                 if os.path.isdir(os.path.join(REPO, "docs")) else [])
    if name.endswith(".md")) if os.path.exists(os.path.join(REPO, page))]

# Fence languages by kind. A language in none of these fails the suite (a
# block nobody decided about is never skipped silently).
LANGUAGES = {
    "python": {"python", "py", "python3", "pycon"},
    "shell": {"bash", "sh", "shell", "console", "zsh"},
    "json": {"json"},
    "yaml": {"yaml", "yml"},
    "text": {"", "text", "txt", "plain", "output"},
}
# Directive -> whether it takes an argument.
DIRECTIVES = {"skip": True, "file": True, "cluster": True, "continue": False,
              "raises": True, "expect": True, "shells": False,
              "complete-script": False, "covered": True, "max-epochs": True}
# `covered: tests/FILE.py::TEST[ID] REASON`: the test that runs what the block
# shows (ID: a parametrization, only for tests/test_docs_examples.py's own).
COVERED = re.compile(r"^(?P<file>tests/[\w/]+\.py)::(?P<test>test_\w+)"
                     r"(?:\[(?P<id>[^\]\s]+)\])?\s+(?P<reason>\S.*)$")
# What the last sentence of the prose above a `continue` block must say (e.g.
# "*Continues the previous block.*"): the reader cannot see the marker.
CONTINUES = re.compile(r"\bcontinu(e|es|ed|ing)\b", re.IGNORECASE)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    page: str           # "docs/launching.md"
    line: int           # 1-based line of the opening fence
    lang: str           # the fence's language, lower case ("" if none)
    code: str           # the content, dedented by the fence's indentation
    markers: list       # [(directive, argument or None), ...] in order
    before: str = ""    # the last paragraph of prose above the block (and its markers)

    @property
    def kind(self):
        for kind, names in LANGUAGES.items():
            if self.lang in names:
                return kind
        return None

    @property
    def where(self):
        return f"{self.page}:{self.line}"

    def marker(self, directive):
        """The argument of `directive` ("" if it takes none), or None if absent."""
        for name, argument in self.markers:
            if name == directive:
                return argument if argument is not None else ""
        return None

    def markers_of(self, directive):
        return [argument for name, argument in self.markers if name == directive]

    @property
    def excluded(self):
        """Whether the block is not run here: `skip`, or `covered` by a test."""
        return self.marker("skip") is not None or self.marker("covered") is not None

    @property
    def covered_by(self):
        """A `covered` block's `(file, test, id or None, reason)`, else None."""
        argument = self.marker("covered")
        if argument is None:
            return None
        match = COVERED.match(argument)
        return match["file"], match["test"], match["id"], match["reason"]


def parse_marker(body, where):
    """`skip: reason` / `cluster --workers 2` / `continue` -> (directive, argument)."""
    match = re.match(r"^(?P<name>[a-z-]+)(?P<colon>:?)\s*(?P<argument>.*)$", body)
    if match is None or match["name"] not in DIRECTIVES:
        raise ValueError(f"{where}: unknown docs-test marker {body!r}; known: "
                         f"{', '.join(sorted(DIRECTIVES))}")
    name, argument = match["name"], match["argument"].strip()
    if DIRECTIVES[name] and not argument:
        raise ValueError(f"{where}: docs-test marker {name!r} needs an argument "
                         f"(e.g. `skip: why it cannot run here`)")
    if not DIRECTIVES[name] and argument:
        raise ValueError(f"{where}: docs-test marker {name!r} takes no argument; "
                         f"received {argument!r}")
    if name == "max-epochs" and not re.fullmatch(r"[1-9]\d*", argument):
        raise ValueError(f"{where}: docs-test marker 'max-epochs' needs a number of epochs "
                         f"(1 or more); received {argument!r}")
    if name == "covered" and (COVERED.match(argument) is None
                              or len(COVERED.match(argument)["reason"].split()) < 3):
        raise ValueError(f"{where}: docs-test marker 'covered' needs the test that runs "
                         f"the block and why, e.g. `covered: tests/test_x.py::test_y "
                         f"runs this command and checks more`; received {argument!r}")
    return name, (argument if DIRECTIVES[name] else None)


def parse_page(page, text=None):
    """Every fenced block of one page, with the markers on the lines before it."""
    if text is None:
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = f.read()
    lines = text.splitlines()
    blocks, pending, prose, i = [], [], [], 0   # prose: the last paragraph's lines
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker:
            pending.append(parse_marker(marker["body"], f"{page}:{i + 1}"))
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            if pending and line.strip():
                raise ValueError(f"{page}:{i + 1}: a docs-test marker must be directly "
                                 f"followed by a fenced code block")
            if line.strip():
                if i and not lines[i - 1].strip():
                    prose = []
                prose.append(line.strip())
            i += 1
            continue
        indent, mark = fence["indent"], fence["fence"]
        closing = re.compile(r"^[ \t]*" + re.escape(mark[0]) + "{" + str(len(mark)) +
                             r",}\s*$")
        body, j = [], i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent)
                        else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{page}:{i + 1}: code fence is never closed")
        blocks.append(Block(page, i + 1, fence["info"].lower(), "\n".join(body) + "\n",
                            pending, " ".join(prose)))
        pending, prose, i = [], [], j + 1
    if pending:
        raise ValueError(f"{page}: a docs-test marker at the end of the page has no block")
    return blocks


def is_doctest(code):
    first = next((line for line in code.splitlines() if line.strip()), "")
    return first.lstrip().startswith(">>>")


@dataclasses.dataclass
class Script:
    """A Python block and the `continue` blocks after it: one fresh namespace."""

    blocks: list

    @property
    def head(self):
        return self.blocks[0]

    @property
    def where(self):
        return self.head.where

    @property
    def kind(self):
        """`file` (written for a shell block), `cluster` or `python` (run as is)."""
        for kind in ("file", "cluster"):
            if self.head.marker(kind) is not None:
                return kind
        return "python"

    @property
    def code(self):
        return "\n\n".join(block.code for block in self.blocks)


def scripts(blocks):
    """Groups the Python blocks into `Script`s; returns `(scripts, problems)`.

    A block starts a script of its own unless it is marked `continue`: then
    it joins the script of the page's previous Python block, and the last
    sentence of the prose right above it must say so (`CONTINUES`), since
    the marker is invisible. Skipped and covered blocks belong to no script.
    """
    found, problems, previous = [], [], {}   # previous: page -> (block, its script)
    for block in blocks:
        if block.kind != "python":
            continue
        last, script = previous.get(block.page, (None, None))
        if block.marker("continue") is None:
            script = None if block.excluded else Script([block])
            if script is not None:
                found.append(script)
        elif last is None:
            problems.append(f"{block.where}: `continue` needs a Python block before it "
                            f"on the page")
        elif script is None:
            problems.append(f"{block.where}: `continue` follows a skipped or covered "
                            f"block, {last.where}: mark this one so too, or run that one")
        else:
            script.blocks.append(block)
            said = re.split(r"(?<=[.!?])\s+", block.before.strip())[-1]
            if not CONTINUES.search(said):
                problems.append(
                    f"{block.where}: a `continue` block needs a visible line right "
                    f"before it that says which block it continues (e.g. \"*Continues "
                    f"the previous block.*\"); the sentence before it is {said!r}")
            if block.marker("complete-script") is not None:
                problems.append(f"{block.where}: `complete-script` on a `continue` "
                                f"block: a complete script is one block")
        previous[block.page] = (block, script)
    return found, problems


def all_scripts():
    """`scripts(...)` of every page's blocks (a page whose markers do not
    parse is left out: test_docs_examples reports it)."""
    blocks = []
    for page in PAGES:
        try:
            blocks.extend(parse_page(page))
        except ValueError:
            pass
    return scripts(blocks)[0]


def fill_workdir(path, page, all_found):
    """Makes `path` a job's work directory for `page`: links to the clone's
    entries, and the page's `file` blocks written out (`all_found`: the
    `Script`s of every page)."""
    files = {s.head.marker("file"): s.code for s in all_found
             if s.head.page == page and s.kind == "file"}
    for name in os.listdir(REPO):
        if name not in (".git", *files):
            os.symlink(os.path.join(REPO, name), os.path.join(path, name))
    for name, code in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(textwrap.dedent(code).lstrip())


def shell_commands(block):
    """A shell block's script; for `console` blocks, only the `$ ` lines."""
    if block.lang != "console":
        return block.code
    return "\n".join(line[2:] for line in block.code.splitlines()
                     if line.startswith("$ ")) + "\n"


# ------------------------------------------------------------------ sandbox
# Brings up loopback in the new network namespace, then becomes the command.
# (The same ioctl as keras_dist.cluster.isolation, without importing TensorFlow.)
_BOOT = """
import fcntl, os, socket, struct, sys
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))
os.execvp(sys.argv[1], sys.argv[1:])
"""


def sandbox_prefix():
    """A prefix that runs a command in private network and PID namespaces.

    Nothing the command starts can reach or be reached from the network (the
    docs' fixed ports cannot collide with anything), and when it ends, or is
    killed, every process it started dies with it (`--kill-child`, PID 1 of
    the namespace). Returns `(prefix, None)` or `(None, reason)`.
    """
    base = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        base.append("--map-root-user")
    try:
        probe = subprocess.run(base + ["true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"unshare failed to start: {error}"
    if probe.returncode != 0:
        return None, f"unshare is not permitted here: {probe.stderr.strip()}"
    return base + [sys.executable, "-c", _BOOT], None


# rc: the exit code, None if the command timed out; seconds: wall time; cpu:
# CPU seconds of the command and of every process it waited for.
Result = collections.namedtuple("Result", "rc out seconds cpu")


class Runner:
    """Runs jobs two (or `workers`) at a time, and every process they start.

    Pages are independent, and a 2-core machine is otherwise half idle while
    a cluster starts up, so jobs run side by side in threads. `close()` kills
    whatever is still running (each command runs in its own process group,
    inside the sandbox when there is one, so its whole tree dies with it).
    """

    def __init__(self, prefix, workers=2):
        self.prefix = prefix
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        self._futures = {}
        self._procs = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, key, fn, *args):
        self._futures[key] = self._pool.submit(fn, self, *args)

    def submitted(self, key):
        return key in self._futures

    def result(self, key):
        return self._futures[key].result()

    def run(self, argv, cwd, env, timeout):
        """Runs argv in the sandbox; returns a `Result`.

        The exit code is None when the command timed out: its process group
        then gets SIGTERM (a launcher stops its tasks), then SIGKILL. When the
        command ends, whatever it left running in its process group is killed
        too (without the sandbox, a shell's background jobs would live on).
        """
        with tempfile.TemporaryFile("w+", errors="replace") as log:
            with self._lock:
                if self._closed:
                    return Result(None, "[docs-test] not run: the session is ending", 0, 0)
                start = time.monotonic()
                proc = subprocess.Popen((self.prefix or []) + argv, cwd=cwd, env=env,
                                        stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                self._procs.add(proc)
            try:
                exited = _wait_unreaped(proc, timeout)
                if not exited:
                    _kill_group(proc, signal.SIGTERM)
                    _wait_unreaped(proc, 10)
            finally:
                # The unreaped process holds its group id: no other group can
                # have it yet, so this kills only what the command left behind.
                _kill_group(proc, signal.SIGKILL)
                with self._lock:
                    self._procs.discard(proc)
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                rc = proc.returncode if exited else None
            seconds = time.monotonic() - start
            log.seek(0)
            out = log.read()
        if rc is None:
            out += f"\n[docs-test] timed out after {timeout} s"
        return Result(rc, out, seconds, usage.ru_utime + usage.ru_stime)

    def close(self):
        for future in self._futures.values():
            future.cancel()
        with self._lock:  # a listed process is not reaped yet: its group id is its own
            self._closed = True
            for proc in self._procs:
                _kill_group(proc, signal.SIGKILL)
        self._pool.shutdown(wait=True)


def _wait_unreaped(proc, timeout):
    """Waits up to `timeout` s for proc to exit, leaving it a zombie; True if it did."""
    deadline = time.monotonic() + timeout
    while True:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _kill_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------ session
def run_session(spec_path):
    """Runs pages' Python scripts in this process, page by page, each script
    in a fresh namespace of its own.

    The spec is `{"pages": [{"page", "cwd", "scripts": [[{"where", "code",
    "raises", "max_epochs"}, ...], ...]}, ...]}`: per page, the work
    directory it runs in and, per script, a block and the blocks that
    continue it, nothing else (no names the reader does not see). Each page
    starts from what a fresh process would give it as far as its blocks can
    tell: the environment, the working directory, `sys.argv`, Keras' dtype
    policy, epoch limit and name counters (`keras.utils.clear_session`) are
    reset before it (`_fresh_page`). A script stops at its first failing
    block (named); the others still run, and so do the later pages. Prints
    `[docs-test] page PAGE` before a page's output and `[docs-test] page
    PAGE: ok` (or `: failed`) after it (`page_output` cuts one page's part
    out). Exits 1 if any block failed.
    """
    with open(spec_path) as f:
        spec = json.load(f)
    environ, argv, failed_pages = dict(os.environ), list(sys.argv), 0
    for page in spec["pages"]:
        print(f"{PAGE_START}{page['page']}", flush=True)
        _fresh_page(environ, argv, page["cwd"])
        failed = sum(not _run_limited(blocks) for blocks in page["scripts"])
        print(f"{PAGE_START}{page['page']}: {'failed' if failed else 'ok'}", flush=True)
        failed_pages += bool(failed)
    sys.exit(1 if failed_pages else 0)


PAGE_START = "[docs-test] page "


def page_output(out, page):
    """What `run_session` printed for `page` (from its start line to its
    result line, both included); "" if the page never started."""
    out = "\n" + out
    start = out.find(f"\n{PAGE_START}{page}\n")
    if start < 0:
        return ""
    end = out.find(f"\n{PAGE_START}{page}: ", start)
    if end < 0:  # the process died in this page
        return out[start + 1:]
    return out[start + 1:out.find("\n", end + 1) + 1 or len(out)]


def _fresh_page(environ, argv, cwd):
    """Undoes what an earlier page may have changed in this process."""
    # Only what changed: setenv(3) and unsetenv(3) race TensorFlow's threads'
    # getenv(3) (tests/conftest.py's _environment_without_putenv).
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    for name, value in environ.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    sys.argv[:] = argv
    os.chdir(cwd)
    if "keras" in sys.modules:
        import keras

        keras.config.set_dtype_policy("float32")
        keras.config.set_max_epochs(None)
        keras.utils.clear_session()


def _run_limited(blocks):
    """One script; a first block's `max_epochs` caps the whole script's
    epochs (`keras.config.set_max_epochs`, reset after it)."""
    limit = blocks[0].get("max_epochs")
    if not limit:
        return _run_script(blocks)
    import keras

    keras.config.set_max_epochs(int(limit))
    print(f"[docs-test] {blocks[0]['where']}: at most {limit} epochs", flush=True)
    try:
        return _run_script(blocks)
    finally:
        keras.config.set_max_epochs(None)


def _run_script(blocks):
    """One script's blocks in one fresh namespace; whether all passed."""
    import doctest
    import traceback

    namespace = {"__name__": "__main__"}
    for block in blocks:
        where, code, raises = block["where"], block["code"], block["raises"]
        print(f"[docs-test] running {where}", flush=True)
        try:
            if is_doctest(code):
                test = doctest.DocTestParser().get_doctest(code, namespace, where, where, 0)
                runner = doctest.DocTestRunner(
                    optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
                runner.run(test, clear_globs=False)
                if runner.failures:
                    raise AssertionError(f"{runner.failures} doctest example(s) failed")
            else:
                exec(compile(code, where, "exec"), namespace)
        except BaseException as error:  # noqa: BLE001 -- report, then judge
            name, _, text = (raises or "").partition(":")
            if raises and type(error).__name__ == name.strip() and text.strip() in str(error):
                print(f"[docs-test] {where} raised {raises} as marked: {error}", flush=True)
                continue
            traceback.print_exc()
            print(f"[docs-test] FAILED {where}: {type(error).__name__}: {error}", flush=True)
            return False
        if raises:
            print(f"[docs-test] FAILED {where}: marked `raises {raises}` but raised "
                  f"nothing", flush=True)
            return False
        print(f"[docs-test] ok {where}", flush=True)
    return True


if __name__ == "__main__":
    if sys.argv[1:2] == ["session"]:
        run_session(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} session SPEC.json")
