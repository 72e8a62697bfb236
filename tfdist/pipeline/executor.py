"""`ScheduleRun`: one pass of a pipeline's schedule, task by task.

Every task (the forward or backward of one micro-batch on one stage, see `schedule.py`) is built
in the schedule's order, its ops under the stage's device and name scope, each after the
previous task of its stage; in a `tf.function` (as under `model.fit`) the stages then run
concurrently wherever the data allows. A run hands tensors between tasks, keeps what each
forward needs for its backward (only the inputs with re-materialization, restoring the stage's
non-trainable state before recomputing), and counts what it keeps (`stats()`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import tensorflow as tf

from tfdist.pipeline.skip import Pop, Stash
from tfdist.pipeline.stats import PipelineStats, nbytes


@dataclass
class _Saved:
    """What one forward task keeps for its backward."""

    x: tf.Tensor
    skips_in: dict
    tape: tf.GradientTape | None = None
    y: tf.Tensor | None = None
    skips_out: dict | None = None
    state: list | None = None
    nbytes: int | None = 0


class ScheduleRun:
    """One pass of the schedule: the tensors the tasks hand each other and keep."""

    def __init__(self, pipe, training: bool, keep: bool, replica: int = 0):
        self.pipe, self.training, self.keep = pipe, training, keep
        self.stages = pipe.replica_stages(replica)  # this replica's copy of the layers
        self.devices = pipe.device_grid[replica]
        k = pipe.num_stages
        self.acts: dict = {}  # (micro, stage) -> stage output, until the next stage takes it
        self.skips: dict = {}  # (micro, name) -> stashed tensor, until its Pop's stage takes it
        self.saved: dict = {}  # (micro, stage) -> _Saved
        self.grads: dict = {}  # (micro, stage) -> gradient of the stage's output
        self.skip_grads: dict = {}  # (micro, name) -> gradient of a stashed tensor
        self.var_grads: dict = {}  # id(variable) -> list of per-micro-batch gradients
        self.last: list = [None] * k  # the last tensor each stage produced (orders its tasks)
        self.live, self.live_bytes = [0] * k, [0] * k
        self.peak, self.peak_bytes = [0] * k, [0] * k
        self.bytes_known = True
        self.xs: list = []
        self.input_grads: dict = {}
        self.stage_vars = [[v for layer in stage for v in layer.trainable_variables]
                           for stage in self.stages]
        self.stage_state = [[v for layer in stage for v in layer.variables if not v.trainable]
                            for stage in self.stages]

    @contextlib.contextmanager
    def _task(self, j: int, tag: str):
        after = [self.last[j]] if self.last[j] is not None else []
        with tf.device(self.devices[j]), tf.name_scope(f"stage{j}"), \
                tf.name_scope(tag), tf.control_dependencies(after):
            yield

    def _run_stage(self, j, x, skips_in, collect=None):
        local = dict(skips_in)
        for layer in self.stages[j]:
            if isinstance(layer, Stash):
                local[layer.skip] = x
                continue
            if isinstance(layer, Pop):
                x = layer([x, local.pop(layer.skip)])
            else:
                x = layer(x, training=self.training)
            if collect is not None:
                collect.append(x)
        return x, {name: local[name] for name in self.pipe.routes.outgoing[j]}

    def _taped_stage(self, j, x, skips_in, collect=None):
        """Stage j on (x, skips_in) under a tape that also watches its floating inputs."""
        tape = tf.GradientTape()
        with tape:
            tape.watch([t for t in (x, *skips_in.values()) if t.dtype.is_floating])
            y, skips_out = self._run_stage(j, x, skips_in, collect=collect)
        return tape, y, skips_out

    # -- tasks --------------------------------------------------------------------------------
    def forward(self, i: int, j: int):
        x = self.xs[i] if j == 0 else self.acts.pop((i, j - 1))
        skips_in = {name: self.skips.pop((i, name)) for name in self.pipe.routes.incoming[j]}
        with self._task(j, f"F{i}"):
            if not self.keep:
                y, skips_out = self._run_stage(j, x, skips_in)
            elif self.pipe.rematerializes(j):
                state = [tf.identity(v.value) for v in self.stage_state[j]]
                y, skips_out = self._run_stage(j, x, skips_in)
                saved = _Saved(x, skips_in, state=state)
                saved.nbytes = nbytes([x, *skips_in.values()])
            else:
                activations: list = []
                tape, y, skips_out = self._taped_stage(j, x, skips_in, collect=activations)
                saved = _Saved(x, skips_in, tape=tape, y=y, skips_out=skips_out)
                saved.nbytes = nbytes([x, *skips_in.values(), *activations])
            self.last[j] = y
        if self.keep:
            self.saved[(i, j)] = saved
            self._account(j, +1, saved.nbytes)
        for name, tensor in skips_out.items():
            self.skips[(i, name)] = tensor
        return y

    def backward(self, i: int, j: int, needs_dx: bool):
        saved = self.saved.pop((i, j))
        dy = self.grads.pop((i, j))
        names_out = self.pipe.routes.outgoing[j]
        with self._task(j, f"B{i}"):
            if saved.tape is None:  # re-materialize: the forward again, with its own state
                after = [tf.identity(v.value) for v in self.stage_state[j]]
                for v, value in zip(self.stage_state[j], saved.state or []):
                    v.assign(value)
                tape, y, skips_out = self._taped_stage(j, saved.x, saved.skips_in)
                for v, value in zip(self.stage_state[j], after):
                    v.assign(value)
            else:
                tape, y, skips_out = saved.tape, saved.y, saved.skips_out
            inputs = list(saved.skips_in.values())
            if needs_dx or j > 0:
                inputs = [saved.x, *inputs]
            sources = inputs + self.stage_vars[j]
            targets = [y] + [skips_out[name] for name in names_out]
            upstream = [dy] + [self.skip_grads.pop((i, name)) for name in names_out]
            grads = tape.gradient(targets, sources, output_gradients=upstream,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            self.last[j] = grads[0] if grads else y
        self._account(j, -1, -saved.nbytes if saved.nbytes is not None else None)
        input_grads, var_grads = grads[:len(inputs)], grads[len(inputs):]
        if needs_dx or j > 0:
            dx, input_grads = input_grads[0], input_grads[1:]
            if j > 0:
                self.grads[(i, j - 1)] = dx
            else:
                self.input_grads[i] = dx
        for name, g in zip(self.pipe.routes.incoming[j], input_grads):
            self.skip_grads[(i, name)] = g
        for v, g in zip(self.stage_vars[j], var_grads):
            self.var_grads.setdefault(id(v), []).append(g)

    def _account(self, j: int, delta: int, nbytes: int | None) -> None:
        self.live[j] += delta
        self.peak[j] = max(self.peak[j], self.live[j])
        if nbytes is None:
            self.bytes_known = False
            return
        self.live_bytes[j] += nbytes
        self.peak_bytes[j] = max(self.peak_bytes[j], self.live_bytes[j])

    # -- whole passes -------------------------------------------------------------------------
    def forward_all(self, xs):
        self.xs = xs
        k = self.pipe.num_stages
        outputs = {}
        for tick in self.pipe.table:
            for task in tick:
                if task.kind == "F":
                    y = self.forward(task.micro, task.stage)
                    if task.stage == k - 1:
                        outputs[task.micro] = y
                    else:
                        self.acts[(task.micro, task.stage)] = y
        return [outputs[i] for i in range(len(xs))]

    def _summed_var_grads(self) -> dict:
        out = {}
        for j, variables in enumerate(self.stage_vars):
            with tf.device(self.devices[j]):
                for v in variables:
                    parts = self.var_grads.get(id(v))
                    if parts:
                        out[id(v)] = parts[0] if len(parts) == 1 else tf.add_n(parts)
        return out

    def backward_all(self, dys, needs_dx: bool):
        k = self.pipe.num_stages
        for i, dy in enumerate(dys):
            self.grads[(i, k - 1)] = dy
        for tick in self.pipe.table:
            for task in tick:
                if task.kind == "B":
                    self.backward(task.micro, task.stage, needs_dx)
        dxs = [self.input_grads[i] for i in range(len(dys))] if needs_dx else []
        return dxs, self._summed_var_grads()

    def train(self, xs, ys, sample_weights, loss_fn, scale=None):
        """The schedule with the loss on the last stage: each micro-batch's mean loss weighted
        by its share of the batch (1/M when they are equal), so the total is the batch's mean
        (times `scale`, this replica's share of a batch split over replicas)."""
        self.xs = xs
        k, m = self.pipe.num_stages, len(xs)
        sizes = [y.shape[0] for y in ys]
        equal = None not in sizes and len(set(sizes)) == 1
        batch = tf.maximum(tf.add_n([tf.shape(y)[0] for y in ys]), 1)
        losses, preds = [], {}
        for tick in self.pipe.table:
            for task in tick:
                i, j = task.micro, task.stage
                if task.kind == "B":
                    self.backward(i, j, needs_dx=False)
                    continue
                y = self.forward(i, j)
                if j < k - 1:
                    self.acts[(i, j)] = y
                    continue
                preds[i] = y
                with self._task(j, f"L{i}"), tf.GradientTape() as tape:
                    tape.watch(y)
                    loss = loss_fn(ys[i], y, sample_weights[i])
                    if equal:
                        loss = loss / m
                    else:  # an empty micro-batch (a batch smaller than M) adds nothing
                        n = tf.shape(ys[i])[0]
                        share = tf.cast(n, loss.dtype) / tf.cast(batch, loss.dtype)
                        loss = tf.where(n > 0, loss * share, tf.zeros_like(loss))
                    if scale is not None:
                        loss = loss * tf.cast(scale, loss.dtype)
                with tf.device(self.devices[j]):
                    self.grads[(i, j)] = tape.gradient(loss, y)
                losses.append(loss)
        with tf.device(self.devices[-1]):
            total = tf.add_n(losses)
        return total, [preds[i] for i in range(m)], self._summed_var_grads()

    def stats(self) -> PipelineStats:
        return PipelineStats(self.pipe.schedule_name, self.pipe.num_microbatches,
                             list(self.peak),
                             list(self.peak_bytes) if self.bytes_known else
                             [None] * self.pipe.num_stages)
