"""Suite "compressors": each compressor's own work per MB of gradient.

One gradient exchange of the comm suite's model (the 5.5M-parameter MLP 64-2304-2304-10, its
tensors of at least 1,024 elements and rank >= 2 compressed, as `GradientExchange` does) through
the transport (`reduce_encoded`) over a loopback communicator of 2 workers: every collective
returns what 2 workers sending this worker's payload would produce, so the time is the
compressor's work on one worker (compressing, packing, decompressing every worker's payload,
error feedback) with no network. A traced `tf.function`, its state fed back at every call as in
training; the median of the timed calls after warm-up, in ms per exchange and per MB of float32
gradient compressed (MB = 10^6 bytes). "dense" is the fused all-reduce of the same tensors:
packing only.
"""

from __future__ import annotations

import statistics
import time

import tensorflow as tf

from tfdist import compression
from tfdist.comm import Communicator, fused_all_reduce, reduce_encoded

SHAPES = [(64, 2304), (2304,), (2304, 2304), (2304,), (2304, 10), (10,)]
MIN_COMPRESS_SIZE = 1024
WORKERS = 2
# (row name, compressor config): the configs/ compressors, and the sparsifiers at 1%.
COMPRESSORS = [
    ("dense", None),
    ("fp16", {"name": "fp16"}),
    ("bf16", {"name": "bf16"}),
    ("ef_topk 1%", {"name": "topk", "ratio": 0.01, "error_feedback": True}),
    ("ef_randomk 1%", {"name": "randomk", "ratio": 0.01, "error_feedback": True}),
    ("dgc 1%", {"name": "dgc", "ratio": 0.01}),
    ("threshold", {"name": "threshold", "threshold": 0.01, "error_feedback": True}),
    ("qsgd 8 levels", {"name": "qsgd", "levels": 8, "bucket_size": 512}),
    ("nuqsgd", {"name": "nuqsgd"}),
    ("terngrad", {"name": "terngrad"}),
    ("ef_signsgd", {"name": "signsgd", "error_feedback": True}),
    ("onebit", {"name": "onebit"}),
    ("powersgd rank 2", {"name": "powersgd", "rank": 2}),
]


class LoopbackCommunicator(Communicator):
    """`world_size` workers that all send this worker's tensors: sums are the tensor times the
    world size, gathers its copies. No bytes move; the compute around the collectives is real."""

    def __init__(self, world_size: int):
        super().__init__(None)
        self._world_size = world_size

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self):
        return 0

    def _all_reduce(self, tensors, op):
        n = tf.constant(float(self._world_size))
        return [t * tf.cast(n, t.dtype) if op == "sum" else tf.identity(t) for t in tensors]

    def _all_gather(self, tensor):
        return tf.concat([tensor] * self._world_size, axis=0)

    def _reduce_scatter(self, tensor, op):
        chunk = tensor.shape[0] // self._world_size
        return self._all_reduce([tensor[:chunk]], op)[0]

    def _broadcast(self, tensors, root):
        return [tf.identity(t) for t in tensors]


def _compressed_shapes() -> list[tuple[int, ...]]:
    return [s for s in SHAPES if len(s) >= 2 and tf.TensorShape(s).num_elements()
            >= MIN_COMPRESS_SIZE]


def time_exchange(config, repeats: int = 30, warmup: int = 3, shapes=None) -> dict:
    """Median ms of one exchange of `shapes` (default: the comm suite model's compressed
    tensors) through the compressor `config` (a config, a name or a compressor; None: dense)."""
    shapes = _compressed_shapes() if shapes is None else [tuple(s) for s in shapes]
    comm = LoopbackCommunicator(WORKERS)
    grads = [tf.random.stateless_normal(s, seed=[i, 7]) * 1e-2 for i, s in enumerate(shapes)]
    compressor = compression.get(config) if config else None
    states = [compressor.init_state(tf.TensorShape(s), tf.float32, seed=i)
              for i, s in enumerate(shapes)] if compressor else []

    @tf.function
    def exchange(grads, states, step):
        if compressor is None:
            return fused_all_reduce(comm, grads, "sum"), states
        return reduce_encoded(compressor, grads, states, step, comm, op="sum")

    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        out, states = exchange(grads, states, tf.constant(i, tf.int64))
        _ = [o.numpy() for o in out[:1]]  # the work is done when a result is read
        if i >= warmup:
            times.append(time.perf_counter() - start)
    ms = 1000 * statistics.median(times)
    megabytes = sum(4 * tf.TensorShape(s).num_elements() for s in shapes) / 1e6
    return {"ms": ms, "ms_per_mb": ms / megabytes, "megabytes": megabytes}


def compressor_rows(quick: bool = False, progress=print) -> list[dict]:
    repeats = 10 if quick else 30
    rows = []
    for name, config in COMPRESSORS:
        result = time_exchange(config, repeats=repeats)
        progress(f"bench: compressors: {name}: {result['ms']:.1f} ms per exchange")
        rows.append({"compressor": name, "config": config, **result})
    return rows


def compressor_table(rows: list[dict]) -> str:
    lines = ["| compressor | ms per exchange | ms per MB |", "|---|---:|---:|"]
    lines += [f"| {r['compressor']} | {r['ms']:.1f} | {r['ms_per_mb']:.2f} |" for r in rows]
    shapes = ", ".join(map(str, _compressed_shapes()))
    return (f"One exchange of {rows[0]['megabytes']:.1f} MB of float32 gradient ({shapes}), "
            f"{WORKERS} workers over a loopback communicator (the compressor's own work, no "
            "network):\n\n" + "\n".join(lines))
