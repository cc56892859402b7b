"""A job run to its end: restarted as a whole after a failure a restart can
mend, stopped on Ctrl-C or SIGTERM.

`run_jobs` holds the rules that `keras-dist-run` (`launch.main`) and
`keras_dist.ray.run` follow; which task's failure a single task's restart
mends is `launch.Cluster.wait`'s. A new cluster is asked for on each
restart, so the tasks get new ports (one taken meanwhile is not reused).
"""

import signal
import threading

from keras_dist.cluster import launch


class TaskLost(Exception):
    """A task cannot be started again where it ran (its machine is gone):
    the job restarts as after a task killed by SIGKILL."""

    def __init__(self, task):
        super().__init__(f"{task[0]}:{task[1]} is lost")
        self.task = task


def run_jobs(new_cluster, max_restarts):
    """Runs the job until it ends; returns the exit code of the whole run.

    Args:
        new_cluster: Callable. `new_cluster(restarts)` gives the job's
            cluster (a `launch.Cluster`, not started) for its attempt after
            `restarts` restarts.
        max_restarts: Integer. How many times the job is restarted after a
            task is killed or preempted (`launch.Failure.restartable`).

    Returns:
        The leader's exit code; for a task that failed the job, its code
        (128 + the signal's number for a killed one); 130 when interrupted,
        75 when the leader saved a backup and exited preempted meanwhile.
    """
    restarts = 0
    # A SIGTERM while the tasks are being stopped does not cut the stopping
    # short (its SIGKILL pass); it is noted, and no restart follows.
    stopping = interrupted = False

    def on_signal(signum, frame):
        nonlocal interrupted
        if stopping:
            interrupted = True
        else:
            raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_signal) if main_thread else None
    try:
        while True:
            cluster = new_cluster(restarts)
            try:
                cluster.start()
                result = cluster.wait()
            except TaskLost as lost:
                result = launch.Failure(lost.task, -signal.SIGKILL)
            except KeyboardInterrupt:
                stopping = True
                cluster._say("interrupted; stopping every task (each may save a backup)")
                cluster.stop(grace=launch.PREEMPTION_WAIT)
                leader = cluster.procs.get(cluster.leader)
                cluster.cleanup()
                return launch.PREEMPTED_EXIT_CODE if leader is not None and \
                    leader.returncode == launch.PREEMPTED_EXIT_CODE else 130
            except BaseException:
                # Anything else (a task that cannot be started: Popen's
                # OSError): no task keeps serving in its own session.
                stopping = True
                cluster.stop()
                cluster.cleanup()
                raise
            stopping = True
            backup = cluster.backup_in_force()
            cluster.stop()
            cluster.cleanup()
            stopping = False
            if not isinstance(result, launch.Failure):
                return result
            if interrupted:
                cluster._say("interrupted while stopping the cluster; not restarting")
                return 130
            task = f"{result.task[0]}:{result.task[1]}"
            # The shell's convention for a killed task: 128 + signal number.
            code = result.code if result.code > 0 else 128 - result.code
            if not result.restartable or max_restarts == 0:
                said = result.why() if result.port is not None else (
                    f"exited with code {result.code}")
                cluster._say(f"{task} {said}; stopping the cluster")
                return code
            if restarts >= max_restarts:
                cluster._say(f"{task} {result.why()}; the job has used its "
                             f"{max_restarts} restarts; stopping the cluster")
                return code
            restarts += 1
            resume = (f"resuming from {backup}" if backup else
                      "no backup in force: starting afresh")
            where = " on new ports" if result.port is not None else ""
            cluster._say(f"{task} {result.why()}; restarting the job{where} "
                         f"({restarts}/{max_restarts}), {resume}")
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
