"""What `tfdist bench --suite pipeline_hosts` measures: pipeline stages on emulated hosts.

The MLP of the pipeline suite (8 Dense(1024) layers, batch 256, SGD) with its K stages on K
emulated hosts (network namespaces, links shaped to the given rate; `tfdist.tools.emulated`),
through TF's cluster runtime (`tfdist.pipeline.cluster_devices`): host 0 drives, the others serve
their stage. Per hosts x link rate:

* one device: the whole model on host 0 (no link), the reference;
* GPipe and 1F1B over the K hosts, M micro-batches, remat "except_last";
* on 4 hosts, 2 pipelines x 2 stages (data x pipeline parallelism, 1F1B): each pipeline takes
  half the batch; each stage's gradients are summed across the pipelines over the links.

For each: the step time (median of repeats after a warm-up), and the bytes every host sent on its
link during the timed steps (its interface's counter, read before and after), per step, next to
the payload that must cross: activations forward and their gradients back at each stage boundary,
the labels to the last stage, and for 2 x 2 the second pipeline's inputs and the stage gradients
each copy receives from the other. The emulated hosts share this machine's cores, so stages on
different hosts do not gain compute: the table shows what the links cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

from tfdist.tools.bench.machine import stamp
from tfdist.tools.bench.pipeline import BATCH, CLASSES, LAYERS, WIDTH

__all__ = ["payload_bytes", "pipeline_hosts_table", "run_pipeline_hosts"]

HOSTS, BANDWIDTHS = (2, 4), ("1gbit", "10gbit")
QUICK_BANDWIDTHS = ("1gbit",)


def _stage_parameters(k: int) -> list[int]:
    per = LAYERS // k
    sizes = [WIDTH * WIDTH + WIDTH] * (LAYERS - 1) + [WIDTH * CLASSES + CLASSES]
    return [sum(sizes[j * per:(j + 1) * per]) for j in range(k)]


def payload_bytes(k: int, replicas: int = 1) -> int:
    """The bytes one step must move between hosts: per pipeline and stage boundary, its share of
    the batch's activations forward and their gradients back (float32); the labels (int64) to
    each last stage on another host than 0; with replicas, the inputs of pipelines 1.. and, per
    stage, every copy's gradient to each other copy."""
    share = BATCH // replicas
    total = replicas * (k - 1) * 2 * share * WIDTH * 4
    total += sum(share * 8 for r in range(replicas) if r * k + k - 1 != 0)  # labels
    total += (replicas - 1) * share * WIDTH * 4  # inputs of the other pipelines
    total += sum(replicas * (replicas - 1) * 4 * p for p in _stage_parameters(k))
    return total


# -- the driver (host 0) and the serving hosts ----------------------------------------------------
def _mark(text: str) -> None:
    print(f"MARK {text}", flush=True)
    time.sleep(0.5)  # the bench reads the link counters while the links are idle


def _timed(label: str, step, steps: int, repeats: int) -> float:
    step()  # trace and warm up
    step()
    _mark(f"start {label}")
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            out = step()
        float(out)
        samples.append((time.perf_counter() - start) / steps)
    _mark(f"end {label} {steps * repeats}")
    return statistics.median(samples) * 1e3


def worker(result: str, quick: bool) -> None:
    from tfdist.pipeline import cluster_devices
    from tfdist.tools.bench.pipeline import _baseline_step, _pipeline_step

    devices = cast(list[str], cluster_devices())  # one row; the serving hosts stop here
    k = len(devices)
    steps, repeats = (3, 3) if quick else (5, 5)
    rows = [{"layout": "one device", "k": 1, "replicas": 1, "m": 1,
             "step_ms": _timed("one device", _baseline_step(devices[0]), steps, repeats)}]
    plans: list[tuple[str, int, Any]] = [(s, m, devices) for m in ((4,) if quick else (1, 4, 8))
                                         for s in ("gpipe", "1f1b")]
    if k == 4:
        plans.append(("1f1b", 4, [devices[:2], devices[2:]]))
    for schedule, m, placed in plans:
        replicas = 2 if isinstance(placed[0], list) else 1
        label = (f"{schedule} {k} stages" if replicas == 1 else
                 f"2 x 2 pipelines x stages ({schedule})")
        _, step = _pipeline_step(placed, m, schedule, "except_last")
        rows.append({"layout": label, "k": k // replicas, "replicas": replicas, "m": m,
                     "step_ms": _timed(label, step, steps, repeats)})
        print(f"bench: pipeline_hosts: {k} hosts, {label}, M={m}: "
              f"{rows[-1]['step_ms']:.1f} ms/step", flush=True)
    Path(result).write_text(json.dumps(rows))


# -- the bench (outside the emulated hosts) -------------------------------------------------------
def _one_cluster(hosts: int, bandwidth: str, quick: bool, out_dir: Path) -> list[dict]:
    from tfdist.tools.emulated import EmulatedCluster

    out_dir = out_dir.resolve()  # the hosts' shared storage: the only files they share
    out_dir.mkdir(parents=True, exist_ok=True)
    result = out_dir / f"pipeline_hosts-{hosts}hosts-{bandwidth}.json"
    result.unlink(missing_ok=True)
    sent: dict[str, int] = {}
    counters: dict[str, list[int]] = {}
    with EmulatedCluster(hosts, bandwidth, shared=[out_dir]) as cluster:

        def on_line(rank: int, line: str) -> None:
            line = line.strip()
            if rank != 0:
                return
            if not line.startswith("MARK "):
                if line.startswith("bench:"):
                    print(line, flush=True)
                return
            _, edge, rest = line.split(" ", 2)
            if edge == "start":
                counters[rest] = cluster.tx_bytes()
            else:
                label, steps = rest.rsplit(" ", 1)
                delta = sum(cluster.tx_bytes()) - sum(counters[label])
                sent[label] = delta // int(steps)

        argv = [sys.executable, "-m", "tfdist.tools.bench.pipeline_hosts", "--result",
                str(result)] + (["--quick"] if quick else [])
        results = cluster.run_workers(argv, timeout=900, on_line=on_line)
    if any(r.returncode != 0 for r in results) or not result.exists():
        tail = "\n".join(r.output[-1500:] for r in results if r.returncode != 0)
        raise RuntimeError(f"the {hosts}-host run at {bandwidth} failed:\n{tail}")
    rows = json.loads(result.read_text())
    for r in rows:
        r.update(hosts=hosts, bandwidth=bandwidth, bytes_per_step=sent[r["layout"]],
                 payload_per_step=payload_bytes(r["k"], r["replicas"]) if r["k"] > 1 or
                 r["replicas"] > 1 else 0, speedup=rows[0]["step_ms"] / r["step_ms"])
    return rows


def pipeline_hosts_table(rows: list[dict]) -> str:
    lines = ["| hosts | link | layout | M | step ms | throughput vs 1 device | bytes sent per "
             "step, all hosts (measured) | payload per step | sent / payload |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['bytes_per_step'] / r['payload_per_step']:.3f}" if r["payload_per_step"] \
            else "-"
        lines.append(f"| {r['hosts']} | {r['bandwidth']} | {r['layout']} | "
                     f"{r['m'] if r['k'] > 1 else '-'} | {r['step_ms']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['bytes_per_step']:,} | "
                     f"{r['payload_per_step']:,} | {ratio} |")
    return "\n".join(lines)


def run_pipeline_hosts(quick: bool, out: str, hosts=None, bandwidths=None) -> list[dict]:
    from tfdist.tools.emulated import check_can_emulate, parse_bandwidth

    hosts = [int(h) for h in hosts] if hosts else list(HOSTS)
    bandwidths = list(bandwidths) if bandwidths else list(QUICK_BANDWIDTHS if quick
                                                          else BANDWIDTHS)
    for h in hosts:
        if h < 2 or LAYERS % h:
            raise ValueError(f"--hosts {h}: a pipeline over emulated hosts needs 2, 4 or 8 "
                             f"hosts (its {LAYERS} layers split equally into one stage per "
                             "host).")
    for b in bandwidths:
        parse_bandwidth(b)
    check_can_emulate(max(hosts))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "tfdist bench --suite pipeline_hosts" + (" --quick" if quick else "")
    if hosts != list(HOSTS):
        command += f" --hosts {','.join(map(str, hosts))}"
    if bandwidths != list(QUICK_BANDWIDTHS if quick else BANDWIDTHS):
        command += f" --bandwidths {','.join(bandwidths)}"
    print(f"bench: pipeline_hosts: MLP of {LAYERS} Dense({WIDTH}) layers, batch {BATCH}; "
          f"hosts {hosts}, links {bandwidths}", flush=True)
    rows: list[dict] = []
    for bandwidth in bandwidths:
        for h in hosts:
            rows += _one_cluster(h, bandwidth, quick, out_dir)
    table = pipeline_hosts_table(rows)
    (out_dir / "pipeline_hosts.md").write_text(f"Command: `{command}`\n\n{table}\n")
    (out_dir / "pipeline_hosts.json").write_text(json.dumps(
        {**stamp(command),
         "model": f"{LAYERS} x Dense({WIDTH})", "batch": BATCH,
         "remat": "except_last", "rows": rows}, indent=2))
    print(table)
    print(f"bench: wrote {out_dir / 'pipeline_hosts.md'} and {out_dir / 'pipeline_hosts.json'}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="internal: one host of the pipeline_hosts bench")
    parser.add_argument("--result", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    worker(args.result, args.quick)


if __name__ == "__main__":
    main()
    sys.exit(0)
