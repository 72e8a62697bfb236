"""Sharded values between a process's replicas and whole vectors (checkpoints, weights).

In a single-process job every shard is here; in a multi-process job (TF_CONFIG workers, Horovod
ranks) a process holds only its own replicas' shards and gathering the others' is a collective:
every process must take part.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

# How long a save waits for the other processes to join the gather of their shards.
SAVE_TIMEOUT_ENV = "TFDIST_ZERO_SAVE_TIMEOUT"
SAVE_TIMEOUT_SECONDS = 600.0


def ranks_here(plan, engine, held: int) -> list[int]:
    """The global ranks of the `held` replicas of this process, in local order."""
    if held == plan.world_size:
        return list(range(held))
    return engine.local_ranks()


def consolidate(plan, engine, shards: list, what: str = "the optimizer state") -> np.ndarray:
    """The length-P value of a sharded variable from this process's `shards` (other processes'
    shards all-gathered; a process that waits longer than $TFDIST_ZERO_SAVE_TIMEOUT seconds for
    the others says so)."""
    shards = [np.asarray(s, np.float32) for s in shards]
    if len(shards) == plan.world_size:
        return plan.consolidate(shards)
    first = min(ranks_here(plan, engine, len(shards)))
    local = tf.constant(np.stack(shards))

    def gather(comm):  # this replica's shard, gathered from every replica in rank order
        return comm.all_gather(tf.gather(local, tf.cast(comm.rank, tf.int32) - first))

    seconds = save_timeout()
    try:
        full = engine.run(gather, timeout=seconds)
    except TimeoutError:
        raise RuntimeError(
            f"ZeRO: saving gathers every process's shard of {what}, and the other processes "
            f"did not join within {seconds:g} s. Save on every process (pass "
            "tfdist.callbacks.ModelCheckpoint to fit on every rank: it writes one file), not on "
            f"rank 0 alone; ${SAVE_TIMEOUT_ENV} sets this wait.") from None
    return plan.consolidate(np.asarray(full).reshape(plan.world_size, plan.shard_size))


def local_shards(plan, engine, value, held: int) -> list:
    """This process's `held` shards of the length-P `value`."""
    shards = plan.split(value)
    return [shards[r] for r in ranks_here(plan, engine, held)]


def save_timeout() -> float:
    value = os.environ.get(SAVE_TIMEOUT_ENV)
    try:
        return float(value) if value else SAVE_TIMEOUT_SECONDS
    except ValueError:
        raise ValueError(f"${SAVE_TIMEOUT_ENV} must be a number of seconds; got {value!r}") \
            from None
