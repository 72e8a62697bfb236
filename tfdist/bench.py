"""`tfdist bench`: step time of the tfdist engines against plain Keras + MirroredStrategy.

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
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import keras

INPUT_DIM, HIDDEN, CLASSES = 256, (1024, 1024), 10
MODEL = {"input_dim": INPUT_DIM, "hidden": list(HIDDEN), "classes": CLASSES}
GLOBAL_BATCH = 256


class StepTimer(keras.callbacks.Callback):
    """Collects the wall time of each training batch."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def _build(strategy, wrap: bool, engine: str = "strategy"):
    import contextlib

    import tfdist
    from tfdist.models import build_model

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
    from tfdist.runner import configure_devices
    from tfdist.strategies import new_mirrored_strategy

    devices = configure_devices(2)
    engines: dict[str, tuple] = {}
    for key, wrap in (("baseline", False), ("tfdist", True)):
        strategy = new_mirrored_strategy(devices)
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
    from tfdist.launch import run_horovod, run_tf_workers

    result_file = out / f"{kind}.worker.json"
    argv = [sys.executable, "-m", "tfdist.bench", "--worker", kind, "--steps", str(steps),
            "--repeats", str(repeats), "--result", str(result_file)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    timeout = 600
    if kind == "horovod":
        from tfdist.horovod import is_available

        if not is_available():
            print("bench: Horovod is not installed; skipping the Horovod row", file=sys.stderr)
            return None
        results = [run_horovod(argv, 2, timeout, env=env)]
    else:
        results = run_tf_workers(argv, 2, timeout, env=env)
    if any(r.returncode != 0 for r in results):
        tail = "\n".join(r.output[-2000:] for r in results)
        raise RuntimeError(f"bench: the {kind} workers failed:\n{tail}")
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


def run_suite(suite: str, quick: bool = False, steps: int | None = None,
              repeats: int | None = None, out: str = "runs/bench") -> list[dict]:
    if suite != "engines":
        raise ValueError(f"Unknown suite {suite!r}; available: engines.")
    steps = steps or (10 if quick else 30)
    repeats = repeats or (3 if quick else 7)
    if steps < 1 or repeats < 1:
        raise ValueError(f"--steps and --repeats must be >= 1. Received: {steps}, {repeats}")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "tfdist bench --suite engines" + (" --quick" if quick else "")
    print(f"bench: {suite}: {repeats} repeats x {steps} steps, global batch {GLOBAL_BATCH}, "
          f"MLP {INPUT_DIM}-{'-'.join(map(str, HIDDEN))}-{CLASSES}",
          flush=True)
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
    table = _table(rows)
    (out_dir / "engines.md").write_text(f"Command: `{command}`\n\n{table}\n")
    (out_dir / "engines.json").write_text(json.dumps(
        {"command": command, "steps": steps, "repeats": repeats, "global_batch": GLOBAL_BATCH,
         "model": MODEL, "rows": rows}, indent=2))
    print(table)
    print(f"bench: wrote {out_dir / 'engines.md'} and {out_dir / 'engines.json'}")
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
