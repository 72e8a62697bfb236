"""The tf.distribute engine: replicas of a MirroredStrategy or a multi-worker strategy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist._hooks.distribute import fresh_collective_keys, uses_merge_call
from tfdist.comm.base import ByteCounter, Communicator
from tfdist.comm.engine import Engine, register

_OPS = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}


class ReplicaCommunicator(Communicator):
    """Collectives through `tf.distribute.get_replica_context()`.

    Use it inside `strategy.run` (which is where Keras `fit` runs a train step). The world is
    every replica in sync: all devices of all workers.

    tf.distribute has no public reduce-scatter or broadcast in replica context. Where all replicas
    live in this process (MirroredStrategy), reduce-scatter runs in `merge_call`: chunk k of every
    replica's tensor is summed on replica k's device, a true reduce-scatter. Elsewhere (multi-
    worker) it runs as an all-reduce that keeps this replica's chunk; broadcast always runs as an
    all-reduce of zeroed non-root inputs. The byte counter charges what really runs.

    Group reductions (`group_all_reduce`) within one worker's devices run in `merge_call` on the
    group's first device, moving data between that worker's devices only (MirroredStrategy).

    Args:
        strategy: The strategy whose replicas take part. Defaults to the current strategy.
        counter: Optional `ByteCounter`.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))


        @tf.function
        def step():
            comm = tfdist.comm.ReplicaCommunicator(strategy)
            rank = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            return comm.all_reduce([rank + 1.0], op="sum")  # [3.0] on both replicas


        print(strategy.run(step))
        ```
    """

    broadcast_kind = "all_reduce"

    def __init__(self, strategy: tf.distribute.Strategy | None = None,
                 counter: ByteCounter | None = None):
        super().__init__(counter)
        fresh_collective_keys()  # the strategies made from now on (see tfdist._hooks.distribute)
        self.strategy = strategy or tf.distribute.get_strategy()

    @property
    def world_size(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def rank(self):
        return tf.cast(_replica_context().replica_id_in_sync_group, tf.int32)

    @property
    def reduce_scatter_kind(self) -> str:
        return "reduce_scatter" if self._all_local() else "all_reduce"

    def _all_local(self) -> bool:
        """Every replica is in this process and reachable from `merge_call` (MirroredStrategy)."""
        return uses_merge_call() and self.local_size == self.world_size

    @property
    def local_size(self) -> int:
        return len(self.strategy.extended.worker_devices)

    def _supports_groups(self, group_size):
        return uses_merge_call() and self.local_size % group_size == 0

    def _group_all_reduce(self, tensors, group_size, op):
        devices = self.strategy.extended.worker_devices

        def per_group(parts):
            return [_reduce_on(devices[first], parts[first:first + group_size], op)
                    for first in range(0, len(parts), group_size)]

        results, local_id = self._in_merge_call(per_group, tensors)
        return [tf.identity(sums[local_id // group_size]) for sums in results]

    def _in_merge_call(self, fn, tensors):
        """Runs `fn(parts)` in `merge_call` for each tensor, `parts` being its values on this
        worker's devices in replica order; returns the results (every replica gets them all)
        and this replica's index among the worker's devices."""
        ctx = _replica_context()
        results = ctx.merge_call(
            lambda distribution, *values: [fn(distribution.experimental_local_results(v))
                                           for v in values], args=tensors)
        return results, int(tf.get_static_value(ctx.replica_id_in_sync_group)) % self.local_size

    def _pinned(self, tensors: list) -> list:
        """Under MultiWorkerMirroredStrategy (one local device), tensors made inside a cross-
        replica tf.cond branch (see Communicator.cond) or read from variables in a step carry
        no device, which TF's collectives reject ("destinations can not be empty"): pin them
        to the local device."""
        local = self.strategy.extended.worker_devices
        if len(local) == 1 and any(not getattr(t, "device", "x") for t in tensors):
            with tf.device(local[0]):
                return [tf.identity(t) for t in tensors]
        return tensors

    def _all_reduce(self, tensors, op):
        return list(_replica_context().all_reduce(_OPS[op], self._pinned(tensors)))

    def _all_gather(self, tensor):
        return _replica_context().all_gather(self._pinned([tensor])[0], axis=0)

    def _reduce_scatter(self, tensor, op):
        n = self.world_size
        chunk = tensor.shape[0] // n
        if not self._all_local():
            (reduced,) = self._all_reduce([tensor], op)
            return reduced[self.rank * chunk:(self.rank + 1) * chunk]
        devices = self.strategy.extended.worker_devices

        def scatter(parts):
            pieces = []  # pieces[r][k]: chunk k of replica r, cut on replica r's device
            for r, part in enumerate(parts):
                with tf.device(devices[r]):
                    pieces.append([part[k * chunk:(k + 1) * chunk] for k in range(n)])
            return [_reduce_on(devices[k], [p[k] for p in pieces], op) for k in range(n)]

        (chunks,), local_id = self._in_merge_call(scatter, [tensor])
        return tf.identity(chunks[local_id])

    def _broadcast(self, tensors, root):
        is_root = tf.equal(self.rank, root)
        masked = [tf.where(is_root, t, tf.zeros_like(t)) for t in tensors]
        return self._all_reduce(masked, "sum")

    def cond(self, pred, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
             args: Sequence = ()) -> Any:
        """Under MirroredStrategy a `tf.cond` in replica context must not contain `merge_call`
        (which every all-reduce and variable update uses): TF raises "merge_call called while
        defining a new graph". The cond then moves to cross-replica context and each branch runs
        on every replica with `call_for_each_replica`, the pattern Keras' LossScaleOptimizer
        uses; `merge_call` runs one replica's closure, hence the per-replica `args`."""
        args = list(args)
        if not uses_merge_call():
            return tf.cond(pred, lambda: true_fn(*args), lambda: false_fn(*args))

        def merge_fn(distribution, pred, *args):
            first = distribution.experimental_local_results(pred)[0]
            return tf.cond(
                first,
                lambda: distribution.extended.call_for_each_replica(true_fn, args=args),
                lambda: distribution.extended.call_for_each_replica(false_fn, args=args),
            )

        return _replica_context().merge_call(merge_fn, args=(pred, *args))


def _reduce_on(device: str, parts: list, op: str) -> tf.Tensor:
    """Sum (or mean) of `parts`, computed on `device`."""
    with tf.device(device):
        total = tf.add_n(list(parts))
        return total / len(parts) if op == "mean" else total


def _replica_context() -> tf.distribute.ReplicaContext:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "ReplicaCommunicator collectives must run in a replica context: call them inside "
            "`strategy.run(...)` (Keras `fit` does this for a train step)."
        )
    return ctx


@register
class DistributeEngine(Engine):
    """The replicas of a `tf.distribute.MirroredStrategy` (one process, many devices) or of a
    `tf.distribute.MultiWorkerMirroredStrategy` (TF_CONFIG workers), subclasses included.

    Keras divides the loss by the number of replicas under a strategy.

    Args:
        strategy: The strategy. Defaults to the one in scope.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        engine = tfdist.comm.DistributeEngine(strategy)
        assert engine.world_size == 2
        ```
    """

    name = "distribute"
    priority = 10
    loss_divided_by_replicas = True

    def __init__(self, strategy: tf.distribute.Strategy | None = None):
        fresh_collective_keys()  # the strategies made from now on (see tfdist._hooks.distribute)
        self.strategy = strategy or tf.distribute.get_strategy()
        self._local_ranks: list[int] | None = None
        self._gather_fn: tuple[int, Any] | None = None  # (values per row, traced gather)

    @classmethod
    def detect(cls, strategy):
        if isinstance(strategy, (tf.distribute.MirroredStrategy,
                                 tf.distribute.MultiWorkerMirroredStrategy)):
            return cls(strategy)
        return None

    def communicator(self, counter=None):
        return ReplicaCommunicator(self.strategy, counter)

    @property
    def world_size(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def local_devices(self) -> list[str]:
        return list(self.strategy.extended.worker_devices)

    @property
    def local_size(self) -> int:
        return len(self.local_devices)

    @property
    def process_count(self) -> int:
        return max(1, self.world_size // self.local_size)

    @property
    def process_index(self) -> int:
        resolver = getattr(self.strategy, "cluster_resolver", None)
        return int(getattr(resolver, "task_id", 0) or 0) if self.multi_process else 0

    @property
    def is_chief(self) -> bool:
        return bool(self.strategy.extended.should_checkpoint)

    def key_value_store(self):
        """TensorFlow's coordination service of a multi-worker job."""
        from tfdist._hooks.coordination import available
        from tfdist.comm.kv import CoordinationStore

        return CoordinationStore() if self.multi_process and available() else None

    def local_ranks(self) -> list[int]:
        if not self.multi_process:
            return list(range(self.world_size))
        if self._local_ranks is None:
            ids = self.strategy.run(
                lambda: tf.distribute.get_replica_context().replica_id_in_sync_group)
            self._local_ranks = [int(i) for i in self.strategy.experimental_local_results(ids)]
        return self._local_ranks

    def gather_values(self, values) -> np.ndarray:
        """As `Engine.gather_values`, through one traced function kept per engine: an eager
        collective under the multi-worker strategy costs about 0.2 s a call, a traced one
        milliseconds."""
        if self.world_size == 1:
            return np.asarray([list(values)], np.float64)
        fn = self._gather_fn
        if fn is None or fn[0] != len(values):
            comm = self.communicator()
            strategy = self.strategy

            @tf.function(reduce_retracing=True)
            def gather(row):
                return strategy.run(lambda: comm.all_gather(row))

            self._gather_fn = fn = (len(values), gather)
        out = fn[1](tf.constant([list(values)], tf.float64))
        return np.asarray(self.strategy.experimental_local_results(out)[0])

    def _run(self, fn):
        if self.world_size == 1:
            return fn(self.communicator())
        comm = self.communicator()
        return self.strategy.experimental_local_results(self.strategy.run(lambda: fn(comm)))[0]
