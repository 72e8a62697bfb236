"""`tfdist bench --suite collectives`: one all-reduce, over each transport tfdist runs on.

Measures the collective alone, without a model: N processes on 127.0.0.1 (no emulated link, no
rate limit) all-reduce (sum) one float32 tensor of S MB (MB = 10^6 bytes), whole or split into K
equal parts with one all-reduce call each (as buckets are), over
  * tf.distribute's collectives (`CollectiveAllReduce`, TF's gRPC ring on CPU): N TF_CONFIG
    workers of `tfdist.MultiWorkerMirroredStrategy`, through `tfdist.comm.ReplicaCommunicator`,
    the calls Keras and tfdist's tf.distribute engine make;
  * Horovod's Gloo: N `horovodrun --gloo` ranks, through `tfdist.comm.HorovodCommunicator`
    (skipped, with a note, where Horovod is not installed).
Each call is a traced `tf.function` that returns two elements of the sum (no copy of the whole
result to Python); after warm-up, the median and the fastest of the timed calls, in ms, and the
bus bandwidth of the median (S / time x 2 (N - 1) / N, the bytes each process sends and receives
per second under a ring, as NCCL's tests report it). Every worker checks every result: worker r
sends r + 1 everywhere, so each element of the sum must be N (N + 1) / 2. Writes
OUT/collectives.md and OUT/collectives.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tfdist.tools.bench.machine import stamp
from tfdist.tools.cpu_load import busy_core_seconds

TRANSPORTS = {
    "tf.distribute": "tf.distribute CollectiveAllReduce (gRPC ring), as Keras calls it",
    "horovod": "Horovod (Gloo)",
}
SHORT = {"tf.distribute": "tf.distribute", "horovod": "Horovod"}  # the page's column names
SIZES_MB = (1.0, 22.0, 94.0)  # one small tensor, the comm suite MLP's gradients, ResNet-50's
QUICK_SIZES_MB = (1.0, 22.0)
SPLITS = (1, 2, 4, 8)
REPEATS, QUICK_REPEATS, WARMUP = 15, 7, 3
TIMEOUT_S = 600


def bus_bandwidth_gbs(size_mb: float, ms: float, processes: int) -> float:
    """GB/s each process moves under a ring all-reduce: S / t x 2 (N - 1) / N."""
    return size_mb * 1e6 / (ms / 1e3) * 2 * (processes - 1) / processes / 1e9


def _elements(size_mb: float) -> int:
    """float32 elements of a tensor of `size_mb` MB (10^6 bytes), at least 1."""
    return max(1, int(size_mb * 1e6 // 4))


def _check(values, processes: int, where: str) -> None:
    expected = processes * (processes + 1) / 2
    if any(abs(float(v) - expected) > 1e-3 * expected for v in values):
        raise RuntimeError(f"collectives: {where}: the all-reduce returned {list(map(float, values))}"
                           f" where every element must be {expected}")


def _measure(comm, run, sizes_mb, splits, repeats: int, processes: int, rank: int) -> list[dict]:
    """Times `comm.all_reduce` of each size and split; `run(fn)` runs `fn` on this worker's
    replica inside the traced call (tf.distribute's `strategy.run`, or a plain call)."""
    import tensorflow as tf

    rows = []
    for size_mb in sizes_mb:
        data = tf.Variable(tf.fill([_elements(size_mb)], float(rank + 1)), trainable=False)
        for k in splits:
            times, busy = _timed(comm, run, data, k, repeats, processes,
                                 f"{size_mb} MB in {k} parts")
            median = statistics.median(times)
            rows.append({"size_mb": size_mb, "splits": k, "median_ms": median,
                         "min_ms": min(times), "samples": len(times),
                         "bus_gbs": bus_bandwidth_gbs(size_mb, median, processes),
                         **({} if busy is None else {"busy_core_ms": busy})})
    return rows


def _timed(comm, run, data, k: int, repeats: int, processes: int,
           where: str) -> tuple[list[float], float | None]:
    """ms of each timed call of one traced all-reduce of `data` in `k` parts, and the machine's
    busy core-ms per timed call (every process's work and the kernel's: `tfdist.tools.cpu_load`;
    None without /proc/stat); the first and last calls' sums are checked."""
    import tensorflow as tf

    def replica_fn():
        parts = tf.split(data.read_value(), k)
        sums = [comm.all_reduce([p], "sum")[0] for p in parts]
        return tf.stack([sums[0][0], sums[-1][-1]])  # first and last element

    call = tf.function(lambda: run(replica_fn))
    times = []
    busy = None
    for i in range(WARMUP + repeats):
        if i == WARMUP:
            busy = busy_core_seconds()
        start = time.perf_counter()
        ends = call().numpy()
        took = time.perf_counter() - start
        if i in (0, WARMUP + repeats - 1):
            _check(ends, processes, where)
        if i >= WARMUP:
            times.append(took * 1e3)
    after = busy_core_seconds()
    if busy is None or after is None:
        return times, None
    return times, 1e3 * (after[0] - busy[0]) / repeats


def _worker(transport: str, sizes_mb, splits, repeats: int, result: str) -> None:
    """One process of a transport's run; rank 0 writes the rows."""
    if transport == "horovod":
        import tfdist.horovod as thvd
        from tfdist.comm.horovod import HorovodCommunicator

        thvd.init()
        rank, processes = thvd.rank(), thvd.size()
        rows = _measure(HorovodCommunicator(), lambda fn: fn(), sizes_mb, splits, repeats,
                        processes, rank)
    else:
        import tfdist
        from tfdist.comm import ReplicaCommunicator

        strategy = tfdist.MultiWorkerMirroredStrategy(timeout_seconds=TIMEOUT_S)
        rank = int(strategy.cluster_resolver.task_id)
        processes = strategy.num_replicas_in_sync
        rows = _measure(ReplicaCommunicator(strategy), lambda fn: strategy.run(fn), sizes_mb,
                        splits, repeats, processes, rank)
    if rank == 0:
        for r in rows:
            r.update(transport=transport, label=TRANSPORTS[transport], processes=processes)
        Path(result).write_text(json.dumps(rows))


def _launch(transport: str, processes: int, sizes_mb, splits, repeats: int,
            out_dir: Path) -> list[dict] | None:
    from tfdist.tools.bench.processes import run_on

    result = out_dir / f"collectives.{transport}.{processes}.json"
    result.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "tfdist.tools.bench.collectives", "--worker", transport,
            "--sizes", ",".join(map(str, sizes_mb)), "--splits", ",".join(map(str, splits)),
            "--repeats", str(repeats), "--result", str(result)]
    if not run_on(transport, argv, processes, TIMEOUT_S, "the collectives' Horovod rows"):
        return None
    return json.loads(result.read_text())


def table(rows: list[dict]) -> str:
    """Markdown; "vs tf.distribute" is tf.distribute's median over the row's, for the same
    size, split and processes (above 1: faster than tf.distribute)."""
    ref = {(r["processes"], r["size_mb"], r["splits"]): r["median_ms"] for r in rows
           if r["transport"] == "tf.distribute"}
    busy = any("busy_core_ms" in r for r in rows)
    lines = ["| transport | processes | size (MB) | all-reduce calls | median (ms) | fastest (ms) "
             "| bus bandwidth (GB/s) | vs tf.distribute |"
             + (" machine's busy core-ms per call |" if busy else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if busy else "")]
    for r in rows:
        base = ref.get((r["processes"], r["size_mb"], r["splits"]))
        ratio = f"{base / r['median_ms']:.2f}x" if base else "n/a"
        lines.append(f"| {r['label']} | {r['processes']} | {r['size_mb']:g} | {r['splits']} | "
                     f"{r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['bus_gbs']:.2f} | {ratio} |"
                     + (f" {_core_ms(r.get('busy_core_ms'))} |" if busy else ""))
    return "\n".join(lines)


def _core_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def page_table(rows: list[dict]) -> str:
    """The benchmark page's table: one row per size and number of calls, one column per
    transport and number of processes; median ms with the bus bandwidth (GB/s) in brackets, and
    after it the machine's busy core-ms per call where the run measured them."""
    columns = list(dict.fromkeys((r["transport"], r["processes"]) for r in sorted(
        rows, key=lambda r: r["processes"])))
    cells = {(r["size_mb"], r["splits"], r["transport"], r["processes"]): r for r in rows}
    lines = ["| size (MB) | all-reduce calls | " + " | ".join(
        f"{SHORT.get(t, t)}, {n} processes" for t, n in columns) + " |",
        "|---:|---:|" + "---:|" * len(columns)]
    for size, splits in sorted({(r["size_mb"], r["splits"]) for r in rows}):
        shown = [cells.get((size, splits, label, n)) for label, n in columns]
        lines.append(f"| {size:g} | {splits} | " + " | ".join(
            _cell(c) if c else "-" for c in shown) + " |")
    return "\n".join(lines)


def _cell(row: dict) -> str:
    busy = f"; {row['busy_core_ms']:.0f} core-ms" if "busy_core_ms" in row else ""
    return f"{row['median_ms']:.1f} ({row['bus_gbs']:.2f}{busy})"


def _positive(values, name: str, kind=float) -> list:
    out = []
    for v in values:
        try:
            x = kind(v)
        except (TypeError, ValueError):
            x = 0
        if x <= 0:
            raise ValueError(f"collectives: {name}: got {v!r}; give positive "
                             f"{'integers' if kind is int else 'numbers'}, e.g. "
                             f"--{name} {'1,4' if kind is int else '1,22'}")
        out.append(x)
    return out


def run_collectives(quick: bool, out: str, processes=None, sizes_mb=None, splits=None,
                    repeats: int | None = None) -> list[dict]:
    counts = _positive(processes or [2], "hosts", int)
    if any(n < 2 for n in counts):
        raise ValueError(f"collectives: hosts: got {counts}; an all-reduce needs at least 2 "
                         "processes, e.g. --hosts 2,4")
    sizes = _positive(sizes_mb or (QUICK_SIZES_MB if quick else SIZES_MB), "sizes")
    parts = _positive(splits or SPLITS, "splits", int)
    for size in sizes:
        for k in parts:
            if _elements(size) % k:
                raise ValueError(f"collectives: {size:g} MB ({_elements(size)} float32) does not "
                                 f"split into {k} equal parts; pick sizes and --splits that "
                                 "divide, e.g. --sizes 1,22 --splits 1,4")
    repeats = (QUICK_REPEATS if quick else REPEATS) if repeats is None else repeats
    if repeats < 1:
        raise ValueError(f"collectives: --repeats must be >= 1. Received: {repeats}")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "tfdist bench --suite collectives" + (" --quick" if quick else "")
    for flag, value in (("hosts", processes), ("sizes", sizes_mb), ("splits", splits)):
        if value is not None:
            command += f" --{flag} {','.join(map(str, value))}"
    print(f"bench: collectives: all-reduce of {', '.join(f'{s:g}' for s in sizes)} MB in "
          f"{', '.join(map(str, parts))} calls, {repeats} timed calls each, over "
          f"{', '.join(TRANSPORTS)} on {', '.join(map(str, counts))} processes", flush=True)
    rows: list[dict] = []
    failures: list[str] = []
    for n in counts:
        for transport in TRANSPORTS:
            try:
                rows += _launch(transport, n, sizes, parts, repeats, out_dir) or []
            except RuntimeError as e:  # the other transports' rows are kept
                failures.append(str(e))
    text = table(rows)
    (out_dir / "collectives.md").write_text(f"Command: `{command}`\n\n{text}\n")
    (out_dir / "collectives.json").write_text(json.dumps(
        {**stamp(command), "repeats": repeats, "failures": failures, "rows": rows}, indent=2))
    print(text)
    print(f"bench: wrote {out_dir / 'collectives.md'} and {out_dir / 'collectives.json'}")
    if failures:
        print("bench: failed runs:\n" + "\n".join(failures), file=sys.stderr)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description="internal: one process of the collectives suite")
    p.add_argument("--worker", choices=list(TRANSPORTS), required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--splits", required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--result", required=True)
    a = p.parse_args()
    _worker(a.worker, [float(s) for s in a.sizes.split(",")],
            [int(s) for s in a.splits.split(",")], a.repeats, a.result)


__all__ = ["bus_bandwidth_gbs", "run_collectives", "table"]

if __name__ == "__main__":
    main()
