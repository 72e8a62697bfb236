"""The Communicator interface and its byte accounting (counted bytes: the ring model).

Every algorithm in tfdist moves data only through a `Communicator`, which an engine
(`tfdist.comm.Engine`) makes: `ReplicaCommunicator` (the tf.distribute replica context),
`HorovodCommunicator`, and `LocalCommunicator` for a world of one. Besides the collectives it
offers the replica-safe conditional (`cond`) that algorithms use around collectives.

Byte accounting. Each collective adds to a `ByteCounter` the bytes *this worker sends* under the
bandwidth-optimal ring algorithms, for a world of N workers and a payload of S bytes:

| collective                          | bytes sent by each worker |
|-------------------------------------|---------------------------|
| all_reduce(S)                       | 2 (N - 1) / N * S         |
| reduce_scatter(S, input size)       | (N - 1) / N * S           |
| all_gather(S, each worker's part)   | (N - 1) * S               |
| broadcast(S)                        | (N - 1) / N * S (average) |
| group_all_reduce(S, group of G)     | 2 (G - 1) / G * S         |

The counts are computed from static shapes when the step is traced and added to a variable each
time the collective actually runs, so a collective inside a branch that is not taken adds nothing.
The same counter also counts collective *calls* (one per all_reduce / all_gather / ... call,
whatever the number of tensors it carries): many small messages cost more than their bytes.

Fusion. `fused_all_reduce` and `fused_all_gather` pack many tensors into one flat buffer per
dtype (per element size for all-gathers, which move raw bits) and so make one collective call
where a loop over tensors would make one each.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.plan.costs import ring_bytes

REDUCE_OPS = ("sum", "mean")


def payload_nbytes(tensors: Sequence[tf.Tensor]):
    """Payload size in bytes: an int where every shape is static, else a float64 scalar tensor
    (rows known only when the step runs, as an embedding's gradient rows)."""
    if all(t.shape.is_fully_defined() for t in tensors):
        return static_nbytes(tensors)
    return tf.add_n([tf.cast(tf.size(t), tf.float64) * t.dtype.size for t in tensors])


def static_nbytes(tensors: Sequence[tf.Tensor]) -> int:
    """Payload size in bytes of tensors with fully known static shapes.

    Example:
        ```python
        assert tfdist.comm.static_nbytes([tf.zeros([10, 10]), tf.zeros([4], tf.float16)]) == 408
        ```
    """
    total = 0
    for t in tensors:
        shape = t.shape
        if not shape.is_fully_defined():
            raise ValueError(
                f"Byte accounting needs static shapes; got a tensor of shape {shape}. "
                "Build the model with a fixed input shape."
            )
        total += int(np.prod(shape.as_list(), dtype=np.int64)) * t.dtype.size
    return total


class ByteCounter:
    """Adds the bytes a worker sends to a float64 scalar variable, inside or outside tf.function,
    and (with `calls`) the number of collective calls to an int64 one.

    Args:
        variable: A scalar float64 variable owned by the caller (an optimizer variable, so that
            checkpoints carry the total). Every replica adds the same amount, so a variable whose
            replicas update independently (aggregation "none") stays consistent.
        calls: Optional scalar int64 variable counting collective calls.

    Example:
        ```python
        total = tf.Variable(0.0, dtype=tf.float64)
        calls = tf.Variable(0, dtype=tf.int64)
        counter = tfdist.comm.ByteCounter(total, calls)
        comm = tfdist.comm.LocalCommunicator(counter)  # a world of one sends nothing
        comm.all_reduce([tf.ones(256)])
        assert float(total.numpy()) == 0.0
        ```
    """

    def __init__(self, variable, calls=None):
        self.variable = variable
        self.calls = calls

    def add(self, nbytes) -> None:
        """Adds `nbytes`: a number, or a scalar tensor counted when the step runs."""
        if tf.is_tensor(nbytes):
            self.variable.assign_add(tf.cast(nbytes, tf.float64))
        elif nbytes:
            self.variable.assign_add(tf.constant(nbytes, dtype=tf.float64))

    def add_call(self) -> None:
        if self.calls is not None:
            self.calls.assign_add(tf.constant(1, dtype=tf.int64))

    @property
    def total(self) -> float:
        return float(np.asarray(self.variable.numpy() if hasattr(self.variable, "numpy")
                                else self.variable))


class Communicator(abc.ABC):
    """Collective operations over the workers (replicas) of one training job.

    Implementations must be usable inside `tf.function` and, for the tf.distribute engine, inside
    a replica context. `world_size` is a Python int; `rank` may be a tensor.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))


        @tf.function
        def step():
            comm = tfdist.comm.ReplicaCommunicator(strategy)
            rank = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            return comm.all_gather(tf.reshape(rank, [1]))  # [0.0, 1.0] on both


        print(strategy.run(step))
        ```
    """

    def __init__(self, counter: ByteCounter | None = None):
        self.counter = counter

    # -- identity ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of participants in each collective."""

    @property
    @abc.abstractmethod
    def rank(self):
        """This participant's index in [0, world_size), an int or a scalar int32 tensor."""

    # -- collectives (implemented by engines) -----------------------------------------------
    @abc.abstractmethod
    def _all_reduce(self, tensors: list[tf.Tensor], op: str) -> list[tf.Tensor]: ...

    @abc.abstractmethod
    def _all_gather(self, tensor: tf.Tensor) -> tf.Tensor: ...

    @abc.abstractmethod
    def _reduce_scatter(self, tensor: tf.Tensor, op: str) -> tf.Tensor: ...

    @abc.abstractmethod
    def _broadcast(self, tensors: list[tf.Tensor], root: int) -> list[tf.Tensor]: ...

    @property
    def local_size(self) -> int:
        """Participants on this worker's host: a tf.distribute worker's devices, Horovod's local
        ranks. The default host size of hierarchical averaging."""
        return 1

    def _supports_groups(self, group_size: int) -> bool:
        """Whether the engine can reduce within groups of `group_size` ranks only."""
        return False

    def _group_all_reduce(self, tensors: list[tf.Tensor], group_size: int,
                          op: str) -> list[tf.Tensor]:
        raise NotImplementedError  # pragma: no cover - only called where supported

    # Which collective an engine really runs for reduce_scatter / broadcast (for accounting).
    @property
    def reduce_scatter_kind(self) -> str:
        return "reduce_scatter"

    broadcast_kind = "broadcast"

    # -- public API: validates, counts, delegates -------------------------------------------
    def all_reduce(self, tensors: Sequence[tf.Tensor], op: str = "sum") -> list[tf.Tensor]:
        """Element-wise reduction of each tensor over all workers; every worker gets the result."""
        _check_op(op)
        tensors = list(tensors)
        if not tensors:
            return []
        self._count("all_reduce", static_nbytes(tensors))
        if self.world_size == 1:
            return [tf.identity(t) for t in tensors]
        return self._all_reduce(tensors, op)

    def all_gather(self, tensor: tf.Tensor) -> tf.Tensor:
        """Concatenates every worker's `tensor` along axis 0, in rank order (the workers' axis 0
        sizes may differ)."""
        self._count("all_gather", payload_nbytes([tensor]))
        if self.world_size == 1:
            return tf.identity(tensor)
        return self._all_gather(tensor)

    def reduce_scatter(self, tensor: tf.Tensor, op: str = "sum") -> tf.Tensor:
        """Reduces `tensor` over workers and returns this worker's chunk of axis 0.

        Raises:
            ValueError: if axis 0 does not divide by the world size.
        """
        _check_op(op)
        dim0 = tensor.shape[0]
        if dim0 is None or dim0 % self.world_size:
            raise ValueError(
                f"reduce_scatter needs axis 0 divisible by the world size {self.world_size}; "
                f"got shape {tensor.shape}. Pad the tensor to a multiple of {self.world_size}."
            )
        self._count(self.reduce_scatter_kind, static_nbytes([tensor]))
        if self.world_size == 1:
            return tf.identity(tensor)
        return self._reduce_scatter(tensor, op)

    def broadcast(self, tensors: Sequence[tf.Tensor], root: int = 0) -> list[tf.Tensor]:
        """Every worker receives the `root` worker's tensors."""
        if not 0 <= root < self.world_size:
            raise ValueError(f"`root` must be in [0, {self.world_size}). Received: root={root}")
        tensors = list(tensors)
        if not tensors:
            return []
        self._count(self.broadcast_kind, static_nbytes(tensors))
        if self.world_size == 1:
            return [tf.identity(t) for t in tensors]
        return self._broadcast(tensors, root)

    def group_all_reduce(self, tensors: Sequence[tf.Tensor], group_size: int,
                         op: str = "mean") -> list[tf.Tensor]:
        """Reduces each tensor within groups of `group_size` consecutive ranks (ranks
        [k G, (k + 1) G) form group k); every rank gets its own group's result.

        Where the engine reduces within a group only, each rank is charged a ring all-reduce over
        G participants. Otherwise the groups' slots are stacked into one global all-reduce of
        (N / G) x the payload, charged as exactly that.

        Raises:
            ValueError: if `group_size` is not a divisor of the world size.
        """
        _check_op(op)
        n = self.world_size
        if (isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer))
                or group_size < 1 or n % group_size):
            raise ValueError(f"`group_size` must be a divisor of the world size {n}. "
                             f"Received: group_size={group_size!r}")
        tensors = list(tensors)
        if not tensors or group_size == 1:
            return [tf.identity(t) for t in tensors]
        if group_size == n:
            return self.all_reduce(tensors, op)
        if self._supports_groups(group_size):
            if self.counter is not None:
                self.counter.add(ring_bytes("all_reduce", static_nbytes(tensors), group_size))
                self.counter.add_call()
            return self._group_all_reduce(tensors, group_size, op)
        groups = n // group_size
        group = tf.cast(self.rank, tf.int32) // group_size
        slots = [tf.reshape(tf.one_hot(group, groups, dtype=t.dtype), [groups] + [1] * t.shape.rank)
                 * t[None] for t in tensors]
        reduced = self.all_reduce(slots, "sum")
        scale = 1.0 / group_size if op == "mean" else 1.0
        return [tf.gather(r, group) * tf.cast(scale, r.dtype) for r in reduced]

    def _count(self, kind: str, payload) -> None:
        if self.counter is not None and self.world_size > 1:
            self.counter.add(ring_bytes(kind, payload, self.world_size))
            self.counter.add_call()

    # -- control flow ----------------------------------------------------------------------------
    def cond(self, pred, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
             args: Sequence = ()) -> Any:
        """`tf.cond` whose branches may run collectives and optimizer updates.

        `pred` must be the same on every worker. Per-replica tensors must reach the branches
        through `args` (they are called as `fn(*args)`), never through a closure: an engine may
        run the branches outside the replica (tf.distribute's merge_call), where a captured
        tensor would be another replica's. Variables may be captured.

        Returns:
            The taken branch's outputs, or None when the branches return None.
        """
        args = list(args)
        return tf.cond(pred, lambda: true_fn(*args), lambda: false_fn(*args))


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"`op` must be one of {REDUCE_OPS}. Received: op={op!r}")


class LocalCommunicator(Communicator):
    """A world of one worker: every collective is the identity and sends no bytes.

    Example:
        ```python
        comm = tfdist.comm.LocalCommunicator()
        assert comm.world_size == 1 and comm.all_reduce([tf.ones(3)])[0].numpy().tolist() == [1, 1, 1]
        ```
    """

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self):
        return 0

    def _all_reduce(self, tensors, op):  # pragma: no cover - world_size 1 short-circuits
        return tensors

    def _all_gather(self, tensor):  # pragma: no cover
        return tensor

    def _reduce_scatter(self, tensor, op):  # pragma: no cover
        return tensor

    def _broadcast(self, tensors, root):  # pragma: no cover
        return tensors


# -- fusion: many tensors, one collective call -----------------------------------------------------
def _flat_groups(tensors: Sequence[tf.Tensor], key) -> dict:
    """{group key: [index, ...]} in first-seen order."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(key(t), []).append(i)
    return groups


def fused_all_reduce(comm: Communicator, tensors: Sequence[tf.Tensor],
                     op: str = "sum") -> list[tf.Tensor]:
    """All-reduces `tensors` as one flat buffer per dtype: one collective call per dtype (one in
    the usual case), whatever the number of tensors. Returns them reduced, in their shapes.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))


        @tf.function
        def step():
            comm = tfdist.comm.ReplicaCommunicator(strategy)
            rank = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            return tfdist.comm.fused_all_reduce(comm, [tf.ones([2, 3]) * rank, tf.ones([4])])  # one call


        print(strategy.run(step))
        ```
    """
    return through_flat_buffers(tensors, lambda buffers: comm.all_reduce(buffers, op=op))


def through_flat_buffers(tensors: Sequence[tf.Tensor],
                         reduce: Callable[[list[tf.Tensor]], list[tf.Tensor]]) -> list[tf.Tensor]:
    """`reduce` (an element-wise collective of a list of tensors) applied to `tensors` packed
    into one flat buffer per dtype; returns its results split back into the tensors' shapes.
    One tensor goes as it is (no copy).

    Example:
        ```python
        doubled = tfdist.comm.base.through_flat_buffers(
            [tf.ones([2, 3]), tf.ones([4])], lambda buffers: [2 * b for b in buffers])
        assert [t.shape.as_list() for t in doubled] == [[2, 3], [4]]
        ```
    """
    tensors = list(tensors)
    if len(tensors) < 2:
        return list(reduce(tensors)) if tensors else []
    out: list[Any] = [None] * len(tensors)
    groups = _flat_groups(tensors, lambda t: t.dtype)
    buffers = [tf.concat([tf.reshape(tensors[i], [-1]) for i in idx], 0) for idx in groups.values()]
    for idx, reduced in zip(groups.values(), reduce(buffers)):
        sizes = [int(tensors[i].shape.num_elements()) for i in idx]
        for i, part in zip(idx, tf.split(reduced, sizes)):
            out[i] = tf.reshape(part, tensors[i].shape)
    return out


def buckets(tensors: Sequence[tf.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `tensors` in buckets of about `bucket_bytes` each, in *reverse* order: the
    last tensors first, as a backward pass produces the gradients of the last layers first. A
    bucket closes once it holds at least `bucket_bytes`; a larger tensor is a bucket of its own."""
    groups: list[list[int]] = [[]]
    filled = 0
    for i in reversed(range(len(tensors))):
        groups[-1].append(i)
        filled += static_nbytes([tensors[i]])
        if filled >= bucket_bytes:
            groups.append([])
            filled = 0
    return [g for g in groups if g]


def bucketed_all_reduce(comm: Communicator, tensors: Sequence, bucket_bytes: int | None,
                        op: str = "sum") -> list[tf.Tensor]:
    """All-reduces `tensors` in buckets of about `bucket_bytes` (see `buckets`), one collective
    call per bucket, so the reduction of the last layers' gradients can run while the backward
    pass still computes the first layers' (inside one traced step, each bucket's collective
    depends only on its own gradients). `bucket_bytes=None`: one call for all, as Keras does.

    Entries given as `tf.IndexedSlices` (an embedding's gradient rows, with a static
    `dense_shape`) are summed as rows (`sparse_all_reduce`) and come back as dense tensors of
    that shape. Each is reduced where a backward pass produces it: before the first bucket
    made only of earlier tensors. The place matters, not only for overlap: tf.distribute runs
    one worker's collectives in the order they were created (they share an ordering token),
    so a collective created first whose input exists last (the first layer's embedding) would
    hold back every bucket until the backward pass ends.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))


        @tf.function
        def step():
            comm = tfdist.comm.ReplicaCommunicator(strategy)
            rank = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            return tfdist.comm.bucketed_all_reduce(comm, [tf.ones([1000])] * 4, bucket_bytes=8000)  # 2 calls


        print(strategy.run(step))
        ```
    """
    tensors = list(tensors)
    rows = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if rows and op != "sum":
        raise ValueError(f"Gradient rows (tf.IndexedSlices) are summed; got op={op!r}.")
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if bucket_bytes is None or len(dense) < 2:
        groups = [dense] if dense else []
    else:
        groups = [[dense[j] for j in g]
                  for g in buckets([tensors[i] for i in dense], bucket_bytes)]
    out: list[Any] = [None] * len(tensors)
    pending = sorted(rows, reverse=True)  # the backward pass's order: last tensors first
    for group in groups:
        while pending and pending[0] > max(group):
            i = pending.pop(0)
            out[i] = _summed_rows(comm, tensors[i])
        for i, reduced in zip(group, comm.all_reduce([tensors[i] for i in group], op=op)):
            out[i] = reduced
    for i in pending:
        out[i] = _summed_rows(comm, tensors[i])
    return out


def _summed_rows(comm: Communicator, grad: tf.IndexedSlices) -> tf.Tensor:
    shape = tf.get_static_value(grad.dense_shape)
    if shape is None:
        raise ValueError("Gradient rows need a static dense_shape (the variable's shape) to be "
                         "summed into a dense tensor; build the IndexedSlices with "
                         "dense_shape=variable.shape.")
    shape = [int(d) for d in shape]
    return tf.reshape(sparse_all_reduce(comm, grad, shape[0]), shape)


def sparse_all_reduce(comm: Communicator, grad: tf.IndexedSlices, rows: int) -> tf.Tensor:
    """The sum over workers of a gradient given as rows and their indices (an embedding's
    `tf.IndexedSlices`), as a dense tensor of `rows` rows. Every worker's rows and indices are
    all-gathered, what it holds rather than the whole table (as Horovod and Keras do for sparse
    gradients): (N-1) x (rows held x (row bytes + 4)) sent per worker, against a dense
    all-reduce's 2 (N-1)/N x the table's bytes. Rows of 4-byte elements (float32) travel with
    their indices as one buffer of 32-bit words, one all-gather call; others in two.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))


        @tf.function
        def step():
            comm = tfdist.comm.ReplicaCommunicator(strategy)
            rank = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            return tfdist.comm.sparse_all_reduce(  # rows 0 and 3 of a 5-row table
                comm, tf.IndexedSlices(tf.ones([2, 4]), tf.constant([0, 3]), tf.constant([5, 4])), rows=5)


        print(strategy.run(step))
        ```
    """
    values = grad.values
    indices = tf.cast(grad.indices, tf.int32)
    width = values.shape[1:].num_elements()
    if values.dtype.size != 4 or width is None:
        gathered = comm.all_gather(values)
        return tf.math.unsorted_segment_sum(gathered, comm.all_gather(indices), rows)
    flat = tf.reshape(values, [-1, width])
    words = flat if values.dtype == tf.int32 else tf.bitcast(flat, tf.int32)
    packed = comm.all_gather(tf.concat([words, indices[:, None]], axis=1))
    gathered = packed[:, :width]
    gathered = gathered if values.dtype == tf.int32 else tf.bitcast(gathered, values.dtype)
    gathered = tf.reshape(gathered, [-1, *values.shape[1:]])
    return tf.math.unsorted_segment_sum(gathered, packed[:, width], rows)


_WORD = {1: tf.int8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def fused_all_gather(comm: Communicator, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """All-gathers `tensors` as one buffer of raw words per element size (one collective call in
    the usual case, where every payload has 4-byte elements). Returns, for each tensor, every
    worker's copy stacked: shape [world_size, *shape], in rank order.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))


        @tf.function
        def step():
            comm = tfdist.comm.ReplicaCommunicator(strategy)
            rank = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            return tfdist.comm.fused_all_gather(comm, [tf.reshape(rank, [1]), tf.range(2)])


        print(strategy.run(step))
        ```
    """
    tensors = list(tensors)
    n = comm.world_size
    out: list[Any] = [None] * len(tensors)
    for idx in _flat_groups(tensors, lambda t: t.dtype.size).values():
        word = _WORD[tensors[idx[0]].dtype.size]
        flat = [tf.reshape(tensors[i], [-1]) for i in idx]
        raw = [f if f.dtype == word else tf.bitcast(f, word) for f in flat]
        gathered = tf.reshape(comm.all_gather(tf.concat(raw, 0)), [n, -1])
        sizes = [int(f.shape[0]) for f in flat]
        for i, part in zip(idx, tf.split(gathered, sizes, axis=1)):
            t = tensors[i]
            part = part if t.dtype == word else tf.bitcast(part, t.dtype)
            out[i] = tf.reshape(part, [n, *t.shape])
    return out
