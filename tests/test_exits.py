"""Whatever ends a `fit`, nothing of it outlives it (issue 48, item 2).

A user's callback raises in the middle of epoch 2 of a `kd.fit` with a
`BackupAndRestore` that catches SIGTERM. Afterwards the signal handlers are
the ones from before `fit`, no keras_dist thread is left but the documented
iterator-release daemon, the backup directory's lock is free (a second
`fit` with the same backup resumes from it and trains), and, tried from
outside in a process of its own, a SIGTERM then ends the process at once, by
the signal. Before, the handlers stayed installed until the next
`on_train_end`, and such a process ignored SIGTERM (exiting 75 only when the
watchdog fired).
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import keras
import numpy as np
import pytest

import keras_dist as kd
from procs import CPUS, REPO

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Boom(keras.callbacks.Callback):
    """Raises at batch 2 of epoch `epoch` (0-based)."""

    def __init__(self, epoch=1):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == 2:
            raise RuntimeError("a user's callback failed")


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    return model


def _threads():
    return {t for t in threading.enumerate() if t.name.startswith("keras_dist")
            and t.name != "keras_dist-iterator-release"}


@pytest.fixture(scope="module")
def mirrored():
    return kd.resolve_strategy("mirrored", devices=CPUS)


@pytest.mark.parametrize("shape,save_freq", [
    ("one_device", "epoch"),      # Keras' own loop, guarded
    ("one_device", 3),            # keras_dist's loop (a mid-epoch backup)
    ("mirrored", 3),              # keras_dist's synchronous executor
])
def test_a_fit_ended_by_an_exception_leaves_nothing_behind(tmp_path, mirrored, shape, save_freq):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = np.arange(64) % 3
    strategy = mirrored if shape == "mirrored" else "auto"
    before = {number: signal.getsignal(number) for number in SIGNALS}
    threads = _threads()
    backup = kd.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=save_freq)
    with pytest.raises(RuntimeError, match="a user's callback failed"):
        kd.fit(build, x, y, strategy=strategy, epochs=3, batch_size=8, verbose=0,
               callbacks=[backup, Boom()])
    assert {number: signal.getsignal(number) for number in SIGNALS} == before
    assert _threads() <= threads
    # The lock is free and the backup is whole: the same backup resumes.
    history = kd.fit(build, x, y, strategy=strategy, epochs=3, batch_size=8, verbose=0,
                     callbacks=[kd.callbacks.BackupAndRestore(str(tmp_path / "backup"),
                                                              save_freq=save_freq)])
    assert backup.restored_epoch is None  # the first fit restored nothing
    assert len(history.history["loss"]) >= 1
    assert {number: signal.getsignal(number) for number in SIGNALS} == before


class FailAt(keras.callbacks.Callback):
    """Raises in `hook` (at epoch 1, batch 2 where those apply)."""

    def __init__(self, hook):
        super().__init__()
        self.hook, self.epoch = hook, 0
        for name in ("on_train_begin", "on_epoch_begin", "on_train_batch_begin",
                     "on_test_begin", "on_epoch_end", "on_train_end"):
            setattr(self, name, self._maybe(name, getattr(self, name)))

    def _maybe(self, name, original):
        def hook(*args, **kwargs):
            if name == "on_epoch_begin":
                self.epoch = args[0]
            at = {"on_train_batch_begin": self.epoch == 1 and args[0] == 2,
                  "on_epoch_begin": self.epoch == 1, "on_epoch_end": args and args[0] == 1,
                  "on_test_begin": self.epoch == 1}.get(name, True)
            if name == self.hook and at:
                raise RuntimeError(f"failed in {name}")
            return original(*args, **kwargs)
        return hook


PHASES = ["strategy", "restore", "on_train_begin", "on_epoch_begin", "on_train_batch_begin",
          "on_test_begin", "on_epoch_end", "on_train_end"]


@pytest.mark.parametrize("shape", ["one_device", "mirrored"])
@pytest.mark.parametrize("phase", PHASES)
def test_an_exception_at_every_phase_of_fit_leaves_nothing_behind(tmp_path, mirrored, shape,
                                                                    phase):
    """Each phase's failure, then: the handlers from before, no keras_dist
    thread, no executor left on the model, and a second `fit` with the same
    backup directory trains. ("restore": the backup was written by another
    model, so restoring it fails; "strategy": a strategy name that does not
    exist.)"""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = np.arange(64) % 3
    strategy = mirrored if shape == "mirrored" else "auto"
    directory = str(tmp_path / "backup")
    if phase == "restore":
        def other():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                                      keras.layers.Dense(3, activation="softmax")])
            model.compile("sgd", "sparse_categorical_crossentropy")
            return model
        with pytest.raises(RuntimeError):  # its backups stay: it did not end well
            kd.fit(other, x, y, strategy=strategy, epochs=2, batch_size=8, verbose=0,
                   callbacks=[kd.callbacks.BackupAndRestore(directory, save_freq=3),
                              FailAt("on_epoch_end")])
        assert os.listdir(directory)
    before = {number: signal.getsignal(number) for number in SIGNALS}
    threads = _threads()
    model = build()
    if shape == "mirrored":
        with mirrored.scope():
            model = build()
    fail = FailAt(phase)
    with pytest.raises((RuntimeError, ValueError)) as raised:
        kd.fit(model, x, y, strategy="no-such-strategy" if phase == "strategy" else strategy,
               epochs=3, batch_size=8, verbose=0, validation_data=(x[:16], y[:16]),
               callbacks=[kd.callbacks.BackupAndRestore(directory, save_freq=3), fail])
    assert str(raised.value).startswith({
        "strategy": "Unknown strategy 'no-such-strategy'",
        "restore": "BackupAndRestore: the backup "}.get(phase, f"failed in {phase}")), raised.value
    if phase == "restore":
        assert "does not fit this model" in str(raised.value)
    assert {number: signal.getsignal(number) for number in SIGNALS} == before
    assert _threads() <= threads
    assert "_kd_executor" not in model.__dict__
    if phase == "restore":
        import shutil

        shutil.rmtree(directory)
    history = kd.fit(build, x, y, strategy=strategy, epochs=3, batch_size=8, verbose=0,
                     callbacks=[kd.callbacks.BackupAndRestore(directory, save_freq=3)])
    assert len(history.history["loss"]) >= 1
    assert {number: signal.getsignal(number) for number in SIGNALS} == before


@pytest.mark.multiprocess
def test_sigterm_after_a_failed_fit_ends_the_process_by_the_signal(tmp_path):
    """From outside: the process that survived a failed `kd.fit` dies of a
    SIGTERM at once (before: it ignored it, and 0.8 x the grace period
    later exited 75)."""
    script = tmp_path / "failed_fit.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.join(REPO, "tests")!r})
        import numpy as np
        import keras_dist as kd
        from test_exits import Boom, build
        x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
        y = np.arange(64) % 3
        try:
            kd.fit(build, x, y, epochs=3, batch_size=8, verbose=0, callbacks=[
                kd.callbacks.BackupAndRestore({str(tmp_path / "backup")!r}, save_freq=3,
                                              grace_period=60), Boom()])
        except RuntimeError:
            print("fit failed", flush=True)
        time.sleep(120)
    """))
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output = []
        for line in proc.stdout:
            output.append(line)
            if line.startswith("fit failed"):
                break
        assert output and output[-1].startswith("fit failed"), "".join(output)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM, "".join(output)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
