"""`tfdist bench --suite models`: standard models at speed on the emulated cluster.

Each model of configs/bench/models.yaml (ResNet-50 on synthetic ImageNet-shaped images, a
BERT-like encoder on synthetic tokens; random weights, sizes small enough for this machine, as the
spec says) trains for a few steps with each algorithm as one TF_CONFIG worker (or Horovod rank)
per emulated host, on the comm suite's machinery: the per-worker batch stays fixed, so the global
batch grows with the hosts. Per run: median step time, throughput (images or tokens per second,
all workers), bytes and collective calls per step, the bytes each host's link carried per step
(its interface's counter over the run: start-up traffic and protocol included; measured for
Keras' own exchange too, whose bytes are otherwise a formula), and the scaling efficiency: the
zero-communication limit's step time (every host trains the same per-worker batch with no
exchange, in the same sweep; the hosts' steps that ran while all of them ran,
`tfdist.tools.bench.comm.concurrent_step_ms`) over the run's. Writes
OUT/models.md, OUT/models.json, OUT/models_*.png and each model's comm-suite files under
OUT/<model>/<hosts>hosts/.

Each row also carries the comm suite's per-step breakdown (`tfdist.tools.bench.comm.breakdown`):
compute, wire at the link's rate, the compressor's own work, and the rest; and the machine's
cores busy during its steps and during the limit's (`tfdist.tools.cpu_load`): every emulated
host shares them, so a step that kept them all busy is bound by the cores, not by the link.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tfdist.tools.bench import comm, plots
from tfdist.tools.bench.machine import stamp
from tfdist.tools.config import ConfigError, configs_dir, read_yaml_mapping

SPEC = "models.yaml"
_KEYS = {"models", "hosts", "bandwidths", "run_timeout_seconds", "algorithms",
         "default_algorithms", "quick"}
_MODEL_KEYS = {"label", "unit", "per_example", "per_worker_batch", "job"}


def _spec_path() -> Path:
    return configs_dir() / "bench" / SPEC


def load(spec_path: str | Path | None = None, quick: bool = False, hosts=None, bandwidths=None,
         algorithms=None, models=None) -> tuple[dict[str, Any], list[tuple[str, int, comm.Plan]]]:
    """The spec and one comm plan per (model, hosts), every config built and checked before
    anything runs. Raises ConfigError naming the value and the fix."""
    path = Path(spec_path) if spec_path else _spec_path()
    spec = read_yaml_mapping(path, "benchmark spec")
    errors = [f"{path}: unknown key '{k}'; allowed: {', '.join(sorted(_KEYS))}"
              for k in spec if k not in _KEYS]
    table = spec.get("models") or {}
    quick_spec = (spec.get("quick") or {}) if quick else {}
    chosen = models if models is not None else quick_spec.get("models", list(table))
    for name in chosen:
        if name not in table:
            errors.append(f"models: unknown {name!r}; choose from {', '.join(table)}")
            continue
        bad = set(table[name]) - _MODEL_KEYS
        if bad:
            errors.append(f"models.{name}: unknown keys {sorted(bad)}; allowed: "
                          f"{', '.join(sorted(_MODEL_KEYS))}")
        batch = table[name].get("per_worker_batch")
        if not isinstance(batch, int) or batch < 1:
            errors.append(f"models.{name}.per_worker_batch: got {batch!r}; must be an integer "
                          ">= 1")
    if errors:
        raise ConfigError("Invalid benchmark:\n  " + "\n  ".join(errors))
    host_counts = hosts if hosts is not None else quick_spec.get("hosts", spec.get("hosts", [2]))
    links = (bandwidths if bandwidths is not None
             else quick_spec.get("bandwidths", spec.get("bandwidths", ["1gbit"])))
    selected = (algorithms if algorithms is not None
                else quick_spec.get("algorithms", spec.get("default_algorithms")))
    plans = []
    for name in chosen:
        model = table[name]
        for n in host_counts:
            try:
                workers = int(n)
            except (TypeError, ValueError):
                raise ConfigError(f"hosts: got {n!r}; must be integers >= 2") from None
            comm_spec = {
                "job": [*model.get("job", []),
                        f"data.global_batch_size={model['per_worker_batch'] * workers}"],
                "target_accuracy": 0.99,  # not the point here: throughput is
                "hosts": [workers], "bandwidths": list(links),
                "run_timeout_seconds": spec.get("run_timeout_seconds", 1800),
                "algorithms": spec.get("algorithms") or {}}
            with tempfile.TemporaryDirectory(prefix="tfdist-models-") as directory:
                spec_file = Path(directory) / f"{name}-{workers}hosts.yaml"
                spec_file.write_text(yaml.safe_dump(comm_spec, sort_keys=False))
                try:
                    plan = comm.load_plan(spec_file, False, None, None, selected)
                except ConfigError as e:  # its file is the spec, not the one made here
                    raise ConfigError(f"models.{name}, {workers} hosts: "
                                      f"{str(e).replace(str(spec_file), str(path))}") from e
            plan.spec_path = path
            plans.append((name, workers, plan))
    return spec, plans


def rows_with_throughput(model: str, info: dict, rows: list[dict]) -> list[dict]:
    """The comm rows of one model, with throughput and scaling efficiency added."""
    out = []
    limit = {(r["hosts"], r["bandwidth"]): r for r in rows if r["algorithm"] == comm.LIMIT}
    for r in rows:
        if r["algorithm"] == comm.LIMIT:
            continue
        per_step = info["per_worker_batch"] * r["hosts"] * info.get("per_example", 1)
        lim = limit.get((r["hosts"], r["bandwidth"]))
        out.append({**{k: v for k, v in r.items() if k != "curve"}, "model": model,
                    "unit": info.get("unit", "examples"),
                    "throughput": per_step / (r["step_ms"] / 1000.0),
                    "limit_step_ms": lim["step_ms"] if lim else None,
                    "scaling_efficiency": lim["step_ms"] / r["step_ms"] if lim else None})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model | hosts | link | algorithm | step time (ms) | throughput | vs first row "
             "| scaling efficiency | collectives/step | bytes/step/worker "
             "| on the wire/step/host (measured) |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    base: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["hosts"], r["bandwidth"])
        b = base.setdefault(key, r)
        eff = r["scaling_efficiency"]
        lines.append(
            f"| {r['model']} | {r['hosts']} | {r['bandwidth']} | {r['label']} | "
            f"{r['step_ms']:.0f} | {r['throughput']:,.0f} {r['unit']}/s | "
            f"{r['throughput'] / b['throughput']:.2f}x | "
            + (f"{eff:.0%}" if eff is not None else "n/a")
            + f" | {r['collectives_per_step']:.0f} | {r['bytes_per_step']:,.0f}"
            + ("" if r["bytes_counted"] else " (formula)")
            + f" | {r['wire_bytes_per_step']:,.0f} |")
    return "\n".join(lines)


def page_table(result: dict) -> str:
    """The benchmark page's tables, from the suite's JSON (what `write` saved): one row per
    run, then each run's per-step breakdown."""
    rows = result["rows"]
    return f"{table(rows)}\n\nPer-step breakdown (ms):\n\n{comm.breakdown_table(rows)}"


def write(rows: list[dict], failures: list[str], out_dir: Path, command: str,
          spec: dict) -> None:
    (out_dir / "models.md").write_text(f"Command: `{command}`\n\n{page_table({'rows': rows})}\n")
    models = {k: {"label": v.get("label"), "unit": v.get("unit"),
                  "per_worker_batch": v.get("per_worker_batch"), "job": v.get("job")}
              for k, v in (spec.get("models") or {}).items()}
    (out_dir / "models.json").write_text(json.dumps(
        {**stamp(command), "models": models, "failures": failures, "rows": rows}, indent=2))
    if rows:
        _plot(rows, out_dir)


def _plot(rows: list[dict], out_dir: Path) -> None:
    for model in sorted({r["model"] for r in rows}):
        plots.models(rows, model, out_dir / f"models_{model}.png")


def run_models(quick: bool, out: str, hosts=None, bandwidths=None, algorithms=None,
               spec: str | None = None, models=None) -> list[dict]:
    spec_data, plans = load(spec, quick, hosts, bandwidths, algorithms, models)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "tfdist bench --suite models" + (" --quick" if quick else "")
    for flag, value in (("models", models), ("hosts", hosts), ("bandwidths", bandwidths),
                        ("algorithms", algorithms)):
        if value is not None:
            command += f" --{flag} {','.join(map(str, value))}"
    runs = sum(p.runs for _, _, p in plans)
    print(f"bench: models: {', '.join(dict.fromkeys(m for m, _, _ in plans))}; {runs} runs",
          flush=True)
    rows: list[dict] = []
    failures: list[str] = []
    for model, hosts_n, plan in plans:
        info = spec_data["models"][model]
        try:
            got = comm.run(plan, out_dir / model / f"{hosts_n}hosts", command)
        except RuntimeError as e:  # some runs failed; the others are kept
            failures.append(f"{model}, {hosts_n} hosts: {e}")
            saved = json.loads((out_dir / model / f"{hosts_n}hosts" / "comm.json").read_text())
            got = saved["rows"]
        rows += rows_with_throughput(model, info, got)
        write(rows, failures, out_dir, command, spec_data)
    write(rows, failures, out_dir, command, spec_data)
    print(page_table({"rows": rows}))
    print(f"bench: wrote {out_dir / 'models.md'}, {out_dir / 'models.json'} and "
          f"models_*.png in {out_dir}")
    if failures:
        print("bench: failed runs:\n" + "\n".join(failures), file=sys.stderr)
    return rows


__all__ = ["load", "page_table", "run_models", "rows_with_throughput", "table"]
