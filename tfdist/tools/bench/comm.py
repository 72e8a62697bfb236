"""`tfdist bench --suite comm`: which algorithm wins on which network, on an emulated cluster.

For every (hosts, link bandwidth) of the spec (configs/bench/comm.yaml), an emulated cluster is
created (tfdist.tools.emulated: one network namespace per host, links shaped by tc) and every algorithm
trains the spec's job there as one TF_CONFIG worker per host (`tfdist train`, engine
multi_worker). Per run: the test accuracy after every epoch against the training time so far
(the sum of the step times, the first, tracing, step left out), the time to the target accuracy,
the final accuracy, the bytes each worker sent per step (counted by the optimizer, and on the wire
from the hosts' interface counters, set-up traffic included), and the median step time.

The zero-communication limit: the same workers, on the same hosts at the same time, run the job's
steps with no exchange at all (each trains alone on its share of the batch), which gives the
compute-only step time: the median, over the hosts, of each host's median step among those
that ran while every host was in its timed steps (`concurrent_step_ms`: the hosts start apart,
and a host's steps while others are still starting or done would not share the machine as a
run's do); the limit's accuracy curve is the baseline's (synchronous training does the same
arithmetic whatever the network), at that step time.

Once the limit has run, every run of that cluster gets a per-step breakdown (`breakdown`):
compute, the limit's step (measured: the forward and backward passes and the optimizer's
update); wire, the bytes the worker sends per step (counted by its optimizer; for Keras' own
exchange, its formula: `tfdist.tools.bench.baselines.keras_exchange`) at the link's
rate; compressor, the compressor's own work on the model's gradients (measured in this process over a loopback
communicator, as the compressors suite does); and the rest of the step (latency, framework
work, the hosts sharing this machine's cores), negative where communication overlapped
computation.

Everything is validated before any namespace is created. Results are written after every run
(nothing is lost if a later run fails): OUT/comm.md, OUT/comm.json, OUT/comm_accuracy_<N>hosts.png
and OUT/comm_bytes.png; each run's summary, worker logs and TensorBoard logs go to
OUT/comm/<N>hosts-<bandwidth>/<algorithm>/.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tfdist.tools import emulated
from tfdist.tools.bench.machine import stamp
from tfdist.tools.config import ConfigError, configs_dir, load_config, read_yaml_mapping

SPEC = "bench/comm.yaml"
LIMIT = "limit"
AUTO = "auto"  # the exchange picked from the measured link: judged against the fixed ones
_SPEC_KEYS = {"job", "target_accuracy", "hosts", "bandwidths", "delay", "run_timeout_seconds",
              "algorithms", "default_algorithms", "quick"}


@dataclass
class Algorithm:
    key: str
    label: str
    config: Path
    overrides: list[str]


@dataclass
class Plan:
    algorithms: list[Algorithm]
    hosts: list[int]
    bandwidths: list[str]
    delay: str | None
    target_accuracy: float
    job: list[str]
    timeout: float
    spec_path: Path
    configs: dict[tuple[int, str], dict] = field(default_factory=dict)  # (hosts, key) -> config

    @property
    def baseline(self) -> str:
        """The algorithm every ratio is taken against: the spec's first."""
        return self.algorithms[0].key

    @property
    def runs(self) -> int:
        return len(self.hosts) * len(self.bandwidths) * (len(self.algorithms) + 1)


def load_plan(spec_path: str | Path | None = None, quick: bool = False,
              hosts: list[str] | None = None, bandwidths: list[str] | None = None,
              algorithms: list[str] | None = None, job: list[str] | None = None) -> Plan:
    """Reads and checks the spec and the command-line selection; builds and validates every
    run's config. Raises ConfigError (naming the value and the fix) before anything starts."""
    path = Path(spec_path) if spec_path else configs_dir() / SPEC
    spec = read_yaml_mapping(path, "benchmark spec")
    errors = [f"{path}: unknown key '{k}'; allowed: {', '.join(sorted(_SPEC_KEYS))}"
              for k in spec if k not in _SPEC_KEYS]
    table = spec.get("algorithms") or {}
    quick_spec = (spec.get("quick") or {}) if quick else {}
    selected = (algorithms if algorithms is not None
                else quick_spec.get("algorithms", spec.get("default_algorithms", list(table))))
    unknown = [a for a in selected if a not in table]
    if unknown:
        errors.append(f"--algorithms: unknown {', '.join(map(repr, unknown))}; choose from "
                      f"{', '.join(table)} (defined in {path})")
    if not table:
        errors.append(f"{path}: no algorithms")
    else:
        baseline = next(iter(table))
        selected = [baseline, *[a for a in selected if a != baseline]]  # the baseline always runs
    host_counts = hosts if hosts is not None else quick_spec.get("hosts", spec.get("hosts", [2]))
    parsed_hosts = []
    for h in host_counts:
        try:
            n = int(h)
            if n < 2:
                raise ValueError
            parsed_hosts.append(n)
        except (TypeError, ValueError):
            errors.append(f"hosts: got {h!r}; must be integers >= 2")
    links = (bandwidths if bandwidths is not None
             else quick_spec.get("bandwidths", spec.get("bandwidths", ["1gbit"])))
    for b in links:
        try:
            emulated.parse_bandwidth(b)
        except ValueError as e:
            errors.append(f"bandwidths: {e}")
    delay = spec.get("delay")
    if delay is not None:
        try:
            emulated.parse_delay(delay)
        except ValueError as e:
            errors.append(f"delay: {e}")
    target = spec.get("target_accuracy", 0.95)
    if not isinstance(target, (int, float)) or not 0 < target < 1:
        errors.append(f"target_accuracy: got {target!r}; must be a number in (0, 1)")
    job = [*spec.get("job", []), *quick_spec.get("set", []), *(job or [])]
    algos = []
    for key in selected if not unknown else []:
        entry = table[key] or {}
        bad = set(entry) - {"label", "config", "set"}
        if bad:
            errors.append(f"algorithms.{key}: unknown keys {sorted(bad)}; allowed: label, "
                          "config, set")
        algos.append(Algorithm(key, entry.get("label", key),
                               configs_dir() / entry.get("config", "default.yaml"),
                               list(entry.get("set", []))))
    if errors:
        raise ConfigError("Invalid benchmark:\n  " + "\n  ".join(errors))
    algos = _drop_horovod_if_missing(algos, explicit=algorithms is not None)
    for n in parsed_hosts:  # more hosts than this machine holds: refused here, not midway
        try:
            emulated.check_can_emulate(n, emulated.parse_delay(delay) if delay else 0.0)
        except (ValueError, RuntimeError, OSError) as e:
            raise ConfigError(f"hosts: {e}") from e
    plan = Plan(algos, parsed_hosts, list(links), delay, float(target), job,
                float(spec.get("run_timeout_seconds", 3600)), path)
    for n in parsed_hosts:
        for algo in algos:
            plan.configs[(n, algo.key)] = _run_config(plan, algo, n)
        plan.configs[(n, LIMIT)] = _limit_config(plan.configs[(n, algos[0].key)], n)
    return plan


def _drop_horovod_if_missing(algos: list[Algorithm], explicit: bool) -> list[Algorithm]:
    from tfdist.horovod import is_available

    horovod = [a for a in algos if "engine.name=horovod" in a.overrides]
    if not horovod or is_available():
        return algos
    names = ", ".join(a.key for a in horovod)
    if explicit:
        raise ConfigError(f"--algorithms: {names} need(s) Horovod, which is not installed: "
                          "build it with launch/build_horovod.sh (BUILD.md)")
    print(f"bench: Horovod is not installed; leaving out {names}", file=sys.stderr)
    return [a for a in algos if a not in horovod]


def _overrides(plan: Plan, algo: Algorithm) -> list[str]:
    return [*plan.job, "engine.name=multi_worker", *algo.overrides, "train.verbose=0",
            "train.evaluate_each_epoch=true"]


def _run_config(plan: Plan, algo: Algorithm, hosts: int) -> dict:
    try:
        config = load_config(algo.config, _overrides(plan, algo))
    except ConfigError as e:
        raise ConfigError(f"algorithms.{algo.key} ({algo.config}): {e}") from e
    batch = config["data"]["global_batch_size"]
    if batch % hosts:
        raise ConfigError(f"algorithms.{algo.key}: data.global_batch_size {batch} does not "
                          f"divide by {hosts} hosts; use a multiple of {hosts}")
    return config


LIMIT_STEPS = 60  # steps each host runs for the compute-only step time
CONCURRENT_STEPS = 5  # fewest steps a host must run while every host runs for them to count


def _limit_config(baseline: dict, hosts: int) -> dict:
    """The baseline's job on one worker's share of the batch, with no exchange."""
    config = copy.deepcopy(baseline)
    config["engine"]["name"] = "single"
    config["data"]["global_batch_size"] //= hosts
    config["train"].update(steps_per_epoch=LIMIT_STEPS, epochs=1, evaluate_each_epoch=False)
    return config


# -- running -----------------------------------------------------------------------------------

class Progress:
    """Two bars on one line: the sweep (runs done) and the current run (epochs done)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done = total, 0
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label, self.start = "", time.monotonic()

    @staticmethod
    def bar(done: float, total: float, width: int = 16) -> str:
        filled = int(width * min(done / total, 1.0)) if total else width
        return "#" * filled + "." * (width - filled)

    def begin(self, label: str) -> None:
        self.label = label
        self.show(0, 1, "starting")

    def show(self, epoch: int, epochs: int, note: str) -> None:
        elapsed = time.monotonic() - self.start
        line = (f"bench: [{self.bar(self.done, self.total)}] run "
                f"{min(self.done + 1, self.total)}/{self.total} "
                f"{self.label} [{self.bar(epoch, epochs, 10)}] {note} ({elapsed:.0f} s)")
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end(self, note: str) -> None:
        self.done += 1
        self.show(1, 1, note)
        if self.tty:
            self.stream.write("\n")


def _run(cluster: emulated.EmulatedCluster, config: dict, run_dir: Path, timeout: float,
         progress: Progress) -> dict:
    """One run on the cluster (`tfdist train` per host); returns host 0's summary plus the
    bytes each host sent on its link."""
    from tfdist.tools.workload import EVAL_TAG

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    # One output directory per host: without an exchange (the limit) every host is a chief,
    # a job of its own, so its process gets no TF_CONFIG (a one-process engine refuses one).
    engine = config["engine"]["name"]
    alone = ["env", "-u", "TF_CONFIG"] if engine == "single" else []
    argv = [*alone, sys.executable, "-m", "tfdist.tools.cli", "train", "--config",
            str(config_path)]

    def host_argv(host: int) -> list[str]:
        return [*argv, "--set", f"train.output_dir={run_dir / f'host{host}'}",
                "--set", "train.run_name=run", "--set", "train.save_model=false"]

    def on_line(rank: int, line: str) -> None:
        if rank == 0 and line.startswith(EVAL_TAG):
            r = json.loads(line[len(EVAL_TAG):])
            progress.show(r["epoch"], r["epochs"], f"epoch {r['epoch']}/{r['epochs']}: "
                          f"accuracy {r['test_accuracy']:.4f}, {r['train_seconds']:.1f} s")

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    before = cluster.tx_bytes()
    if engine == "horovod":
        results = cluster.run_horovod_workers(host_argv, timeout, env=env, on_line=on_line)
    else:  # a parameter server runs on host 0, next to worker 0
        results = cluster.run_workers(host_argv, timeout, env=env, on_line=on_line,
                                      ps=int(engine == "parameter_server"))
    sent = [b - a for a, b in zip(before, cluster.tx_bytes())]
    for r in results:
        name = f"worker{r.rank}" if r.rank < cluster.hosts else f"ps{r.rank - cluster.hosts}"
        (run_dir / f"{name}.log").write_text(r.output)
    if any(r.returncode != 0 for r in results):
        codes = [r.returncode for r in results]
        tail = results[0].output[-1500:] if results[0].returncode else next(
            r.output[-1500:] for r in results if r.returncode != 0)
        raise RuntimeError(f"workers exited with {codes} (None: stopped); logs in {run_dir}:\n"
                           f"{tail}")
    summary = json.loads((run_dir / "host0" / "run" / "summary.json").read_text())
    summary["wire_bytes_per_host"] = sent
    return summary


def _per_host(sent: list[int]) -> float:
    return sum(sent) / len(sent)


def _time_to(log: list[dict], target: float) -> float | None:
    return next((r["train_seconds"] for r in log if r["test_accuracy"] >= target), None)


def _row(plan: Plan, hosts: int, link: str, algo: Algorithm, s: dict) -> dict:
    steps = s["steps"]
    return {"hosts": hosts, "bandwidth": link, "algorithm": algo.key, "label": algo.label,
            "time_to_target_s": _time_to(s["epoch_log"], plan.target_accuracy),
            "final_accuracy": s["test_accuracy"], "steps": steps,
            "train_seconds": s["epoch_log"][-1]["train_seconds"],
            "bytes_per_step": s["bytes_sent_per_step"], "bytes_counted": s["bytes_counted"],
            "collectives_per_step": s["collectives_per_step"],
            "wire_bytes_per_step": _per_host(s["wire_bytes_per_host"]) / steps,
            "step_ms": s["step_ms_median"], "parameters": s["trainable_parameters"],
            "auto_choice": (s.get("auto") or {}).get("choice"),
            # Worker 0's seconds from its process' start to the end of its first step.
            "startup_s": (s.get("startup_seconds") or {}).get("total"),
            "first_step_s": (s.get("startup_seconds") or {}).get("first_step"),
            # Worker 0's profiled step (train.profile_step), or None.
            "timeline": s.get("timeline"),
            **_load(s),
            "curve": [(r["train_seconds"], r["test_accuracy"], r["steps"])
                      for r in s["epoch_log"]]}


def concurrent_step_ms(spans: list[list[list[float]]]) -> tuple[float, int]:
    """The median over the hosts of each host's median step (ms) among its steps that began and
    ended while every host was in its timed steps, from each host's `step_spans` ([begin, end]
    per step, one clock); and the fewest such steps of a host. The window runs from the
    latest first timed step (every host's first, tracing, step left out) to the earliest last
    end. Where some host ran fewer than `CONCURRENT_STEPS` steps in it (the hosts barely
    overlapped), every host's timed steps count, and the count returned says so."""
    import numpy as np

    timed = [host[1:] or host for host in spans]
    begin, end = max(t[0][0] for t in timed), min(t[-1][1] for t in timed)
    inside = [[e - b for b, e in t if b >= begin and e <= end] for t in timed]
    fewest = min(len(steps) for steps in inside)
    if fewest < CONCURRENT_STEPS:
        inside = [[e - b for b, e in t] for t in timed]
    return 1000.0 * float(np.median([np.median(steps) for steps in inside])), fewest


def _hosts_spans(run_dir: Path, hosts: int) -> list[list[list[float]]]:
    """Every host's `step_spans` in a limit run's directory (every host a chief)."""
    return [json.loads((run_dir / f"host{host}" / "run" / "summary.json").read_text())
            ["step_spans"] for host in range(hosts)]


def _limit_row(plan: Plan, hosts: int, link: str, baseline: dict, s: dict,
               spans: list[list[list[float]]]) -> dict:
    step_ms, concurrent = concurrent_step_ms(spans)
    if concurrent < CONCURRENT_STEPS:
        print(f"bench: {hosts} hosts @ {link}: the limit's hosts ran {concurrent} steps at "
              "the same time; its step is every host's timed steps'", file=sys.stderr)
    step_s = step_ms / 1000  # the first step is left out, as in the runs' times
    curve = [(round((steps - 1) * step_s, 4), acc, steps) for _, acc, steps in baseline["curve"]]
    reached = next((t for t, a, _ in curve if a >= plan.target_accuracy), None)
    return {"hosts": hosts, "bandwidth": link, "algorithm": LIMIT,
            "label": "zero-communication limit (baseline's steps, no exchange)",
            "time_to_target_s": reached, "final_accuracy": baseline["final_accuracy"],
            "steps": baseline["steps"], "train_seconds": curve[-1][0], "bytes_per_step": 0.0,
            "bytes_counted": True, "collectives_per_step": 0.0,
            "wire_bytes_per_step": _per_host(s["wire_bytes_per_host"]) / s["steps"],
            "step_ms": step_ms, "worker0_step_ms": s["step_ms_median"],
            "concurrent_steps": concurrent, "parameters": baseline["parameters"],
            **_load(s), "curve": curve}


def _load(s: dict) -> dict:
    """The machine's cores busy during worker 0's timed steps (`machine_load`: `cores`,
    `busy_cores`, `busy_core_ms_per_step`; every emulated host shares them), and worker 0's own
    CPU per step by thread (`thread_core_ms_per_step`). Empty for a summary without the
    measurement."""
    return dict(s.get("machine_load") or {})


def compressor_ms(run_dir: Path, repeats: int = 10, picked: str | None = None) -> float:
    """The compressor's own work per step on the model of the run in `run_dir` (its
    config.yaml): one exchange of the gradients it compresses, over a loopback communicator;
    0 for a dense exchange. An `auto` run's is that of the candidate it `picked`."""
    import numpy as np

    from tfdist import compression
    from tfdist.optimizers import AutoExchange
    from tfdist.tools.bench.compressors import time_exchange
    from tfdist.tools.parts import make_compressor
    from tfdist.tools.workload import load_data, make_model

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    section = config["compression"]
    if section["name"] == AUTO:
        chosen = [c.compressor for c in AutoExchange(**section["options"]).candidates
                  if c.name == picked]
        compressor = compression.get(chosen[0]) if chosen and chosen[0] is not None else None
    else:
        compressor = make_compressor(section)
    if compressor is None:
        return 0.0
    model = make_model(config, load_data(config))
    shapes = [tuple(v.shape) for v in model.trainable_weights
              if int(np.prod(v.shape)) >= section["min_size"]
              and (len(v.shape) >= 2 or section["compress_1d"])
              and compressor.applies_to(v.shape)]
    return time_exchange(compressor, repeats=repeats, shapes=shapes)["ms"] if shapes else 0.0


def mean_step_s(row: dict[str, Any]) -> float:
    """A run's mean step: its training time over its timed steps (the first, tracing, step left
    out). Unlike the median, it holds local SGD's averaging rounds."""
    return row["train_seconds"] / max(row["steps"] - 1, 1)


def breakdown(row: dict, compute_ms: float | None, compressor: float) -> dict:
    """Compute, wire, compressor and the rest of one row's mean step, in ms (None: no limit
    run). Wire and compressor are per step on average, as the bytes are."""
    if compute_ms is None:
        return {}
    step = 1000.0 * mean_step_s(row)
    wire = 1000.0 * 8 * row["bytes_per_step"] / emulated.parse_bandwidth(row["bandwidth"])
    return {"mean_step_ms": step, "compute_ms": compute_ms, "wire_ms": wire,
            "compressor_ms": compressor, "rest_ms": step - compute_ms - wire - compressor}


def _add_breakdowns(ran: list[tuple[dict, Path]], limit: dict) -> None:
    """Each run of one cluster (row, run directory), not its `limit` row, gets `breakdown`
    against the limit's step, and the cores busy during the limit's steps."""
    for row, run_dir in ran:
        if row["algorithm"] != LIMIT:
            work = compressor_ms(run_dir, picked=row.get("auto_choice")) \
                if (run_dir / "config.yaml").exists() else 0.0
            row.update(breakdown(row, limit["step_ms"], work))
            if "busy_cores" in limit:
                row["limit_busy_cores"] = limit["busy_cores"]
            if "thread_core_ms_per_step" in limit:
                row["limit_thread_core_ms_per_step"] = limit["thread_core_ms_per_step"]


def run(plan: Plan, out_dir: Path, command: str) -> list[dict]:
    """Runs the plan; writes the table, JSON and plots after every run."""
    out_dir = out_dir.resolve()  # the hosts' shared storage: the only files they share
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(plan.runs)
    rows: list[dict] = []
    failures: list[str] = []
    for hosts in plan.hosts:
        for link in plan.bandwidths:
            with emulated.EmulatedCluster(hosts, link, plan.delay, shared=[out_dir]) as cluster:
                baseline: dict | None = None
                ran: list[tuple[dict, Path]] = []  # this cluster's rows and their run dirs
                for algo in [*plan.algorithms, None]:
                    key = LIMIT if algo is None else algo.key
                    where = f"{hosts} hosts @ {link}"
                    progress.begin(f"{where}: {algo.label if algo else LIMIT}")
                    run_dir = out_dir / "comm" / f"{hosts}hosts-{link}" / key
                    try:
                        if algo is None and baseline is None:
                            raise RuntimeError("the baseline run failed; no limit without it")
                        s = _run(cluster, plan.configs[(hosts, key)], run_dir, plan.timeout,
                                 progress)
                    except RuntimeError as e:
                        failures.append(f"{where}, {key}: {e}")
                        progress.end(f"FAILED ({str(e).splitlines()[0]})")
                        continue
                    if algo is None:
                        assert baseline is not None
                        row = _limit_row(plan, hosts, link, baseline, s,
                                         _hosts_spans(run_dir, hosts))
                    else:
                        row = _row(plan, hosts, link, algo, s)
                        if algo is plan.algorithms[0]:
                            baseline = row
                    rows.append(row)
                    ran.append((row, run_dir))
                    progress.end(f"accuracy {row['final_accuracy']:.4f}, "
                                 f"{row['step_ms']:.0f} ms/step")
                    write(plan, rows, failures, out_dir, command)
                if ran and ran[-1][0]["algorithm"] == LIMIT:  # written first: nothing lost
                    _add_breakdowns(ran, ran[-1][0])
    write(plan, rows, failures, out_dir, command)
    if failures:
        raise RuntimeError(f"{len(failures)} of {plan.runs} runs failed:\n" + "\n".join(failures))
    return rows


# -- output ------------------------------------------------------------------------------------

def _fmt_time(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.1f}"


def page_table(result: dict) -> str:
    """The benchmark page's tables, from the suite's JSON (what `write` saved)."""
    return _with_breakdown(table(result["target_accuracy"], result["baseline"], result["rows"]),
                           result["rows"])


def _with_breakdown(text: str, rows: list[dict]) -> str:
    if not any("compute_ms" in r for r in rows):  # no limit run (or a result saved before)
        return text
    return f"{text}\n\nPer-step breakdown (ms):\n\n{breakdown_table(rows)}"


def breakdown_table(rows: list[dict]) -> str:
    """The rows' `breakdown`s, with each run's start-up; a model column where rows name one
    (the models suite)."""
    models = any("model" in r for r in rows)
    profiled = any(r.get("timeline") for r in rows)
    loaded = any("busy_cores" in r for r in rows)
    threads = any("thread_core_ms_per_step" in r for r in rows)
    lines = [("| model " if models else "") + "| hosts | link | algorithm | mean step (ms) | compute | "
             "wire at link rate | compressor | rest | "
             + ("profiled step: span, exposed communication, update | " if profiled else "")
             + ("cores busy: run, limit | " if loaded else "")
             + ("worker 0's core-ms per step: op pools + other threads, run; limit | "
                if threads else "") + "start-up (s) | first step (s) |",
             ("|---" if models else "") + "|---:|---|---|---:|---:|---:|---:|---:|"
             + ("---:|" if profiled else "") + ("---:|" if loaded else "")
             + ("---:|" if threads else "") + "---:|---:|"]
    for r in rows:
        if "compute_ms" in r:
            lines.append((f"| {r['model']} " if models else "") +
                         f"| {r['hosts']} | {r['bandwidth']} | {r['label']} | "
                         f"{r['mean_step_ms']:.0f} | {r['compute_ms']:.0f} | {r['wire_ms']:.0f} | "
                         f"{r['compressor_ms']:.0f} | {r['rest_ms']:.0f} | "
                         + (f"{_profiled(r)} | " if profiled else "")
                         + (f"{busy_cores(r)} | " if loaded else "")
                         + (f"{thread_split(r)} | " if threads else "")
                         + f"{_seconds(r.get('startup_s'))} | {_seconds(r.get('first_step_s'))} |")
    return "\n".join(lines)


def busy_cores(row: dict) -> str:
    """The cores busy, on average, during a row's steps and during its limit's (every emulated
    host shares them), e.g. "1.96, 2.00 of 2", or n/a."""
    if "busy_cores" not in row:
        return "n/a"
    limit = row.get("limit_busy_cores")
    return (f"{row['busy_cores']:.2f}, " + ("n/a" if limit is None else f"{limit:.2f}")
            + f" of {row['cores']}")


def thread_split(row: dict) -> str:
    """Worker 0's own CPU per step, TensorFlow's op pools + every other thread (the training
    loop's and the transport's), in its run and in its limit's: e.g. "1056 + 270; 1157 + 60",
    or n/a."""
    from tfdist.tools.cpu_load import thread_groups  # (imports Keras)

    def split(core_ms: dict | None) -> str:
        if core_ms is None:
            return "n/a"
        compute, other = thread_groups(core_ms)
        return f"{compute:.0f} + {other:.0f}"

    if "thread_core_ms_per_step" not in row:
        return "n/a"
    return (f"{split(row['thread_core_ms_per_step'])}; "
            f"{split(row.get('limit_thread_core_ms_per_step'))}")


def _profiled(row: dict) -> str:
    """A row's profiled step: its span, exposed communication and update time (ms), or n/a.
    A profile that saw no collective in a run that made at least one every step cannot say
    what was exposed (n/a)."""
    timeline = row.get("timeline")
    if not timeline:
        return "n/a"
    unseen = timeline["communication_ms"] == 0
    exposed = "n/a" if unseen and row["collectives_per_step"] >= 1 else \
        f"{timeline['exposed_communication_ms']:.0f}"
    return f"{timeline['span_ms']:.0f}, {exposed}, {timeline['busy_ms']['update']:.0f}"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def table(target_accuracy: float, baseline: str, rows: list[dict]) -> str:
    """One row per run; ratios against the run of algorithm `baseline` on the same cluster."""
    lines = [f"| hosts | link | algorithm | time to {target_accuracy:.0%} (s) | speed-up vs "
             "baseline | final accuracy | vs baseline (pt) | bytes/step/worker | wire bytes/step/"
             "host | collectives/step | step time (ms) | step time vs baseline |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["hosts"], r["bandwidth"]): r for r in rows if r["algorithm"] == baseline}
    for r in rows:
        b = base.get((r["hosts"], r["bandwidth"]))
        speedup = (f"{b['time_to_target_s'] / r['time_to_target_s']:.2f}x"
                   if b and b["time_to_target_s"] and r["time_to_target_s"] else "n/a")
        counted = f"{r['bytes_per_step']:,.0f}" + ("" if r["bytes_counted"] else " (formula)")
        label = r["label"] + (f": picked {r['auto_choice']}" if r.get("auto_choice") else "")
        lines.append(
            f"| {r['hosts']} | {r['bandwidth']} | {label} | {_fmt_time(r['time_to_target_s'])}"
            f" | {speedup} | {r['final_accuracy']:.4f} | "
            + (f"{100 * (r['final_accuracy'] - b['final_accuracy']):+.1f}" if b else "n/a")
            + f" | {counted} | {r['wire_bytes_per_step']:,.0f} | "
            + f"{r.get('collectives_per_step', float('nan')):.2f} | {r['step_ms']:.0f} | "
            + (f"{r['step_ms'] / b['step_ms']:.3f} |" if b else "n/a |"))
    return "\n".join(lines)


def plots(rows: list[dict], target_accuracy: float, out_dir: Path) -> list[Path]:
    """The sweep's figures in `out_dir`: accuracy against training time per host count (a
    panel per link, slowest first, `target_accuracy` dotted) and the bytes per step."""
    from tfdist.tools.bench.plots import pyplot

    plt = pyplot()  # matplotlib, or the extra that installs it named
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    written = []
    for hosts in sorted({r["hosts"] for r in rows}):
        links = sorted({r["bandwidth"] for r in rows if r["hosts"] == hosts},
                       key=emulated.parse_bandwidth)
        fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4.6), squeeze=False)
        for ax, link in zip(axes[0], links):
            for r in rows:
                if r["hosts"] == hosts and r["bandwidth"] == link:
                    t, a, _ = zip(*r["curve"])
                    ax.plot(t, a, marker="o", ms=3, label=r["label"],
                            linestyle="--" if r["algorithm"] == LIMIT else "-")
            ax.axhline(target_accuracy, color="grey", lw=0.8, ls=":")
            ax.set(title=f"{hosts} hosts, {link} links", xlabel="training time (s, log scale)",
                   ylabel="test accuracy", xscale="log")
            # Labels at 1-2-5 steps only, as plain numbers: no crowded or overlapping labels.
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.grid(alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8,
                   frameon=False)  # below the panels, off the data
        fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 2) // 3), 1, 1))
        path = out_dir / f"comm_accuracy_{hosts}hosts.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    first: dict[tuple[int, str], dict] = {}
    for r in rows:  # bytes per step do not depend on the link: one bar per (hosts, algorithm)
        if r["algorithm"] != LIMIT:
            first.setdefault((r["hosts"], r["label"]), r)
    if first:
        fig, ax = plt.subplots(figsize=(9, 0.6 * len(first) + 1.8))
        labels = [f"{label} ({hosts} hosts)" for hosts, label in first]
        y = list(range(len(labels)))
        ax.barh([i - 0.2 for i in y], [r["bytes_per_step"] for r in first.values()], height=0.4,
                label="counted payload")  # side by side: neither bar hides the other
        ax.barh([i + 0.2 for i in y], [r["wire_bytes_per_step"] for r in first.values()],
                height=0.4, label="on the wire (incl. set-up)")
        ax.set_yticks(y, labels)
        ax.set(xscale="log", xlabel="bytes per step per worker (log scale)")
        ax.invert_yaxis()
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(y)),
                  ncol=2, frameon=False)
        fig.tight_layout()
        path = out_dir / "comm_bytes.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


ACCURACY_SLACK = 0.01  # a decision's algorithm ends within 1 point of the baseline's accuracy


def decisions(plan: Plan, rows: list[dict]) -> str:
    """Which algorithm to pick, per number of hosts, link speed and model size: the one that
    reached the target accuracy soonest among those ending within 1 point of the baseline's
    final accuracy (the one-tensor-at-a-time rows and the limit are not candidates)."""
    lines = [f"| hosts | link | model (parameters) | pick | time to {plan.target_accuracy:.0%} "
             "vs dense all-reduce | runner-up |", "|---:|---|---:|---|---:|---|"]
    baseline = plan.baseline
    for (hosts, link) in sorted({(r["hosts"], r["bandwidth"]) for r in rows},
                                key=lambda k: (k[0], emulated.parse_bandwidth(k[1]))):
        here = [r for r in rows if (r["hosts"], r["bandwidth"]) == (hosts, link)]
        base = next((r for r in here if r["algorithm"] == baseline), None)
        if base is None:
            continue
        ok = sorted((r for r in here if r["algorithm"] not in (LIMIT, AUTO)
                     and not r["algorithm"].endswith("_per_tensor")
                     and r["time_to_target_s"] is not None
                     and r["final_accuracy"] >= base["final_accuracy"] - ACCURACY_SLACK),
                    key=lambda r: r["time_to_target_s"])
        if not ok:
            continue
        pick, rest = ok[0], ok[1:]
        ratio = ("(it is the baseline)" if pick is base else
                 f"{base['time_to_target_s'] / pick['time_to_target_s']:.2f}x sooner"
                 if base["time_to_target_s"] else "dense did not reach it")
        lines.append(f"| {hosts} | {link} | {base['parameters']:,} | {pick['label']} | {ratio} | "
                     + (rest[0]["label"] if rest else "-") + " |")
    return "\n".join(lines)


def auto_check(plan: Plan, rows: list[dict]) -> str:
    """How `auto` did against the fixed algorithms of the same run: its time to the target over
    the fastest fixed algorithm's and over the dense all-reduce's (tfdist's, else the
    baseline)."""
    lines = ["| hosts | link | auto picked | time to target (s) | vs fastest fixed | "
             "vs dense |", "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        if r["algorithm"] != AUTO:
            continue
        here = [x for x in rows if (x["hosts"], x["bandwidth"]) == (r["hosts"], r["bandwidth"])
                and x["algorithm"] not in (LIMIT, AUTO) and x["time_to_target_s"]]
        fastest = min(here, key=lambda x: x["time_to_target_s"], default=None)
        dense = next((x for key in ("dense", plan.baseline) for x in here
                      if x["algorithm"] == key), None)

        def ratio(other, mine=r["time_to_target_s"]):
            return "n/a" if other is None or not mine else \
                f"{mine / other['time_to_target_s']:.2f}x"

        fastest_note = f" ({fastest['algorithm']})" if fastest is not None else ""
        lines.append(f"| {r['hosts']} | {r['bandwidth']} | {r.get('auto_choice')} | "
                     f"{_fmt_time(r['time_to_target_s'])} | {ratio(fastest)}{fastest_note} | "
                     f"{ratio(dense)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def write(plan: Plan, rows: list[dict], failures: list[str], out_dir: Path,
          command: str) -> None:
    text = _with_breakdown(table(plan.target_accuracy, plan.baseline, rows), rows)
    (out_dir / "comm.md").write_text(f"Command: `{command}`\n\n{text}\n")
    picks = decisions(plan, rows)
    (out_dir / "decisions.md").write_text(
        f"Which algorithm when, from `{command}` (the fastest to {plan.target_accuracy:.0%} "
        f"among those ending within {100 * ACCURACY_SLACK:g} point of the baseline's final "
        f"accuracy):"
        f"\n\n{picks}\n")
    auto = auto_check(plan, rows)
    if auto:
        with (out_dir / "decisions.md").open("a") as f:
            f.write(f"\nThe `auto` exchange, against the fixed algorithms of the same run:\n\n"
                    f"{auto}\n")
    meta: dict[str, Any] = {
        **stamp(command), "spec": str(plan.spec_path), "target_accuracy": plan.target_accuracy,
        "baseline": plan.baseline, "job": plan.job, "delay": plan.delay,
        "failures": failures, "rows": rows}
    (out_dir / "comm.json").write_text(json.dumps(meta, indent=2))
    if rows:
        plots(rows, plan.target_accuracy, out_dir)


def run_comm(quick: bool, out: str, hosts=None, bandwidths=None, algorithms=None,
             spec: str | None = None, job: list[str] | None = None) -> list[dict]:
    """The sweep; `job` adds config overrides to the spec's job (e.g. another model size)."""
    plan = load_plan(spec, quick, hosts, bandwidths, algorithms, job)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "tfdist bench --suite comm" + (" --quick" if quick else "")
    for flag, value in (("hosts", hosts), ("bandwidths", bandwidths),
                        ("algorithms", algorithms)):
        if value is not None:
            command += f" --{flag} {','.join(map(str, value))}"
    command += "".join(f' --set "{override}"' for override in job or [])
    params = plan.configs[(plan.hosts[0], plan.baseline)]["model"]
    print(f"bench: comm: {len(plan.algorithms)} algorithms + the zero-communication limit on "
          f"{plan.hosts} hosts x {plan.bandwidths} links ({plan.runs} runs); model "
          f"{params['name']} {params['hidden']}, target accuracy {plan.target_accuracy}",
          flush=True)
    rows = run(plan, out_dir, command)
    print(table(plan.target_accuracy, plan.baseline, rows))
    print(f"bench: wrote {out_dir / 'comm.md'}, {out_dir / 'comm.json'} and the plots "
          f"comm_*.png in {out_dir}")
    return rows


__all__ = ["Plan", "breakdown", "breakdown_table", "compressor_ms", "load_plan",
           "mean_step_s", "run_comm"]
