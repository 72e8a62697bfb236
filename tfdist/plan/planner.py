"""Predicted step time, bytes and memory of each algorithm on a cluster that does not exist yet.

`predict(workload, cluster)` prices one step of every algorithm for one worker count, in
plain arithmetic (no TensorFlow, well under a second for 1,024 workers):

- **compute**: the workload's step on one worker (forward, backward, optimizer update) at the
  worker's batch, given or measured on one device (`tfdist plan` measures it where none is
  given).
- **exchange**: the step's collectives on the cluster's links (`tfdist.plan.costs`): a ring
  collective waits for the latency of each of its hops and sends `ring_bytes` at the bandwidth
  of the slowest link the ring crosses (a flat ring over all workers: with several workers per
  host, one hop per direction crosses each host's network link). A `Calibration` adds what the
  engine itself spends per hop and per byte beyond the link (tf.distribute's gRPC ring spends
  more than a 10 Gbit/s link on CPU hosts: `tfdist bench --suite collectives`). tfdist's
  exchange runs after the backward pass, so all of it is exposed; `dense_overlap` prices the
  overlap PyTorch DDP and Horovod's own layer do, for comparison: the backward pass
  (`backward_share` of the compute) hides the exchange but for its last bucket.
- **compressor**: a compressor's own work per MB of gradient, where a calibration measured it
  (`tfdist bench --suite compressors`).
- **bubble**: a pipeline's idle time, (S - 1) / M of the compute for S stages, M micro-batches.

Memory per device is tfdist's own layout (`tfdist.zero.memory_report` measures it): float32
parameters, gradients, the optimizer's slots, what the algorithm keeps (error-feedback
residuals, ZeRO's parameter shard, ZeRO-3's largest gathered layer), and the activations given.

The recommendation is the algorithm with the least time per dense-step-equivalent (step time x
the steps it needs relative to the dense all-reduce) among those that fit the device's memory
and whose steps factor is known (`tfdist.plan.costs.STEPS_FACTORS`: measured by the benches, or
1 for exchanges that compute the dense update exactly). What the model leaves out, it says:
contention between a host's workers for its link, and hierarchical or tree all-reduces (NCCL's
at scale) are not modelled; stragglers and asynchrony are simulated (`tfdist.plan.simulate`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tfdist.arguments import check_choice, check_int, check_number
from tfdist.plan.costs import (
    DEFAULT_BUCKET_BYTES,
    POWERSGD_MIN_COMPRESSION_RATE,
    STEPS_FACTORS,
    compresses,
    gathers_rows,
    link_seconds,
    matrix_shape,
    num_kept,
    powersgd_rank,
    ring_bytes,
    ring_hops,
)

ENGINES = ("tf.distribute", "horovod")
# The families whose update is tfdist.DistributedOptimizer's, fused by default
# (`Workload.update_saving_s`); ZeRO's sharded update, the pipeline's and the servers' are not.
FUSED_UPDATE = frozenset({"dense", "dense_overlap", "fp16", "powersgd", "topk", "local_sgd"})
FLOAT = 4  # bytes of a float32 (and of an int32 index)
HALF = 2  # bytes of a float16
PRECISIONS = ("float32", "mixed")
COMPRESSOR_FAMILIES = ("fp16", "powersgd", "topk")  # the compressors the planner prices


@dataclasses.dataclass(frozen=True)
class Link:
    """A network link, each direction.

    Args:
        gbit_per_s: Bandwidth in Gbit/s (10**9 bits per second).
        latency_us: One-way latency of a message in microseconds (0: not modelled).

    Example:
        ```python
        link = tfdist.plan.Link(gbit_per_s=25, latency_us=10)
        assert link.seconds_per_byte == 8 / 25e9 and link.latency_s == 1e-5
        ```
    """

    gbit_per_s: float
    latency_us: float = 0.0

    def __post_init__(self):
        check_number("gbit_per_s", self.gbit_per_s, 0, low_open=True)
        check_number("latency_us", self.latency_us, 0)

    @property
    def seconds_per_byte(self) -> float:
        return 8.0 / (self.gbit_per_s * 1e9)

    @property
    def latency_s(self) -> float:
        return self.latency_us / 1e6


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The workers and their links.

    Args:
        workers: Number of workers (data-parallel replicas: one per GPU, or per CPU host).
        link: Each host's network link.
        workers_per_host: Workers that share one host (and its link). Defaults to 1.
        intra: The link between workers of one host (NVLink, PCIe, shared memory). Defaults to
            `link`.
        engine: "tf.distribute" (TF_CONFIG workers) or "horovod". ZeRO's reduce-scatter is a
            true one on Horovod and an all-reduce that keeps the local chunk across TF_CONFIG
            workers (twice its bytes).
        device_memory: Bytes of one device's memory; algorithms that need more are not
            recommended. None: not checked.

    Example:
        ```python
        # 64 GPUs, 8 per host on a 300 Gbit/s fabric, hosts on 25 Gbit/s Ethernet
        cluster = tfdist.plan.Cluster(64, tfdist.plan.Link(25), workers_per_host=8,
                                      intra=tfdist.plan.Link(300), device_memory=24 * 10**9)
        assert cluster.hosts == 8 and cluster.ring_link().gbit_per_s == 25  # the slowest hop
        ```
    """

    workers: int
    link: Link
    workers_per_host: int = 1
    intra: Link | None = None
    engine: str = "tf.distribute"
    device_memory: int | None = None

    def __post_init__(self):
        check_int("workers", self.workers, 1)
        check_int("workers_per_host", self.workers_per_host, 1)
        check_choice("engine", self.engine, ENGINES)
        if self.device_memory is not None:
            check_int("device_memory", self.device_memory, 1)

    @property
    def hosts(self) -> int:
        return -(-self.workers // self.workers_per_host)

    def ring_link(self, workers: int | None = None) -> Link:
        """The slowest link a ring over `workers` workers (all, by default) crosses."""
        n = self.workers if workers is None else workers
        intra = self.intra or self.link
        if n <= self.workers_per_host:
            return intra
        return Link(min(intra.gbit_per_s, self.link.gbit_per_s),
                    max(intra.latency_us, self.link.latency_us))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What an engine and the compressors spend beyond the link, measured on a machine.

    Args:
        hop_s: The engine's own time per hop of a ring collective.
        seconds_per_byte: The engine's own time per byte sent, beyond the link's.
        compressor_ms_per_mb: A compressor family's ("fp16", "powersgd", "topk") work per MB
            (10**6 bytes) of gradient.
        source: Where the figures come from.
        processes: How many processes shared the machine when the engine's costs were measured
            (0: not known).
        compressor_processes: How many processes shared it when the compressors' were (0: not
            known).

    Example:
        ```python
        # what `Calibration.from_results(DIR)` fits from your own benchmark JSON, given by hand
        calibration = tfdist.plan.Calibration(hop_s=2e-3, seconds_per_byte=4e-9,
                                              compressor_ms_per_mb={"fp16": 0.25})
        plan = tfdist.plan.predict(tfdist.plan.Workload.from_parameters(1_000_000, 0.05),
                                   tfdist.plan.Cluster(2, tfdist.plan.Link(10)), ["fp16"],
                                   calibration=calibration)
        fp16 = plan.estimates[0]
        assert abs(fp16.compressor_s - 0.25e-3 * 4) < 1e-12  # 4 MB of gradients
        ```
    """

    hop_s: float = 0.0
    seconds_per_byte: float = 0.0
    compressor_ms_per_mb: Mapping[str, float] = dataclasses.field(default_factory=dict)
    source: str = "none: the links alone"
    processes: int = 0
    compressor_processes: int = 0

    @classmethod
    def from_results(cls, directory: str | Path, engine: str = "tf.distribute",
                     processes: int | None = None) -> Calibration:
        """Fits `engine`'s per-hop and per-byte cost to the collectives suite's whole all-reduces
        (`collectives.json`) between `processes` processes where it has them, else between the
        fewest, and reads the compressors suite's work per MB (`compressors.json`) measured in
        as many processes at once where it has them, else in the fewest; both from `directory`
        (e.g. docs/benchmarks/data). A file that is missing leaves its part at 0."""
        check_choice("engine", engine, ENGINES)
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"Calibration directory {str(directory)!r} does not exist: give "
                             "the directory where `tfdist bench --suite collectives` and "
                             "`--suite compressors` wrote their JSON (e.g. docs/benchmarks/data)")
        hop_s = per_byte = 0.0
        fitted = 0
        sources = []
        collectives = directory / "collectives.json"
        if collectives.exists():
            data = json.loads(collectives.read_text())
            rows = [r for r in data["rows"] if r["transport"] == engine and r["splits"] == 1]
            if rows:
                fitted = _measured_at({r["processes"] for r in rows}, processes)
                points = sorted((ring_bytes("all_reduce", r["size_mb"] * 1e6, fitted),
                                 r["median_ms"] / 1e3) for r in rows if r["processes"] == fitted)
                per_call, per_byte = _line(points)
                hop_s = max(per_call, 0.0) / ring_hops("all_reduce", fitted)
                sources.append(f"{collectives.name} ({fitted} processes, "
                               f"{data.get('date', '?')}, {data.get('machine', '?')})")
        per_mb = {}
        measured_in = 0
        compressors = directory / "compressors.json"
        if compressors.exists():
            data = json.loads(compressors.read_text())
            measured_in = _measured_at({r.get("processes", 1) for r in data["rows"]},
                                       processes)
            for row in data["rows"]:
                name = (row.get("config") or {}).get("name")
                if name in COMPRESSOR_FAMILIES and name not in per_mb \
                        and row.get("processes", 1) == measured_in:
                    per_mb[name] = float(row["ms_per_mb"])
            sources.append(f"{compressors.name} ({measured_in} "
                           f"process{'es' if measured_in > 1 else ''}, {data.get('date', '?')})")
        return cls(hop_s, max(per_byte, 0.0), per_mb,
                   ", ".join(sources) or f"none found in {directory}", fitted, measured_in)


def _measured_at(counts: set[int], wanted: int | None) -> int:
    """The process count of a calibration's rows to read: `wanted` where measured, else the
    fewest."""
    return wanted if wanted is not None and wanted in counts else min(counts)


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(per call, per byte) from (bytes, seconds) points sorted by bytes: the slope between the
    two largest (where bytes dominate), the intercept from the smallest (where calls do)."""
    if len(points) == 1:
        x, y = points[0]
        return 0.0, y / x
    (x1, y1), (x2, y2) = points[-2:]
    slope = (y2 - y1) / (x2 - x1)
    x0, y0 = points[0]
    return y0 - slope * x0, slope


@dataclasses.dataclass
class Workload:
    """One worker's share of a training step.

    Args:
        shapes: The trainable variables' shapes.
        compute_s: Seconds of one worker's step with no exchange (forward, backward, update).
        optimizer_slots: Per-parameter state of the optimizer (Adam 2, momentum 1, SGD 0).
        activation_bytes: Activations a worker keeps for its backward pass (0: not counted).
        boundary_bytes: The activation tensor at a pipeline stage boundary, for a worker's batch
            (0: not counted).
        backward_share: The backward pass's share of `compute_s` (what an overlapped exchange
            can hide). Defaults to 2/3.
        layers: Layers with weights (ZeRO-3 gathers per layer). Defaults to the number of
            tensors with 2 or more dimensions.
        name: How tables name it (default: its parameter count).
        precision: `"float32"` (the default: parameters, gradients and optimizer state in
            float32, as tfdist and Keras keep them, `mixed_float16` included) or `"mixed"`: the
            ZeRO paper's and DeepSpeed's mixed precision, float16 parameters and gradients (the
            exchanges send float16) with a float32 master copy of the parameters kept beside
            the optimizer state (Adam: 12 bytes of state per parameter).
        shapes_known: False where `shapes` stands for a parameter count alone
            (`from_parameters`): every gradient is then taken as compressible, and PowerSGD
            (which needs the matrices) is left out.
        update_saving_s: Seconds of `compute_s` that tfdist's fused optimizer update saves
            (`DistributedOptimizer(fused_update=True)`, the default: Adam, AdamW and SGD in one
            kernel or compiled function per device) against the per-variable update that
            `compute_s` was measured with, e.g. Keras' update minus the fused one in
            `tfdist bench --suite overhead`. The exchanges of `tfdist.DistributedOptimizer`
            (dense, FP16, PowerSGD, top-k, local SGD) price their compute without it; ZeRO,
            the pipeline and the parameter servers keep `compute_s`. 0 (the default): not
            known, or `compute_s` was measured with the fused update.
        sparse_rows: For each variable in `shapes`' order, the rows its gradient holds when it
            comes as rows (`tf.IndexedSlices`: an embedding table, one row per id a worker's
            batch looks up, repeats included), 0 for a dense gradient; empty (the default):
            every gradient dense. The dense exchange all-gathers such rows with their int32
            indices, what each worker holds, instead of all-reducing the table
            (`tfdist.comm.sparse_all_reduce`), where that sends fewer bytes
            (`tfdist.plan.costs.gathers_rows`); the compressors, local SGD, ZeRO, the pipeline
            and the servers send the whole table. `from_keras(model, ..., batch=B)` counts
            them.
        input_s: Seconds one worker's input pipeline needs per step (reading and decoding its
            examples on the cores it has for them, e.g. `tfdist plan --decode-ms`). It runs
            beside the step (tf.data reads ahead), so a step takes at least this long, whatever
            the exchange. 0 (the default): not counted.

    Example:
        ```python
        model = build_model()
        work = tfdist.plan.Workload.from_keras(model, compute_s=0.002)
        assert work.parameters == model.count_params() and work.optimizer_slots == 2
        ```
    """

    shapes: tuple[tuple[int, ...], ...]
    compute_s: float
    optimizer_slots: int = 2
    activation_bytes: int = 0
    boundary_bytes: int = 0
    backward_share: float = 2 / 3
    layers: int | None = None
    name: str = ""
    shapes_known: bool = True
    precision: str = "float32"
    update_saving_s: float = 0.0
    sparse_rows: tuple[int, ...] = ()
    input_s: float = 0.0

    def __post_init__(self):
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        if not shapes or any(d < 1 for s in shapes for d in s):
            raise ValueError(f"`shapes` must be the trainable variables' shapes, each dimension "
                             f">= 1. Received: shapes={self.shapes!r}")
        self.shapes = shapes
        self.name = self.name or f"{sum(math.prod(s) for s in shapes):,} parameters"
        check_number("compute_s", self.compute_s, 0)
        check_int("optimizer_slots", self.optimizer_slots, 0)
        check_int("activation_bytes", self.activation_bytes, 0)
        check_int("boundary_bytes", self.boundary_bytes, 0)
        check_number("backward_share", self.backward_share, 0, 1)
        check_choice("precision", self.precision, PRECISIONS)
        check_number("update_saving_s", self.update_saving_s, 0)
        check_number("input_s", self.input_s, 0)
        self.sparse_rows = tuple(int(r) for r in self.sparse_rows)
        if self.sparse_rows and (len(self.sparse_rows) != len(shapes)
                                 or any(r < 0 for r in self.sparse_rows)):
            raise ValueError(f"`sparse_rows` must give one row count >= 0 per shape "
                             f"({len(shapes)}), 0 for a dense gradient, or be empty. Received: "
                             f"sparse_rows={self.sparse_rows!r}")
        if self.update_saving_s > self.compute_s:
            raise ValueError(f"`update_saving_s` ({self.update_saving_s:g} s) cannot exceed "
                             f"`compute_s` ({self.compute_s:g} s), the step it is part of")

    @classmethod
    def from_parameters(cls, parameters: int, compute_s: float, **kwargs) -> Workload:
        """A workload known by its parameter count alone: every gradient is taken as
        compressible, and PowerSGD (which needs the matrices) is left out."""
        check_int("parameters", parameters, 1)
        return cls(((parameters,),), compute_s, shapes_known=False, **kwargs)

    @classmethod
    def from_keras(cls, model, compute_s: float, batch: int | None = None,
                   **kwargs) -> Workload:
        """The trainable shapes of a built Keras model; with `batch` (the examples of one
        worker's step), its embeddings' gradients as the rows that batch looks up
        (`embedding_rows`)."""
        shapes = tuple(tuple(v.shape) for v in model.trainable_variables)
        kwargs.setdefault("name", model.name)
        if batch is not None:
            kwargs.setdefault("sparse_rows", embedding_rows(model, check_int("batch", batch, 1)))
        return cls(shapes, compute_s, **kwargs)

    @property
    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def parameters(self) -> int:
        return sum(self.sizes)

    @property
    def rows(self) -> tuple[int, ...]:
        """`sparse_rows`, one count per shape (0: dense)."""
        return self.sparse_rows or (0,) * len(self.shapes)

    @property
    def weighted_layers(self) -> int:
        if self.layers is not None:
            return self.layers
        return max(1, sum(1 for s in self.shapes if len(s) >= 2))


def embedding_rows(model, batch: int) -> tuple[int, ...]:
    """For each of a built Keras model's trainable variables, the rows of its gradient when it
    comes as rows: an `Embedding`'s table, `batch` times the ids one example looks up (its
    input's size, where the functional graph fixes it); 0 for every other variable.

    Example:
        ```python
        inputs = keras.Input((6,), dtype="int32")
        outputs = keras.layers.Dense(2)(keras.layers.Embedding(50, 4)(inputs))
        model = keras.Model(inputs, outputs)
        assert tfdist.plan.embedding_rows(model, 8) == (48, 0, 0)  # table, kernel, bias
        ```
    """
    import keras

    from tfdist._hooks.variables import nested_layers

    per_example = {}
    for layer in nested_layers(model):
        if isinstance(layer, keras.layers.Embedding):
            try:
                dims = layer.input.shape[1:]
            except (AttributeError, ValueError):  # not called in a functional graph
                continue
            if all(d is not None for d in dims):
                per_example[id(layer.embeddings)] = math.prod(dims)
    return tuple(batch * per_example.get(id(v), 0) for v in model.trainable_variables)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One algorithm's predicted step on the cluster. Times in seconds; bytes per worker per
    step (sent, ring model); memory per device, by kind, in bytes.

    Example:
        ```python
        plan = tfdist.plan.predict(tfdist.plan.Workload.from_keras(build_model(), 0.002),
                                   tfdist.plan.Cluster(8, tfdist.plan.Link(1)))
        dense = next(e for e in plan.estimates if e.algorithm == "dense")
        assert dense.step_s == dense.compute_s + dense.exchange_s
        print(f"{dense.step_s * 1e3:.2f} ms, {dense.wire_bytes:,.0f} bytes sent per step, "
              f"{dense.memory_bytes:,} bytes per device")
        ```
    """

    algorithm: str
    label: str
    step_s: float
    compute_s: float
    exchange_s: float
    compressor_s: float
    bubble_s: float
    wire_bytes: float
    calls: float
    memory: Mapping[str, int]
    steps_factor: float | None
    note: str = ""

    @property
    def memory_bytes(self) -> int:
        return sum(self.memory.values())

    @property
    def dense_step_equivalent_s(self) -> float | None:
        """Step time x steps factor: the time a dense step's worth of progress takes."""
        return None if self.steps_factor is None else self.step_s * self.steps_factor

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "memory": dict(self.memory),
                "memory_bytes": self.memory_bytes,
                "dense_step_equivalent_s": self.dense_step_equivalent_s}


@dataclasses.dataclass(frozen=True)
class Plan:
    """`predict`'s answer: every algorithm's estimate, the recommendation with its reason, and
    the algorithms left out with why (a pipeline whose stages do not divide the workers).

    Example:
        ```python
        plan = tfdist.plan.predict(tfdist.plan.Workload.from_parameters(5_000_000, 0.05),
                                   tfdist.plan.Cluster(6, tfdist.plan.Link(1)))
        print(plan.table())  # Markdown, one row per algorithm
        print(plan.best.label, "-", plan.reason)
        assert "pipeline:4x8" in plan.left_out  # 4 stages do not divide 6 workers
        ```
    """

    workload: Workload
    cluster: Cluster
    calibration: Calibration
    estimates: tuple[Estimate, ...]
    best: Estimate | None
    reason: str
    left_out: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def table(self) -> str:
        """The estimates as a Markdown table."""
        lines = ["| algorithm | step (ms) | compute | exchange | compressor | bubble | "
                 "bytes/worker/step | calls | memory/device (MB) | steps factor | "
                 "per dense step (ms) |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in self.estimates:
            per_dense = e.dense_step_equivalent_s
            fits = self.cluster.device_memory is None or e.memory_bytes <= \
                self.cluster.device_memory
            lines.append(
                f"| {e.label}{' **(recommended)**' if e is self.best else ''}"
                f"{'' if fits else ' (does not fit)'} | {e.step_s * 1e3:,.1f} | "
                f"{e.compute_s * 1e3:,.1f} | {e.exchange_s * 1e3:,.1f} | "
                f"{e.compressor_s * 1e3:,.1f} | {e.bubble_s * 1e3:,.1f} | "
                f"{e.wire_bytes:,.0f} | {e.calls:g} | {e.memory_bytes / 1e6:,.1f} | "
                f"{'not measured' if e.steps_factor is None else f'{e.steps_factor:g}'} | "
                f"{'' if per_dense is None else f'{per_dense * 1e3:,.1f}'} |")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"workload": {"name": self.workload.name, "parameters": self.workload.parameters,
                             "compute_s": self.workload.compute_s,
                             "update_saving_s": self.workload.update_saving_s,
                             "optimizer_slots": self.workload.optimizer_slots,
                             "precision": self.workload.precision},
                "cluster": dataclasses.asdict(self.cluster),
                "calibration": dataclasses.asdict(self.calibration) | {
                    "compressor_ms_per_mb": dict(self.calibration.compressor_ms_per_mb)},
                "estimates": [e.as_dict() for e in self.estimates],
                "recommended": None if self.best is None else self.best.algorithm,
                "reason": self.reason, "left_out": dict(self.left_out)}


DEFAULT_ALGORITHMS = ("dense", "dense_overlap", "fp16", "powersgd:2", "powersgd:4",
                      "topk:0.01", "local_sgd:8", "zero1", "zero2", "zero3", "pipeline:4x8",
                      "ps:1", "ps:n/8")
SPEC_HELP = ("dense, dense_overlap, fp16, powersgd:RANK, topk:RATIO, local_sgd:PERIOD, zero1, "
             "zero2, zero3, pipeline:STAGESxMICROBATCHES, ps:SERVERS (a number, or n/D: the "
             "workers divided by D)")


class _Pricer:
    """The shared arithmetic of one workload on one cluster."""

    def __init__(self, workload: Workload, cluster: Cluster, calibration: Calibration):
        self.w, self.c, self.cal = workload, cluster, calibration
        self.n = cluster.workers
        self.p = workload.parameters
        # bytes of one parameter or gradient, and of the float32 master copy mixed precision keeps
        self.value, self.master = (FLOAT, 0) if workload.precision == "float32" else (HALF, FLOAT)
        self.grad_bytes = self.value * self.p

    def collective(self, kind: str, payload: float, calls: float = 1.0,
                   workers: int | None = None) -> tuple[float, float]:
        """(seconds, wire bytes) of `calls` ring collectives moving `payload` bytes in all."""
        n = self.n if workers is None else workers
        link = self.c.ring_link(n)
        wire = ring_bytes(kind, payload, n)
        hop = link.latency_s + self.cal.hop_s
        seconds = link_seconds(calls * ring_hops(kind, n), wire, hop,
                               link.seconds_per_byte + self.cal.seconds_per_byte)
        return seconds, wire

    def compressor(self, family: str) -> float:
        # calibrated per MB of float32 gradient: a compressor's work goes with the elements
        return self.cal.compressor_ms_per_mb.get(family, 0.0) * FLOAT * self.p / 1e6 / 1e3

    def memory(self, parameters: float, gradients: float, state: float, kept: float = 0.0):
        return {"parameters": int(parameters), "gradients": int(gradients),
                "optimizer_state": int(state), "algorithm_state": int(kept),
                "activations": self.w.activation_bytes}

    def state_bytes(self, elements: float) -> float:
        """The optimizer state of `elements` parameters, the master copy included."""
        return (FLOAT * self.w.optimizer_slots + self.master) * elements

    def dense_memory(self, kept: float = 0.0):
        b = self.grad_bytes
        return self.memory(b, b, self.state_bytes(self.p), kept)

    def buckets(self, nbytes: float) -> int:
        return max(1, math.ceil(nbytes / DEFAULT_BUCKET_BYTES))

    def estimate(self, algorithm, label, *, exchange=0.0, compressor=0.0, bubble=0.0, wire=0.0,
                 calls=0.0, memory=None, factor=None, note="") -> Estimate:
        compute = self.w.compute_s
        if algorithm.split(":")[0] in FUSED_UPDATE:
            compute -= self.w.update_saving_s
        return Estimate(algorithm, label, compute + exchange + compressor + bubble, compute,
                        exchange, compressor, bubble, wire, calls,
                        memory or self.dense_memory(), factor, note)


def _dense(pr: _Pricer, spec: str, arg: str | None) -> Estimate:
    # each embedding's rows, with their int32 indices, in one all-gather where that sends less
    # than the table (float16 rows travel apart from their indices: two); the rest in buckets
    gathered, dense = [], pr.grad_bytes
    for shape, rows in zip(pr.w.shapes, pr.w.rows):
        row = pr.value * math.prod(shape[1:])
        if rows and gathers_rows(rows, row, row * shape[0], pr.n):
            gathered.append((rows, row))
            dense -= row * shape[0]
    calls = pr.buckets(dense) if dense else 0
    seconds, wire = pr.collective("all_reduce", dense, calls) if dense else (0.0, 0.0)
    for rows, row in gathered:
        gather_calls = 1 if pr.value == FLOAT else 2
        s, b = pr.collective("all_gather", rows * (row + FLOAT), gather_calls)
        seconds, wire, calls = seconds + s, wire + b, calls + gather_calls
    tables = sum(1 for rows in pr.w.rows if rows)
    whole = tables - len(gathered)
    rows_note = "; ".join(filter(None, [
        f"{len(gathered)} of {tables} embedding table(s) sent as the rows the batch looks up"
        if gathered else "",
        f"{whole} of {tables} sent whole: every worker's rows would send more" if whole else ""]))
    if spec == "dense":
        return pr.estimate(spec, "dense all-reduce",
                           exchange=seconds, wire=wire, calls=calls,
                           factor=STEPS_FACTORS["dense"], note=rows_note)
    hidden = pr.w.backward_share * pr.w.compute_s
    exposed = max(seconds - hidden, seconds / max(calls, 1))  # never the last bucket
    note = ("the backward pass hides all but the last bucket, as DDP and Horovod's own layer do; "
            "tfdist's exchange starts after the backward pass")
    return pr.estimate(spec, "dense all-reduce, overlapped (DDP-style)", exchange=exposed, wire=wire,
                       calls=calls, factor=STEPS_FACTORS["dense"],
                       note="; ".join(filter(None, [note, rows_note])))


def _split(pr: _Pricer, rule=lambda shape: True) -> tuple[list[tuple[int, ...]], int]:
    """(the shapes the exchange compresses, the elements it sends dense): the exchange's
    size rule (`costs.compresses`, default options) and the compressor's own `rule`."""
    compressed, dense = [], 0
    for shape, size in zip(pr.w.shapes, pr.w.sizes, strict=True):
        if not pr.w.shapes_known or compresses(shape) and rule(shape):
            compressed.append(shape)
        else:
            dense += size
    return compressed, dense


def _sum(pr: _Pricer, payloads: Sequence[float]) -> tuple[float, float, int]:
    """(seconds, wire bytes, calls) of one all-reduce per non-empty payload (bytes)."""
    seconds = wire = 0.0
    calls = 0
    for nbytes in payloads:
        if nbytes:
            s, b = pr.collective("all_reduce", nbytes)
            seconds, wire, calls = seconds + s, wire + b, calls + 1
    return seconds, wire, calls


def _fp16(pr: _Pricer, spec: str, arg: str | None) -> Estimate:
    compressed, dense = _split(pr)
    half = HALF * sum(math.prod(s) for s in compressed)
    seconds, wire, calls = _sum(pr, [pr.value * dense, half])
    return pr.estimate(spec, "FP16 all-reduce", exchange=seconds, wire=wire, calls=calls,
                       compressor=pr.compressor("fp16"), factor=STEPS_FACTORS["fp16"])


def _powersgd(pr: _Pricer, spec: str, arg: str | None) -> Estimate | str:
    rank = check_int("powersgd rank", int(arg or 2), 1)
    rate = POWERSGD_MIN_COMPRESSION_RATE  # PowerSGD's default
    compressed, dense = _split(pr, lambda shape: powersgd_rank(shape, rank, rate) > 0)
    if not compressed or not pr.w.shapes_known:
        return "no tensor is a matrix worth compressing (give the model's shapes, not a "\
               "parameter count)"
    p_elems = q_elems = kept = 0
    for shape in compressed:
        rows, cols = matrix_shape(shape)
        r = powersgd_rank(shape, rank, rate)
        p_elems, q_elems, kept = p_elems + rows * r, q_elems + cols * r, kept + rows * cols
    # one all-reduce of the dense rest, one of every P, one of every Q
    seconds, wire, calls = _sum(pr, [pr.value * dense, pr.value * p_elems, pr.value * q_elems])
    return pr.estimate(spec, f"PowerSGD rank {rank}", exchange=seconds, wire=wire, calls=calls,
                       compressor=pr.compressor("powersgd"),
                       memory=pr.dense_memory(pr.value * (kept + q_elems)),  # residuals and Q
                       factor=STEPS_FACTORS.get(f"powersgd:{rank}"))


def _topk(pr: _Pricer, spec: str, arg: str | None) -> Estimate:
    ratio = check_number("topk ratio", float(arg or 0.01), 0, 1, low_open=True)
    compressed, dense = _split(pr)
    kept = sum(num_kept(math.prod(s), ratio) for s in compressed)
    # the dense rest with one flag (a worker's non-finite input) in one all-reduce; the kept
    # values and their int32 indices in one all-gather
    seconds, wire, calls = _sum(pr, [pr.value * (dense + 1)])
    s, b = pr.collective("all_gather", (pr.value + FLOAT) * kept)
    return pr.estimate(spec, f"EF-TopK {ratio:g}", exchange=seconds + s, wire=wire + b,
                       calls=calls + 1, compressor=pr.compressor("topk"),
                       memory=pr.dense_memory(pr.value * sum(math.prod(s) for s in compressed)),
                       factor=None)


def _local_sgd(pr: _Pricer, spec: str, arg: str | None) -> Estimate:
    period = check_int("local_sgd period", int(arg or 8), 1)
    calls = pr.buckets(pr.grad_bytes)
    seconds, wire = pr.collective("all_reduce", pr.grad_bytes, calls)
    return pr.estimate(spec, f"local SGD, H={period}", exchange=seconds / period,
                       wire=wire / period, calls=calls / period,
                       factor=STEPS_FACTORS.get(f"local_sgd:{period}"),
                       note="the models are averaged every H steps; the steps between are local")


def _zero(pr: _Pricer, spec: str, arg: str | None) -> Estimate:
    stage = int(spec[-1])
    n = pr.n
    scatter = "reduce_scatter" if pr.c.engine == "horovod" else "all_reduce"
    if stage < 3:
        elements = -(-pr.p // n)
        shard = pr.value * elements
        # the padded flat vector, each shard with its count of non-finite replicas
        s1, b1 = pr.collective(scatter, pr.value * n * (elements + 1))
        s2, b2 = pr.collective("all_gather", shard)
        gradients = pr.grad_bytes if stage == 1 else shard
        # float32: the shard a worker updates is a copy; mixed: it is the master copy (state)
        updated = 0 if pr.master else FLOAT * elements
        return pr.estimate(spec, f"ZeRO-{stage}", exchange=s1 + s2, wire=b1 + b2, calls=2,
                           memory=pr.memory(pr.grad_bytes, gradients, pr.state_bytes(elements),
                                            updated),
                           factor=1.0)
    elements = sum(-(-size // n) for size in pr.w.sizes)
    shard = pr.value * elements
    layers = pr.w.weighted_layers
    s1, b1 = pr.collective("all_gather", 2 * shard, calls=2 * layers)  # forward, backward
    s2, b2 = pr.collective(scatter, pr.grad_bytes, calls=layers)
    return pr.estimate(spec, "ZeRO-3", exchange=s1 + s2, wire=b1 + b2, calls=3 * layers,
                       memory=pr.memory(shard, shard, pr.state_bytes(elements),
                                        pr.value * max(pr.w.sizes)),
                       factor=1.0, note="a layer's parameters are gathered before it runs")


def _pipeline(pr: _Pricer, spec: str, arg: str | None) -> Estimate | str:
    try:
        stages, micro = (int(x) for x in (arg or "4x8").lower().split("x"))
    except ValueError:
        raise ValueError(f"pipeline: give STAGESxMICROBATCHES, e.g. pipeline:4x8. "
                         f"Received: {spec}:{arg}") from None
    check_int("pipeline stages", stages, 1)
    check_int("pipeline micro-batches", micro, 1)
    if pr.n % stages:
        return f"{stages} stages do not divide {pr.n} workers"
    replicas = pr.n // stages
    stage_bytes = pr.grad_bytes / stages
    calls = pr.buckets(stage_bytes)
    seconds, wire = pr.collective("all_reduce", stage_bytes, calls, workers=replicas)
    boundary = pr.w.boundary_bytes
    sends = 2 * boundary * pr.c.ring_link().seconds_per_byte if stages > 1 else 0.0
    bubble = pr.w.compute_s * (stages - 1) / micro
    note = "" if boundary else "activations between stages not counted: give boundary_bytes"
    return pr.estimate(f"pipeline:{stages}x{micro}", f"pipeline {stages}x{micro}, {replicas} "
                       f"replicas", exchange=seconds + sends,
                       bubble=bubble, wire=wire + 2 * boundary, calls=calls,
                       memory=pr.memory(stage_bytes, stage_bytes, pr.state_bytes(pr.p / stages)),
                       factor=1.0, note=note)


def _ps(pr: _Pricer, spec: str, arg: str | None) -> Estimate:
    text = arg or "1"
    if text.startswith("n/"):
        servers = -(-pr.n // check_int("ps divisor", int(text[2:]), 1))
    else:
        servers = check_int("ps servers", int(text), 1)
    link = pr.c.link
    per_byte = link.seconds_per_byte + pr.cal.seconds_per_byte
    host_bytes = min(pr.c.workers_per_host, pr.n) * pr.grad_bytes
    server_bytes = pr.n * pr.grad_bytes / servers
    seconds = 2 * (max(host_bytes, server_bytes) * per_byte + link.latency_s + pr.cal.hop_s)
    return pr.estimate(f"ps:{servers}", f"{servers} parameter server(s), synchronous",
                       exchange=seconds, wire=pr.grad_bytes, calls=2 * servers,
                       memory=pr.memory(pr.grad_bytes, pr.grad_bytes, 0), factor=1.0,
                       note="push then pull through the busiest link; the optimizer state "
                            "lives on the servers")


_FAMILY = {"dense": _dense, "dense_overlap": _dense, "fp16": _fp16, "powersgd": _powersgd,
           "topk": _topk, "local_sgd": _local_sgd, "zero1": _zero, "zero2": _zero,
           "zero3": _zero, "pipeline": _pipeline, "ps": _ps}


def _price(pricer: _Pricer, spec: str) -> Estimate | str:
    """One spec's estimate on `pricer`, or why it does not apply; a bad spec is refused."""
    family, _, arg = str(spec).partition(":")
    if family not in _FAMILY:
        raise ValueError(f"Unknown algorithm {spec!r}. Choose from: {SPEC_HELP}")
    try:
        return _FAMILY[family](pricer, family, arg or None)
    except ValueError as e:
        raise ValueError(f"Algorithm {spec!r}: {e}. Specs: {SPEC_HELP}") from None


def check_algorithms(specs: Sequence[str]) -> list[str]:
    """The specs, each checked on a small workload before anything else runs: an unknown
    family or a bad argument is refused by name."""
    probe = _Pricer(Workload(((8, 8),), 0.0), Cluster(8, Link(1.0)), Calibration())
    for spec in specs:
        _price(probe, spec)
    return [str(spec) for spec in specs]


def predict(workload: Workload, cluster: Cluster,
            algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
            calibration: Calibration | None = None) -> Plan:
    """Every algorithm's predicted step on `cluster`, and the recommendation.

    Args:
        workload: The model's shapes and one worker's compute step.
        cluster: The workers, their links and memory.
        algorithms: Specs, from `SPEC_HELP`. Those that do not apply (a pipeline whose stages
            do not divide the workers, PowerSGD on a model known by its parameter count) are
            left out, with why, in `Plan.left_out`.
        calibration: The engine's and compressors' own costs (`Calibration.from_results`).
            Defaults to none: the links alone, as for GPUs whose collectives reach the link.

    Example:
        ```python
        from tfdist.plan import Cluster, Link, Workload, predict

        # 25M parameters, 300 ms of compute per step, 64 workers, 8 per host, 25 Gbit/s
        plan = predict(Workload.from_parameters(25_000_000, 0.3),
                       Cluster(64, Link(25, latency_us=10), workers_per_host=8,
                               intra=Link(300)))
        print(plan.table())
        print(plan.best.algorithm, plan.reason)
        ```
    """
    calibration = calibration or Calibration()
    pricer = _Pricer(workload, cluster, calibration)
    estimates: list[Estimate] = []
    left_out: dict[str, str] = {}
    for spec in algorithms:
        estimate = _price(pricer, spec)
        if isinstance(estimate, str):
            left_out[spec] = estimate
        elif all(e.algorithm != estimate.algorithm for e in estimates):  # ps:1 and ps:n/8 at 8
            estimates.append(estimate)
    if not estimates:
        raise ValueError(f"No algorithm applies: {left_out}")
    estimates = [_fed(e, workload.input_s) for e in estimates]
    best, reason = _recommend(estimates, cluster)
    if best is not None and best.step_s == workload.input_s:
        reason = (f"input, not the exchange, bounds the step: the input pipeline needs "
                  f"{workload.input_s * 1e3:,.1f} ms per step; decode on more cores or off the "
                  f"trainers (docs/guides/data.md); {reason}")
    return Plan(workload, cluster, calibration, tuple(estimates), best, reason, left_out)


def _fed(estimate: Estimate, input_s: float) -> Estimate:
    """`estimate` with its input: a step no shorter than the input pipeline's `input_s`."""
    if input_s <= estimate.step_s:
        return estimate
    note = (f"input bound: {estimate.step_s * 1e3:,.1f} ms of step waits for "
            f"{input_s * 1e3:,.1f} ms of input")
    return dataclasses.replace(estimate, step_s=input_s,
                               note=f"{estimate.note}; {note}" if estimate.note else note)


def _recommend(estimates: list[Estimate], cluster: Cluster) -> tuple[Estimate | None, str]:
    memory = cluster.device_memory
    if memory is not None and all(e.memory_bytes > memory for e in estimates):
        return None, (f"no algorithm fits {memory / 1e9:.1f} GB per device: the least needs "
                      f"{min(e.memory_bytes for e in estimates) / 1e9:.2f} GB")
    fits = [e for e in estimates if memory is None or e.memory_bytes <= memory]
    known = [(e.step_s * e.steps_factor, e) for e in fits if e.steps_factor is not None]
    if not known:
        return None, "no algorithm that fits has a measured steps factor"
    known.sort(key=lambda pair: pair[0])
    cost, best = known[0]
    why = (f"least time per dense-step-equivalent: {best.step_s * 1e3:,.1f} ms per step x "
           f"{best.steps_factor:g} = {cost * 1e3:,.1f} ms")
    if len(known) > 1:
        second_cost, second = known[1]
        why += (f"; next: {second.label}, {second_cost * 1e3:,.1f} ms "
                f"({second_cost / cost:.2f}x)")
    if memory is not None and len(fits) < len(estimates):
        why += (f"; {len(estimates) - len(fits)} algorithm(s) do not fit {memory / 1e9:.1f} GB "
                "per device")
    return best, why
