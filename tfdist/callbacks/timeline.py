"""`StepTimeline`: when each part of one training step ran, from TensorFlow's profiler.

The profiler records every op kernel the step ran, with its start and end (an asynchronous
kernel, a collective, from its start to its completion). Each op is sorted into one kind:

* `communication`: a collective (tf.distribute's `Collective*` ops, Horovod's `Horovod*` ops);
* `backward`: an op of the gradient tape (its name holds `gradient_tape/`);
* `update`: the optimizer's update (a `ResourceApply*` kernel, or an op in the inner
  optimizer's name scope);
* `forward`: an op in the model's or the loss's name scope;
* `other`: the rest (the wrapper's own work: packing, the non-finite check, counters).

From these: each kind's busy time (the union of its ops' intervals) and its op time by op type
(the sum of its kernels' spans: where the op threads' time went), the collectives' time that
no forward, backward or update op overlaps (the *exposed* communication: what a step waits for
the network), the time they ran beside computation (overlapped), and when the backward pass
ended. A bucketed all-reduce that starts during the backward pass shows as overlap.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import keras
import tensorflow as tf

from tfdist._hooks.profiler import op_events
from tfdist.arguments import check_int
from tfdist.callbacks.start import skipping

KINDS = ("forward", "backward", "update", "communication", "other")
COMPUTE = ("forward", "backward", "update")
FILE = "timeline.json"
# How long the profiler keeps recording after the step returned. An asynchronous kernel's trace
# event can close after the step is done: TensorFlow's collectives record theirs when the thread
# that signalled the collective's end returns, and the executor's `ProcessAsync::Done` event
# (Horovod's ops) closes after the op's consumers were scheduled; on a loaded machine that
# thread may not run again for milliseconds, and an event still open when the profiler stops is
# lost.
GRACE_SECONDS = 0.1


def classify(node: str, op_type: str, model_scope: str, optimizer_scopes: tuple[str, ...]) -> str:
    """The kind of one op (see the module), from its node name and op type."""
    if op_type.startswith(("Collective", "Horovod")):
        return "communication"
    if "gradient_tape/" in node:
        return "backward"
    path = f"/{node}/"
    if op_type.startswith("ResourceApply") or any(f"/{s}/" in path for s in optimizer_scopes):
        return "update"
    # Keras names a model's scope after it, with a suffix when the name was taken ("mlp_1")
    if re.search(rf"/{re.escape(model_scope)}(_\d+)?/", path) or "/compile_loss/" in path:
        return "forward"
    return "other"


def _merged(intervals) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def _length(intervals) -> int:
    return sum(e - s for s, e in intervals)


def _overlap(a, b) -> int:
    """How long merged intervals `a` and `b` both cover."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_of(events, model_scope: str, optimizer_scopes: tuple[str, ...]) -> dict:
    """The timeline of one step from its ops' `events` ((node, op type, start ns, end ns), as
    `tfdist._hooks.profiler.op_events` reads them): times in ms from the step's first op of a
    known kind (not `other`) to its last."""
    kinded = [(*event, classify(event[0], event[1], model_scope, optimizer_scopes))
              for event in events]
    step = [(start, end) for *_, start, end, kind in kinded if kind != "other"]
    if not step:
        raise ValueError("The profiler recorded no op of the step.")
    # The step's window: from its first to its last op of a known kind; other ops in it (the
    # wrapper's, the input pipeline's) count, those outside it (before or after) do not.
    t0, t1 = min(s for s, _ in step), max(e for _, e in step)
    ms = 1e-6
    kinds: dict[str, list[tuple[int, int]]] = {kind: [] for kind in KINDS}
    op_ms: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    collectives = []
    for node, op_type, start, end, kind in kinded:
        if end < t0 or start > t1:
            continue
        start, end = max(start, t0), min(end, t1)
        kinds[kind].append((start, end))
        op_ms[kind][op_type] = op_ms[kind].get(op_type, 0.0) + (end - start) * ms
        if kind == "communication":
            collectives.append({"node": node, "op": op_type, "start_ms": (start - t0) * ms,
                                "end_ms": (end - t0) * ms})
    merged = {kind: _merged(spans) for kind, spans in kinds.items()}
    compute = _merged(span for kind in COMPUTE for span in merged[kind])
    communication = merged["communication"]
    overlapped = _overlap(communication, compute)
    backward = merged["backward"]
    return {
        "span_ms": (t1 - t0) * ms,
        "busy_ms": {kind: _length(merged[kind]) * ms for kind in KINDS},
        # each kind's op time by op type: the sum of its kernels' spans (ops on several
        # threads at once add up), largest first
        "op_ms": {kind: dict(sorted(spent.items(), key=lambda kv: -kv[1]))
                  for kind, spent in op_ms.items()},
        "communication_ms": _length(communication) * ms,
        "exposed_communication_ms": (_length(communication) - overlapped) * ms,
        "overlapped_communication_ms": overlapped * ms,
        "backward_end_ms": (backward[-1][1] - t0) * ms if backward else None,
        "collectives": sorted(collectives, key=lambda c: c["start_ms"]),
        "intervals": {kind: [[(s - t0) * ms, (e - t0) * ms] for s, e in spans]
                      for kind, spans in merged.items()},
    }


class StepTimeline(keras.callbacks.Callback):
    """Profiles training step `step` (1 = the first, counted over epochs) and keeps its
    timeline in `result` (see `timeline_of`), also written to `path`/timeline.json when `path`
    is given. The profiler starts before the step and stops before the next one (`GRACE_SECONDS`
    after the step returned, so that the events of asynchronous kernels that close late are
    in), so a `StepTimer` placed after this callback does not time the profiler's own start and
    stop.
    Pick a step after the first (which traces) and after any warm-up.

    Example:
        ```python
        model = build_model()
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                      loss="sparse_categorical_crossentropy")
        timeline = tfdist.callbacks.StepTimeline(step=3)
        model.fit(x, y, batch_size=64, epochs=1, callbacks=[timeline], verbose=0)
        busy = timeline.result["busy_ms"]
        print(f"step {timeline.result['span_ms']:.1f} ms: forward {busy['forward']:.1f}, "
              f"backward {busy['backward']:.1f}, update {busy['update']:.1f}")
        assert busy["backward"] > 0 and busy["update"] > 0
        ```
    """

    def __init__(self, step: int, path: str | None = None):
        super().__init__()
        self.step = check_int("step", step, 1)
        self.path = None if path is None else Path(path)
        self.result: dict | None = None
        self._seen = 0
        self._logdir: str | None = None

    def on_train_batch_begin(self, batch, logs=None):
        self._finish()
        if skipping(self.model):
            return
        self._seen += 1
        if self._seen == self.step:
            self._logdir = tempfile.mkdtemp(prefix="tfdist-timeline-")
            tf.profiler.experimental.start(self._logdir)

    def on_epoch_end(self, epoch, logs=None):
        self._finish()

    def on_train_end(self, logs=None):
        self._finish()

    def _finish(self) -> None:
        if self._logdir is None:
            return
        logdir, self._logdir = self._logdir, None
        try:
            time.sleep(GRACE_SECONDS)  # untimed by a StepTimer placed after this callback
            tf.profiler.experimental.stop()
            events = op_events(logdir)
        finally:
            shutil.rmtree(logdir, ignore_errors=True)
        optimizer = self.model.optimizer
        scopes = tuple(dict.fromkeys(o.name for o in (
            optimizer, getattr(optimizer, "inner_optimizer", None)) if o is not None))
        self.result = {"step": self.step, **timeline_of(events, self.model.name, scopes)}
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / FILE).write_text(json.dumps(self.result, indent=1))


__all__ = ["StepTimeline", "classify", "timeline_of"]
