"""The Horovod engine: one process per rank, launched by `horovodrun`.

Horovod is imported when the engine or its communicator is created, never at `import tfdist`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from tfdist.comm.base import ByteCounter, Communicator, through_flat_buffers
from tfdist.comm.engine import Engine, register

# This process's Horovod process set for each group size (created once, on every rank; Horovod's
# process sets are themselves the process's).
_GROUP_SETS: dict[int, object] = {}


def import_horovod():
    """Returns `horovod.tensorflow`, or raises an ImportError that says how to get it."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:  # pragma: no cover - exercised where Horovod is missing
        raise ImportError(
            "The Horovod engine needs Horovod built against this TensorFlow. Run "
            "`launch/build_horovod.sh` (see BUILD.md), or use the tf.distribute engine."
        ) from e
    return hvd


EXIT_WAIT = 120.0  # seconds a rank that has finished waits at exit for the others


def wait_for_the_others_at_exit() -> None:
    """Makes this process, when it exits normally, wait (up to `EXIT_WAIT` s) until every rank
    has finished before Horovod's own exit handler shuts Horovod down. A rank that finishes
    first would otherwise end the collectives the others still run: e.g. one host's last
    averaging round within its process set, while another host's ranks are done. Not after an
    uncaught error (the others then fail at once, as Horovod makes them). Call after each
    `hvd.init()` (exit handlers run last registered first)."""
    atexit.unregister(_finish_together)
    atexit.register(_finish_together)


def _finish_together() -> None:
    hvd = import_horovod()
    if getattr(sys, "last_value", None) is not None or not hvd.is_initialized() \
            or hvd.size() == 1:
        return
    done = threading.Event()

    def barrier():
        try:
            import tensorflow as tf

            hvd.allreduce(tf.zeros([]), name="tfdist_exit", op=hvd.Sum)
        except Exception:  # noqa: BLE001 - Horovod already shut down by another rank's error
            pass
        finally:
            done.set()

    threading.Thread(target=barrier, daemon=True).start()
    if not done.wait(EXIT_WAIT):
        print(f"[tfdist] rank {hvd.rank()}: the other ranks did not finish within {EXIT_WAIT:.0f} "
              "s of this one; exiting", file=sys.stderr, flush=True)


class HorovodCommunicator(Communicator):
    """Collectives through `horovod.tensorflow` ops (Gloo on CPU, NCCL on GPU builds).

    An all-reduce of several tensors (a bucket of gradients) goes to Horovod as one flat buffer
    per dtype: Horovod's background thread then negotiates, caches and tracks
    one tensor per bucket rather than one per gradient, work it repeats every cycle (1 ms) on
    every rank, and on hosts whose cores all compute that CPU time comes out of the step (the
    models benchmark measures both).

    `hvd.init()` must have been called (`tfdist.horovod.init()` does it).
    """

    def __init__(self, counter: ByteCounter | None = None):
        super().__init__(counter)
        self._hvd = import_horovod()
        if not self._hvd.is_initialized():
            raise RuntimeError("Horovod is not initialised: call tfdist.horovod.init() first.")

    @property
    def world_size(self) -> int:
        return int(self._hvd.size())

    @property
    def rank(self):
        return int(self._hvd.rank())

    @property
    def local_size(self) -> int:
        return int(self._hvd.local_size())

    def _supports_groups(self, group_size):
        return True

    def _process_set(self, group_size: int):
        """This rank's process set for groups of `group_size` (Horovod dynamic process sets;
        every rank adds every group, in the same order, the first time the size is used)."""
        if group_size not in _GROUP_SETS:
            if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
                raise RuntimeError(
                    "Reducing within groups of Horovod ranks (hierarchical averaging) needs "
                    "dynamic process sets: call tfdist.horovod.init(process_sets='dynamic').")
            mine = None
            for first in range(0, self.world_size, group_size):
                process_set = self._hvd.add_process_set(list(range(first, first + group_size)))
                if first <= self.rank < first + group_size:
                    mine = process_set
            _GROUP_SETS[group_size] = mine
        return _GROUP_SETS[group_size]

    def _group_all_reduce(self, tensors, group_size, op):
        process_set = self._process_set(group_size)
        return through_flat_buffers(tensors, lambda ts: self._hvd.grouped_allreduce(
            ts, op=self._op(op), process_set=process_set))

    def _op(self, op: str):
        return self._hvd.Sum if op == "sum" else self._hvd.Average

    def _all_reduce(self, tensors, op):
        return through_flat_buffers(tensors, lambda ts: self._hvd.grouped_allreduce(ts, op=self._op(op)))

    def _all_gather(self, tensor):
        return self._hvd.allgather(tensor)

    def _reduce_scatter(self, tensor, op):
        return self._hvd.reducescatter(tensor, op=self._op(op))

    def _broadcast(self, tensors, root):
        return [self._hvd.broadcast(t, root_rank=root) for t in tensors]


@register
class HorovodEngine(Engine):
    """Horovod ranks. `tfdist.horovod.init()` initialises Horovod and activates this engine; a
    process that called `horovod.tensorflow.init()` itself is detected too (several ranks, no
    tf.distribute strategy in scope). No strategy divides the loss here.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        tfdist.horovod.init()  # activates a HorovodEngine
        assert tfdist.comm.resolve().name == "horovod"
        ```
    """

    name = "horovod"
    loss_divided_by_replicas = False

    def __init__(self):
        self._hvd = import_horovod()
        if not self._hvd.is_initialized():
            raise RuntimeError("Horovod is not initialised: call tfdist.horovod.init() first.")

    @classmethod
    def detect(cls, strategy):
        hvd = sys.modules.get("horovod.tensorflow")
        if hvd is not None and hvd.is_initialized() and hvd.size() > 1:
            return cls()
        return None

    def communicator(self, counter=None):
        return HorovodCommunicator(counter)

    @property
    def world_size(self) -> int:
        return int(self._hvd.size())

    @property
    def process_count(self) -> int:
        return self.world_size

    @property
    def process_index(self) -> int:
        return int(self._hvd.rank())

    def key_value_store(self):
        """The Gloo rendezvous' HTTP store (horovodrun's, or `tfdist.launch --slurm --horovod`'s);
        None under MPI."""
        from tfdist.comm.kv import RendezvousStore

        return RendezvousStore.from_environment()

    @property
    def local_size(self) -> int:
        return int(self._hvd.local_size())
