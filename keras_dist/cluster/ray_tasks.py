"""The tasks of a keras-dist cluster as Ray actors (`keras_dist.ray.run`).

Each task is one actor, `TaskActor`, on some node of the Ray cluster. It
holds a port of its node until the driver has gathered every task's
address, then runs the task's command as a subprocess of its own (a fresh
process each time: TensorFlow's servers cannot be stopped in-process) in
its own process group, and keeps the output's lines until the driver reads
them.

On the driver `RayCluster` is `keras_dist.cluster.launch.Cluster` with the
processes replaced by `RemoteProcess` handles, so the launcher's own
`Cluster.wait` decides what a failure means (which task is restarted alone,
when the job is). Ray is not imported here at import time: `ray.remote` is
applied by `actor_class()`, when a run starts.
"""

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from keras_dist.cluster import jobs
from keras_dist.cluster import launch
from keras_dist.cluster import ports
from keras_dist.cluster import recipes

READ_SECONDS = 1.0
"""How long an actor holds the driver's read of its output when there is none."""

CALL_SECONDS = 60.0
"""How long the driver waits for an actor's answer to anything but a read."""

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # keras_dist/


class TaskActor:
    """One task of the cluster, on a Ray node (the body of a Ray actor)."""

    def __init__(self):
        import ray

        self.host = ray.util.get_node_ip_address()
        # Held (bound, not listening) until the task starts, so that no other
        # task on this node is given the same port meanwhile.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("", 0))
        self.port = self._socket.getsockname()[1]
        # The task's files: its BackupAndRestore's note of the backup in force
        # (launch.STATE_ENV), a function target's pickle.
        self.state_dir = tempfile.mkdtemp(prefix="keras-dist-ray-")
        self.proc = None
        self.generation = 0
        self._lines, self._progress, self._drained = [], None, True
        self._changed = threading.Condition()

    def address(self):
        return f"{self.host}:{self.port}"

    def start(self, command, tf_config, env, cwd, boot):
        """Starts the task's process (again, after it ended); returns its pid
        and its generation (how many processes this actor started).

        `command` is a list of arguments, or bytes: a pickled function that
        `keras_dist.cluster.ray_call` runs. `boot` puts keras_dist's start-up
        hook first on `PYTHONPATH` (with ps, as the launcher does).
        """
        if self._socket is not None:
            self._socket.close()  # the task's server binds it next
            self._socket = None
        if isinstance(command, bytes):
            path = os.path.join(self.state_dir, "function.pkl")
            with open(path, "wb") as f:
                f.write(command)
            command = [sys.executable, "-m", "keras_dist.cluster.ray_call", path]
        task_env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env:
            # Ray sets it to the actor's CPUs (1 for our 0-CPU actors); a task
            # started by the launcher would not have it.
            task_env.pop("OMP_NUM_THREADS", None)
        task_env.update(env)
        task_env["TF_CONFIG"] = tf_config
        for key, value in recipes.TASK_ENV:
            task_env.setdefault(key, value)
        task_env["PYTHONUNBUFFERED"] = "1"
        task_env[launch.STATE_ENV] = self.state_dir
        if boot:
            task_env["PYTHONPATH"] = os.pathsep.join(
                [os.path.join(_PACKAGE, "_boot")]
                + [p for p in task_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        cwd = cwd if cwd and os.path.isdir(cwd) else None
        with self._changed:
            self.generation += 1
            self._lines, self._progress, self._drained = [], None, False
        self.proc = subprocess.Popen(
            command, env=task_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        return self.proc.pid, self.generation

    def _read(self, proc):
        launch.pump(proc, self.line, self.progress)
        proc.wait()
        with self._changed:
            self._drained = True
            self._changed.notify_all()

    def line(self, text):
        with self._changed:
            self._lines.append(text)
            self._progress = None
            self._changed.notify_all()

    def progress(self, text):
        with self._changed:
            self._progress = text
            self._changed.notify_all()

    def read(self, generation, timeout=READ_SECONDS):
        """`(lines, progress, code, backup)`: the lines written since the
        last read, the progress bar's text (or `None`), the exit code once
        the process has ended and every line was read (else `None`), and the
        backup the task's `BackupAndRestore` last reported as in force (or
        `None`): sent with every read, so that it is known after the actor
        is lost."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._lines or self._progress or self._drained
                or generation != self.generation, timeout)
            backup = launch.read_backup_note(self.state_dir)
            if generation != self.generation:
                return [], None, None, backup
            lines, self._lines = self._lines, []
            progress, self._progress = self._progress, None
            done = self._drained and self.proc is not None
            return lines, progress, self.proc.returncode if done else None, backup

    def port_in_use(self, port):
        """Whether `port` is taken on this actor's node (`ports.port_in_use`)."""
        return ports.port_in_use(port)

    def signal(self, signum):
        """Sends `signum` to the task's process group (for tests and users)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signum)

    def stop(self, grace):
        """SIGTERM to the task's process group, SIGKILL after `grace` seconds."""
        if self.proc is None:
            return None
        launch._signal_group(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        launch._signal_group(self.proc, signal.SIGKILL)  # also what the task started
        self.proc.wait()
        return self.proc.returncode

    def cleanup(self):
        shutil.rmtree(self.state_dir, ignore_errors=True)


def _die_with_parent():
    """In the task's process before it runs: SIGKILL it when its actor dies
    (killed, or out of memory), which then cannot stop it (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def actor_class():
    """`TaskActor` as a Ray actor class."""
    import ray

    # Reads wait for output while start, stop and signal must still answer.
    return ray.remote(max_concurrency=4)(TaskActor)


class RemoteProcess:
    """A task's process on its actor, as much of `subprocess.Popen` as
    `launch.Cluster.wait` uses: `pid`, `returncode`, `poll()`, `wait()`.

    A thread reads its output from the actor and writes it to the console;
    `returncode` is set once all of it is written. A dead actor reads as a
    process killed by SIGKILL (its node was lost).
    """

    def __init__(self, actor, pid, generation, name, console):
        self.actor, self.pid, self.returncode, self.backup = actor, pid, None, None
        self._done = threading.Event()
        self.thread = threading.Thread(target=self._pump, args=(generation, name, console),
                                       daemon=True)
        self.thread.start()

    def _pump(self, generation, name, console):
        import ray

        code = None
        while code is None:
            try:
                lines, progress, code, backup = ray.get(self.actor.read.remote(generation),
                                                        timeout=CALL_SECONDS)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                code = -signal.SIGKILL
                break
            self.backup = backup or self.backup
            for text in lines:
                console.line(name, text)
            if progress is not None:
                console.progress(name, progress)
        self.returncode = code
        self._done.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"task process {self.pid}", timeout)
        return self.returncode


class RayCluster(launch.Cluster):
    """The running tasks of one job on Ray actors, with the launcher's rules.

    Args:
        config: `ClusterConfig`. The actors' addresses.
        command: List of strings, or bytes (a pickled function).
        actors: Dict. `(role, index)` to the task's actor.
        env: Dict. Set in every task's environment (over the actor's own).
        cwd: String or `None`. The tasks' working directory, where it exists.
        out: File. Where the prefixed output goes; TensorFlow's C++ noise
            (`launch.NOISE`) is dropped unless `TF_CPP_MIN_LOG_LEVEL` is set
            here or in `env`, as by the launcher.
        max_restarts: Integer. How often a worker may be restarted alone.
    """

    def __init__(self, config, command, actors, env, cwd, out, max_restarts):
        # Not launch.Cluster.__init__: the environment, the state directory
        # and the start-up hook's path are each actor's own, on its node.
        self.config, self.command, self.actors = config, command, actors
        self.env, self.cwd = env, cwd
        self.console = launch._Console(
            out, quiet="TF_CPP_MIN_LOG_LEVEL" not in {**os.environ, **env})
        self.procs, self.all_procs, self.restarts = {}, [], {}
        self.max_restarts = max_restarts
        self._threads = []

    def _start_task(self, role, index):
        import ray

        actor = self.actors[(role, index)]
        tf_config = self.config.for_task(role, index).to_tf_config()
        try:
            pid, generation = ray.get(
                actor.start.remote(self.command, tf_config, self.env, self.cwd,
                                   bool(self.config.num_ps)),
                timeout=CALL_SECONDS)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            raise jobs.TaskLost((role, index)) from None  # its actor died
        proc = RemoteProcess(actor, pid, generation, f"{role}:{index}", self.console)
        self.procs[(role, index)] = proc
        self.all_procs.append(proc)
        self._threads.append(proc.thread)
        host = self.config.cluster[role][index].rsplit(":", 1)[0]
        self._say(f"started {role}:{index} (pid {pid} on {host})")

    def stop(self, grace=launch.GRACE_SECONDS):
        """Stops every task: SIGTERM to each process group, SIGKILL after
        `grace` seconds, on every actor at once."""
        import ray

        calls = [actor.stop.remote(grace) for actor in self.actors.values()]
        for call in calls:
            try:
                ray.get(call, timeout=grace + CALL_SECONDS)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # its node is gone, and its processes with it
        for thread in self._threads:
            thread.join(timeout=CALL_SECONDS)

    def _port_in_use(self, task, port):
        """Asks the task's actor: the port is on its node, not the driver's."""
        import ray

        try:
            return ray.get(self.actors[task].port_in_use.remote(port), timeout=CALL_SECONDS)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False  # its node is gone: a lost task, not a taken port

    def backup_in_force(self):
        """What the tasks' `BackupAndRestore` last reported as in force, the
        leader's first, as their actors last sent it."""
        ordered = [self.leader] + [t for t in self.procs if t != self.leader]
        return next((self.procs[t].backup for t in ordered
                     if t in self.procs and self.procs[t].backup), None)

    def cleanup(self):
        import ray

        for actor in self.actors.values():
            try:
                ray.get(actor.cleanup.remote(), timeout=CALL_SECONDS)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            ray.kill(actor)

    def _say(self, text):
        self.console.line("keras-dist-ray", text)
