"""Collectives from eager code (callbacks, checks) for whichever engine a model trains on."""

from __future__ import annotations

import sys
from collections.abc import Callable

import tensorflow as tf

from tfdist.comm.base import Communicator, LocalCommunicator
from tfdist.comm.replica import ReplicaCommunicator


def eager_collectives(strategy: tf.distribute.Strategy | None = None
                      ) -> tuple[Communicator, Callable[[Callable[[], tf.Tensor]], tf.Tensor]]:
    """(communicator, run) for collectives outside a train step.

    Under a multi-replica tf.distribute strategy, `run(fn)` runs `fn` on every replica and returns
    replica 0's result; with an initialised multi-rank Horovod (and no such strategy) it calls `fn`
    directly over Horovod; otherwise the world is this process alone.
    """
    strategy = strategy or tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        def run(fn):
            return strategy.experimental_local_results(strategy.run(fn))[0]

        return ReplicaCommunicator(strategy), run
    if running_horovod() is not None:
        from tfdist.comm.horovod import HorovodCommunicator

        return HorovodCommunicator(), lambda fn: fn()
    return LocalCommunicator(), lambda fn: fn()


def running_horovod():
    """`horovod.tensorflow` when this process is one of several initialised Horovod ranks, else
    None (a process running Horovod has imported it already)."""
    hvd = sys.modules.get("horovod.tensorflow")
    return hvd if hvd is not None and hvd.is_initialized() and hvd.size() > 1 else None
