"""The pieces that cut a parameter-server update's transfers, in one process.

`gradients.ship_gradients` (gradients and a report in one transfer),
`step_report.ReportRing` (reports collected where the version lives) and
`staleness.fetch_add` (an atomic claim). Their use in real clusters is
checked by test_async (ps_train.py at steps_per_execution 1 and 5).
"""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from keras_dist.training import staleness
from keras_dist.training import step_report
from keras_dist.training import gradients
from keras_dist.training.step_report import ReportRing


def test_ship_gradients_keeps_values_and_carries_float64_bits_exactly():
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=(3, 4)), tf.float32), None,
             tf.constant(rng.normal(size=(5,)), tf.float32),
             tf.constant(rng.normal(size=(2, 2)), tf.float16)]
    sparse = tf.IndexedSlices(tf.ones((2, 3)), tf.constant([0, 4]), tf.constant([6, 3]))
    grads.append(sparse)
    extra = tf.constant([np.pi, -0.0, 1e-300, np.inf, np.nan, 123456789.123456789],
                        tf.float64)
    shipped, arrived = gradients.ship_gradients(grads, "/CPU:0", extra=extra)
    for before, after in zip(grads[:4], shipped[:4]):
        if before is None:
            assert after is None
        else:
            assert after.dtype == before.dtype and after.shape == before.shape
            np.testing.assert_array_equal(after.numpy(), before.numpy())
    assert shipped[4] is sparse  # sparse gradients travel as they are
    # Bit for bit, NaN and signed zero included.
    np.testing.assert_array_equal(arrived.numpy().view(np.int64), extra.numpy().view(np.int64))


@pytest.mark.parametrize("dtype", [tf.float16, tf.float64])
def test_ship_gradients_carries_the_report_in_any_float_width(dtype):
    extra = tf.constant([1.0 / 3, -7.5, 2.0 ** -40], tf.float64)
    shipped, arrived = gradients.ship_gradients([tf.ones((4,), dtype)], "/CPU:0", extra=extra)
    np.testing.assert_array_equal(shipped[0].numpy(), np.ones(4))
    np.testing.assert_array_equal(arrived.numpy(), extra.numpy())


def test_ship_gradients_without_dense_gradients_still_delivers_the_report():
    sparse = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([3, 2]))
    shipped, arrived = gradients.ship_gradients([sparse, None], "/CPU:0",
                                             extra=tf.constant([5.0], tf.float64))
    assert shipped == [sparse, None]
    assert arrived.numpy().tolist() == [5.0]


def test_packed_carries_every_numeric_dtype_bit_for_bit_in_one_vector():
    # What a round of local steps pulls and pushes: float32 weights, an
    # int64 counter, a float16 slot, an int32, a bool; each comes back
    # exactly (an int64 beyond float32's integers, NaN, -0.0 included).
    rng = np.random.default_rng(1)
    tensors = [tf.constant(rng.normal(size=(3, 4)), tf.float32),
               tf.constant(2 ** 53 + 7, tf.int64),
               tf.constant([np.nan, -0.0, 65504.0], tf.float16),
               tf.constant([-3, 2 ** 31 - 1], tf.int32),
               tf.constant([True, False]),
               None,
               tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([3, 2]))]
    packed = gradients.Packed(tensors)
    assert packed.carrier == tf.float16  # the narrowest numeric dtype
    assert packed.transfers == 3  # the numbers, the bools, the sparse one
    with tf.device("/CPU:0"):
        out = packed.unpack()
    for before, after in zip(tensors[:5], out[:5]):
        assert after.dtype == before.dtype and after.shape == before.shape
        a, b = before.numpy(), after.numpy()
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(b.view(f"u{a.itemsize}"), a.view(f"u{a.itemsize}"))
        else:
            np.testing.assert_array_equal(b, a)
    assert out[5] is None and out[6] is tensors[6]


def test_home_device_is_the_one_device_or_none():
    a, b = tf.Variable(1.0), tf.Variable(2.0)
    assert gradients.home_device([a, b]) == a.device

    class Elsewhere:
        device = "/job:ps/replica:0/task:1/device:CPU:0"

    assert gradients.home_device([a, Elsewhere()]) is None
    assert gradients.home_device([]) is None


def test_report_ring_takes_rows_in_slot_order_and_counts_lost_slots():
    ring = ReportRing(width=10, capacity=8, clock=lambda: 0.0)  # time stands still
    for i in range(2):
        ring.write(tf.constant([10.0 + i], tf.float64), 1, taus=[tf.constant(i)],
                   skipped=[tf.constant(1.0, tf.float64)])
    staleness.fetch_add(ring.count)  # slot 2: claimed by an execution that then failed
    ring.write(tf.constant([13.0, 14.0], tf.float64), 2, taus=[tf.constant(0), tf.constant(5)])
    taken = ring.take()  # stops at the slot not written yet
    assert [(k, s, r.tolist()) for k, s, r in taken] == [(1, 1, [10.0, 0.0]),
                                                         (1, 1, [11.0, 1.0])]
    assert ring.take() == []
    final = ring.take(final=True)  # nothing runs any more: slot 2 is lost
    assert [(k, s, r.tolist()) for k, s, r in final] == [(2, 0, [13.0, 14.0, 0.0, 5.0])]
    assert ring.lost == 1 and ring.next == 4


def test_report_ring_passes_a_lost_slot_once_more_than_can_run_at_once_are_written():
    ring = ReportRing(width=6, capacity=8, clock=lambda: 0.0)
    staleness.fetch_add(ring.count)  # slot 0: its execution failed after claiming it
    for i in range(3):
        ring.write(tf.constant([float(i)], tf.float64), 1)
    assert ring.take(in_flight=4) == []  # slot 0 could still be running
    ring.write(tf.constant([3.0], tf.float64), 1)
    assert [r.tolist() for _, _, r in ring.take(in_flight=4)] == [[0.0], [1.0], [2.0], [3.0]]
    assert ring.lost == 1 and ring.next == 5


def test_report_ring_passes_a_hole_once_a_later_row_has_waited_behind_it():
    # Claim and write are adjacent: a slot still unwritten HOLE_WAIT
    # seconds after a later one was seen written never will be. This is
    # what ends an epoch whose last executions are behind a hole (a link
    # cut while gradients were on their way: tests/test_multihost.py).
    now = [100.0]
    ring = ReportRing(width=6, capacity=64, clock=lambda: now[0])
    assert ring.take(in_flight=32) == []  # nothing claimed: no hole to judge
    staleness.fetch_add(ring.count)  # slot 0: its execution failed after claiming it
    assert ring.take(in_flight=32) == []  # not seen behind a written row yet
    now[0] += 10.0
    ring.write(tf.constant([1.0], tf.float64), 1)
    assert ring.take(in_flight=32) == []  # first seen now
    now[0] += step_report.HOLE_WAIT - 0.1
    assert ring.take(in_flight=32) == []
    now[0] += 0.1
    assert [r.tolist() for _, _, r in ring.take(in_flight=32)] == [[1.0]]
    assert ring.lost == 1 and ring.next == 2


def test_report_ring_claims_a_slot_only_once_the_row_is_there_to_write():
    # The slot is claimed after the report arrives: an execution whose
    # report never comes (its worker stopped or cut off) leaves no hole.
    ring = ReportRing(width=6, capacity=8)
    release, started = threading.Event(), threading.Event()

    def slow_report():
        started.set()
        release.wait(30)
        return np.array([7.0])

    @tf.function
    def execution():
        report = tf.py_function(slow_report, [], tf.float64)
        report.set_shape([1])
        ring.write(report, 1)

    runner = threading.Thread(target=execution)
    runner.start()
    try:
        assert started.wait(30)
        time.sleep(0.5)  # unordered, the claim would have run by now
        assert int(ring.count.numpy()) == 0
    finally:
        release.set()
        runner.join(30)
    assert int(ring.count.numpy()) == 1
    assert [r.tolist() for _, _, r in ring.take()] == [[7.0]]


def test_report_ring_takes_at_most_limit_rows_and_keeps_the_rest_for_later():
    # The chief takes as many rows as executions it knows finished; rows of
    # executions whose end it has not seen yet wait for the next take.
    ring = ReportRing(width=6, capacity=8)
    for i in range(3):
        ring.write(tf.constant([float(i)], tf.float64), 1)
    assert [r.tolist() for _, _, r in ring.take(limit=2)] == [[0.0], [1.0]]
    assert [r.tolist() for _, _, r in ring.take(limit=5)] == [[2.0]]
    assert ring.take(limit=1) == [] and ring.next == 3


def test_report_ring_refuses_to_read_an_overwritten_slot():
    ring = ReportRing(width=6, capacity=2)
    for i in range(3):  # slot 2 overwrites slot 0 before the chief read it
        ring.write(tf.constant([float(i)], tf.float64), 1)
    with pytest.raises(RuntimeError, match="slot 0 was overwritten"):
        ring.take()


def test_report_ring_fits_and_bad_sizes():
    ring = ReportRing(width=7, capacity=1)
    assert ring.fits(tf.zeros([2], tf.float64), extra=1)
    assert not ring.fits(tf.zeros([3], tf.float64), extra=1)
    with pytest.raises(ValueError, match="width=4"):
        ReportRing(width=4, capacity=1)


def test_fetch_add_hands_out_every_value_once_under_concurrency():
    counter = tf.Variable(tf.constant(0, tf.int64))
    claim = tf.function(lambda: staleness.fetch_add(counter))
    seen, threads = [], []

    def worker():
        got = [int(claim()) for _ in range(300)]
        seen.extend(got)

    for _ in range(4):
        threads.append(threading.Thread(target=worker))
        threads[-1].start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1200))
    assert int(counter.numpy()) == 1200
