"""`tfdist bench`: measured tables (step time, bytes, accuracy), each with its command.

Suite "local_sgd": configs/local_sgd.yaml (the default job with SGD-momentum) synchronous and
with averaging periods 2, 4, 8 and 16 after a one-epoch synchronous warm-up, then H=8 with
SlowMo, with SMA and with the optimizer state averaged (2 devices), and on 4 devices as 2 hosts
of 2 with hierarchical averaging: communication rounds, bytes, test accuracy and step time
relative to synchronous training on as many devices.

Suite "memory": Adam on the engines suite's MLP under MirroredStrategy over N = 1, 2, 4, 8
devices, with 2 accumulation steps so gradient buffers are variables: bytes each replica holds
for optimizer state + parameter shard + gradient buffers, read from the devices the variables'
copies sit on, for tfdist.DistributedOptimizer (baseline), ZeroOptimizer stages 1, 2 and 3
(stage 3 on a ShardedModel), next to the ZeRO formulas (fp32, K = 2 slots), and the totals with
the model's own parameters.

Suite "overhead" (tfdist/tools/bench/overhead.py): Keras' optimizer, tfdist's dense wrapper and
local SGD's local steps side by side in a world of one (no communication): the wrapper's own cost
per step, and the weights each reaches against Keras'.

Suite "compression": the default job (CNN on the embedded digits set, MirroredStrategy over 2
devices) once dense and once per compressor config in configs/, in one process: bytes each
worker sends per step, ratio to dense, test accuracy, and median step time relative to dense.
Results go to OUT/compression.md and OUT/compression.json.

Suite "engines" (one run, same model, same global batch):
  * MirroredStrategy with the user's Adam: the baseline, in this process;
  * tfdist.DistributedOptimizer(Adam) on the same MirroredStrategy, in this process, its
    repeats interleaved with the baseline's so both see the same machine load;
  * tfdist.MultiWorkerMirroredStrategy, 2 TF_CONFIG worker processes on 127.0.0.1;
  * the Horovod engine, 2 horovodrun ranks (when Horovod is installed).
Each row reports the median step time (ms), its ratio to the baseline and the bytes each worker
sent per step. Results go to OUT/engines.md and OUT/engines.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import keras
import tensorflow as tf

from tfdist.callbacks import StepTimer
from tfdist.tools.bench import plots
from tfdist.tools.bench.machine import stamp

INPUT_DIM, HIDDEN, CLASSES = 256, (1024, 1024), 10
MODEL = {"input_dim": INPUT_DIM, "hidden": list(HIDDEN), "classes": CLASSES}
GLOBAL_BATCH = 256




def _build(strategy, wrap: bool, engine: str = "strategy"):
    import contextlib

    import tfdist
    from tfdist.tools.models import build_model

    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build_model("mlp", (INPUT_DIM,), CLASSES, HIDDEN)
        opt = keras.optimizers.Adam(1e-3)
        if engine == "horovod":
            import tfdist.horovod as thvd

            opt = thvd.DistributedOptimizer(opt)
        elif wrap:
            opt = tfdist.DistributedOptimizer(opt)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    return model, opt


def _dataset(strategy, rank=0, size=1):
    from tfdist.data import distribute, global_batches, shard_batches, synthetic_classification

    x, y = synthetic_classification(4 * GLOBAL_BATCH, (INPUT_DIM,), CLASSES)
    if strategy is not None:
        return distribute(strategy, x, y, GLOBAL_BATCH)
    return shard_batches(global_batches(x, y, GLOBAL_BATCH), rank, size)


def _timed_fit(model, data, steps: int) -> list[float]:
    timer = StepTimer()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    return timer.times


def _median_ms(samples: list[list[float]]) -> float:
    return 1000 * statistics.median(statistics.median(s) for s in samples)


def _in_process(steps: int, repeats: int) -> list[dict]:
    from tfdist.devices import local_devices

    devices = local_devices(2)
    engines: dict[str, tuple] = {}
    for key, wrap in (("baseline", False), ("tfdist", True)):
        strategy = tf.distribute.MirroredStrategy(devices)
        model, opt = _build(strategy, wrap)
        data = _dataset(strategy)
        _timed_fit(model, data, 3)  # trace and warm up
        engines[key] = (model, opt, data, [])
    for _ in range(repeats):  # interleaved: both engines see the same machine load
        for model, _, data, samples in engines.values():
            samples.append(_timed_fit(model, data, steps))
    rows = []
    labels = {"baseline": "Keras + tf.distribute.MirroredStrategy (baseline)",
              "tfdist": "tfdist.DistributedOptimizer on MirroredStrategy"}
    for key, (model, opt, _, samples) in engines.items():
        rounds = getattr(opt, "communication_rounds", 0)
        rows.append({"engine": labels[key], "layout": "1 process x 2 devices",
                     "step_ms": _median_ms(samples),
                     "bytes_per_step": opt.bytes_sent / rounds if rounds else None,
                     "parameters": int(model.count_params())})
    return rows


def _multi_process(kind: str, steps: int, repeats: int, out: Path) -> dict | None:
    from tfdist.tools.bench.processes import run_on

    result_file = out / f"{kind}.worker.json"
    argv = [sys.executable, "-m", "tfdist.tools.bench.suites", "--worker", kind, "--steps", str(steps),
            "--repeats", str(repeats), "--result", str(result_file)]
    if not run_on(kind, argv, 2, 600, f"the engines suite's {kind} row"):
        return None
    return json.loads(result_file.read_text())


def _worker(kind: str, steps: int, repeats: int, result: str) -> None:
    """One process of a multi-process row (rank 0 writes the result)."""
    if kind == "horovod":
        import tfdist.horovod as thvd

        thvd.init()
        rank, size = thvd.rank(), thvd.size()
        model, opt = _build(None, True, engine="horovod")
        data = _dataset(None, rank, size)
        model.fit(data, epochs=1, steps_per_epoch=3, verbose=0,
                  callbacks=[thvd.callbacks.BroadcastGlobalVariables(0)])
        label = "tfdist.horovod.DistributedOptimizer"
    else:
        import tfdist

        strategy = tfdist.MultiWorkerMirroredStrategy(timeout_seconds=300)
        rank, size = int(strategy.cluster_resolver.task_id), strategy.num_replicas_in_sync
        model, opt = _build(strategy, True)
        data = _dataset(strategy)
        _timed_fit(model, data, 3)
        label = "tfdist.MultiWorkerMirroredStrategy + DistributedOptimizer"
    samples = [_timed_fit(model, data, steps) for _ in range(repeats)]
    if rank == 0:
        Path(result).write_text(json.dumps({
            "engine": label, "layout": f"{size} processes x 1 device",
            "step_ms": _median_ms(samples),
            "bytes_per_step": opt.bytes_sent / max(opt.communication_rounds, 1),
            "parameters": int(model.count_params())}))


def _table(rows: list[dict]) -> str:
    base = rows[0]["step_ms"]
    lines = ["| engine | layout | step time (ms, median) | ratio vs baseline | bytes sent/step/worker |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        sent = "n/a (not counted)" if r["bytes_per_step"] is None else f"{r['bytes_per_step']:,.0f}"
        lines.append(f"| {r['engine']} | {r['layout']} | {r['step_ms']:.1f} | "
                     f"{r['step_ms'] / base:.2f} | {sent} |")
    return "\n".join(lines)


COMPRESSION_CONFIGS = ("default", "fp16", "ef_topk", "randomk", "dgc", "qsgd", "terngrad",
                       "ef_signsgd", "powersgd")


def _compression_rows(quick: bool, out_dir: Path) -> list[dict]:
    from tfdist.tools.config import configs_dir, load_config
    from tfdist.tools.runner import train

    rows = []
    for i, name in enumerate(COMPRESSION_CONFIGS):
        overrides = [f"train.output_dir={out_dir / name}", "train.verbose=0"]
        if quick:
            overrides.append("train.epochs=4")
        config = load_config(configs_dir() / f"{name}.yaml", overrides)
        t = time.time()
        s = train(config, progress=False)
        comp = s["compressor"]
        label = "dense all-reduce" if comp is None else _label(comp)
        print(f"bench: [{i + 1}/{len(COMPRESSION_CONFIGS)}] {label}: accuracy "
              f"{s['test_accuracy']:.4f}, {s['bytes_sent_per_step']:,.0f} bytes/step "
              f"({time.time() - t:.0f} s)", flush=True)
        rows.append({"config": f"configs/{name}.yaml", "compressor": label,
                     "bytes_per_step": s["bytes_sent_per_step"],
                     "ratio_vs_dense": s["bytes_ratio_vs_dense"],
                     "test_accuracy": s["test_accuracy"], "step_ms": s["step_ms_median"],
                     "epochs": config["train"]["epochs"]})
    return rows


def _label(spec: dict) -> str:
    spec = dict(spec)
    name = spec.pop("name")
    if name == "error_feedback":
        return "EF-" + _label(spec["inner"])
    args = ", ".join(f"{k}={v}" for k, v in spec.items()
                     if k in ("ratio", "rank", "levels", "momentum", "scale"))
    return f"{name}({args})" if args else name


def _compression_table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| compressor | config | bytes/step/worker | ratio vs dense | test accuracy | "
             "step time vs dense |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['compressor']} | `{r['config']}` | {r['bytes_per_step']:,.0f} | "
                     f"{r['ratio_vs_dense']:.4f} | {r['test_accuracy']:.4f} | "
                     f"{r['step_ms'] / base['step_ms']:.2f} |")
    return "\n".join(lines)


def _engines_rows(steps: int, repeats: int, out_dir: Path) -> list[dict]:
    rows: list[dict] = []
    parts: list[tuple[str, Callable[[], list[dict | None]]]] = [
        ("in-process MirroredStrategy rows", lambda: list(_in_process(steps, repeats))),
        ("2 TF_CONFIG workers", lambda: [_multi_process("multi_worker", steps, repeats, out_dir)]),
        ("2 Horovod ranks", lambda: [_multi_process("horovod", steps, repeats, out_dir)]),
    ]
    for i, (name, fn) in enumerate(parts):
        print(f"bench: [{i + 1}/3] {name} ...", flush=True)
        t = time.time()
        rows += [r for r in fn() if r is not None]
        print(f"bench: [{i + 1}/3] done in {time.time() - t:.0f} s", flush=True)
    return rows


_WARMUP = "averaging.warmup_steps=22"
# (row name, devices, overrides of configs/local_sgd.yaml); each group of rows with the same
# devices is compared to the first row with those devices (synchronous training).
LOCAL_SGD_RUNS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("sync", 2, ("averaging.period=null", "averaging.warmup_steps=0")),
    *((f"H={h}", 2, (f"averaging.period={h}", _WARMUP)) for h in (2, 4, 8, 16)),
    ("H=8, SlowMo(0.5, 1)", 2, ("averaging.period=8", _WARMUP,
                                "averaging.outer={name: slowmo, momentum: 0.5}")),
    ("H=8, SMA(0.25, 0.5)", 2, ("averaging.period=8", _WARMUP,
                                "averaging.outer={name: sma, alpha: 0.25, momentum: 0.5}")),
    ("H=8, optimizer state averaged", 2, ("averaging.period=8", _WARMUP,
                                          "averaging.average_optimizer_state=true")),
    ("sync", 4, ("averaging.period=null", "averaging.warmup_steps=0")),
    ("H=8", 4, ("averaging.period=8", _WARMUP)),
    ("hierarchical: 2 hosts x 2, H=2 in host, H=8 across", 4,
     ("averaging.period=8", _WARMUP, "averaging.intra_period=2", "averaging.host_size=2")),
)


def _local_sgd_rows(quick: bool, out_dir: Path) -> list[dict]:
    from tfdist.devices import local_devices
    from tfdist.tools.config import configs_dir, load_config
    from tfdist.tools.runner import train

    local_devices(max(devices for _, devices, _ in LOCAL_SGD_RUNS))  # once per process
    rows = []
    for i, (name, devices, settings) in enumerate(LOCAL_SGD_RUNS):
        overrides = [f"train.output_dir={out_dir / f'run{i}'}", "train.verbose=0",
                     f"engine.devices={devices}", *settings]
        if quick:
            overrides.append("train.epochs=4")
        config = load_config(configs_dir() / "local_sgd.yaml", overrides)
        t = time.time()
        s = train(config, progress=False)
        print(f"bench: [{i + 1}/{len(LOCAL_SGD_RUNS)}] {name} ({devices} devices): accuracy "
              f"{s['test_accuracy']:.4f}, {s['communication_rounds']} rounds "
              f"({time.time() - t:.0f} s)", flush=True)
        rows.append({"run": name, "devices": devices,
                     "warmup_steps": config["averaging"]["warmup_steps"],
                     "rounds": s["communication_rounds"], "steps": s["steps"],
                     "bytes_total": s["bytes_sent_total"], "test_accuracy": s["test_accuracy"],
                     "step_ms": s["step_ms_median"]})
    return rows


def _local_sgd_table(rows: list[dict]) -> str:
    lines = ["| devices | run | warm-up steps | rounds / steps | bytes sent (total/worker) | "
             "test accuracy | step time vs sync |", "|---:|---|---:|---:|---:|---:|---:|"]
    base: dict[int, dict] = {}
    for r in rows:
        sync = base.setdefault(r["devices"], r)
        lines.append(f"| {r['devices']} | {r['run']} | {r['warmup_steps']} | "
                     f"{r['rounds']} / {r['steps']} | {r['bytes_total']:,.0f} | "
                     f"{r['test_accuracy']:.4f} | {r['step_ms'] / sync['step_ms']:.2f} |")
    return "\n".join(lines)


MEMORY_DEVICES = (1, 2, 4, 8)


def _memory_rows() -> list[dict]:
    """Per-replica bytes of Adam's state and gradient buffers (accumulation_steps=2, so the
    buffers are variables), read from where each variable's copies were placed."""
    import keras

    from tfdist import DistributedOptimizer, ZeroOptimizer
    from tfdist.devices import local_devices
    from tfdist.tools.models import build_model
    from tfdist.zero import ShardedModel, memory_report

    devices = local_devices(max(MEMORY_DEVICES))
    rows = []
    for n in MEMORY_DEVICES:
        row: dict = {"replicas": n}
        for name, make in (
                ("baseline", lambda: DistributedOptimizer(keras.optimizers.Adam(),
                                                          accumulation_steps=2)),
                ("zero1", lambda: ZeroOptimizer(keras.optimizers.Adam(), stage=1,
                                                accumulation_steps=2)),
                ("zero2", lambda: ZeroOptimizer(keras.optimizers.Adam(), stage=2,
                                                accumulation_steps=2)),
                ("zero3", lambda: ZeroOptimizer(keras.optimizers.Adam(), stage=3,
                                                accumulation_steps=2))):
            strategy = tf.distribute.MirroredStrategy(devices[:n])
            with strategy.scope():
                keras.utils.set_random_seed(0)
                model = build_model("mlp", (INPUT_DIM,), CLASSES, HIDDEN)
                row["parameters"] = int(model.count_params())
                if name == "zero3":  # the parameters themselves sharded
                    model = ShardedModel(model)
                    row["shard_zero3"] = model.plan.shard_size
                    row["largest_layer"] = 4 * model.plan.largest_layer
                optimizer = make()
                optimizer.build(model.trainable_variables)
            per_device = list(memory_report(optimizer).values())
            sizes = {d["optimizer_state"] + d["param_shard"] + d["gradient_buffers"]
                     for d in per_device}
            assert len(sizes) == 1, f"replicas hold different amounts: {sizes}"
            row[name] = sizes.pop()
        p, shard = row["parameters"], -(-row["parameters"] // n)
        row["formula_zero1"] = 4 * (2 + 1) * shard + 4 * p  # Adam K=2, fp32 shard, full grads
        row["formula_zero2"] = 4 * (2 + 2) * shard
        # stage 3: parameters, K slots and the gradient buffer, each S = sum_l ceil(P_l / N)
        row["formula_zero3"] = 4 * (2 + 2) * row["shard_zero3"]
        print(f"bench: [{MEMORY_DEVICES.index(n) + 1}/{len(MEMORY_DEVICES)}] N={n}: "
              f"baseline {row['baseline']:,} B, ZeRO-1 {row['zero1']:,} B, "
              f"ZeRO-2 {row['zero2']:,} B, ZeRO-3 {row['zero3']:,} B per replica", flush=True)
        rows.append(row)
    return rows


def _memory_table(rows: list[dict]) -> str:
    """Two tables: the optimizer's bytes (state, parameter shard, gradient buffers) per
    replica against the formulas, and the totals with the model's own parameters (4P on every
    replica but at stage 3, whose parameter shard is the model's)."""
    lines = ["| N | baseline bytes/replica | ZeRO-1 | ZeRO-2 | ZeRO-3 | formula ZeRO-1: "
             "4(K+1)⌈P/N⌉ + 4P | formula ZeRO-2: 4(K+2)⌈P/N⌉ | formula ZeRO-3: 4(K+2) Σ⌈P_l/N⌉ |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['baseline']:,} | {r['zero1']:,} | {r['zero2']:,} | "
                     f"{r['zero3']:,} | {r['formula_zero1']:,} | {r['formula_zero2']:,} | "
                     f"{r['formula_zero3']:,} |")
    lines += ["", "| N | baseline + model parameters | ZeRO-2 + model parameters | ZeRO-3 "
              "(parameters included) | ZeRO-3 vs baseline | largest gathered layer "
              "(transient) |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        model = 4 * r["parameters"]
        lines.append(f"| {r['replicas']} | {r['baseline'] + model:,} | {r['zero2'] + model:,} | "
                     f"{r['zero3']:,} | {r['zero3'] / (r['baseline'] + model):.3f} | "
                     f"{r['largest_layer']:,} |")
    return "\n".join(lines)


def _pipeline_rows(quick: bool) -> list[dict]:
    from tfdist.devices import local_devices
    from tfdist.tools.bench.pipeline import pipeline_rows

    return pipeline_rows(local_devices(4), quick,
                         progress=lambda line: print(line, flush=True))


SUITES = ("engines", "overhead", "compression", "compressors", "local_sgd", "memory", "pipeline")


def table_of(suite: str, result: dict) -> str:
    """The Markdown table of a suite's result (what `run_suite` wrote to SUITE.json)."""
    rows = result["rows"]
    if suite == "pipeline":
        from tfdist.tools.bench.pipeline import pipeline_table

        return pipeline_table(rows)
    if suite == "compressors":
        from tfdist.tools.bench.compressors import compressor_table

        return compressor_table(rows)
    if suite == "overhead":
        from tfdist.tools.bench.overhead import overhead_table, update_table

        text = overhead_table(rows, result["steps"], result["repeats"])
        if "update_rows" in result:  # results saved before the update was timed alone have none
            text += "\n\n" + update_table(result["update_rows"], result["update_steps"])
        return text
    if suite == "comm":
        from tfdist.tools.bench.comm import page_table as comm_page

        return comm_page(result)
    if suite == "models":
        from tfdist.tools.bench.models import page_table as models_page

        return models_page(result)
    if suite == "plan":
        from tfdist.tools.bench.plan import page_table as plan_page

        return plan_page(result)
    if suite == "collectives":
        from tfdist.tools.bench.collectives import page_table

        return page_table(rows)
    if suite == "input":
        from tfdist.tools.bench.input import page_table as input_page

        return input_page(result)
    if suite == "stragglers":
        from tfdist.tools.bench.stragglers import page_table as stragglers_page

        return stragglers_page(result)
    if suite == "pipeline_hosts":
        from tfdist.tools.bench.pipeline_hosts import pipeline_hosts_table

        return pipeline_hosts_table(rows)
    tables = {"memory": _memory_table, "local_sgd": _local_sgd_table,
              "compression": _compression_table, "engines": _table}
    return tables[suite](rows)


def run_suite(suite: str, quick: bool = False, steps: int | None = None,
              repeats: int | None = None, out: str = "runs/bench",
              processes=None) -> list[dict]:
    """Runs `suite` and writes OUT/SUITE.md, .json and .png. `processes` (compressors only):
    numbers of processes measured at once (`compressors.shared_rows`)."""
    if suite not in SUITES:
        raise ValueError(f"Unknown suite {suite!r}; available: {', '.join(SUITES)}.")
    steps = (10 if quick else 30) if steps is None else steps
    repeats = (3 if quick else 7) if repeats is None else repeats
    if steps < 1 or repeats < 1:
        raise ValueError(f"--steps and --repeats must be >= 1. Received: {steps}, {repeats}")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if processes and suite != "compressors":
        raise ValueError(f"--hosts does not apply to the {suite} suite (received {processes}): "
                         "it runs in this process")
    command = f"tfdist bench --suite {suite}" + (" --quick" if quick else "") + \
        (f" --hosts {','.join(map(str, processes))}" if processes else "")
    meta: dict = {}
    if suite == "pipeline":
        from tfdist.tools.bench import pipeline as measure

        print("bench: pipeline: MLP of "
              f"{measure.LAYERS} Dense({measure.WIDTH}) layers, batch {measure.BATCH}", flush=True)
        rows = _pipeline_rows(quick)
        meta = {"model": f"{measure.LAYERS} x Dense({measure.WIDTH})", "batch": measure.BATCH,
                "remat_timed": "except_last"}
    elif suite == "memory":
        print(f"bench: memory: Adam on the {MODEL} MLP, N = {MEMORY_DEVICES}", flush=True)
        rows = _memory_rows()
        meta = {"model": MODEL, "optimizer": "Adam (K = 2 slots)", "accumulation_steps": 2}
    elif suite == "local_sgd":
        print(f"bench: local_sgd: {len(LOCAL_SGD_RUNS)} runs of configs/local_sgd.yaml",
              flush=True)
        rows = _local_sgd_rows(quick, out_dir)
    elif suite == "compressors":
        from tfdist.tools.bench.compressors import COMPRESSORS, compressor_rows

        where = (f"in {', '.join(map(str, processes))} processes at once" if processes
                 else "in this process")
        print(f"bench: compressors: {len(COMPRESSORS)} compressors, one exchange each, {where}",
              flush=True)
        rows = compressor_rows(quick, processes=processes)
    elif suite == "overhead":
        from tfdist.tools.bench import overhead

        print(f"bench: overhead: {len(overhead.VARIANTS)} optimizers, {repeats} repeats x "
              f"{steps} steps, in this process", flush=True)
        rows = overhead.overhead_rows(steps, repeats, progress=lambda s: print(s, flush=True))
        update_steps = 20
        print(f"bench: overhead: the update alone, {len(overhead.UPDATE_MODELS)} models x 2 "
              f"optimizers x {len(overhead.UPDATE_VARIANTS)} updates, {repeats} repeats x "
              f"{update_steps} updates", flush=True)
        meta = {"steps": steps, "repeats": repeats, "batch": overhead.BATCH,
                "model": {"input_dim": overhead.INPUT_DIM, "hidden": list(overhead.HIDDEN),
                          "classes": overhead.CLASSES},
                "update_steps": update_steps,
                "update_rows": overhead.update_rows(update_steps, repeats,
                                                    progress=lambda s: print(s, flush=True))}
    elif suite == "compression":
        print(f"bench: compression: {len(COMPRESSION_CONFIGS)} runs of the default job", flush=True)
        rows = _compression_rows(quick, out_dir)
    else:
        print(f"bench: engines: {repeats} repeats x {steps} steps, global batch {GLOBAL_BATCH}, "
              f"MLP {INPUT_DIM}-{'-'.join(map(str, HIDDEN))}-{CLASSES}", flush=True)
        rows = _engines_rows(steps, repeats, out_dir)
        meta = {"steps": steps, "repeats": repeats, "global_batch": GLOBAL_BATCH, "model": MODEL}
    result = {**stamp(command), **meta, "rows": rows}
    table = table_of(suite, result)
    (out_dir / f"{suite}.md").write_text(f"Command: `{command}`\n\n{table}\n")
    (out_dir / f"{suite}.json").write_text(json.dumps(result, indent=2))
    png = getattr(plots, suite)(rows, out_dir / f"{suite}.png")
    print(table)
    print(f"bench: wrote {out_dir / f'{suite}.md'}, {out_dir / f'{suite}.json'} and {png}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description="internal: one worker of a multi-process bench row")
    p.add_argument("--worker", choices=["multi_worker", "horovod"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--result", required=True)
    a = p.parse_args()
    _worker(a.worker, a.steps, a.repeats, a.result)


if __name__ == "__main__":
    main()
