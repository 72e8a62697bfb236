"""`tfdist plan`: the workload (a config's model, or a saved `.keras` model, or a parameter
count), one worker's compute step (given, or measured on this machine's first device), and the
plan for each worker count (`tfdist.plan.predict`).

With `--parameters` and `--compute-ms` nothing loads TensorFlow: the answer is arithmetic.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tfdist.plan import (
                         Calibration,
                         Cluster,
                         Link,
                         Plan,
                         Simulation,
                         Stragglers,
                         Workload,
                         predict,
                         simulate,
)
from tfdist.plan.planner import check_algorithms
from tfdist.tools.emulated import parse_bandwidth

_MEMORY_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """'24GB', '80GiB', '512mb' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _MEMORY_UNITS:
        raise ValueError(f"memory {text!r}: give a number and a unit, one of GB, GiB, MB, MiB "
                         "(e.g. 24GB, 80GiB)")
    return int(float(m.group(1)) * _MEMORY_UNITS[unit])


def parse_stragglers(text: str) -> Stragglers:
    """'0.01:2:0.3' -> Stragglers(slow=0.01, slowdown=2, sigma=0.3); a bad one is refused with
    the form."""
    parts = str(text).split(":")
    try:
        if not 2 <= len(parts) <= 4:
            raise ValueError("give 2 to 4 numbers")
        slow, slowdown, sigma, late = [float(p) for p in parts] + [0.0] * (4 - len(parts))
        return Stragglers(slow=slow, slowdown=slowdown, sigma=sigma, late_s=late)
    except ValueError as e:
        raise ValueError(f"--stragglers {text!r}: {e}; the form is SLOW:SLOWDOWN[:SIGMA"
                         "[:LATE_S]], e.g. 1:3 (one worker 3x slower) or 0.01:2:0.3") from None


SIMULATED = ("sync", "local_sgd:8", "ssp:4", "async")
SIMULATED_STEPS = 100


def simulations(plan: Plan, stragglers: Stragglers) -> list[Simulation]:
    """The plan's workload and cluster played with `stragglers`: the all-reduce (and a local
    SGD averaging) takes the dense exchange's time; a parameter-server push and pull take what
    the servers' estimate gives (`ps:n/8`: one server per 8 workers, every worker sending)."""
    dense, servers = predict(plan.workload, plan.cluster, ["dense", "ps:n/8"],
                             calibration=plan.calibration).estimates
    return [simulate(spec, plan.cluster.workers, plan.workload.compute_s, SIMULATED_STEPS,
                     stragglers=stragglers, exchange_s=dense.exchange_s,
                     transfer_s=servers.exchange_s) for spec in SIMULATED]


def simulation_table(runs: list[Simulation]) -> str:
    lines = ["| simulated | chief step (ms) | worker steps/s | waiting | staleness (mean, max) |",
             "|---|---:|---:|---:|---:|"]
    for r in runs:
        staleness = f"{r.staleness_mean:,.1f}, {r.staleness_max:,}" if r.staleness else ""
        lines.append(f"| {r.algorithm} | {r.step_s * 1e3:,.1f} | {r.throughput:,.1f} | "
                     f"{r.waiting_share:.0%} | {staleness} |")
    return "\n".join(lines)


def link(bandwidth: str, latency_us: float) -> Link:
    return Link(parse_bandwidth(bandwidth) / 1e9, latency_us)


def optimizer_slots(optimizer, variables) -> int:
    """Per-parameter state of a Keras optimizer, counted on `variables` (momentum: 1, Adam: 2):
    its variables' elements beyond the scalars, over the parameters'."""
    optimizer.build(variables)
    parameters = sum(int(v.shape.num_elements()) for v in variables)
    state = sum(int(v.shape.num_elements()) for v in optimizer.variables if len(v.shape))
    return round(state / parameters)


def measure_compute(model, optimizer, batch: int, steps: int = 8) -> float:
    """Median seconds of one training step of `model` (forward, backward, and `optimizer`'s
    update as `tfdist.DistributedOptimizer` runs it, fused, on one device: the update of every
    planned exchange but ZeRO's) at `batch` examples on this machine's first device, synthetic
    inputs and targets; the first two (tracing) steps left out."""
    import keras
    import numpy as np

    from tfdist.optimizers import DistributedOptimizer

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *model.input_shape[1:])).astype("float32")
    y = rng.standard_normal((batch, *model.output_shape[1:])).astype("float32")
    model.compile(optimizer=DistributedOptimizer(optimizer),
                  loss=keras.losses.MeanSquaredError())
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def workload(args, config: dict[str, Any] | None) -> tuple[Workload, str]:
    """The workload `args` describe, and how its compute time was found."""
    extra: dict[str, Any] = {"precision": args.precision,
                             "update_saving_s": (args.update_saving_ms or 0.0) / 1e3}
    if args.optimizer_slots is not None:
        extra["optimizer_slots"] = args.optimizer_slots
    if args.parameters is not None:
        if args.compute_ms is None:
            raise ValueError("--parameters needs --compute-ms: there is no model to measure "
                             "(or give a config or --model-file instead)")
        if args.decode_ms is not None:
            extra["input_s"] = input_seconds(args, args.batch)
        return (Workload.from_parameters(args.parameters, args.compute_ms / 1e3, **extra),
                "given")
    import keras

    import tfdist  # noqa: F401  (registers tfdist's classes: a saved model may use them)
    from tfdist.tools.workload import inner_optimizer, load_data, make_model

    if args.model_file:
        if not Path(args.model_file).is_file():
            raise ValueError(f"--model-file {args.model_file!r} does not exist")
        model = keras.saving.load_model(args.model_file, compile=False)
        optimizer = keras.optimizers.Adam()
        batch = args.batch or 32
    else:
        assert config is not None
        model = make_model(config, load_data(config))
        optimizer = inner_optimizer(config["optimizer"], config["optimizer"]["learning_rate"])
        batch = args.batch or config["data"]["global_batch_size"]
    if "optimizer_slots" not in extra:
        extra["optimizer_slots"] = optimizer_slots(optimizer, model.trainable_variables)
    if args.decode_ms is not None:
        extra["input_s"] = input_seconds(args, batch)
    if args.compute_ms is not None:
        compute, how = args.compute_ms / 1e3, "given"
    else:
        compute = measure_compute(model, optimizer, batch)
        how = f"measured on this machine's first device, batch {batch}, tfdist's fused update"
    return Workload.from_keras(model, compute, batch=batch, **extra), how


def input_seconds(args, batch: int | None) -> float:
    """One worker's input time per step: `batch` examples at --decode-ms each, on
    --decode-cores cores."""
    if batch is None:
        raise ValueError("--decode-ms with --parameters needs --batch: the examples one worker "
                         "decodes per step")
    return batch * args.decode_ms / 1e3 / args.decode_cores


def cluster(args, workers: int) -> Cluster:
    return Cluster(workers, link(args.link, args.latency_us), args.per_host,
                   link(args.intra, args.latency_us) if args.intra else None, args.engine,
                   parse_memory(args.device_memory) if args.device_memory else None)


def check(args) -> None:
    """Every option checked before anything loads or runs."""
    for n in args.workers:
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--workers: {n!r} is not a worker count; give whole numbers, "
                             "e.g. --workers 8,64,1024")
    for name in ("link", "intra"):
        if getattr(args, name):
            parse_bandwidth(getattr(args, name))
    if args.device_memory:
        parse_memory(args.device_memory)
    if args.algorithms:
        check_algorithms(args.algorithms)
    if args.stragglers:
        parse_stragglers(args.stragglers)
    cluster(args, 1)
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch {args.batch}: give the examples of one worker's step, >= 1")
    if args.decode_cores < 1:
        raise ValueError(f"--decode-cores {args.decode_cores}: give the cores each worker "
                         "decodes on, >= 1")
    for name in ("compute_ms", "latency_us", "update_saving_ms", "decode_ms"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= 0")


def plans(args, config: dict[str, Any] | None) -> tuple[list[Plan], str]:
    work, how = workload(args, config)
    calibration = (Calibration.from_results(args.calibrate, args.engine) if args.calibrate
                   else None)
    kwargs = {"algorithms": args.algorithms} if args.algorithms else {}
    return [predict(work, cluster(args, int(n)), calibration=calibration, **kwargs)
            for n in args.workers], how


def report(results: list[Plan], how: str, out=None, stragglers: Stragglers | None = None,
           simulated: list[list[Simulation]] | None = None) -> None:
    """The plans as text, to `out` (default: `sys.stdout` as it is at the call, so a redirection
    made after the import is followed); with `stragglers`, each plan's `simulated` runs after
    it."""
    out = sys.stdout if out is None else out
    w = results[0].workload
    size = "" if "parameters" in w.name else f" ({w.parameters:,} parameters)"
    mixed = ", mixed precision (float32 master copy)" if w.precision == "mixed" else ""
    print(f"model: {w.name}{size}, optimizer state {w.optimizer_slots} per parameter{mixed}, "
          f"compute {w.compute_s * 1e3:,.1f} ms per step ({how})", file=out)
    if w.input_s:
        print(f"input {w.input_s * 1e3:,.1f} ms per step (read and decoded beside the step; a "
              "step takes at least this long)", file=out)
    if w.update_saving_s:
        print(f"tfdist's fused update saves {w.update_saving_s * 1e3:,.1f} ms of it (dense, FP16, "
              "PowerSGD, top-k and local SGD are priced without it)", file=out)
    print(f"calibration: {results[0].calibration.source}", file=out)
    for k, plan in enumerate(results):
        c = plan.cluster
        intra = c.intra or c.link
        print(f"\n{c.workers:,} workers ({c.workers_per_host} per host, {c.hosts:,} hosts), "
              f"{c.engine}, link {c.link.gbit_per_s:g} Gbit/s {c.link.latency_us:g} us, "
              f"within a host {intra.gbit_per_s:g} Gbit/s"
              + (f", {c.device_memory / 1e9:g} GB per device" if c.device_memory else ""),
              file=out)
        print(plan.table(), file=out)
        best = plan.best.label if plan.best else "none"
        print(f"recommended: {best}: {plan.reason}", file=out)
        if plan.best is not None:
            for line in how_to_run(plan):
                print(f"  {line}", file=out)
        for e in plan.estimates:
            if e.note:
                print(f"  {e.label}: {e.note}", file=out)
        for spec, why in plan.left_out.items():
            print(f"  left out: {spec}: {why}", file=out)
        if stragglers is not None and simulated is not None:
            print(f"\nsimulated, {SIMULATED_STEPS} steps per worker, {stragglers.slowed(c.workers)}"
                  f" worker(s) {stragglers.slowdown:g}x slower, spread {stragglers.sigma:g}, late "
                  f"start {stragglers.late_s:g} s (tfdist.plan.simulate):", file=out)
            print(simulation_table(simulated[k]), file=out)


def write_json(results: list[Plan], how: str, path: str,
               simulated: list[list[Simulation]] | None = None) -> None:
    plans = [p.as_dict() for p in results]
    for data, runs in zip(plans, simulated or [], strict=False):
        data["simulated"] = [run.as_dict() | {"chief_clock": None} for run in runs]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"compute": how, "plans": plans}, indent=2) + "\n")


MARGIN = 1.1  # below this ratio to the next algorithm, a recommendation is within the error


def how_to_run(plan) -> list[str]:
    """What a reader of a recommendation needs next: what its steps factor means, how to turn
    the algorithm on in a config, and whether its margin over the next is worth trusting."""
    import re

    best = plan.best
    family = best.algorithm.partition(":")[0]
    number = re.findall(r"[\d.]+", best.label)  # its rank, ratio or period, as labelled
    arg = number[-1] if number else ""
    settings = {
        "dense": "the default: synchronous data parallelism, nothing to set",
        "dense_overlap": "not a tfdist setting: the exchange overlapped with the backward "
                         "pass, as DDP and Horovod's own layer do (tfdist's starts after it)",
        "fp16": "--set compression.name=fp16",
        "powersgd": f"--set compression.name=powersgd --set compression.options={{rank: {arg}}}",
        "topk": f"--set compression.name=topk --set compression.options={{ratio: {arg}}} "
                "--set compression.error_feedback=true",
        "local_sgd": f"--set averaging.period={arg}",
        "zero1": "--set optimizer.zero_stage=1",
        "zero2": "--set optimizer.zero_stage=2",
        "zero3": "--set optimizer.zero_stage=3",
        "pipeline": "tfdist.pipeline.Pipeline in your model (Python; docs/guides/pipelines.md)",
        "ps": "--set engine.name=parameter_server, with python -m tfdist.launch --ps N",
    }
    lines = [f"to run it: {settings.get(family, 'see docs/which-algorithm.md')}"]
    if best.steps_factor is not None:
        lines.append(f"steps factor {best.steps_factor:g}: the steps it needs for one dense "
                     "step's progress (measured by the benches; 1 for an exact exchange)")
    ranked = sorted((e.dense_step_equivalent_s, e.label) for e in plan.estimates
                    if e.dense_step_equivalent_s is not None)
    if len(ranked) > 1 and ranked[1][0] < MARGIN * ranked[0][0]:
        lines.append(f"the margin over {ranked[1][1]} ({ranked[1][0] / ranked[0][0]:.2f}x) is "
                     f"within the planner's error (about 10-20% on the emulated cluster): "
                     "measure both on your cluster before choosing (tfdist bench --suite comm)")
    return lines
