"""Discrete-event simulation of asynchronous workers, in one process.

A real cluster on a 2-core machine shows two workers; users run 8 to 256.
This package replays what N asynchronous workers do to a model -- the order
in which their updates land and the staleness of each -- and trains a real
Keras model exactly that way: every gradient is computed on the weights its
worker pulled when it started, and applied (through any keras_dist
staleness-aware wrapper) when that worker finishes.

What it models: the order of updates, each update's staleness, slow
workers (persistently, or per step from a heavy-tailed law), workers that
stop and come back, computations stopped for being stale (Ringmaster),
and synchronous steps that drop their slowest workers (backup workers). What it does not model:
network bandwidth and latency, parameter-server load, or the time the
updates themselves take. Deterministic for a given seed.

Where each part lives: `async_schedule` (`Schedule`, `schedule`: the order
and staleness of asynchronous updates, and the speed model), `replay`
(`fit`: training a model along a `Schedule`; `epoch_times`), and
`synchronous` (`SyncSchedule`, `sync_schedule`, `sync_fit`: synchronous SGD
with backup workers), and `steps` (the gradient step both trainings
compute). Import them from here: `from keras_dist import
simulate`.
"""

from keras_dist.simulate.async_schedule import SPEEDS, Schedule, schedule
from keras_dist.simulate.replay import epoch_times, fit
from keras_dist.simulate.synchronous import LR_SCALINGS, SyncSchedule, sync_fit, sync_schedule

__all__ = ["Schedule", "SyncSchedule", "epoch_times", "fit", "schedule", "sync_fit",
           "sync_schedule"]
