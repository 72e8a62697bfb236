"""Optimizer state off the device: in host memory (ZeRO-Offload) or in files (ZeRO-Infinity).

`Offload("cpu")` keeps each replica's shard of the optimizer state in host memory and runs the
inner optimizer's update there: the device holds neither the state nor the update's temporaries;
per step the gradient shard goes to the host and the updated parameter shard comes back.

`Offload("disk", directory, budget_bytes)` keeps the state in files (one per state slot and
replica) and streams it through host memory in chunks: each chunk of every slot is memory-mapped,
copied into the update's working variables, updated and written back, then unmapped. At most
`budget_bytes` of state are in host memory at once: half for the mapped windows, half for the
working copy.

The update is the inner Keras optimizer's own (a clone built on one chunk, run eagerly on the
host from a `tf.numpy_function`), so offloading changes where the state lives, not the result.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
import shutil
import tempfile
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist._hooks.optimizer import disable_gradient_all_reduce, fuse_like
from tfdist.arguments import check_int

KINDS = ("cpu", "disk")
DEFAULT_BUDGET = 64 * 2**20
_F32 = 4


class Offload:
    """Where ZeroOptimizer keeps the optimizer state when not on the device.

    Args:
        kind: "cpu" (host memory) or "disk" (memory-mapped files).
        directory: For "disk": an existing, writable directory for the state files (a temporary
            one, removed at exit, when None). The files are removed when the optimizer goes.
        budget_bytes: For "disk": the most bytes of one replica's state held in host memory at
            once (mapped windows plus the update's working copy).

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            optimizer = tfdist.ZeroOptimizer(
                keras.optimizers.Adam(1e-3), stage=2,
                offload=tfdist.zero.Offload("disk", budget_bytes=1 << 20))  # a temporary dir
            model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        ```
    """

    def __init__(self, kind: str = "cpu", directory: str | None = None,
                 budget_bytes: int = DEFAULT_BUDGET):
        if not isinstance(kind, str) or kind not in KINDS:
            raise ValueError(f"`offload` must be one of {KINDS} or None. Received: {kind!r:.80} "
                             "(state on another accelerator is not an offload target).")
        if directory is not None and not isinstance(directory, str):
            raise ValueError(f"`directory` must be a path (a string) or None. "
                             f"Received: directory={directory!r:.80}")
        if kind == "cpu" and directory is not None:
            raise ValueError("`directory` is for offload='disk'; offload='cpu' keeps the state "
                             f"in host memory. Received: directory={directory!r}")
        if directory is not None:
            if not os.path.isdir(directory):
                raise ValueError(f"Offload directory {directory!r} does not exist: create it "
                                 "(or pass directory=None for a temporary one).")
            if not os.access(directory, os.W_OK):
                raise ValueError(f"Offload directory {directory!r} is not writable.")
        self.budget_bytes = check_int("budget_bytes", budget_bytes, 1024)
        self.kind = kind
        self.directory = directory

    @classmethod
    def parse(cls, value) -> Offload | None:
        """None, "cpu", "disk", a config dict or an `Offload`."""
        if value is None or isinstance(value, Offload):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as e:
                raise ValueError(f"Bad `offload` config {value!r:.80}: {e}") from None
        raise ValueError(f"`offload` must be None, 'cpu', 'disk' or tfdist.zero.Offload(...). "
                         f"Received: {value!r}")

    def get_config(self) -> dict[str, Any]:
        return {"kind": self.kind, "directory": self.directory,
                "budget_bytes": self.budget_bytes}


class _DiskStore:
    """State slots of one replica's shard in files, mapped a window at a time."""

    def __init__(self, slots: int, size: int, directory: str, tag: str):
        self.size = size
        self.nbytes = slots * size * _F32
        self.directory = os.path.realpath(directory)
        self.paths = [os.path.join(self.directory, f"zero-{tag}-slot{k}.f32")
                      for k in range(slots)]
        self._own = set(self.paths)
        self._finalizer = weakref.finalize(self, _remove, list(self.paths))
        for path in self.paths:
            # Reserved, not sparse: a full disk fails here, with the bytes named, instead of a
            # SIGBUS when a mapped page is first written.
            with open(path, "wb") as f:
                try:
                    os.posix_fallocate(f.fileno(), 0, size * _F32)
                except OSError as e:
                    self._finalizer()
                    raise OSError(e.errno, f"Offload directory {directory!r}: could not reserve "
                                  f"{size * _F32:,} bytes for {path} ({e.strerror}); the "
                                  f"optimizer state needs {self.nbytes:,} bytes per replica. "
                                  "Free space there, or choose another directory.") from None

    @contextlib.contextmanager
    def window(self, start: int, stop: int):
        maps = [np.memmap(p, np.float32, "r+", offset=start * _F32, shape=(stop - start,))
                for p in self.paths]
        try:
            yield maps
            for m in maps:
                m.flush()
        finally:
            del maps  # unmapped: the window's pages leave this process

    def resident_bytes(self) -> int:
        """Bytes of the state files resident in this process now, from /proc/self/smaps."""
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # mapping header
                    inside = len(head) == 6 and head[5].strip() in self._own
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
        return total

    def read(self, slot: int) -> np.ndarray:
        return np.fromfile(self.paths[slot], np.float32)

    def write(self, slot: int, value: np.ndarray) -> None:
        np.asarray(value, np.float32).tofile(self.paths[slot])


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _clone(inner):
    """A fresh optimizer like `inner` (its learning rate is set at every step), its update
    fused as `inner`'s is."""
    config = inner.get_config()
    config["learning_rate"] = 0.0
    clone = type(inner).from_config(config)
    fuse_like(inner, clone)
    return clone


class _VariableStore:
    """offload="cpu": the state is the host optimizer's own slot variables (one chunk is the
    whole shard), so nothing is copied in and out."""

    def __init__(self, slots: list):
        self.slots = slots
        self.nbytes = sum(int(v.shape.num_elements()) * _F32 for v in slots)

    @contextlib.contextmanager
    def window(self, start: int, stop: int):
        yield None

    def read(self, slot: int) -> np.ndarray:
        return self.slots[slot].numpy()

    def write(self, slot: int, value: np.ndarray) -> None:
        self.slots[slot].assign(value)


class _ShardUpdater:
    """The inner optimizer's update of one replica's shard, on the host, chunk by chunk."""

    def __init__(self, inner, size: int, chunk: int, store_factory, host: str):
        self.size, self.chunk, self.host = size, chunk, host
        with tf.device(host):
            self.optimizer = _clone(inner)
            disable_gradient_all_reduce(self.optimizer)
            self.param = tf.Variable(tf.zeros([chunk]), name="zero_offload_chunk")
            self.optimizer.build([self.param])
        self.slots = [v for v in self.optimizer.variables if tuple(v.shape) == (chunk,)]
        self.store = store_factory(self.slots)

    def step(self, iteration, learning_rate, grad: np.ndarray, param: np.ndarray) -> np.ndarray:
        out = np.empty_like(param)
        with tf.device(self.host):
            self.optimizer.learning_rate = float(learning_rate)
            for start in range(0, self.size, self.chunk):
                stop = min(start + self.chunk, self.size)
                with self.store.window(start, stop) as state:  # None: state in the slots
                    for var, value in zip(self.slots, state or ()):
                        var.assign(self._pad(value))
                    self.param.assign(self._pad(param[start:stop]))
                    self.optimizer.iterations.assign(iteration)
                    self.optimizer.apply([tf.constant(self._pad(grad[start:stop]))],
                                         [self.param])
                    for var, value in zip(self.slots, state or ()):
                        value[:] = var.numpy()[:stop - start]
                out[start:stop] = self.param.numpy()[:stop - start]
        return out

    def _pad(self, value: np.ndarray) -> np.ndarray:
        if len(value) == self.chunk:
            return np.asarray(value)
        return np.concatenate([value, np.zeros(self.chunk - len(value), np.float32)])


def check_space(directory: str, needed: int, replicas: int) -> None:
    """Raises (before any file is made) if `directory` cannot hold every replica's state."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise ValueError(f"Offload directory {directory!r} has {free:,} bytes free; the optimizer "
                         f"state of this process's {replicas} replica(s) needs {needed:,} bytes. "
                         "Free space there, choose another directory (Offload('disk', "
                         "directory=...)), or offload to 'cpu'.")


class OffloadedState:
    """The offloaded state of this process's replicas (one `_ShardUpdater` each).

    The updaters are built, and run, on one thread per replica that no distribution strategy
    scope reaches: the update is the inner optimizer's plain single-device update.
    """

    def __init__(self, offload: Offload, inner, size: int, replicas: int, host: str):
        self.offload, self.size, self.replicas, self.host = offload, size, replicas, host
        self._tmp = None
        directory = offload.directory
        if offload.kind == "disk" and directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tfdist-zero-")
            directory = self._tmp.name
        self.directory = directory
        self._pools = [concurrent.futures.ThreadPoolExecutor(1, f"tfdist-zero-offload-{r}")
                       for r in range(replicas)]
        self._num_slots = self._on(0, _count_slots, inner) if offload.kind == "disk" else 0
        if offload.kind == "disk":
            check_space(str(directory), replicas * self._num_slots * size * _F32, replicas)
        self.updaters = [self._on(r, self._make_updater, inner, r) for r in range(replicas)]
        weakref.finalize(self, _shutdown, list(self._pools))

    def _make_updater(self, inner, replica: int) -> _ShardUpdater:
        kind, size = self.offload.kind, self.size
        if kind == "cpu":
            return _ShardUpdater(inner, size, size, _VariableStore, self.host)
        slots = self._num_slots
        chunk = self.offload.budget_bytes // (2 * _F32 * max(slots, 1))
        page = mmap.PAGESIZE // _F32
        if chunk >= page:  # whole pages: a window's resident pages are the window itself
            chunk -= chunk % page
        chunk = max(1, min(size, chunk))
        if slots and 2 * _F32 * slots > self.offload.budget_bytes:
            raise ValueError(f"budget_bytes={self.offload.budget_bytes} cannot hold one element "
                             f"of {slots} state slots twice; raise it.")
        tag, directory = f"{os.getpid()}-{id(self)}-{replica}", str(self.directory)
        return _ShardUpdater(
            inner, size, chunk,
            lambda slots: _DiskStore(len(slots), size, directory, tag),
            self.host)

    def _on(self, replica: int, fn, *args):
        return self._pools[replica].submit(fn, *args).result()

    # -- the step, from the graph --------------------------------------------------------------
    def update(self, replica, iteration, learning_rate, grad, param) -> tf.Tensor:
        """This replica's updated parameter shard (a host op in the step's graph)."""
        with tf.device(self.host):
            out = tf.numpy_function(
                self._step, [tf.cast(replica, tf.int32), tf.cast(iteration, tf.int64),
                             tf.cast(learning_rate, tf.float32), grad, param],
                tf.float32, stateful=True, name="zero_offloaded_update")
        out.set_shape(param.shape)
        return out

    def _step(self, replica, iteration, learning_rate, grad, param):
        r = int(replica) % self.replicas
        return self._on(r, self.updaters[r].step, int(iteration), float(learning_rate),
                        grad, param)

    # -- checkpoints and accounting --------------------------------------------------------------
    def slot(self, replica: int, k: int) -> np.ndarray:
        return self.updaters[replica].store.read(k)

    def set_slot(self, replica: int, k: int, value: np.ndarray) -> None:
        self.updaters[replica].store.write(k, value)

    def stored_bytes(self) -> int:
        return sum(u.store.nbytes for u in self.updaters)

    def working_bytes(self) -> int:
        """Host bytes of the update's working copy (one chunk of every slot, per replica)."""
        u = self.updaters[0]
        return self.replicas * len(u.slots) * u.chunk * _F32


def _count_slots(inner) -> int:
    """How many per-element state slots the inner optimizer keeps for one variable."""
    probe = _clone(inner)
    probe.build([keras.Variable(np.zeros(3, np.float32))])
    return sum(tuple(v.shape) == (3,) for v in probe.variables)


def _shutdown(pools) -> None:
    for pool in pools:
        pool.shutdown(wait=False)
