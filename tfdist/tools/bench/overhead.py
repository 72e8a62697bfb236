"""Suite "overhead": what tfdist's optimizer wrapper adds to a step that exchanges nothing.

One process, no strategy: a world of one worker, where every collective is the identity, so a
step's time beyond plain Keras' is the wrapper's own work (its parts, checks and counters), not
communication. The same model, initial weights and batches are trained, for SGD with momentum
and for Adam, by

  * Keras' own optimizer: the baseline of its rows;
  * `tfdist.DistributedOptimizer` around it, the dense exchange, with its fused update (one
    TensorFlow kernel per variable) and with Keras' update (`fused_update=False`);
  * for SGD, `tfdist.DistributedOptimizer(..., local_sgd=PeriodicSchedule(P))` with P longer
    than the run: every step a local step (the path a local SGD job takes between averaging
    rounds).

Their repeats are interleaved, so all see the same machine load; each row reports the median
step time over the repeats' medians, the difference to its baseline in ms, and the largest
difference between its weights and the baseline's after the same steps (in a world of one the
wrapper must not change the answer; Adam's fused kernel rounds differently). The model is the
comm suite's 5.5M-parameter MLP (64-2304-2304-10, batch 64): its per-step passes over the
gradients are large enough to see.
"""

from __future__ import annotations

import statistics
import time

import keras
import numpy as np

from tfdist.averaging import PeriodicSchedule
from tfdist.optimizers import DistributedOptimizer

INPUT_DIM, HIDDEN, CLASSES, BATCH = 64, (2304, 2304), 10, 64
LOCAL_PERIOD = 10**9  # longer than any run: every step is local

# (key, row label, Keras optimizer, tfdist.DistributedOptimizer's options; None: Keras'
# optimizer alone, the baseline of the rows with its optimizer).
VARIANTS: tuple[tuple[str, str, str, dict | None], ...] = (
    ("keras", "Keras' SGD with momentum (baseline)", "sgd", None),
    ("dense", "tfdist.DistributedOptimizer, dense exchange (fused update)", "sgd", {}),
    ("dense_keras_update", "tfdist.DistributedOptimizer, dense exchange, Keras' update", "sgd",
     {"fused_update": False}),
    ("local_sgd", "tfdist.DistributedOptimizer, local SGD (local steps)", "sgd",
     {"local_sgd": PeriodicSchedule(LOCAL_PERIOD)}),
    ("keras_adam", "Keras' Adam (baseline)", "adam", None),
    ("dense_adam", "tfdist.DistributedOptimizer(Adam), dense exchange (fused update)", "adam", {}),
    ("dense_adam_keras_update", "tfdist.DistributedOptimizer(Adam), dense exchange, Keras' update",
     "adam", {"fused_update": False}),
)


def _optimizer(name: str):
    return keras.optimizers.SGD(0.01, momentum=0.9) if name == "sgd" else \
        keras.optimizers.Adam(1e-3)


def _model(optimizer_name: str, options: dict | None):
    from tfdist.tools.models import build_model

    keras.utils.set_random_seed(0)
    model = build_model("mlp", (INPUT_DIM,), CLASSES, HIDDEN)
    optimizer = _optimizer(optimizer_name)
    if options is not None:
        optimizer = DistributedOptimizer(optimizer, **options)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


def overhead_rows(steps: int, repeats: int, progress=print) -> list[dict]:
    """Trains every variant `3 + repeats * steps` steps, repeats interleaved; see the module."""
    import tensorflow as tf

    from tfdist.callbacks import StepTimer
    from tfdist.data import synthetic_classification

    x, y = synthetic_classification(steps * BATCH, (INPUT_DIM,), CLASSES)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    models: dict[str, keras.Model] = {}
    samples: dict[str, list[float]] = {}
    losses: dict[str, float] = {}  # each model's mean loss over its last repeat
    for key, _, optimizer, options in VARIANTS:
        start = time.perf_counter()
        models[key] = _model(optimizer, options)
        models[key].fit(data.take(3), epochs=1, verbose=0)  # trace and warm up
        samples[key] = []
        progress(f"bench: overhead: {key} traced in {time.perf_counter() - start:.1f} s")
    for i in range(repeats):
        for key, model in models.items():
            timer = StepTimer()
            history = model.fit(data, epochs=1, verbose=0, callbacks=[timer])
            samples[key].append(1000 * statistics.median(timer.times))
            losses[key] = float(history.history["loss"][-1])
        progress(f"bench: overhead: repeat {i + 1}/{repeats}: " + ", ".join(
            f"{key} {samples[key][-1]:.1f} ms" for key in models))
    baselines = {optimizer: key for key, _, optimizer, options in VARIANTS if options is None}
    rows = []
    for key, label, optimizer, _ in VARIANTS:
        base = baselines[optimizer]
        ms, base_ms = statistics.median(samples[key]), statistics.median(samples[base])
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip(models[key].get_weights(), models[base].get_weights()))
        rows.append({"variant": key, "label": label, "optimizer": optimizer, "baseline": base,
                     "step_ms": ms,
                     "repeat_ms": samples[key], "overhead_ms": ms - base_ms,
                     "ratio": ms / base_ms, "max_weight_diff": diff, "loss": losses[key],
                     "parameters": int(models[key].count_params())})
    return rows


def overhead_table(rows: list[dict], steps: int, repeats: int) -> str:
    lines = ["| optimizer | step time (ms, median) | range over repeats (ms) | beyond Keras' (ms) "
             "| ratio | weights vs Keras' (max abs diff) | loss, last repeat |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = min(r["repeat_ms"]), max(r["repeat_ms"])
        lines.append(f"| {r['label']} | {r['step_ms']:.1f} | {lo:.1f}-{hi:.1f} | "
                     f"{r['overhead_ms']:+.1f} | {r['ratio']:.2f} | {r['max_weight_diff']:.1e} | "
                     f"{r['loss']:.4f} |")
    return (f"A world of one (no strategy, no communication), MLP {INPUT_DIM}-"
            f"{'-'.join(map(str, HIDDEN))}-{CLASSES} ({rows[0]['parameters']:,} parameters), "
            f"batch {BATCH}; {repeats} interleaved repeats of {steps} steps, each repeat's median "
            "step; each row against Keras' own optimizer of the same kind:\n\n"
            + "\n".join(lines))
