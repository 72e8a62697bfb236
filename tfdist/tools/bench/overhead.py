"""Suite "overhead": what tfdist's optimizer wrapper adds to a step that exchanges nothing.

One process, no strategy: a world of one worker, where every collective is the identity, so a
step's time beyond plain Keras' is the wrapper's own work (its parts, checks and counters), not
communication. The same model, initial weights and batches are trained, for SGD with momentum
and for Adam, by

  * Keras' own optimizer: the baseline of its rows;
  * `tfdist.DistributedOptimizer` around it, the dense exchange, with its fused update (Adam's
    own arithmetic compiled by XLA, one function per device; SGD's one TensorFlow kernel per
    variable), with Keras' update (`fused_update=False`) and, for SGD, with Keras' update
    compiled by XLA (`fused_update="xla"`, which for Adam is the fused update);
  * for SGD, `tfdist.DistributedOptimizer(..., local_sgd=PeriodicSchedule(P))` with P longer
    than the run: every step a local step (the path a local SGD job takes between averaging
    rounds).

Their repeats are interleaved, so all see the same machine load; each row reports the median
step time over the repeats' medians, the difference to its baseline in ms, and the largest
difference between its weights and the baseline's after the same steps (in a world of one the
wrapper must not change the answer; XLA may round a multiply-add once). The model is the
comm suite's 5.5M-parameter MLP (64-2304-2304-10, batch 64): its per-step passes over the
gradients are large enough to see.

The update alone (`update_rows`): on that MLP and on the models suite's ResNet-50, the same
gradients applied 20 times in one traced function by Keras' optimizer, by the same optimizer
fused by tfdist (the fused update alone), and by the wrapper with each of its updates (fused,
Keras', Keras' compiled by XLA; the wrapper adds its non-finite check, a pass over the
gradients), timed per update, with the weights after the 20 updates compared with Keras'; and
the bound a flat buffer would reach, the wrapper's fused update once over one vector of all
parameters.
"""

from __future__ import annotations

import statistics
import time

import keras
import numpy as np

from tfdist._hooks.optimizer import fuse_update
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
    ("dense_xla", "tfdist.DistributedOptimizer, dense exchange, Keras' update compiled by XLA",
     "sgd", {"fused_update": "xla"}),
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
        lines.append(f"| {r['label']} | {r['step_ms']:.1f} | {_spread(r, 1)} | "
                     f"{r['overhead_ms']:+.1f} | {r['ratio']:.2f} | {r['max_weight_diff']:.1e} | "
                     f"{r['loss']:.4f} |")
    return (f"A world of one (no strategy, no communication), MLP {INPUT_DIM}-"
            f"{'-'.join(map(str, HIDDEN))}-{CLASSES} ({rows[0]['parameters']:,} parameters), "
            f"batch {BATCH}; {repeats} interleaved repeats of {steps} steps, each repeat's median "
            "step; each row against Keras' own optimizer of the same kind:\n\n"
            + "\n".join(lines))


# -- the update alone -------------------------------------------------------------------------
# (model, its builder's arguments) for the update-alone rows: the MLP above and the models
# suite's ResNet-50 (64x64x3 images, 10 classes).
UPDATE_MODELS = (("mlp", (INPUT_DIM,), CLASSES, HIDDEN), ("resnet50", (64, 64, 3), 10, ()))
# (key, row label, tfdist.DistributedOptimizer's options; None: Keras' optimizer alone; ALONE:
# Keras' optimizer fused as the wrapper fuses its inner one, without the wrapper). "flat" is
# what a flat buffer would reach: the wrapper's fused update once over all parameters, as if
# every variable were a view into one buffer (`_flat_updates`).
ALONE = "alone"
UPDATE_VARIANTS: tuple[tuple[str, str, dict | str | None], ...] = (
    ("keras", "Keras' update (baseline)", None),
    ("alone", "tfdist's fused update alone (Keras' optimizer, fused; no wrapper)", ALONE),
    ("fused", "tfdist.DistributedOptimizer, fused update (with its non-finite check)", {}),
    ("keras_update", "tfdist.DistributedOptimizer, Keras' update", {"fused_update": False}),
    ("xla", "tfdist.DistributedOptimizer, Keras' update compiled by XLA",
     {"fused_update": "xla"}),
    ("flat", "bound: the wrapper's fused update over one flat copy of all parameters (not a "
     "training option)", None),
)


def _update_setup(model_name: str, shape, classes: int, hidden, optimizer_name: str,
                  options: dict | str | None):
    """A built model's trainable variables, gradients of one batch for them, and the optimizer
    (built) of a variant; the same initial weights and gradients for every variant."""
    import tensorflow as tf

    from tfdist.tools.models import build_model

    keras.utils.set_random_seed(0)
    model = build_model(model_name, shape, classes, hidden)
    x = tf.random.stateless_normal((BATCH, *shape), seed=(1, 2))
    y = tf.random.stateless_uniform((BATCH,), seed=(3, 4), maxval=classes, dtype=tf.int32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True)))
    variables = model.trainable_variables
    grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
    optimizer = _optimizer(optimizer_name)
    if options == ALONE:
        fuse_update(optimizer, True)
    elif isinstance(options, dict):
        optimizer = DistributedOptimizer(optimizer, **options)
    optimizer.build(variables)
    return model, variables, grads, optimizer


def _updates(optimizer, grads, variables, steps: int):
    """A traced function applying `grads` to `variables` `steps` times."""
    import tensorflow as tf

    @tf.function
    def updates():
        for _ in tf.range(steps):
            optimizer.apply(grads, variables)
        return optimizer.iterations

    return updates


def _flat_updates(optimizer_name: str, grads, variables, steps: int):
    """The fused update (the "fused" variant's wrapper and kernel) applied `steps` times to one
    flat variable holding a copy of all `variables`, with the concatenated `grads`, in one
    traced function; and a function giving the flat variable back as the variables' values."""
    import tensorflow as tf

    def flattened(tensors):
        return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)

    shapes = [v.shape for v in variables]
    flat = keras.Variable(flattened(variables))
    optimizer = DistributedOptimizer(_optimizer(optimizer_name))
    optimizer.build([flat])
    updates = _updates(optimizer, [flattened(grads)], [flat], steps)

    def values():
        parts = tf.split(flat.value, [s.num_elements() for s in shapes])
        return [tf.reshape(p, s).numpy() for p, s in zip(parts, shapes)]

    return updates, values


def update_rows(steps: int, repeats: int, progress=print) -> list[dict]:
    """The optimizer's update alone, timed: `steps` applies of the same gradients in one traced
    function, for every `UPDATE_MODELS` model, SGD with momentum and Adam, and every
    `UPDATE_VARIANTS` variant, repeats interleaved; each row with the largest difference from
    Keras' weights after the same `steps` updates from the same weights."""
    rows = []
    for model_name, shape, classes, hidden in UPDATE_MODELS:
        for optimizer_name in ("sgd", "adam"):
            runs = {}
            for key, _, options in UPDATE_VARIANTS:
                model, variables, grads, optimizer = _update_setup(
                    model_name, shape, classes, hidden, optimizer_name, options)
                if key == "flat":
                    updates, values = _flat_updates(optimizer_name, grads, variables, steps)
                else:
                    updates = _updates(optimizer, grads, variables, steps)
                    values = lambda variables=variables: [v.numpy() for v in variables]  # noqa: E731
                updates()  # trace, and the `steps` updates whose weights are compared
                runs[key] = {"model": model, "variables": variables, "after": values(),
                             "updates": updates, "samples": []}
            for i in range(repeats):
                for run in runs.values():
                    start = time.perf_counter()
                    run["updates"]()
                    run["samples"].append(1000 * (time.perf_counter() - start) / steps)
                progress(f"bench: overhead: update, {model_name}, {optimizer_name}, repeat "
                         f"{i + 1}/{repeats}: " + ", ".join(
                             f"{key} {run['samples'][-1]:.2f} ms" for key, run in runs.items()))
            base = runs["keras"]
            base_ms = statistics.median(base["samples"])
            for key, label, _ in UPDATE_VARIANTS:
                run = runs[key]
                ms = statistics.median(run["samples"])
                diff = max(float(np.max(np.abs(a - b)))
                           for a, b in zip(run["after"], base["after"]))
                rows.append({"model": model_name, "optimizer": optimizer_name, "variant": key,
                             "label": label, "update_ms": ms, "repeat_ms": run["samples"],
                             "speedup": base_ms / ms, "max_weight_diff": diff,
                             "parameters": int(run["model"].count_params()),
                             "variables": len(run["variables"])})
    return rows


def update_table(rows: list[dict], steps: int) -> str:
    """The update-alone rows: per model and optimizer, each variant against Keras' update."""
    lines = ["| model | optimizer | update | update time (ms, median) | range over repeats (ms) "
             "| speed-up vs Keras' | weights vs Keras' (max abs diff) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['parameters']:,} parameters, {r['variables']} "
                     f"variables) | {_OPTIMIZER_NAMES[r['optimizer']]} | {r['label']} | "
                     f"{r['update_ms']:.2f} | {_spread(r, 2)} | {r['speedup']:.2f}x | "
                     f"{r['max_weight_diff']:.1e} |")
    return (f"The optimizer's update alone: {steps} updates with the same gradients (one "
            f"batch's) in one traced function, from the same weights; each repeat's time per "
            "update, and the weights after the first "
            f"{steps} updates against Keras':\n\n" + "\n".join(lines))


_OPTIMIZER_NAMES = {"sgd": "SGD with momentum 0.9", "adam": "Adam"}


def _spread(row: dict, digits: int) -> str:
    """A row's range over its repeats, "lowest-highest" (ms)."""
    return f"{min(row['repeat_ms']):.{digits}f}-{max(row['repeat_ms']):.{digits}f}"
