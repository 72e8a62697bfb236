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

With `--hosts N,...` the suite measures the same exchanges in N processes at once for each N,
each over a loopback of N workers (decompressing N payloads), as N emulated hosts sharing the
machine's cores run them: the processes start each compressor's timed calls together and wait
for each other after them. A row's ms is the mean of the processes' medians, `slowest_ms` the
largest; the planner's calibration reads the rows of as many processes as the run it predicts
(`tfdist.plan.Calibration.from_results`).
"""

from __future__ import annotations

import multiprocessing
import queue
import statistics
import time

import tensorflow as tf

from tfdist import compression
from tfdist.comm import Communicator, fused_all_reduce, reduce_encoded

SHAPES = [(64, 2304), (2304,), (2304, 2304), (2304,), (2304, 10), (10,)]
MIN_COMPRESS_SIZE = 1024
WORKERS = 2
TIMEOUT_S = 900  # for all of one process count's exchanges, tracing included
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


def time_exchange(config, repeats: int = 30, warmup: int = 3, shapes=None,
                  workers: int = WORKERS, together=None) -> dict:
    """Median ms of one exchange of `shapes` (default: the comm suite model's compressed
    tensors) through the compressor `config` (a config, a name or a compressor; None: dense),
    over a loopback of `workers`. `together()`, where given, is called before the first timed
    call and after the last (processes measured at once wait for each other there)."""
    shapes = _compressed_shapes() if shapes is None else [tuple(s) for s in shapes]
    comm = LoopbackCommunicator(workers)
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
        if i == warmup and together:
            together()
        start = time.perf_counter()
        out, states = exchange(grads, states, tf.constant(i, tf.int64))
        _ = [o.numpy() for o in out[:1]]  # the work is done when a result is read
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if together:
        together()
    ms = 1000 * statistics.median(times)
    megabytes = sum(4 * tf.TensorShape(s).num_elements() for s in shapes) / 1e6
    return {"ms": ms, "ms_per_mb": ms / megabytes, "megabytes": megabytes}


def compressor_rows(quick: bool = False, progress=print, processes=None) -> list[dict]:
    """One row per compressor, measured in this process (`processes` None) or, for each count
    N of `processes`, in N processes at once (`shared_rows`)."""
    if processes is None:
        return _rows(quick, progress)
    counts = [int(n) for n in processes if str(n).isdigit()]
    if len(counts) != len(processes) or not counts or any(n < 2 for n in counts):
        raise ValueError(f"compressors: --hosts must be process counts of at least 2 (a loopback "
                         f"of N workers each). Received: {processes}; leave it out to measure "
                         "in this process alone")
    return [row for n in counts for row in shared_rows(n, quick, progress)]


def _rows(quick: bool, progress, workers: int = WORKERS, together=None, compressors=None,
          shapes=None) -> list[dict]:
    repeats = 10 if quick else 30
    rows = []
    for name, config in COMPRESSORS if compressors is None else compressors:
        result = time_exchange(config, repeats=repeats, shapes=shapes, workers=workers,
                               together=together)
        progress(f"bench: compressors: {name}: {result['ms']:.1f} ms per exchange")
        rows.append({"compressor": name, "config": config, **result, "processes": 1,
                     "workers": workers})
    return rows


def _process(index: int, processes: int, quick: bool, barrier, results, compressors,
             shapes) -> None:
    """One of `shared_rows`' processes: every exchange over a loopback of `processes` workers;
    the first reports progress."""
    try:
        def progress(line: str) -> None:
            if index == 0:
                print(line.replace("compressors:", f"compressors ({processes} at once), "
                                   "process 0:"), flush=True)

        results.put((index, _rows(quick, progress, processes, lambda: barrier.wait(TIMEOUT_S),
                                  compressors, shapes)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, with the process
        barrier.abort()
        results.put((index, f"{type(e).__name__}: {e}"))


def shared_rows(processes: int, quick: bool = False, progress=print, compressors=None,
                shapes=None) -> list[dict]:
    """Each compressor's exchange (default: COMPRESSORS, of the suite's shapes) in `processes`
    processes at once, each over a loopback of `processes` workers: the mean of the processes'
    medians (`ms`) and the largest (`slowest_ms`). Raises RuntimeError naming the process where
    one fails, or where they do not all finish within TIMEOUT_S."""
    context = multiprocessing.get_context("spawn")  # TensorFlow is not fork-safe
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_process, daemon=True,
                               args=(i, processes, quick, barrier, results, compressors, shapes))
               for i in range(processes)]
    progress(f"bench: compressors: {processes} processes at once, each over a loopback of "
             f"{processes} workers")
    for w in workers:
        w.start()
    deadline = time.monotonic() + TIMEOUT_S
    per_process: dict[int, list[dict] | str] = {}  # a process's rows, or why it failed
    try:
        while len(per_process) < processes:
            try:
                index, rows = results.get(timeout=5)
            except queue.Empty:
                dead = [i for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = (f"process {dead[0]} exited with code {workers[dead[0]].exitcode}"
                           if dead else f"not done after {TIMEOUT_S} s")
                    raise RuntimeError(
                        f"compressors: {processes} processes at once: {why}") from None
                continue
            per_process[index] = rows
        failed = sorted((why.startswith("BrokenBarrierError"), i, why)  # the cause first
                        for i, why in per_process.items() if isinstance(why, str))
        if failed:
            raise RuntimeError(f"compressors: {processes} processes at once: process "
                               f"{failed[0][1]} failed: {failed[0][2]}")
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
                w.join()
    measured = [rows for _, rows in sorted(per_process.items()) if not isinstance(rows, str)]
    merged = []
    for i, first in enumerate(measured[0]):
        medians = [rows[i]["ms"] for rows in measured]
        ms = statistics.mean(medians)
        merged.append({**first, "ms": ms, "ms_per_mb": ms / first["megabytes"],
                       "slowest_ms": max(medians), "processes": processes})
    for r in merged:
        progress(f"bench: compressors ({processes} at once): {r['compressor']}: "
                 f"{r['ms']:.1f} ms per exchange (slowest process {r['slowest_ms']:.1f})")
    return merged


def compressor_table(rows: list[dict]) -> str:
    shapes = ", ".join(map(str, _compressed_shapes()))
    head = (f"One exchange of {rows[0]['megabytes']:.1f} MB of float32 gradient ({shapes}) "
            "over a loopback communicator (the compressor's own work, no network)")
    if all(r.get("processes", 1) == 1 for r in rows):
        lines = ["| compressor | ms per exchange | ms per MB |", "|---|---:|---:|"]
        lines += [f"| {r['compressor']} | {r['ms']:.1f} | {r['ms_per_mb']:.2f} |" for r in rows]
        return f"{head}, {rows[0].get('workers', WORKERS)} workers:\n\n" + "\n".join(lines)
    lines = ["| processes at once | compressor | ms per exchange (mean) | slowest process | "
             "ms per MB |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['processes']} | {r['compressor']} | {r['ms']:.1f} | "
              f"{r.get('slowest_ms', r['ms']):.1f} | {r['ms_per_mb']:.2f} |" for r in rows]
    return (f"{head}; N processes at once, each over a loopback of N workers (the mean of "
            "their medians, and the slowest process's):\n\n" + "\n".join(lines))
