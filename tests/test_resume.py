"""A chief failure: fail fast, then resume from a backup.

A real parameter-server cluster under keras-dist-run runs
tests/scripts/resume_train.py with kd.callbacks.BackupAndRestore. A first
run crashes (the chief exits hard right after an epoch's backup); the
launcher must stop the whole cluster promptly with a message naming the
task. Rerunning the same command resumes: the epoch after the checkpoint,
the weights and optimizer state exactly as backed up, and the parameter
version. Elsewhere: a parameter server SIGKILLed (the launcher's part:
tests/test_launch.py; the job resuming: tests/test_preemption.py and
tests/test_k8s_cluster.py), and MultiWorkerMirrored jobs resuming
(tests/test_preemption.py).
"""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.callbacks import BackupAndRestore
from procs import CPUS, REPO


def launch(out_dir, backup, epochs, crash_epoch, ps):
    # One worker: the chief's crash stops every other task (the worker and
    # the ps) all the same, with two tasks fewer to start per run.
    cmd = [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "1", "--ps", str(ps),
           "--max-restarts", "0", "--", sys.executable, "tests/scripts/resume_train.py", str(out_dir),
           str(backup), str(epochs), str(crash_epoch)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc, timeout=240):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out


def check_resumed(out_dir, crash_epochs_done, epochs, ps):
    """The rerun resumed after epoch `crash_epochs_done` with the exact state."""
    with open(out_dir / "result.json") as f:
        result = json.load(f)
    assert result["restored_epoch"] == crash_epochs_done
    assert result["epochs"] == list(range(crash_epochs_done, epochs))
    saved = np.load(out_dir / f"weights-{crash_epochs_done}.npz")
    restored = np.load(out_dir / "restored.npz")
    np.testing.assert_array_equal(restored["weights"], saved["weights"])
    np.testing.assert_array_equal(restored["optimizer"], saved["optimizer"])
    if ps:  # every epoch is 20 updates; the version continued from the backup
        assert int(saved["version"]) == 20 * crash_epochs_done
        assert result["version"] == 20 * epochs
    assert result["history"]["loss"][-1] < 1.0
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("ps", [1], ids=["async"])
def test_chief_crash_stops_the_cluster_and_a_rerun_resumes(tmp_path, ps):
    """(Without ps, worker 0 leads: its crash stopping the cluster with its
    code is test_launch's leader test; a MultiWorkerMirrored job resuming
    exactly from its backups, test_preemption's.)"""
    backup = tmp_path / "backup"
    began = time.monotonic()
    code, out = finish(launch(tmp_path, backup, 5, 2, ps))
    crashed_after = time.monotonic() - began
    chief = "chief:0" if ps else "worker:0"
    assert code == 3, out[-3000:]
    assert f"{chief} exited with code 3; stopping the cluster" in out, out[-3000:]
    # The backups of epochs 2 and 3 (keep=2), the newest in force.
    assert sorted(os.listdir(backup)) == [".lock", "backup-000002-000000000",
                                          "backup-000003-000000000", "latest.json"]
    # Fail fast: the launcher does not wait for anything after the crash.
    assert crashed_after < 120
    code, out = finish(launch(tmp_path, backup, 5, -1, ps))
    assert code == 0, out[-3000:]
    assert f"resuming from {backup}/backup-000003-000000000 at epoch 4, step 0" in out
    check_resumed(tmp_path, 3, 5, ps)


# ------------------------------------------------------------- one process
def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


X, Y = np.random.default_rng(0).normal(size=(64, 4)), np.ones((64, 1))


def test_a_crash_while_writing_leaves_the_previous_backup_in_force(tmp_path, monkeypatch):
    backup = BackupAndRestore(tmp_path, delete_checkpoint=False)
    model = _model()
    model.fit(X, Y, epochs=2, verbose=0, callbacks=[backup])
    before = [w.copy() for w in model.get_weights()]
    from keras_dist.callbacks import backup as backup_lib

    def torn_write(path, arrays):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a file")  # the disk fills mid-write
        raise OSError("No space left on device")

    monkeypatch.setattr(backup_lib, "_write_arrays", torn_write)
    with pytest.raises(OSError, match="No space left"):
        model.fit(X, Y, epochs=4, verbose=0, callbacks=[backup])
    monkeypatch.undo()
    assert backup.latest()["epoch"] == 2  # the torn write never came into force
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".writing-")]
    fresh = _model()
    history = fresh.fit(X, Y, epochs=3, verbose=0,
                        callbacks=[restorer := BackupAndRestore(tmp_path, delete_checkpoint=False)])
    assert restorer.restored_epoch == 2 and history.epoch == [2]
    # Restored exactly what epoch 2 backed up (then trained one more epoch).
    probe = _model()
    probe.fit(X, Y, epochs=2, verbose=0)  # same seed, same data: epoch-2 weights
    for a, b in zip(before, probe.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_backup_is_deleted_after_a_normal_end_and_the_next_fit_starts_at_zero(tmp_path):
    model = _model()
    backup = BackupAndRestore(tmp_path / "b")
    model.fit(X, Y, epochs=2, verbose=0, callbacks=[backup])
    assert not (tmp_path / "b").exists()
    # Keras' own BackupAndRestore leaves model._initial_epoch set; ours clears it.
    assert model.fit(X, Y, epochs=1, verbose=0).epoch == [0]


def test_a_backup_of_another_model_is_refused_clearly(tmp_path):
    _model().fit(X, Y, epochs=1, verbose=0,
                 callbacks=[BackupAndRestore(tmp_path, delete_checkpoint=False)])
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(7), keras.layers.Dense(1)])
    other.compile("sgd", "mse")
    with pytest.raises(ValueError, match="(?s)does not fit this model.*Delete it to start afresh"):
        other.fit(X, Y, epochs=2, verbose=0, callbacks=[BackupAndRestore(tmp_path)])


def test_a_backup_whose_optimizer_differs_is_refused_not_half_loaded(tmp_path):
    _model().fit(X, Y, epochs=1, verbose=0,
                 callbacks=[BackupAndRestore(tmp_path, delete_checkpoint=False)])
    model = _model()
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")  # other slots
    with pytest.raises(ValueError, match=r"does not fit this model: it holds \d+ variables, "
                                         r"this model and its optimizer have \d+"):
        model.fit(X, Y, epochs=2, verbose=0, callbacks=[BackupAndRestore(tmp_path)])


def test_a_backup_without_local_steps_state_restores_the_rest_and_says_so(tmp_path,
                                                                          kd_messages):
    """A backup an earlier keras_dist wrote holds no outer-optimizer state
    (tests/test_local_steps.py checks the backups that do): restoring it
    into training that has an outer optimizer restores the model and its
    optimizer, leaves the outer optimizer as it is, and warns."""
    saved = _model()
    saved.fit(X, Y, epochs=1, verbose=0,
              callbacks=[BackupAndRestore(tmp_path, delete_checkpoint=False)])
    model = _model()
    # What local-steps training keeps beside the model (set by its executor
    # before the callbacks' on_train_begin): an outer optimizer with momentum.
    outer = keras.optimizers.SGD(0.7, momentum=0.9)
    outer.build(model.trainable_variables)
    for slot in outer.variables[2:]:
        slot.assign(np.full(slot.shape, 0.25))
    model.__dict__["outer_optimizer"] = outer

    class Restored(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.weights = [w.numpy() for w in model.weights]
            self.outer = [v.numpy() for v in outer.variables[2:]]

    restored = Restored()
    model.fit(X, Y, epochs=2, verbose=0, callbacks=[BackupAndRestore(tmp_path), restored])
    for got, want in zip(restored.weights, saved.weights):
        np.testing.assert_array_equal(got, want.numpy())
    assert all((slot == 0.25).all() for slot in restored.outer)
    assert [m for m in kd_messages if "holds no outer-optimizer or EASGD state" in m], kd_messages
    # A count that fits neither layout is refused, naming all three parts.
    _model().fit(X, Y, epochs=1, verbose=0,
                 callbacks=[BackupAndRestore(tmp_path / "other", delete_checkpoint=False)])
    other = _model()
    other.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")  # other slots
    other.__dict__["outer_optimizer"] = outer
    with pytest.raises(ValueError, match="this model, its optimizer and its local steps' state"):
        other.fit(X, Y, epochs=2, verbose=0, callbacks=[BackupAndRestore(tmp_path / "other")])


def test_an_easgd_backup_of_another_worker_count_is_refused_naming_both(tmp_path):
    """EASGD's copies have a row per worker (kept beside the model by its
    executor): a backup taken with 2 workers cannot resume 3."""
    from keras_dist.training.local_steps import ElasticCopies

    def fit(workers, **backup):
        model = _model()
        model.__dict__["elastic_copies"] = ElasticCopies(model, workers=workers, alpha=0.3)
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[BackupAndRestore(tmp_path, **backup)])

    fit(2, delete_checkpoint=False)
    with pytest.raises(ValueError, match="the backup holds 2, this run has 3 workers. Resume "
                                         "with 2 workers"):
        fit(3)
    fit(2)  # the same count resumes


def test_resume_under_mirrored_with_keras_dist_loop(tmp_path):
    strategy = kd.resolve_strategy("mirrored", devices=CPUS)

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kd.fit(_model, X, Y, epochs=4, batch_size=16, verbose=0, strategy=strategy,
               callbacks=[BackupAndRestore(tmp_path, delete_checkpoint=False), Stop()])
    history = kd.fit(_model, X, Y, epochs=4, batch_size=16, verbose=0, strategy=strategy,
                     callbacks=[BackupAndRestore(tmp_path)])
    assert history.epoch == [2, 3]
