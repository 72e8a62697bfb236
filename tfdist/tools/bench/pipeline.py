"""What `tfdist bench --suite pipeline` measures.

One training step (forward, backward with the loss on the last stage, SGD update) of an MLP of
equal Dense layers cut into K stages on K devices, per schedule and number of micro-batches M:

* step time (median over repeats, after a warm-up) and throughput relative to the same layers in
  one Sequential on one device;
* the idle fraction of each stage, measured: the TensorFlow profiler times every op kernel of one
  step; a stage is busy while any of its ops (forward, backward or recomputation, found by the
  `stage<j>` name scope the executor gives them) runs; idle = 1 - busy / the step's span. Next to
  it the GPipe bubble (K - 1) / (M + K - 1);
* per stage, the most micro-batches and bytes of activations kept for the backward (the
  executor's count of the tensors it holds), with and without re-materialization.
"""

from __future__ import annotations

import re
import statistics
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from tfdist.devices import place_slots
from tfdist.pipeline import Pipeline
from tfdist.pipeline.schedule import bubble_fraction

__all__ = ["stage_idle_fractions", "pipeline_rows", "pipeline_table"]

WIDTH, LAYERS, BATCH, CLASSES = 1024, 8, 256, 10
_STAGE = re.compile(r"stage(\d+)")


def stage_idle_fractions(intervals, k: int) -> list[float]:
    """Per stage, 1 - (time any of its ops ran) / (first op start to last op end of all stages)."""
    spans: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    for name, start, end in intervals:
        match = _STAGE.search(name)
        if match and int(match.group(1)) < k:
            spans[int(match.group(1))].append((start, end))
    if not all(spans):
        raise RuntimeError("The profile holds no op of some stage: "
                           f"{[len(s) for s in spans]} ops per stage.")
    first = min(s for stage in spans for s, _ in stage)
    last = max(e for stage in spans for _, e in stage)
    fractions = []
    for stage in spans:
        busy = 0
        ordered = sorted(stage)
        current_start, current_end = ordered[0]
        for start, end in ordered[1:]:  # union of the stage's intervals
            if start > current_end:
                busy += current_end - current_start
                current_start, current_end = start, end
            else:
                current_end = max(current_end, end)
        busy += current_end - current_start
        fractions.append(1 - busy / (last - first))
    return fractions


def _layers(seed: int = 0):
    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(WIDTH if i < LAYERS - 1 else CLASSES,
                               activation="relu" if i < LAYERS - 1 else None)
            for i in range(LAYERS)]


def _loss(y_true, y_pred, weight=None):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred,
                                                                      from_logits=True))


def _data():
    rs = np.random.RandomState(0)
    return (tf.constant(rs.randn(BATCH, WIDTH).astype("float32")),
            tf.constant(rs.randint(0, CLASSES, BATCH)))


def _time(step, steps: int, repeats: int) -> float:
    step()  # trace and warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            out = step()
        tf.nest.map_structure(lambda t: t.numpy(), out)
        samples.append((time.perf_counter() - start) / steps)
    return statistics.median(samples) * 1e3


def _baseline_step(device: str):
    x, y = _data()
    with tf.device(device):
        model = keras.Sequential([keras.Input((WIDTH,)), *_layers()])
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step():
        with tf.device(device), tf.GradientTape() as tape:
            loss = _loss(y, model(x, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step


def _pipeline_step(devices, m: int, schedule: str, remat: str):
    """One step of the MLP cut into one stage per device (or per device of each row of a grid
    of data-parallel pipelines)."""
    x, y = _data()
    layers = _layers()
    k = len(devices[0]) if isinstance(devices[0], list) else len(devices)
    per = LAYERS // k
    pipe = Pipeline([layers[j * per:(j + 1) * per] for j in range(k)],
                    devices=devices, num_microbatches=m, schedule=schedule, remat=remat)
    pipe.build((BATCH, WIDTH))
    optimizer = place_slots(keras.optimizers.SGD(0.01))
    optimizer.build(pipe.trainable_variables)

    @tf.function
    def step():
        loss, _, grads = pipe.forward_backward(x, y, _loss)
        optimizer.apply(grads, pipe.trainable_variables)
        return loss

    return pipe, step


def pipeline_rows(devices: list[str], quick: bool, progress=print) -> list[dict]:
    from tfdist._hooks.profiler import profile_op_intervals

    steps, repeats = (3, 3) if quick else (5, 5)
    baseline_ms = _time(_baseline_step(devices[0]), steps, repeats)
    progress(f"bench: pipeline: 1 device: {baseline_ms:.1f} ms/step")
    rows = [{"schedule": "one device", "k": 1, "m": 1, "step_ms": baseline_ms, "speedup": 1.0}]
    configs = [(k, m, s) for k in (2, 4) if k <= len(devices) for m in ((4,) if quick else (1, 4, 8))
               for s in ("gpipe", "1f1b")]
    for n, (k, m, schedule) in enumerate(configs, 1):
        pipe, step = _pipeline_step(devices[:k], m, schedule, "except_last")
        step_ms = _time(step, steps, repeats)
        with tempfile.TemporaryDirectory() as logdir:
            idle = stage_idle_fractions(profile_op_intervals(step, logdir), k)
        kept = {}
        for remat in ("all", "none"):
            other, other_step = _pipeline_step(devices[:k], m, schedule, remat)
            other_step.get_concrete_function()  # tracing fills the executor's counts
            kept[remat] = other.stats
        row = {"schedule": schedule, "k": k, "m": m, "step_ms": step_ms,
               "speedup": baseline_ms / step_ms, "idle": idle,
               "bubble": bubble_fraction(m, k),
               "microbatches_kept": kept["none"].peak_microbatches,
               "activation_bytes_remat": kept["all"].peak_bytes,
               "activation_bytes_no_remat": kept["none"].peak_bytes}
        rows.append(row)
        progress(f"bench: pipeline [{n}/{len(configs)}] {schedule} K={k} M={m}: "
                 f"{step_ms:.1f} ms/step, idle {np.mean(idle):.2f} (bubble {row['bubble']:.2f})")
    return rows


def _kib(values) -> str:
    return " / ".join(f"{v / 1024:,.0f}" for v in values)


def pipeline_table(rows: list[dict]) -> str:
    lines = ["| schedule | K | M | step ms | throughput vs 1 device | idle per stage (measured) "
             "| bubble (K-1)/(M+K-1) | micro-batches kept per stage | activations kept per stage, KiB: "
             "remat vs no remat |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["k"] == 1:
            lines.append(f"| one device | 1 | - | {r['step_ms']:.1f} | 1.00x | - | - | - | - |")
            continue
        lines.append(
            f"| {r['schedule']} | {r['k']} | {r['m']} | {r['step_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {' / '.join(f'{v:.2f}' for v in r['idle'])} | "
            f"{r['bubble']:.2f} | {' / '.join(map(str, r['microbatches_kept']))} | "
            f"{_kib(r['activation_bytes_remat'])} vs {_kib(r['activation_bytes_no_remat'])} |")
    return "\n".join(lines)
