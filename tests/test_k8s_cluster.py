"""The pods of a `keras-dist-run --emit k8s` Job, run as a real cluster.

No Kubernetes here: each pod of the emitted Job is a process on a virtual
host of its own (tests/netns.py: a network namespace with its own 10.x
address on a private switch), so that every pod serves on the SAME port, as
pods do. The pods' DNS names, `<job>-<index>.<service>`, resolve to those
addresses through a hosts file per namespace (`ip netns exec NAME` mounts
/etc/netns/NAME/hosts over /etc/hosts), as the headless Service makes
Kubernetes' DNS resolve them. Each pod process gets ONLY the environment its
container would get: the manifest's `env` entries, what Kubernetes adds
(`JOB_COMPLETION_INDEX`, `HOSTNAME`), and PATH, PYTHONPATH and HOME to run
Python; no `TF_CONFIG`. It runs the manifest's command and arguments
unchanged.

`Job` stands in for the Job controller, reading its rules from the
manifest: every index starts at once; a failed pod is replaced as the
`podFailurePolicy` says (Ignore: not counted; else counted against
`backoffLimitPerIndex`); a preempted pod gets the DisruptionTarget
condition, SIGTERM, and SIGKILL after `terminationGracePeriodSeconds`; the
Job is complete when the `successPolicy` indexes (else all) have succeeded,
and the pods still running are then stopped. Runs: a preempted chief, a lost
parameter server and a lost MultiWorkerMirrored worker, each restarted by
index, not as a whole job as keras-dist-run does; in the same runs, each
pod's role from its index, its DNS name, and the Job's completion.

Needs root and iproute2 (CI has both); skipped elsewhere with the reason.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

import netns
import test_preemption as preemption
from procs import REPO, kill_groups
from test_preemption import multiworker_reference  # noqa: F401 (a fixture)

from keras_dist import recipes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

REASON = netns.available()
needs_hosts = pytest.mark.skipif(REASON is not None,
                                 reason=f"virtual hosts unavailable: {REASON}")
SCRIPTS = os.path.join(REPO, "tests", "scripts")


class Job:
    """The pods of an emitted manifest, each on a virtual host of its own,
    run by the manifest's own rules: a small stand-in for the Job controller."""

    def __init__(self, text, hosts, log_dir):
        self.service, self.job = yaml.safe_load_all(text)
        assert (self.service["kind"], self.job["kind"]) == ("Service", "Job")
        self.name = self.job["metadata"]["name"]
        self.spec = self.job["spec"]
        self.hosts, self.log_dir = hosts, log_dir
        self.tasks = self.spec["completions"]
        assert self.spec["parallelism"] == self.tasks == hosts.count
        pod = self.spec["template"]["spec"]
        assert pod["restartPolicy"] == "Never"  # a new pod per restart, as here
        self.subdomain = pod["subdomain"]
        assert self.subdomain == self.service["metadata"]["name"]
        self.grace = pod["terminationGracePeriodSeconds"]
        (self.container,) = pod["containers"]
        self.pods = {}          # index -> the running (or last) pod's process
        self.started = {}       # index -> how many pods it has had
        self.failures = {}      # index -> failures counted against its limit
        self.events = []        # (index, exit code, action taken)
        self.disrupted = {}     # index -> when Kubernetes told the pod to go
        self.etc = []

    def hostname(self, index):
        return f"{self.name}-{index}"  # what Kubernetes names an Indexed Job's pod host

    def write_hosts_files(self):
        """What the headless Service makes DNS answer, in every namespace."""
        lines = ["127.0.0.1 localhost"] + [
            f"{address} {self.hostname(i)}.{self.subdomain} {self.hostname(i)}"
            for i, address in enumerate(self.hosts.addresses)]
        if not os.path.isdir("/etc/netns"):
            self.etc.append("/etc/netns")  # removed last, if no one else uses it
        for namespace in self.hosts.names:
            directory = os.path.join("/etc/netns", namespace)
            os.makedirs(directory)
            self.etc.append(directory)
            with open(os.path.join(directory, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def pod_env(self, index):
        env = {}
        for item in self.container["env"]:
            assert set(item) == {"name", "value"}, item  # no downward API to fill in
            env[item["name"]] = item["value"]
        env.update(JOB_COMPLETION_INDEX=str(index), HOSTNAME=self.hostname(index),
                   PATH=os.environ["PATH"], PYTHONPATH=REPO,
                   HOME=str(self.log_dir / "home"))
        return env

    def start(self, index):
        command = self.container["command"] + self.container.get("args", [])
        self.started[index] = self.started.get(index, 0) + 1
        self.pods[index] = self.hosts.start(
            index, command, env=self.pod_env(index),
            log_path=str(self.log_dir / f"pod{index}-{self.started[index]}.log"))

    def preempt(self, index):
        """What Kubernetes does to a pod it preempts: the DisruptionTarget
        condition, SIGTERM, and SIGKILL after the grace period."""
        self.disrupted[index] = time.monotonic()
        os.killpg(self.pods[index].pid, signal.SIGTERM)

    def action(self, index, code):
        """The manifest's podFailurePolicy for a pod that failed with `code`:
        the first rule that matches, else Count."""
        for rule in self.spec.get("podFailurePolicy", {}).get("rules", []):
            codes = rule.get("onExitCodes")
            if codes is not None and codes.get("containerName") in (
                    None, self.container["name"]):
                inside = code in codes["values"]
                if inside == (codes["operator"] == "In"):
                    return rule["action"]
            for condition in rule.get("onPodConditions", []):
                if condition["type"] == "DisruptionTarget" and index in self.disrupted:
                    return rule["action"]
        return "Count"

    def run(self, timeout, restarts=False, tick=lambda job: None):
        """Starts every pod at once; returns `{index: exit code}` once the
        Job is complete: the indexes of `successPolicy` (else all) exited 0.
        The pods still running are then stopped, as Kubernetes stops them.

        A failed pod is replaced or counted as the manifest's
        podFailurePolicy and backoffLimitPerIndex say; unless `restarts`,
        the first failure fails the test at once, with the logs. `tick(job)`
        runs while the pods do (to preempt one).
        """
        rules = self.spec.get("successPolicy", {"rules": [
            {"succeededIndexes": f"0-{self.tasks - 1}"}]})["rules"]
        (rule,) = rules
        first, _, last = rule["succeededIndexes"].partition("-")
        needed = set(range(int(first), int(last or first) + 1))
        self.write_hosts_files()
        for index in range(self.tasks):
            self.start(index)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tick(self)
            for index, pod in list(self.pods.items()):
                code = pod.poll()
                if code is None:
                    if time.monotonic() - self.disrupted.get(index, 1e12) > self.grace:
                        os.killpg(pod.pid, signal.SIGKILL)
                    continue
                if code == 0:
                    continue
                code = 128 - code if code < 0 else code  # a container's exit code
                self.replace(index, code, restarts)
            codes = {i: pod.poll() for i, pod in self.pods.items()}
            if all(codes[i] == 0 for i in needed):
                self.stop_running()
                return {i: pod.returncode for i, pod in self.pods.items()}
            time.sleep(0.1)
        raise AssertionError(f"the Job did not complete in {timeout} s:\n{self.logs()}")

    def replace(self, index, code, restarts):
        action = self.action(index, code)
        self.events.append((index, code, action))
        self.disrupted.pop(index, None)
        assert restarts, f"pod {index} failed with exit code {code}:\n{self.logs()}"
        if action == "Count":
            self.failures[index] = self.failures.get(index, 0) + 1
            failed = self.failures[index] > self.spec["backoffLimitPerIndex"]
            assert not failed, f"the Job failed: {self.events}\n{self.logs()}"
        assert action in ("Ignore", "Count"), (action, self.events)
        self.start(index)  # the old pod is gone: podReplacementPolicy Failed

    def stop_running(self):
        """SIGTERM, then SIGKILL after the grace period: a pod's end."""
        running = [pod for pod in self.pods.values() if pod.poll() is None]
        for pod in running:
            os.killpg(pod.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for pod in running:
            try:
                pod.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        kill_groups(running)

    def log(self, index, pod=None):
        return (self.log_dir / f"pod{index}-{pod or self.started[index]}.log").read_text()

    def logs(self, tail=2500):
        return "\n".join(f"--- pod {i} ({self.started[i]}) ---\n{self.log(i)[-tail:]}"
                         for i in self.pods)

    def close(self):
        kill_groups(list(self.pods.values()))
        for directory in reversed(self.etc):
            if directory != "/etc/netns":
                for name in os.listdir(directory):
                    os.remove(os.path.join(directory, name))
            try:
                os.rmdir(directory)
            except OSError:  # /etc/netns, holding another test's namespaces
                pass


def _run_job(tmp_path, command, timeout, restarts=False, tick=lambda job: None,
             **shape):
    """Emits the Job for `command` and runs its pods; returns the `Job`
    (its pods' exit codes in `job.codes`)."""
    (tmp_path / "home").mkdir()
    text = recipes.k8s_job(command, image="registry.example.com/train:1", name="digits",
                           **shape)
    _, manifest = yaml.safe_load_all(text)
    with netns.VirtualHosts(manifest["spec"]["completions"]) as hosts:
        job = Job(text, hosts, tmp_path)
        try:
            job.codes = job.run(timeout, restarts, tick)
        finally:
            job.close()
    return job


EPOCHS, STEPS = 3, 23  # tests/scripts/preempt_train.py: digits in batches of 64


def _backed_up_training(tmp_path):
    """tests/scripts/preempt_train.py's command (a backup every 10 steps) and
    its output directory, where it writes its progress and result.json."""
    out = tmp_path / "out"
    out.mkdir()
    return out, [sys.executable, os.path.join(SCRIPTS, "preempt_train.py"), str(out),
                 str(tmp_path / "backup"), str(EPOCHS), "10"]


def _in_epoch_1(out):
    """Whether the training has reached epoch 1, step 5 (its progress file)."""
    try:
        return tuple(map(int, (out / "progress").read_text().split())) >= (1, 5)
    except (OSError, ValueError):
        return False


def _sigkill(job, index):
    """Kills pod `index` without warning, and notes it in the job's events."""
    os.killpg(job.pods[index].pid, signal.SIGKILL)
    job.events.append((index, "SIGKILL", "sent"))


def _losses(resumed):
    """Each epoch's loss, from the backup restored and the run after it (a
    backup from before the first epoch ended holds no history yet)."""
    return (resumed["restored_history"] or {}).get("loss", []) + resumed["history"]["loss"]


@needs_hosts
def test_a_preempted_chief_pod_is_replaced_and_resumes_with_the_serving_pods(tmp_path):
    """Kubernetes preempts the chief's pod mid-epoch: SIGTERM, and the
    DisruptionTarget condition. Its BackupAndRestore backs up and exits 75;
    the manifest's podFailurePolicy replaces the pod without counting it.
    The new chief, at the same DNS name, finds the parameter server and
    workers still serving (only the chief's index restarts, where the
    launcher restarts the whole job) and resumes from the backup, as
    TensorFlow's ClusterCoordinator documents for a coordinator that comes
    back. Every scheduled update is applied once."""
    out, command = _backed_up_training(tmp_path)

    def preempt_in_epoch_1(job):
        if _in_epoch_1(out) and job.started[0] == 1 and 0 not in job.disrupted:
            job.preempt(0)

    job = _run_job(tmp_path, command, 360, restarts=True, tick=preempt_in_epoch_1,
                   workers=2, ps=1)
    assert job.events == [(0, 75, "Ignore")], job.events  # backed up, not counted
    assert job.started == {0: 2, 1: 1, 2: 1, 3: 1}  # the others served on
    # Index 0 is the chief: its success completed the Job (successPolicy),
    # and the pods still serving were then stopped.
    assert job.codes[0] == 0
    # Each pod found its role from its index (the chief's pod both times)
    # and the others served under their DNS names.
    roles = {0: "chief:0", 1: "ps:0", 2: "worker:0", 3: "worker:1"}
    for index, role in roles.items():
        for pod in range(1, job.started[index] + 1):
            assert ("keras_dist: using parameter_server strategy (cluster of 1 chief, 2 "
                    f"workers, 1 ps from Kubernetes; this task {role})") in job.log(index, pod), \
                job.log(index, pod)[-3000:]
        if index:
            assert f"keras_dist: {role} serving at digits-{index}.digits:2222" in \
                job.log(index), job.log(index)[-3000:]
    with open(out / "result.json") as f:
        resumed = json.load(f)
    # It resumed where it was preempted (after epoch 1, step 5), from the
    # backup it wrote on SIGTERM ...
    restored = resumed["restored_epoch"] * STEPS + resumed["restored_step"]
    assert restored >= STEPS + 5, resumed
    # ... and what was in flight finished before that backup: every update
    # counted once, none repeated (no worker failed).
    assert resumed["version"] == EPOCHS * STEPS, resumed["version"]
    counts = resumed["step_counts"]
    assert counts["scheduled"] == counts["finished"] == EPOCHS * STEPS - restored, counts
    loss = _losses(resumed)
    assert len(loss) == EPOCHS and loss[-1] < loss[0]


@needs_hosts
def test_a_lost_parameter_server_pod_is_replaced_and_so_is_the_chief_which_resumes(
        tmp_path):
    """The parameter server's pod dies without warning (SIGKILL: its node
    is lost, or it ran out of memory). Kubernetes replaces it, counting the
    failure; the chief, whose variables lived there, fails, and its pod is
    replaced too, counted as well: what TensorFlow's ClusterCoordinator asks
    for a lost parameter server (bring it back, restart the coordinator).
    A manifest that failed the Job on the chief's error would end training
    here. The new chief resumes from the backup."""
    out, command = _backed_up_training(tmp_path)

    def kill_ps_in_epoch_1(job):
        if _in_epoch_1(out) and job.started[1] == 1 and not job.events:
            _sigkill(job, 1)

    job = _run_job(tmp_path, command, 360, restarts=True, tick=kill_ps_in_epoch_1,
                   workers=2, ps=1)
    events = job.events[1:]
    assert (1, 137, "Count") in events, events
    assert [e for e in events if e[0] == 0] == [(0, 1, "Count")], events
    assert job.started[0] == job.started[1] == 2 and job.codes[0] == 0, job.started
    assert job.failures == {0: 1, 1: 1}  # within backoffLimitPerIndex (3)
    with open(out / "result.json") as f:
        resumed = json.load(f)
    # A backup from before the kill (one every 10 steps) was restored ...
    restored = resumed["restored_epoch"] * STEPS + resumed["restored_step"]
    assert restored >= 20, resumed
    # ... and every update applied from there on; at least once: a backup
    # is taken while updates go on.
    assert 0 <= resumed["version"] - EPOCHS * STEPS <= 4, resumed["version"]
    loss = _losses(resumed)
    assert len(loss) == EPOCHS and loss[-1] < loss[0]


@needs_hosts
def test_a_lost_multiworker_pod_fails_its_peer_and_both_are_replaced_and_resume(
        tmp_path, multiworker_reference):
    """Synchronous training: worker 1's pod dies without warning. Worker 0
    waits in an all-reduce with it until the replacement pod connects, then
    fails ("tried to connect with a different incarnation"); Kubernetes
    replaces it too (each failure counted against its own index), and the
    new pair resumes from the backup: the whole-job restart keras-dist-run
    does, made of per-index restarts. Both pods of each pair train one
    model in step: the Job ends with the weights, optimizer state and
    History of the same job run uninterrupted under keras-dist-run."""
    out, command = _backed_up_training(tmp_path)

    def kill_worker_1_in_epoch_1(job):
        if _in_epoch_1(out) and job.started[1] == 1 and not job.events:
            _sigkill(job, 1)

    job = _run_job(tmp_path, command, 360, restarts=True, tick=kill_worker_1_in_epoch_1,
                   workers=2)
    assert job.events[1:] == [(1, 137, "Count"), (0, 1, "Count")], job.events
    # No successPolicy: the Job completed once every index succeeded.
    assert job.started == {0: 2, 1: 2} and job.codes == {0: 0, 1: 0}, job.started
    # Each pod, each time, a worker of one two-worker MultiWorkerMirrored
    # cluster, by its index.
    for index in (0, 1):
        for pod in (1, 2):
            assert ("keras_dist: using multi_worker strategy (cluster of 2 workers from "
                    f"Kubernetes; this task worker:{index})") in job.log(index, pod), \
                job.log(index, pod)[-3000:]
    with open(out / "result.json") as f:
        resumed = json.load(f)
    # A backup from before the kill (after epoch 1, step 5: one every 10
    # steps) was restored ...
    restored = resumed["restored_epoch"] * STEPS + resumed["restored_step"]
    assert restored >= 20, resumed
    # ... and the job's steps were each applied once from there on.
    assert resumed["version"] == EPOCHS * STEPS, resumed["version"]
    loss = _losses(resumed)
    assert len(loss) == EPOCHS and loss[-1] < loss[0]
    # One model, trained in step on both pods: what the uninterrupted job
    # ends with, exactly.
    preemption.assert_same_run(preemption.result(out), multiworker_reference)
