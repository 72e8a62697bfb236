"""The link model, in plain arithmetic: what a collective sends and what it costs on a link.

One source for the byte counts of the library (`tfdist.comm` counts with `ring_bytes`), for the
shape rules of the compressors that decide what they send (PowerSGD's matrix view and when it
pays, the sparsifiers' kept count), for `AutoExchange`'s estimate inside a traced step, and for
the planner (`tfdist.plan`). Nothing here imports TensorFlow: the functions take Python numbers
and, where they only add and multiply, tensors too (`link_seconds` inside `AutoExchange`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_BUCKET_BYTES = 25 * 2**20  # measured: docs/guides/compression.md, bucket sizes
MIN_COMPRESS_SIZE = 1024  # elements: smaller gradients are sent dense by default
POWERSGD_MIN_COMPRESSION_RATE = 2.0  # PowerSGD compresses a matrix only where it pays this much


def ring_bytes(kind: str, payload_bytes: float, world_size: int) -> float:
    """Bytes one worker sends for a collective under ring algorithms (see `tfdist.comm`).

    Example:
        ```python
        # a ring all-reduce of 1,000 bytes over 4 workers: each sends 2 x 3/4 of it
        assert tfdist.comm.ring_bytes("all_reduce", 1000, 4) == 1500
        ```
    """
    n = world_size
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * payload_bytes
    if kind in ("reduce_scatter", "broadcast"):
        return (n - 1) / n * payload_bytes
    if kind == "all_gather":
        return float(n - 1) * payload_bytes
    raise ValueError(f"Unknown collective kind: {kind!r}.")


def ring_hops(kind: str, world_size: int) -> int:
    """Messages one worker waits for, one after another, in a ring collective: each adds the
    link's latency. An all-reduce is a reduce-scatter then an all-gather, N - 1 steps each."""
    n = world_size
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def link_seconds(calls, wire_bytes, latency_s, seconds_per_byte):
    """The link model: `calls` collectives of `latency_s` each plus `wire_bytes` at
    `seconds_per_byte`. Takes numbers or tensors (`AutoExchange` evaluates it in the step)."""
    return calls * latency_s + wire_bytes * seconds_per_byte


def gathers_rows(rows: int | None, row_bytes: float, table_bytes: float,
                 world_size: int) -> bool:
    """Whether the dense exchange sends an embedding's gradient as rows: all-gathering each
    worker's `rows` rows (`row_bytes` each, with a 4-byte index) sends fewer bytes than
    all-reducing the whole table. Rows not known when traced (`None`) go as rows. Each worker's
    rows reach the N - 1 others, so past a few workers the table is the cheaper: 1,024 rows of
    256 floats against an 8,192 x 256 table, from 16 workers on."""
    if rows is None:
        return True
    return (ring_bytes("all_gather", rows * (row_bytes + 4), world_size)
            < ring_bytes("all_reduce", table_bytes, world_size))


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """PowerSGD's matrix view of a tensor. Keras kernels keep the output dimension last
    ([kh, kw, in, out], [in, out]): the matrix is [everything else, out]."""
    dims = [int(d) for d in shape]
    return math.prod(dims[:-1]), dims[-1]


def powersgd_rank(shape: Sequence[int], rank: int, min_compression_rate: float) -> int:
    """The rank PowerSGD compresses a tensor of `shape` to, or 0 when it is sent dense (1-D
    tensors, and matrices where n m <= min_compression_rate (n + m) r: it would not pay)."""
    if len(shape) < 2:
        return 0
    n, m = matrix_shape(shape)
    r = min(rank, n, m)
    return r if n * m > min_compression_rate * (n + m) * r else 0


def num_kept(n: int, ratio: float) -> int:
    """How many of n elements a sparsifier with `ratio` keeps (at least one)."""
    return max(1, min(n, math.ceil(ratio * n)))


# Steps to a given accuracy relative to the dense all-reduce, where the benches measured them
# (the comm suite's loss curves on the 5.5M-parameter MLP: PowerSGD rank 2 reached 95% after
# about 2x the dense steps, FP16 after as many; the local_sgd suite: periods up to 8 reached
# synchronous training's accuracy in as many steps on the digits CNN). Exchanges that compute
# the same update as the dense all-reduce (ZeRO, pipelines, synchronous parameter servers, the
# dense all-reduce overlapped) need as many steps by construction. Others are not measured.
STEPS_FACTORS = {"dense": 1.0, "fp16": 1.0, "powersgd:2": 2.0,
                 "local_sgd:2": 1.0, "local_sgd:4": 1.0, "local_sgd:8": 1.0}


def compresses(shape: Sequence[int], min_compress_size: int = MIN_COMPRESS_SIZE,
               compress_1d: bool = False) -> bool:
    """Whether the exchange hands a gradient of `shape` to its compressor (before the
    compressor's own rule, as PowerSGD's): large enough, and a matrix unless `compress_1d`."""
    return math.prod(shape) >= min_compress_size and (len(shape) >= 2 or compress_1d)
