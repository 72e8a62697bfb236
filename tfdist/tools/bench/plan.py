"""`tfdist bench --suite plan`: the planner (`tfdist.plan`) against the emulated cluster.

It runs the communication suite (`tfdist bench --suite comm`: the same hosts, links and
algorithms, written under OUT/comm/), or reads a run of it (`--results comm.json`), and
predicts each run's step from the job's model and the sweep's zero-communication limit at the
run's host count (the compute step, measured in the same sweep, its runs averaged over the
links): predicted and measured step time and bytes per worker per step side by side, with the
error. `--calibrate DIR` adds the engine's and the compressors' own costs measured on the
machine (`Calibration.from_results`). The limit updates with tfdist's fused update, as every
planned algorithm does but Keras' own exchange, whose compute adds what Keras' per-variable
update takes beyond it (the overhead suite's run in the same directory, `overhead.json`).

The measured step is the mean over the run's timed steps (the first, tracing, left out), which
is what the planner predicts: for local SGD it spreads the averaging rounds over the steps.
Post-local SGD's run starts with synchronous steps (its config's `averaging.warmup_steps`), so
its prediction is the run's mix: those steps priced as the dense exchange, the rest as local SGD.

Given a stragglers suite's run instead (`--results stragglers.json`, `tfdist bench --suite
stragglers`), the simulation (`tfdist.plan.simulate`) plays the same job: the same workers,
the same slow worker and slowdown, the same steps. Its three inputs come from three of the
run's mean chief steps, with the slowdown the suite set: the asynchronous parameter server's
(a fast step and its transfer), the synchronous parameter server's (the slow worker's step and
the same transfer) and the synchronous all-reduce's (the slow step and the all-reduce). The
other algorithms are predicted: their mean step, their time to the target accuracy (the
chief's clock at the step where the run's own accuracy curve reached it) and its ratio to the
synchronous all-reduce's, and the mean staleness.

Given a models suite's run (`--results models.json`, `tfdist bench --suite models`), each
model is predicted as a comm run is, from its own shapes and its runs' zero-communication limit,
or, where the sweep ran the opt-in `limit_in_phase` (nothing exchanged, the hosts in step on the
multi-worker engine, as a synchronous run keeps them), that run's step (`compute_steps`).

Given a memory suite's run (`--results memory.json`, `tfdist bench --suite memory`), the
planner's memory per replica for the dense exchange and ZeRO 1-3 is set beside the bytes each
replica's optimizer held there (`compare_memory`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from tfdist.plan import Calibration, Cluster, Link, Stragglers, Workload, predict, simulate
from tfdist.plan.simulate import histogram_mean
from tfdist.tools.bench.comm import mean_step_s
from tfdist.tools.bench.machine import cores_of, stamp
from tfdist.tools.emulated import parse_bandwidth

# comm suite algorithm -> (planner spec, engine)
ALGORITHMS = {
    "dense_keras": ("dense", "tf.distribute"),
    "dense": ("dense", "tf.distribute"),
    "dense_horovod": ("dense", "horovod"),
    "fp16": ("fp16", "tf.distribute"),
    "ef_topk": ("topk:0.01", "tf.distribute"),
    "powersgd": ("powersgd:2", "tf.distribute"),
    "local_sgd": ("local_sgd:8", "tf.distribute"),
    "zero1": ("zero1", "tf.distribute"),
    "zero2": ("zero2", "tf.distribute"),
    "zero3": ("zero3", "tf.distribute"),
}
LIMIT = "limit"
# configs/bench/models.yaml's opt-in run: nothing exchanged, the multi-worker engine, the hosts
# in step as a synchronous run keeps them
IN_PHASE = "limit_in_phase"
KERAS_DENSE = "dense_keras"  # Keras' own exchange, with Keras' own update
# The overhead suite's compute-only update rows: Keras' update, and tfdist's fused one
KERAS_VARIANT, FUSED_VARIANT = "keras", "fused"


@dataclasses.dataclass(frozen=True)
class JobModel:
    """A bench job's model as the planner needs it: the trainable shapes, the ids each
    variable's gradient rows come from per example (an embedding's lookups; 0: dense) and the
    job's global batch (which a suite may set per run instead)."""

    shapes: tuple[tuple[int, ...], ...]
    lookups: tuple[int, ...]
    global_batch: int

    def workload(self, compute_s: float, hosts: int,
                 per_worker_batch: int | None = None) -> Workload:
        """One worker's share on `hosts` hosts, at `per_worker_batch` examples (default: the
        job's global batch over the hosts)."""
        batch = per_worker_batch or self.global_batch // hosts
        return Workload(self.shapes, compute_s,
                        sparse_rows=tuple(batch * k for k in self.lookups))


def job_model(job: list[str]) -> JobModel:
    """The model of a bench suite's job (its config overrides)."""
    from tfdist.plan import embedding_rows
    from tfdist.tools.config import load_config
    from tfdist.tools.workload import load_data, make_model

    config = load_config(None, job)
    model = make_model(config, load_data(config))
    return JobModel(tuple(tuple(v.shape) for v in model.trainable_variables),
                    embedding_rows(model, 1), config["data"]["global_batch_size"])


def job_optimizer(job: list[str]) -> str:
    """The name of the job's optimizer (its config overrides)."""
    from tfdist.tools.config import load_config

    return load_config(None, job)["optimizer"]["name"]


def keras_update_s(directory: str | None, model: str, optimizer: str) -> float:
    """Seconds Keras' per-variable update of `model` with `optimizer` takes beyond tfdist's
    fused one, which the zero-communication limit runs (the `single` engine updates with
    `tfdist.DistributedOptimizer`): the overhead suite's compute-only updates in `directory`
    (`overhead.json`, `tfdist bench --suite overhead`); 0 where they are not there."""
    path = Path(directory) / "overhead.json" if directory else None
    if path is None or not path.exists():
        return 0.0
    ms = {r["variant"]: r["update_ms"]
          for r in json.loads(path.read_text()).get("update_rows", [])
          if r["model"] == model and r["optimizer"] == optimizer}
    if KERAS_VARIANT not in ms or FUSED_VARIANT not in ms:
        return 0.0
    return max(ms[KERAS_VARIANT] - ms[FUSED_VARIANT], 0.0) / 1e3


def shared_machine(calibration: Calibration | None, hosts: int,
                   cores: int | None) -> Calibration | None:
    """`calibration` for `hosts` emulated hosts sharing `cores` cores. Each CPU-bound cost grows
    with the processes per core, `max(1, processes / cores)`, from the process count it was
    measured at (none where that was `hosts`): the engine's work per hop and per byte from its
    collectives', the compressors' from theirs (one process unless `--suite compressors --hosts`
    measured several at once). The collectives suite shows the effect: one 22 MB all-reduce
    took 2.9x as long between 4 processes as between 2 on 2 cores, where the ring's bytes per
    process grow 1.5x."""
    if calibration is None or not cores:
        return calibration

    def per_core(processes: int) -> float:
        return max(1.0, processes / cores)

    engine = per_core(hosts) / per_core(calibration.processes or hosts)
    compressor = per_core(hosts) / per_core(calibration.compressor_processes or 1)
    if engine == compressor == 1:
        return calibration
    return dataclasses.replace(
        calibration, hop_s=calibration.hop_s * engine,
        seconds_per_byte=calibration.seconds_per_byte * engine,
        compressor_ms_per_mb={k: v * compressor
                              for k, v in calibration.compressor_ms_per_mb.items()},
        source=f"{calibration.source}; for {hosts} hosts on {cores} cores, the engine's costs "
               f"x{engine:g}, the compressors' x{compressor:g}")


def link_independent(limits: dict[tuple[int, str], float]) -> dict[tuple[int, str], float]:
    """`limits` ((hosts, link) -> seconds, the zero-communication limit runs of a sweep) with
    each host count's runs averaged over its links. A run that exchanges nothing does not
    depend on the link, and on hosts that share a machine's cores one such run's step moves
    by a quarter from one run to the next (4 emulated hosts on 2 cores, 2026-12-03: 50 ms at
    1 Gbit/s, 34 ms at 10 Gbit/s, the same job minutes apart)."""
    by_hosts: dict[int, list[float]] = {}
    for (hosts, _), seconds in limits.items():
        by_hosts.setdefault(hosts, []).append(seconds)
    return {(hosts, link): statistics.fmean(by_hosts[hosts]) for hosts, link in limits}


def compare(results: dict[str, Any], job: JobModel, calibrate: str | None,
            limits: dict[tuple[int, str], float] | None = None,
            overrides: dict[str, list[str]] | None = None, model: str = "mlp",
            per_worker_batch: int | None = None) -> list[dict]:
    """Predicted against measured, one row per run of a planned algorithm whose hosts and link
    have a zero-communication limit (`limits`, seconds; default: the limit runs in `results`,
    each host count's averaged over its links: `link_independent`); calibrated from the JSON in
    directory `calibrate` (or not at all), at the run's number of processes where the
    collectives were measured so, and for the hosts sharing the machine's cores
    (`shared_machine`). The limit updates as tfdist does; Keras' own exchange adds what Keras'
    update of `model` (the overhead suite's name for it) takes beyond that, where `calibrate`
    holds an overhead suite's run (`keras_update_s`). Local SGD's synchronous warm-up is read
    from its config, the run's job and the algorithm's own `overrides` (default:
    configs/bench/comm.yaml's). A worker's batch, which sets an embedding's rows, is
    `per_worker_batch` (a models suite's) or the job's global batch over the hosts."""
    if limits is None:
        limits = link_independent({(r["hosts"], r["bandwidth"]): mean_step_s(r)
                                   for r in results["rows"] if r["algorithm"] == LIMIT})
    if overrides is None:
        overrides = algorithm_overrides("comm.yaml")
    cores = cores_of(results.get("machine", ""))
    calibrations: dict[tuple[str, int], Calibration | None] = {}  # (engine, hosts) -> scaled
    keras_update = keras_update_s(calibrate, model, job_optimizer(results["job"]))
    rows = []
    for r in results["rows"]:
        where = (r["hosts"], r["bandwidth"])
        if r["algorithm"] not in ALGORITHMS or where not in limits:
            continue
        spec, engine = ALGORITHMS[r["algorithm"]]
        cluster = Cluster(r["hosts"], Link(parse_bandwidth(r["bandwidth"]) / 1e9), engine=engine)
        if (engine, r["hosts"]) not in calibrations:
            calibrations[engine, r["hosts"]] = shared_machine(
                Calibration.from_results(calibrate, engine, r["hosts"]) if calibrate else None,
                r["hosts"], cores)
        calibration = calibrations[engine, r["hosts"]]
        synchronous = 0
        compute = limits[where] + (keras_update if r["algorithm"] == KERAS_DENSE else 0.0)
        work = job.workload(compute, r["hosts"], per_worker_batch)
        estimate, dense = (predict(work, cluster, [name],
                                   calibration=calibration).estimates[0]
                           for name in (spec, "dense"))
        step_s, wire = estimate.step_s, estimate.wire_bytes
        if spec.startswith("local_sgd"):
            warmup = _local_sgd(results["job"] + overrides.get(r["algorithm"], []))[1]
            synchronous = min(warmup, r["steps"])
            period = int(spec.split(":")[1])
            step_s, wire = local_sgd_run(estimate, dense, period, synchronous, r["steps"])
        measured = mean_step_s(r)
        rows.append({"hosts": r["hosts"], "bandwidth": r["bandwidth"],
                     "algorithm": r["algorithm"], "label": r["label"],
                     "spec": spec + (f" after {synchronous} dense steps" if synchronous else ""),
                     "engine": engine, "compute_ms": compute * 1e3,
                     "calibration": calibration.source if calibration else "none",
                     "predicted_ms": step_s * 1e3, "measured_ms": measured * 1e3,
                     "step_error": step_s / measured - 1,
                     "predicted_bytes": wire,
                     "counted_bytes": r["bytes_per_step"],
                     "bytes_error": (wire / r["bytes_per_step"] - 1
                                     if r["bytes_per_step"] else None)})
    return rows


def compare_models(data: dict[str, Any], calibrate: str | None) -> list[dict]:
    """`compare` for a models suite's run (`tfdist bench --suite models`), model by model:
    each model's shapes from its job, the compute step from its runs (`compute_steps`), the
    algorithms' overrides those of configs/bench/models.yaml."""
    overrides = algorithm_overrides("models.yaml")
    rows = []
    for name, model in data["models"].items():
        mine = [r for r in data["rows"] if r.get("model") == name]
        limits, source = compute_steps(mine)
        part = compare({**data, "rows": mine, "job": model["job"]}, job_model(model["job"]),
                       calibrate, limits, overrides, model=name,
                       per_worker_batch=model.get("per_worker_batch"))
        rows += [{"model": name, **r, "compute_from": source[r["hosts"]]} for r in part]
    return rows


def compute_steps(rows: list[dict]) -> tuple[dict[tuple[int, str], float], dict[int, str]]:
    """A models suite's compute step per (hosts, link), in seconds, and what it is per host
    count: the step of its `limit_in_phase` runs where the sweep has them (nothing exchanged,
    the hosts in step on the multi-worker engine), else its zero-communication limit
    (`limit_step_ms`: one `single` worker per host, the hosts out of step); either averaged
    over the links (`link_independent`)."""
    limits = link_independent({(r["hosts"], r["bandwidth"]): r["limit_step_ms"] / 1e3
                               for r in rows if r.get("limit_step_ms")})
    in_phase = {hosts: seconds for (hosts, _), seconds in link_independent(
        {(r["hosts"], r["bandwidth"]): r["step_ms"] / 1e3
         for r in rows if r["algorithm"] == IN_PHASE}).items()}
    source = {hosts: IN_PHASE if hosts in in_phase else LIMIT for hosts, _ in limits}
    return {(hosts, link): in_phase.get(hosts, seconds)
            for (hosts, link), seconds in limits.items()}, source


def algorithm_overrides(spec_name: str) -> dict[str, list[str]]:
    """Each algorithm's own config overrides (`set`) in configs/bench/SPEC_NAME."""
    from tfdist.tools.config import configs_dir, read_yaml_mapping

    spec = read_yaml_mapping(configs_dir() / "bench" / spec_name, "benchmark spec")
    return {key: list(algorithm.get("set") or [])
            for key, algorithm in (spec.get("algorithms") or {}).items()}


def local_sgd_run(estimate, dense, period: int, synchronous: int,
                  steps: int) -> tuple[float, float]:
    """(mean step over the timed steps, mean bytes per step over all) of a local SGD run of
    `steps` steps as it ran: `synchronous` dense steps (`dense`), then local steps with one
    averaging round after every H of them, (steps - synchronous) // H rounds in all; the first
    step, which traces, is not timed. `estimate` is the planner's `local_sgd:H` (H = `period`),
    whose exchange and bytes are one round's spread over H steps."""
    rounds = (steps - synchronous) // period
    timed_dense = max(synchronous - 1, 0)
    timed_local = steps - 1 - timed_dense
    step_s = (timed_dense * dense.step_s + timed_local * estimate.compute_s
              + rounds * period * estimate.exchange_s) / max(steps - 1, 1)
    wire = (synchronous * dense.wire_bytes + rounds * period * estimate.wire_bytes) / steps
    return step_s, wire


def table(rows: list[dict]) -> str:
    models = any("model" in r for r in rows)  # a models suite's run: one column more
    lines = [("| model " if models else "") + "| hosts | link | algorithm | compute (ms) | "
             "predicted step (ms) | measured step (ms) | error | predicted bytes/step | "
             "counted bytes/step | error |",
             ("|---" if models else "") + "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bytes_error = "" if r["bytes_error"] is None else f"{r['bytes_error']:+.1%}"
        lines.append((f"| {r['model']} " if models else "") +
                     f"| {r['hosts']} | {r['bandwidth']} | {r['label']} | "
                     f"{r['compute_ms']:,.0f} | {r['predicted_ms']:,.0f} | "
                     f"{r['measured_ms']:,.0f} | {r['step_error']:+.1%} | "
                     f"{r['predicted_bytes']:,.0f} | {r['counted_bytes']:,.0f} | {bytes_error} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    errors = [abs(r["step_error"]) for r in rows]
    if not errors:
        return "no run to compare"
    within = sum(e <= 0.2 for e in errors)
    text = (f"step time: median error {statistics.median(errors):.1%}, {within} of "
            f"{len(errors)} runs within 20%")
    if any(r.get("compute_from") == IN_PHASE for r in rows):
        text += f"; compute: the `{IN_PHASE}` runs' step (the hosts in step, nothing exchanged)"
    return text


# stragglers suite algorithm -> the simulated one
STRAGGLERS = {"sync": "sync", "local_sgd": "local_sgd", "ps_sync": "ssp:0", "ssp1": "ssp:1",
              "ssp4": "ssp:4", "async": "async", "async_scaled": "async", "async_dc": "async",
              "sync_keras_update": "sync"}
FITTED = ("async", "ps_sync", "sync")  # the runs the simulation's inputs are fitted to


def first_epoch_stall_s(row: dict[str, Any]) -> float:
    """What a run's first epoch took beyond its timed steps at the pace of the later epochs
    (0 for a run of one epoch): a synchronous run's second step waits there for the slow
    worker's first update (its XLA compile, after the first all-reduce)."""
    curve = row["curve"]
    if len(curve) < 2 or curve[-1][2] <= curve[0][2]:
        return 0.0
    (first_s, _, first_steps), (last_s, _, last_steps) = curve[0], curve[-1]
    pace = (last_s - first_s) / (last_steps - first_steps)
    return max(0.0, first_s - (first_steps - 1) * pace)


def straggler_inputs(data: dict[str, Any]) -> dict[str, float]:
    """The simulation's compute, transfer and all-reduce seconds, from the mean chief steps of
    the run's asynchronous (a = c + t) and synchronous (p = f c + t) parameter servers and
    synchronous all-reduce (s = f c + e, its first epoch's stall left out), f the suite's
    slowdown; how late the slow worker starts (the synchronous servers' first chief step waits
    for it, the asynchronous ones' does not); and how long after the first all-reduce it ends
    its first step (the all-reduce's first-epoch stall, `first_epoch_stall_s`)."""
    runs = {r["algorithm"]: r for r in data["rows"]}
    steps = {name: mean_step_s(r) for name, r in runs.items()}
    missing = [a for a in FITTED if a not in steps]
    if missing:
        raise ValueError(f"--results: the stragglers run has no {', '.join(missing)} row: the "
                         f"simulation is fitted to {', '.join(FITTED)} (run them with "
                         "`tfdist bench --suite stragglers`)")
    f = float(data["straggler"]["slowdown"])
    stall = first_epoch_stall_s(runs["sync"])
    compute = (steps["ps_sync"] - steps["async"]) / (f - 1) if f > 1 else 0.0
    first = {name: r.get("first_step_s") for name, r in runs.items()}
    inputs = {"slowdown": f, "compute_s": compute, "transfer_s": steps["async"] - compute,
              "exchange_s": steps["sync"] - stall / max(runs["sync"]["steps"] - 1, 1) - f * compute,
              "first_update_s": stall,
              # the synchronous servers' first step waits for the slow worker's start-up, the
              # asynchronous ones' does not
              "late_s": max(0.0, (first["ps_sync"] or 0.0) - (first["async"] or 0.0))}
    if f <= 1 or min(inputs["compute_s"], inputs["transfer_s"], inputs["exchange_s"]) <= 0:
        raise ValueError(f"--results: the run's steps (async {steps['async']:.3f} s, ps_sync "
                         f"{steps['ps_sync']:.3f} s, sync {steps['sync']:.3f} s, slowdown {f:g}) "
                         "give no positive compute, transfer and all-reduce times to simulate")
    return inputs


def _local_sgd(job: list[str]) -> tuple[int, int]:
    """A suite's local SGD job: its averaging period and synchronous warm-up (read from
    configs/local_sgd.yaml and the job's overrides, without loading TensorFlow)."""
    from tfdist.tools.config import configs_dir, read_config

    averaging = read_config(configs_dir() / "local_sgd.yaml", job)["averaging"]
    return int(averaging["period"]), int(averaging.get("warmup_steps") or 0)


def _compiles_update(config_name: str, job: list[str]) -> bool:
    """Whether a suite's job (configs/`config_name` and the job's overrides) updates with an
    XLA-compiled function, which compiles where it first runs: after the first exchange."""
    from tfdist.tools.config import XLA_FUSED, configs_dir, load_config

    optimizer = load_config(configs_dir() / config_name, job)["optimizer"]
    fused = optimizer["fused_update"]
    return fused == "xla" or (fused is True and optimizer["name"] in XLA_FUSED)


def _step_reaching(row: dict[str, Any], target: float) -> int | None:
    """The chief's step at the end of the first epoch whose accuracy reached `target`."""
    return next((int(step) for _, accuracy, step in row["curve"] if accuracy >= target), None)


def compare_stragglers(data: dict[str, Any], inputs: dict[str, float]) -> list[dict]:
    """The simulation, given its `straggler_inputs`, against each run of a stragglers suite's
    results."""
    period, warmup = _local_sgd(data["job"])
    # the all-reduce's stall is its first XLA compile: a local SGD job compiles only if its
    # optimizer does, the all-reduce with Keras' update not at all
    first_update = {"sync": inputs["first_update_s"],
                    "local_sgd": inputs["first_update_s"] if _compiles_update(
                        "local_sgd.yaml", data["job"]) else 0.0}
    rows = []
    for r in data["rows"]:
        spec = STRAGGLERS.get(r["algorithm"])
        if spec is None:
            continue
        spec = f"local_sgd:{period}" if spec == "local_sgd" else spec
        run = simulate(spec, r["hosts"], inputs["compute_s"], r["steps"],
                       stragglers=Stragglers(slow=1, slowdown=inputs["slowdown"],
                                             late_s=inputs["late_s"],
                                             first_update_s=first_update.get(
                                                 r["algorithm"], 0.0)),
                       exchange_s=inputs["exchange_s"], transfer_s=inputs["transfer_s"],
                       warmup_steps=warmup if spec.startswith("local_sgd") else 0)
        clock = run.chief_clock
        counted = run.counted_staleness()  # as the servers count: "63 or more" last
        reached = _step_reaching(r, data["target_accuracy"])
        rows.append({"algorithm": r["algorithm"], "label": r["label"], "simulated": spec,
                     "fitted": r["algorithm"] in FITTED,
                     "predicted_ms": (clock[-1] - clock[0]) / max(len(clock) - 1, 1) * 1e3,
                     "measured_ms": mean_step_s(r) * 1e3,
                     "reached_at_step": reached,
                     "predicted_target_s": None if reached is None else clock[reached - 1] -
                     clock[0],
                     "measured_target_s": r["time_to_target_s"],
                     "predicted_staleness": histogram_mean(counted) if counted else None,
                     "measured_staleness": r.get("staleness_mean"),
                     "predicted_staleness_max": max(counted) if counted else None,
                     "measured_staleness_max": r.get("staleness_max")})
    base = next((r for r in rows if r["algorithm"] == "sync"), None)
    for r in rows:
        r["step_error"] = r["predicted_ms"] / r["measured_ms"] - 1
        r["predicted_ratio"] = r["measured_ratio"] = r["ratio_error"] = None
        if base and None not in (r["predicted_target_s"], r["measured_target_s"],
                                 base["predicted_target_s"], base["measured_target_s"]):
            r["predicted_ratio"] = r["predicted_target_s"] / base["predicted_target_s"]
            r["measured_ratio"] = r["measured_target_s"] / base["measured_target_s"]
            r["ratio_error"] = r["predicted_ratio"] / r["measured_ratio"] - 1
    return rows


def stragglers_table(rows: list[dict]) -> str:
    def cell(value, form):
        return "" if value is None else format(value, form)

    def staleness(mean, most):
        return "" if mean is None else f"{mean:.2f} (max {most})"

    lines = ["| algorithm | simulated as | mean chief step (ms), simulated | measured | error | "
             "time to target (s), simulated | measured | ratio to sync, simulated | measured | "
             "error | staleness: mean (max), simulated | measured |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['label']}{' (fitted)' if r['fitted'] else ''} | `{r['simulated']}` | "
            f"{r['predicted_ms']:,.0f} | {r['measured_ms']:,.0f} | {r['step_error']:+.0%} | "
            f"{cell(r['predicted_target_s'], '.1f')} | {cell(r['measured_target_s'], '.1f')} | "
            f"{cell(r['predicted_ratio'], '.2f')} | {cell(r['measured_ratio'], '.2f')} | "
            f"{cell(r['ratio_error'], '+.0%')} | "
            f"{staleness(r['predicted_staleness'], r['predicted_staleness_max'])} | "
            f"{staleness(r['measured_staleness'], r['measured_staleness_max'])} |")
    return "\n".join(lines)


def stragglers_summary(rows: list[dict]) -> str:
    predicted = [r for r in rows if not r["fitted"] and r["ratio_error"] is not None]
    order = [r["algorithm"] for r in sorted(rows, key=lambda r: r["measured_target_s"] or 1e9)]
    simulated = [r["algorithm"] for r in sorted(rows, key=lambda r: r["predicted_target_s"]
                                                or 1e9)]
    within = sum(abs(r["ratio_error"]) <= 0.25 for r in predicted)
    return (f"time to target, predicted runs: {within} of {len(predicted)} ratios to sync within "
            f"25%; measured order {', '.join(order)}; simulated order {', '.join(simulated)}")


# Published set-ups fed to the planner (`--published`): the paper's or page's own figures, and
# the single-device step time a source of the same period gives for its hardware.
HOROVOD_PAGE = ("Horovod's benchmark page (docs/benchmarks.rst, horovod/horovod): 128 servers "
                "x 4 Pascal GPUs, RoCE-capable 25 Gbit/s, tf_cnn_benchmarks at 64 images per GPU")
P100_PAGE = ("TensorFlow 1.x guide performance/benchmarks.md, DGX-1 (Tesla P100), synthetic "
             "data, batch 64 per GPU, May 2017")
PUBLISHED = (
    # model, trainable parameters (keras.applications, 1,000 classes), images/s on one P100,
    # the published scaling efficiency
    ("Inception V3", 23_817_352, 142.0, 0.90),
    ("VGG-16", 138_357_544, 154.0, 0.68),
)
PUBLISHED_ALGORITHMS = ("dense", "dense_overlap")
ZERO_PAPER = ("ZeRO (Rajbhandari et al., SC 2020, arXiv 1910.02054), Figure 1: the model "
              "states per device of a 7.5B-parameter model at data-parallel degree 64, "
              "mixed-precision Adam (K = 12)")
ZERO_FIGURE = (  # the planned algorithm, the paper's name for it, its figure in bytes
    ("dense", "baseline data parallelism", 120e9), ("zero1", "P_os (ZeRO-1)", 31.4e9),
    ("zero2", "P_os+g (ZeRO-2)", 16.6e9), ("zero3", "P_os+g+p (ZeRO-3)", 1.9e9))


def compare_published() -> list[dict]:
    """The planner on Horovod's published 512-GPU set-up: the scaling efficiency (compute step
    over step) it predicts with the exchange after the backward pass and overlapped with it,
    beside the published one. The step of 64 images is a P100's (`P100_PAGE`): Horovod's page
    names no GPU model, link latency or links inside a server (none is modelled)."""
    cluster = Cluster(512, Link(25.0), workers_per_host=4, engine="horovod")
    rows = []
    for model, parameters, images_per_s, published in PUBLISHED:
        work = Workload.from_parameters(parameters, 64 / images_per_s, optimizer_slots=0)
        plan = predict(work, cluster, list(PUBLISHED_ALGORITHMS))
        efficiency = {e.algorithm: work.compute_s / e.step_s for e in plan.estimates}
        rows.append({"setup": HOROVOD_PAGE, "step_source": P100_PAGE, "model": model,
                     "parameters": parameters, "workers": 512, "compute_ms": work.compute_s * 1e3,
                     "published": published,
                     **{f"planned_{a}": efficiency[a] for a in PUBLISHED_ALGORITHMS}})
    return rows + compare_zero_paper()


def compare_zero_paper() -> list[dict]:
    """The planner's model states per device (parameters, gradients, optimizer state with the
    master copy) for the ZeRO paper's Figure 1 (`ZERO_PAPER`), stage by stage. The paper counts
    no buffers; the planner's algorithm state (in mixed precision, ZeRO-3's gathered layer
    alone) is left out likewise."""
    work = Workload.from_parameters(7_500_000_000, 0.0, optimizer_slots=2, precision="mixed")
    plan = predict(work, Cluster(64, Link(25.0)), [spec for spec, _, _ in ZERO_FIGURE])
    planned = {e.algorithm: e.memory for e in plan.estimates}
    rows = []
    for spec, label, published in ZERO_FIGURE:
        memory = planned[spec]
        states = memory["parameters"] + memory["gradients"] + memory["optimizer_state"]
        rows.append({"setup": ZERO_PAPER, "model": "7.5B parameters", "workers": 64,
                     "stage": label, "published_bytes": published, "planned_bytes": states,
                     "memory_error": states / published - 1})
    return rows


def published_table(rows: list[dict]) -> str:
    """Each set-up's published efficiency, and the planner's with its relative error."""
    def planned(r: dict, algorithm: str) -> str:
        value = r[f"planned_{algorithm}"]
        return f"{value:.1%} ({value / r['published'] - 1:+.1%})"

    return "\n".join(
        ["| model | parameters | workers | compute step (ms) | published efficiency | "
         "planned, exchange after the backward pass | planned, overlapped with it |",
         "|---|---:|---:|---:|---:|---:|---:|"] +
        [" | ".join(["", r["model"], f"{r['parameters']:,}", str(r["workers"]),
                     f"{r['compute_ms']:.1f}", f"{r['published']:.0%}",
                     *(planned(r, a) for a in PUBLISHED_ALGORITHMS), ""]).strip()
         for r in rows])


def published_memory_table(rows: list[dict]) -> str:
    """The paper's model states per device, stage by stage, and the planner's."""
    return "\n".join(
        ["| model | workers | stage | published (GB/device) | planned (GB/device) | error |",
         "|---|---:|---|---:|---:|---:|"] +
        [f"| {r['model']} | {r['workers']} | {r['stage']} | {r['published_bytes'] / 1e9:g} | "
         f"{r['planned_bytes'] / 1e9:.2f} | {r['memory_error']:+.1%} |" for r in rows])


def published_memory_summary(rows: list[dict]) -> str:
    within = sum(abs(r["memory_error"]) <= 0.05 for r in rows)
    return (f"{within} of {len(rows)} stages within 5% of the paper's figure; set-up: "
            f"{rows[0]['setup']}")


def published_summary(rows: list[dict]) -> str:
    between = sum(r["planned_dense"] <= r["published"] <= r["planned_dense_overlap"]
                  for r in rows)
    return (f"{between} of {len(rows)} published figures between the planner's two bounds; "
            f"set-up: {rows[0]['setup']}; step times: {rows[0]['step_source']}")


# memory suite column -> the planned algorithm whose memory it measured
MEMORY = {"baseline": ("dense", "dense exchange"), "zero1": ("zero1", "ZeRO-1"),
          "zero2": ("zero2", "ZeRO-2"), "zero3": ("zero3", "ZeRO-3")}


def compare_memory(data: dict[str, Any]) -> list[dict]:
    """The planner's memory per device against a memory suite's run (`tfdist bench --suite
    memory`): per replica, the optimizer's own bytes as that suite reads them from where each
    variable was placed (`tfdist.zero.memory_report`): Adam's state and the gradient buffers,
    ZeRO-1/2's fp32 parameter shard, ZeRO-3's share of the model. The model is the suite's
    MLP, whose shapes its dimensions give."""
    model = data["model"]
    widths = [model["input_dim"], *model["hidden"], model["classes"]]
    shapes = [s for a, b in zip(widths, widths[1:]) for s in ((a, b), (b,))]
    rows = []
    for r in data["rows"]:
        if sum(math.prod(s) for s in shapes) != r["parameters"]:
            raise ValueError(f"--results: the memory run's model has {r['parameters']:,} "
                             f"parameters, not the {widths} MLP's; give a memory suite's run")
        workload = Workload(tuple(shapes), 0.0, optimizer_slots=2)  # Adam's two slots
        for column, (spec, label) in MEMORY.items():
            (estimate,) = predict(workload, Cluster(r["replicas"], Link(1.0)), [spec]).estimates
            planned = estimate.memory
            predicted = planned["optimizer_state"] + planned["gradients"] + (
                planned["algorithm_state"] if spec in ("zero1", "zero2") else 0) + (
                planned["parameters"] if spec == "zero3" else 0)
            rows.append({"replicas": r["replicas"], "stage": column, "label": label,
                         "predicted_bytes": predicted, "measured_bytes": r[column],
                         "memory_error": predicted / r[column] - 1})
    return rows


def memory_table(rows: list[dict]) -> str:
    lines = ["| replicas | algorithm | predicted bytes/replica | measured bytes/replica | error |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['replicas']} | {r['label']} | {r['predicted_bytes']:,} | "
              f"{r['measured_bytes']:,} | {r['memory_error']:+.1%} |" for r in rows]
    return "\n".join(lines)


def memory_summary(rows: list[dict]) -> str:
    within = sum(abs(r["memory_error"]) <= 0.05 for r in rows)
    return (f"memory per replica: {within} of {len(rows)} within 5%, largest error "
            f"{max(abs(r['memory_error']) for r in rows):.1%}")


def page_table(result: dict[str, Any]) -> str:
    """The benchmark page's section of a plan result (what `run_plan` saved): the run it was
    set beside, then the table and its summary."""
    rows, measured = result["rows"], result.get("measured")
    if measured is None:  # the published set-ups: nothing measured here
        return "\n\n".join(_sections(rows))
    return "\n\n".join([f"Against `{measured['command']}`, measured on {measured['date']} on "
                          f"{measured['machine']}:", *_sections(rows)])


def _sections(rows: list[dict]) -> list[str]:
    """A comparison's table and summary, for whichever suite's run it was set beside."""
    if rows and "simulated" in rows[0]:
        return [stragglers_table(rows), stragglers_summary(rows)]
    if rows and "setup" in rows[0]:  # the published set-ups: efficiency, then memory
        scaling = [r for r in rows if "published" in r]
        memory = [r for r in rows if "published_bytes" in r]
        return [published_table(scaling), published_summary(scaling)] + (
            [published_memory_table(memory), published_memory_summary(memory)] if memory else [])
    if rows and "stage" in rows[0]:
        return [memory_table(rows), memory_summary(rows)]
    return [table(rows), summary(rows)]


def run_plan(quick: bool, out: str, hosts=None, bandwidths=None, algorithms=None,
             results: str | None = None, calibrate: str | None = None,
             published: bool = False) -> list[dict]:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if published:
        if results or calibrate:
            raise ValueError("--published feeds the papers' own set-ups to the planner: it takes "
                             "no --results or --calibrate")
        return _write_plan(out_dir, "tfdist bench --suite plan --published", None,
                           compare_published(), "The planner on published set-ups.")
    unknown = sorted(set(algorithms or ()) - set(ALGORITHMS))
    if unknown:
        raise ValueError(f"--algorithms: the planner predicts {', '.join(ALGORITHMS)}; "
                         f"not {', '.join(unknown)}")
    if calibrate:
        Calibration.from_results(calibrate)  # a missing directory is refused before any run
    if results is None:
        from tfdist.tools.bench.comm import run_comm

        run_comm(quick, str(out_dir / "comm"), hosts, bandwidths,
                 algorithms or list(ALGORITHMS))
        results = str(out_dir / "comm" / "comm.json")
    if not Path(results).is_file():
        raise ValueError(f"--results {results!r} does not exist: give a comm.json, "
                         "models.json, stragglers.json or memory.json written by `tfdist bench`")
    data = json.loads(Path(results).read_text())
    if "straggler" in data:  # a stragglers suite's run: the simulation
        inputs = straggler_inputs(data)
        rows = compare_stragglers(data, inputs)
        head = (f"Simulated by `tfdist.plan.simulate` for `{data['command']}` (measured "
                f"{data['date']}, {data['machine']}), fitted: compute "
                f"{inputs['compute_s'] * 1e3:.1f} ms, slowdown {inputs['slowdown']:g}, transfer "
                f"{inputs['transfer_s'] * 1e3:.1f} ms, all-reduce {inputs['exchange_s'] * 1e3:.1f}"
                f" ms, the slow worker's late start {inputs['late_s']:.2f} s, its first update"
                f" {inputs['first_update_s']:.2f} s after the first all-reduce.")
    elif data["rows"] and "zero1" in data["rows"][0]:  # a memory suite's run
        rows = compare_memory(data)
        head = (f"Memory planned by `tfdist.plan` for `{data['command']}` (measured "
                f"{data['date']}, {data['machine']}).")
    else:
        rows = (compare_models(data, calibrate) if "models" in data  # a models suite's run
                else compare(data, job_model(data["job"]), calibrate))
        sources = dict.fromkeys(r["calibration"] for r in rows)
        head = (f"Predicted by `tfdist.plan` for `{data['command']}` (measured {data['date']}, "
                f"{data['machine']}); calibration: {'; '.join(sources) or 'none'}.")
    command = f"tfdist bench --suite plan --results {results}" + (
        f" --calibrate {calibrate}" if calibrate else "")
    return _write_plan(out_dir, command, {k: data[k] for k in ("command", "date", "machine")},
                       rows, head)


def _write_plan(out_dir: Path, command: str, measured: dict | None, rows: list[dict],
                head: str) -> list[dict]:
    text = "\n\n".join([head, *_sections(rows)]) + "\n"
    (out_dir / "plan.md").write_text(text)
    extra = {"measured": measured} if measured else {}
    (out_dir / "plan.json").write_text(json.dumps(
        {**stamp(command), **extra, "rows": rows}, indent=2) + "\n")
    print(text)
    print(f"bench: wrote {out_dir / 'plan.md'} and {out_dir / 'plan.json'}")
    return rows
