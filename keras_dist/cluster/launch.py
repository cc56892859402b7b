"""`keras-dist-run`: start a real local cluster running one script.

    keras-dist-run --workers 2 --ps 1 -- python examples/train_digits.py --epochs 5

Runs the cluster inside a private network namespace (see
`keras_dist.cluster.isolation`; `--no-isolate` opts out), picks free loopback ports,
starts one process per task with its own
`TF_CONFIG` (the same script everywhere; it learns its role from
`TF_CONFIG`), prefixes every output line with the task (`[worker:1] ...`),
and returns the exit code of the task that leads (the chief, or worker 0
without one). Every task is stopped when the leader ends, when a training
task fails, or on Ctrl-C / SIGTERM; each runs in its own process group, which
is killed as a whole, so nothing is left behind.
"""

import argparse
import codecs
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from keras_dist.cluster import isolation
from keras_dist.cluster import ports
from keras_dist.cluster import recipes
from keras_dist.cluster.config import DEFAULT_GRACE_PERIOD, PREEMPTED_EXIT_CODE, ClusterConfig

GRACE_SECONDS = 5.0
"""Seconds stopped tasks get between SIGTERM and SIGKILL when the job ends."""

PREEMPTION_WAIT = DEFAULT_GRACE_PERIOD
"""Seconds the launcher lets a preempted job's tasks save and exit by
themselves (Kubernetes' default grace period) before stopping them."""

STATE_ENV = "KERAS_DIST_RUN_STATE"
"""A directory the launcher gives its tasks: `BackupAndRestore` notes there
which backup is in force, and the launcher names it when it restarts the job."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # keras_dist/


@dataclasses.dataclass(frozen=True)
class Failure:
    """A task ended the job: it died, saved a backup and exited preempted, or
    could not listen because another program holds its port (`port`)."""

    task: tuple
    code: int
    port: int = None

    @property
    def restartable(self):
        """Killed by a signal (a lost machine, the OOM killer, a scheduler;
        137/143 through a shell), preempted, or its port taken (the job
        restarts on new ports): a restart can help. A task that exits with an
        error of its own (a Python exception: 1) would fail again."""
        return self.port is not None or self.code < 0 or self.code in (
            PREEMPTED_EXIT_CODE, 128 + signal.SIGKILL, 128 + signal.SIGTERM)

    def why(self):
        if self.port is not None:
            return f"could not listen on port {self.port}: it is in use by another program"
        if self.code == PREEMPTED_EXIT_CODE:
            return "was preempted (saved a backup, exit code 75)"
        if self.code < 0:
            return f"was killed by {signal.Signals(-self.code).name}"
        return f"exited with code {self.code}"


def add_task_arguments(parser):
    """The cluster's shape and restarts, and the command after `--`: the
    arguments `keras-dist-run` and `python -m keras_dist.ray` share. Check
    them with `check_task_arguments`."""
    parser.add_argument("--workers", type=int, default=2,
                        help="number of worker tasks (default 2)")
    parser.add_argument("--ps", type=int, default=0,
                        help="number of parameter-server tasks; > 0 means asynchronous "
                             "training with a chief (default 0: synchronous multi-worker)")
    parser.add_argument("--evaluator", action="store_true",
                        help="add an evaluator task")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="how many times the job is restarted when a task dies or is "
                             "preempted: every task is stopped and started again, and "
                             "training resumes from its newest backup "
                             "(kd.callbacks.BackupAndRestore). With --ps a worker that dies "
                             "is restarted alone, up to this many times per worker "
                             "(default 3; 0: stop the job on the first failure)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command to run on every task, after --")


def check_task_arguments(parser, args):
    """Refuses bad `add_task_arguments` values through `parser.error`;
    returns the command without its leading `--`."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.workers < 1:
        parser.error(f"--workers must be at least 1. Received: --workers {args.workers}.")
    if args.ps < 0:
        parser.error(f"--ps must be 0 or more. Received: --ps {args.ps}.")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be 0 or more. Received: --max-restarts "
                     f"{args.max_restarts}.")
    if not command:
        parser.error(f"no command given. Put it after --, e.g. {parser.prog} "
                     "--workers 2 -- python train.py")
    return command


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="keras-dist-run",
        description="Run a script as every task of a local TensorFlow cluster.",
        epilog="Example: keras-dist-run --workers 2 --ps 1 -- python train.py --epochs 5")
    add_task_arguments(parser)
    parser.add_argument("--no-isolate", action="store_true",
                        help="do not run the cluster in a private network namespace: its "
                             "unauthenticated TensorFlow ports are then reachable from "
                             "the network (see docs/security.md)")
    parser.add_argument("--_in-namespace", action="store_true", dest="in_namespace",
                        help=argparse.SUPPRESS)
    recipes.add_arguments(parser)
    args = parser.parse_args(argv)
    command = check_task_arguments(parser, args)
    if args.emit is None:
        for option, value in (("--image", args.image), ("--job-name", args.job_name),
                              ("--port", args.port)):
            if value is not None:
                parser.error(
                    f"{option} applies to a recipe (--emit) only; without --emit the "
                    f"tasks run here and nothing would use it. Received: {option} {value} "
                    "and no --emit. Add --emit tfjob, k8s or slurm, or drop " + option + ".")
    else:
        # The command runs in a container or on compute nodes: it need not exist here.
        args.command = command
        try:
            args.recipe = recipes.emit_from_args(args)
        except ValueError as error:
            parser.error(str(error))
        return args
    if shutil.which(command[0]) is None and not os.path.exists(command[0]):
        parser.error(f"command {command[0]!r} not found.")
    script = next((a for a in command[1:] if a.endswith(".py")), None)
    if script is not None and not os.path.exists(script):
        parser.error(f"script {script!r} does not exist (working directory: {os.getcwd()}).")
    args.command = command
    return args


class Cluster:
    """The running task processes of one launch."""

    def __init__(self, config, command, env=None, out=None, max_restarts=3):
        self.config, self.command = config, command
        self.env = dict(os.environ if env is None else env)
        # Where a task's BackupAndRestore says which backup is in force.
        self.state_dir = tempfile.mkdtemp(prefix="keras-dist-run-")
        self.env[STATE_ENV] = self.state_dir
        if config.cluster.get("ps"):
            # Every task imports keras_dist at start-up, whose guard refuses
            # Keras' own model.fit there (keras_dist/cluster/plain_fit.py): a script
            # that never hands its training to keras_dist fails on every
            # task instead of training one model per task.
            boot = os.path.join(_PACKAGE, "_boot")
            self.env["PYTHONPATH"] = os.pathsep.join(
                [boot] + [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.console = _Console(out or sys.stdout,
                                quiet="TF_CPP_MIN_LOG_LEVEL" not in self.env)
        self.procs = {}
        self.all_procs = []  # every process ever started, restarted ones included
        self.restarts = {}
        self.max_restarts = max_restarts
        self._threads = []

    def tasks(self):
        order = ("ps", "worker", "evaluator", "chief")  # servers first, chief last
        return [(role, i) for role in order
                for i in range(len(self.config.cluster.get(role, ())))]

    @property
    def leader(self):
        return ("chief", 0) if "chief" in self.config.cluster else ("worker", 0)

    def start(self):
        for role, index in self.tasks():
            self._start_task(role, index)

    def _start_task(self, role, index):
        env = dict(self.env)
        env["TF_CONFIG"] = self.config.for_task(role, index).to_tf_config()
        for key, value in recipes.TASK_ENV:  # what a TFJob or SLURM task gets too
            env.setdefault(key, value)
        env["PYTHONUNBUFFERED"] = "1"  # the prefixer needs lines as they come
        proc = subprocess.Popen(
            self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[(role, index)] = proc
        self.all_procs.append(proc)
        name = f"{role}:{index}"
        thread = threading.Thread(
            target=pump, args=(proc, lambda text: self.console.line(name, text),
                               lambda text: self.console.progress(name, text)),
            daemon=True)
        thread.start()
        self._threads.append(thread)
        self._say(f"started {role}:{index} (pid {proc.pid})")

    def wait(self):
        """Waits for the leader (and, without ps, every worker); returns its
        code, or `Failure` when the job should be restarted as a whole.

        With ps tasks (asynchronous training) a worker that dies (killed by
        a signal, or preempted: 75) is restarted alone, up to `max_restarts`
        times per worker; one that exits with an error of its own stops the
        job, as any training task's does without ps. TensorFlow's
        coordinator runs its lost steps elsewhere and uses it again once it
        is back. Any other task that dies (or exits with
        `PREEMPTED_EXIT_CODE`, having saved a backup) fails the job: a
        `Failure` naming it.
        """
        training = [t for t in self.procs if t[0] in ("chief", "worker")]
        must_finish = [self.leader] if self.config.num_ps else training
        while True:
            for task in list(self.procs):
                code = self.procs[task].poll()
                if code is None or task not in training and task[0] != "ps":
                    continue
                if task == self.leader and self.config.num_ps:
                    return code if code == 0 else self._failure(task, code)
                if self.config.num_ps and code == 0:
                    # Worker and ps tasks serve until the chief is done; one that
                    # ends cleanly ran the script on its own.
                    self._say(
                        f"{task[0]}:{task[1]} exited with code 0 before the chief was "
                        "done: the script probably trained on its own there (plain "
                        "model.fit?). On worker and ps tasks call kd.fit or kd.serve, "
                        "which serve the chief. Stopping the cluster")
                    return 1
                if self.config.num_ps and task[0] == "worker" and not Failure(
                        task, code).restartable and self._taken_port(task) is None:
                    # An error of its own (a Python exception): restarted, it
                    # would fail the same way; the job stops, as without ps.
                    self._say(f"{task[0]}:{task[1]} exited with code {code}; stopping the "
                              "cluster (an error of the task's own: a restart would fail "
                              "the same way)")
                    return code
                if self.config.num_ps and task[0] == "worker":
                    used = self.restarts.get(task, 0)
                    if self._taken_port(task) is not None:
                        # Restarted alone it must keep its address: the job
                        # restarts instead, on new ports.
                        return self._failure(task, code)
                    if used < self.max_restarts:
                        self.restarts[task] = used + 1
                        self._say(f"{task[0]}:{task[1]} exited with code {code}; restarting "
                                  f"it ({used + 1}/{self.max_restarts})")
                        self._start_task(*task)
                        continue
                    self._say(f"{task[0]}:{task[1]} exited with code {code} and has used "
                              f"its {self.max_restarts} restarts; stopping the cluster")
                    return code or 1
                if self.config.num_ps or code != 0:
                    if code == PREEMPTED_EXIT_CODE and not self.config.num_ps:
                        # Every worker saves at the step they agreed on; the
                        # leader writes the backup: let it finish.
                        self._wait_for(self.leader, PREEMPTION_WAIT)
                    return self._failure(task, code)
            if all(self.procs[t].poll() is not None for t in must_finish):
                return self.procs[self.leader].returncode
            time.sleep(0.1)

    def _failure(self, task, code):
        """The `Failure` that ended the job: of the tasks ended so far, one
        killed or preempted (its peers fail after it, with errors of their
        own), else `task`."""
        ended = {t: Failure(t, p.poll(), self._taken_port(t))
                 for t, p in self.procs.items() if p.poll() is not None}
        failure = ended.get(task) or Failure(task, code, self._taken_port(task))
        for other in ended.values():
            if other.restartable and not failure.restartable:
                return other
        return failure

    def _taken_port(self, task):
        """The port of `task`, ended with an error, when another program holds
        it now (the task could not start its server), else `None`."""
        if self.procs[task].poll() in (None, 0):
            return None
        port = int(self.config.cluster[task[0]][task[1]].rpartition(":")[2])
        return port if self._port_in_use(task, port) else None

    def _port_in_use(self, task, port):
        """Whether `port` is taken where `task` runs (here, for this launcher)."""
        return ports.port_in_use(port)

    def _wait_for(self, task, seconds):
        try:
            self.procs[task].wait(seconds)
        except subprocess.TimeoutExpired:
            pass

    def backup_in_force(self):
        """What the tasks' `BackupAndRestore` last reported as in force
        (`"<dir>/<backup>"`), or `None`."""
        return read_backup_note(self.state_dir)

    def stop(self, grace=GRACE_SECONDS):
        """Stops every task: SIGTERM to each process group, SIGKILL after
        `grace` seconds."""
        alive = [p for p in self.all_procs if p.poll() is None]
        for proc in alive:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in alive:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.all_procs:
            _signal_group(proc, signal.SIGKILL)  # also reaps what a task started
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for thread in self._threads:
            thread.join(timeout=2)

    def cleanup(self):
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def _say(self, text):
        self.console.line("keras-dist-run", text)


def pump(proc, line, progress):
    """Reads `proc`'s output to its end: `line(text)` for each line (as a
    terminal would show it), `progress(text)` for a line being redrawn."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending = ""
    while True:
        chunk = proc.stdout.read1(65536)
        pending += decoder.decode(chunk, final=not chunk)
        *lines, pending = pending.split("\n")
        for text in lines:
            line(_final_state(text))
        if not chunk:
            break
        if "\r" in pending or "\b" in pending:  # a progress bar being redrawn
            progress(_final_state(pending))
    if pending:
        line(_final_state(pending))
    proc.stdout.close()


def read_backup_note(state_dir):
    """The backup the tasks' `BackupAndRestore` last noted as in force in
    `state_dir` (`STATE_ENV`), or `None`."""
    try:
        with open(os.path.join(state_dir, "backup.json")) as f:
            return json.load(f)["path"]
    except (OSError, ValueError, KeyError):
        return None


NOISE = re.compile(
    # TensorFlow's C++ INFO / WARNING lines ("I0000 00:00:1796.. 4647 port.cc:153] ..."):
    # those logged while TensorFlow loads ignore TF_CPP_MIN_LOG_LEVEL.
    r"^[IW]\d{4} [\d:.]+\s+\d+ [\w./-]+\.(cc|h|cpp):\d+\] "
    # Its CUDA probe, an error line on every machine without a GPU.
    r"|failed call to cuInit"
    r"|^WARNING: All log messages before absl::InitializeLog\(\) is called")
"""Task output lines the launcher drops unless the user set
`TF_CPP_MIN_LOG_LEVEL` (then every line passes). Python logging lines, such as
absl's `I1203 16:44:16.240616 1401 train.py:12] ...`, are never dropped."""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _final_state(text):
    """What a terminal would show for `text` once written: Keras' progress bar
    erases with backspaces and returns with `\\r`; the last redraw wins."""
    return text.replace("\b", "").rsplit("\r", 1)[-1]


class _Console:
    """Writes the tasks' output, each line prefixed with its task, one at a time.

    A task's progress bar (a line redrawn with `\\r`) is shown live only when
    the output is a terminal, as one line that other tasks' lines do not break
    up; in a log file only each line's final state is written.
    """

    def __init__(self, out, quiet=True):
        self.out, self.quiet = out, quiet
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.live = None  # (task, text) of the progress line on screen, if any
        self._lock = threading.Lock()

    def line(self, name, text):
        if self.quiet and NOISE.search(text):
            return
        if not self.tty:
            text = _ANSI.sub("", text)  # Keras colours its bar even into a pipe
        with self._lock:
            if self.live is not None:
                self.out.write("\r\x1b[K")
                if self.live[0] == name:
                    self.live = None  # the bar's final line replaces it
            self.out.write(f"[{name}] {text}\n")
            if self.live is not None:
                self.out.write(f"[{self.live[0]}] {self.live[1]}")
            self.out.flush()

    def progress(self, name, text):
        if not self.tty:
            return
        with self._lock:
            self.live = (name, text)
            self.out.write(f"\r\x1b[K[{name}] {text}")
            self.out.flush()


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv=None):
    """Entry point of `keras-dist-run` (also `python -m keras_dist.cluster.launch`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.emit is not None:
        sys.stdout.write(args.recipe)
        return 0
    if args.in_namespace:
        isolation.bring_up_loopback()
    elif not args.no_isolate:
        command, reason = isolation.unshare_command()
        if command is not None:
            # Become the same launcher inside a private network namespace: same
            # PID, so signals to it still reach the launcher that owns the tasks.
            sys.stdout.flush()
            os.execv(command[0], command + [sys.executable, "-m", "keras_dist.cluster.launch",
                                            "--_in-namespace", *argv])
        print(f"[keras-dist-run] warning: cannot isolate the cluster: {reason}. Its "
              "TensorFlow ports (no authentication) are reachable from the network; "
              "run it only on a trusted network, or pass --no-isolate to silence this.",
              file=sys.stderr, flush=True)
    else:
        print("[keras-dist-run] warning: --no-isolate: the cluster's TensorFlow ports "
              "(no authentication) listen on every interface.", file=sys.stderr, flush=True)
    from keras_dist.cluster import jobs  # it imports this module

    where = "private network namespace" if args.in_namespace else "host network"

    def new_cluster(restarts):
        # New free ports each time: a port taken meanwhile is not reused.
        config = ClusterConfig.local(workers=args.workers, ps=args.ps,
                                     evaluator=args.evaluator)
        cluster = Cluster(config, args.command, max_restarts=args.max_restarts)
        if restarts == 0:
            cluster._say(f"cluster: {config.describe()}; {where}")
        return cluster

    return jobs.run_jobs(new_cluster, args.max_restarts)


if __name__ == "__main__":
    # The module's own copy, not this `__main__` one: `jobs` checks results
    # against `keras_dist.cluster.launch.Failure`.
    from keras_dist.cluster.launch import main as _main

    sys.exit(_main())
