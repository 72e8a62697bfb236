"""`AutoExchange`: the gradient exchange picked from the measured link, during training.

Which exchange trains fastest depends on the link: PowerSGD wins by 6-7x at 100 Mbit/s and loses
at 10 Gbit/s, where FP16 or the dense all-reduce win (the README's comm-suite tables). This part
measures instead of asking the user to know:

1. At its first exchange it times all-reduces of 4 bytes (latency) and of `probe_bytes` bytes
   (bandwidth) over the real workers, and of 4 MiB where the first moved too fast to time.
2. It then trains with each candidate in turn for `probe_steps` steps (the first step of each
   not measured), timing the whole step and the exchange alone with `tf.timestamp` inside the
   traced step. A candidate is only tried if the link model (latency x collective calls + wire
   bytes / bandwidth, with the compute time measured on the candidates already tried) predicts
   it within `explore` x the best time measured so far: on a slow link the dense all-reduce is
   never run.
3. It picks the candidate with the least estimated time to a given accuracy: step time x the
   candidate's `steps_factor`, the steps it needs relative to the dense all-reduce (from the
   comm suite's loss curves, not a guess about accuracy: PowerSGD rank 2 reached 95% after
   about 2x the dense steps on the 5.5M-parameter job, FP16 after the same).
4. It keeps the smallest step time of every `recheck_every` steps; when it drifts by more than
   `drift` from the time the decision was made with, it measures again.

A candidate may also be local SGD (`Candidate(..., local_period=P)`): each replica applies its
own gradients and the models are averaged (one dense all-reduce of the weights) every P steps.
Its cost is its measured local step plus the link model's averaging round divided by P, and its
steps factor is the user's evidence (the local_sgd suite: H <= 8 reached synchronous training's
accuracy in as many steps on the digits CNN). When the pick moves away from a local candidate the
models are averaged first, so every replica continues from the same weights.

Every worker takes the same decision: the measurements are all-gathered and the slowest
worker's numbers (the one a synchronous step waits for) decide, the same arithmetic on the same
values. Each decision is printed once (by rank 0) with its numbers, and `report()` returns them.
The state (the pick, the measurements) lives in optimizer variables: a resumed job keeps its
pick. Candidates keep their own compressor state (PowerSGD's Q), so switching back is cheap.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist import compression
from tfdist.arguments import check_int, check_number
from tfdist.averaging.rounds import average
from tfdist.comm import ByteCounter, ring_bytes
from tfdist.comm.holes import Holes
from tfdist.optimizers.exchange import DEFAULT_BUCKET_BYTES, GradientExchange
from tfdist.optimizers.parts import Part, register
from tfdist.plan.costs import STEPS_FACTORS, link_seconds

PROBE_LINK, PROBING, DECIDED = 0, 1, 2
INF = np.float64(np.inf)
FAST_TRANSFER_S = 0.02  # a probe moved in less: timer noise is too large a share; probe again
LARGE_PROBE_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One exchange `AutoExchange` may pick.

    Attributes:
        name: How decisions and reports name it.
        compressor: A compressor, its registry name or config; None for the dense all-reduce.
        steps_factor: Steps it needs to reach a given accuracy, relative to the dense
            all-reduce (1.0: the same).
        bucket_bytes: The size of its all-reduce buckets (None: one call for all gradients);
            two candidates that differ only here let the measured step time pick the bucket
            size. Defaults to the exchange's default, 25 MiB.
        local_period: 1 (default): the gradients are exchanged every step. P > 1: local SGD,
            each replica steps on its own gradients and the models are averaged every P steps
            (no compressor).

    Example:
        ```python
        from tfdist.optimizers import AutoExchange, Candidate

        exchange = AutoExchange([Candidate("powersgd", {"name": "powersgd", "rank": 2},
                                           steps_factor=1.1),
                                 Candidate("dense")])
        opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3), exchange)
        ```
    """

    name: str
    compressor: Any = None
    steps_factor: float = 1.0
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    local_period: int = 1

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "compressor": compression.serialize(
            compression.get(self.compressor)), "steps_factor": self.steps_factor,
            "bucket_bytes": self.bucket_bytes, "local_period": self.local_period}


# Tried in this order: the least bytes first, so a slow link never runs the expensive ones.
DEFAULT_CANDIDATES = (
    Candidate("powersgd", {"name": "powersgd", "rank": 2}, STEPS_FACTORS["powersgd:2"]),
    Candidate("fp16", "fp16", STEPS_FACTORS["fp16"]),
    Candidate("dense", None, STEPS_FACTORS["dense"]),
)


def _candidate(value) -> Candidate:
    if isinstance(value, Candidate):
        return value
    if isinstance(value, dict) and set(value) <= {"name", "compressor", "steps_factor",
                                                  "bucket_bytes", "local_period"} \
            and "name" in value:
        return Candidate(**value)
    raise ValueError(f"A candidate is a tfdist.optimizers.Candidate or a mapping with `name`, "
                     f"`compressor`, `steps_factor`, `bucket_bytes` and `local_period`. "
                     f"Received: {value!r}")


class _LocalSteps:
    """A local SGD candidate's step: the replica's own gradients applied, the models averaged
    every `period` steps (`average_now` also on demand)."""

    def __init__(self, period: int):
        self.period = period

    def build(self, owner, var_list, engine) -> None:
        self._since = owner.add_variable(shape=(), dtype="int64", aggregation="none",
                                         name="auto_local_since", initializer="zeros")

    def variables(self) -> list:
        return [self._since]

    def per_replica_variables(self) -> list:
        return []

    def average_now(self, ctx, also=()) -> None:
        average(ctx.comm, [*ctx.variables, *also])
        ctx.traffic.add_round()
        self._since.assign(0)

    def step(self, ctx, grads, next) -> None:
        del next  # nothing goes on to the exchange: the replica applies its own gradients
        holes = Holes(grads)
        scale = ctx.comm.world_size  # gradients come divided by the replicas (see parts.py)
        (ctx.apply_local or ctx.apply)(holes.refill([g * tf.cast(scale, g.dtype)
                                                     for g in holes.values]))
        since = self._since + 1
        self._since.assign(since)
        ctx.comm.cond(since >= self.period, lambda: self.average_now(ctx), lambda: None)


def _fastest(comm, elements: int, repeats: int):
    """The least of `repeats` timed all-reduces of `elements` float32 zeros, in seconds."""
    seconds = []
    for _ in range(repeats):
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            (out,) = comm.all_reduce([tf.zeros([elements], tf.float32)])
        with tf.control_dependencies([out]):
            seconds.append(tf.timestamp() - start)
    return tf.reduce_min(tf.stack(seconds))


class _Recorder(ByteCounter):
    """Counts like the step's counter and also keeps, at trace time, the bytes and calls of the
    exchange being traced (a candidate's static cost)."""

    def __init__(self, inner: ByteCounter | None):
        super().__init__(inner.variable if inner else None, inner.calls if inner else None)
        self.counting = inner is not None
        self.nbytes = 0.0
        self.ncalls = 0

    def add(self, nbytes: float) -> None:
        self.nbytes += nbytes
        if self.counting:
            super().add(nbytes)

    def add_call(self) -> None:
        self.ncalls += 1
        if self.counting:
            super().add_call()


def estimates(step_s, exchange_s, link, calls, wire_bytes, factors, periods=None):
    """Each candidate's estimated step time (measured, or compute + the link model) and its time
    per dense-step-equivalent (step time x steps factor). Measured entries are finite.

    Args:
        step_s, exchange_s: [K] measured step and exchange seconds (inf: not measured).
        link: [2] latency in seconds and seconds per byte.
        calls, wire_bytes: [K] each candidate's collective calls and wire bytes per exchange.
        factors: [K] steps factors.
        periods: [K] steps per exchange (local SGD's averaging period; 1: every step, the
            default). A local candidate's measured step is a local one (the fastest probe
            step), so its averaging round, modelled, is added divided by its period.
    """
    periods = tf.ones_like(step_s) if periods is None else periods
    measured = tf.math.is_finite(step_s)
    compute = tf.reduce_min(tf.where(measured, step_s - exchange_s, INF))
    compute = tf.where(tf.math.is_finite(compute), tf.maximum(compute, 0.0), 0.0)
    link_s = link_seconds(calls, wire_bytes, link[0], link[1]) / periods
    model = compute + link_s
    step = tf.where(measured, step_s + tf.where(periods > 1, link_s, 0.0), model)
    return step, step * factors


def next_move(step_s, exchange_s, link, calls, wire_bytes, factors, current, explore,
              periods=None):
    """After candidate `current` was measured: (the next candidate to measure, or -1 to decide,
    the best candidate, every candidate's estimated step time).

    The next one is the first after `current` (in the candidates' order) whose estimated time
    per dense-step-equivalent is within `explore` x the best measured one."""
    step, cost = estimates(step_s, exchange_s, link, calls, wire_bytes, factors, periods)
    measured = tf.math.is_finite(step_s)
    best_measured = tf.reduce_min(tf.where(measured, cost, INF))
    k = tf.shape(step_s, out_type=tf.int64)[0]
    later = tf.range(k) > current
    worth = later & tf.logical_not(measured) & (cost <= explore * best_measured)
    nxt = tf.where(tf.reduce_any(worth), tf.argmax(tf.cast(worth, tf.int32), output_type=tf.int64),
                   tf.constant(-1, tf.int64))
    return nxt, tf.argmin(cost, output_type=tf.int64), step


@register("AutoExchange")
class AutoExchange(Part):
    """Picks the gradient exchange (dense, FP16, PowerSGD, ...) from the measured link while
    training; see the module docstring for how.

    Args:
        candidates: The exchanges to choose from, in the order they are tried (fewest bytes
            first): `Candidate`s or mappings. Defaults to PowerSGD rank 2, FP16, dense.
        probe_steps: Steps each tried candidate trains for (the first not measured). Defaults to 3.
        probe_bytes: Size of the bandwidth probe's all-reduce. Defaults to 512 KiB.
        explore: A candidate is tried when predicted within this factor of the best measured.
            Defaults to 1.1 (each try costs `probe_steps` steps of a likely slower exchange).
        recheck_every: Steps between checks of the step time against the decision's. Defaults
            to 200.
        drift: Relative change of the step time that makes it measure again. Defaults to 0.25.

    Example:
        ```python
        opt = tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3), algorithm="auto")
        ```
    """

    reduces = True

    def __init__(self, candidates=None, probe_steps: int = 3, probe_bytes: int = 1 << 19,
                 explore: float = 1.1, recheck_every: int = 200, drift: float = 0.25):
        given = DEFAULT_CANDIDATES if candidates is None else candidates
        if isinstance(given, (str, bytes, dict)) or not hasattr(given, "__iter__"):
            raise ValueError(f"`candidates` must be a list of candidates. Received: {given!r}")
        self.candidates = [_candidate(c) for c in given]
        names = [c.name for c in self.candidates]
        if not self.candidates or len(set(names)) != len(names):
            raise ValueError(f"`candidates` must be a non-empty list with distinct names. "
                             f"Received names: {names}")
        for c in self.candidates:
            check_number(f"steps_factor of candidate {c.name!r}", c.steps_factor, 0,
                         low_open=True, high=1e6)
            check_int(f"local_period of candidate {c.name!r}", c.local_period, 1)
            if c.local_period > 1 and c.compressor is not None:
                raise ValueError(f"Candidate {c.name!r}: local SGD (local_period="
                                 f"{c.local_period}) averages whole models; give no compressor.")
        self.exchanges = [_LocalSteps(c.local_period) if c.local_period > 1 else
                          GradientExchange(c.compressor, bucket_bytes=c.bucket_bytes)
                          for c in self.candidates]
        self.single = GradientExchange()  # one worker: the identity
        self.probe_steps = check_int("probe_steps", probe_steps, 2)
        self.probe_bytes = check_int("probe_bytes", probe_bytes, 4, 1 << 30)
        self.explore = check_number("explore", explore, 1.0, high=1e6)
        self.recheck_every = check_int("recheck_every", recheck_every, 1)
        self.drift = check_number("drift", drift, 0, low_open=True, high=1e6)
        self.static: list[tuple[float, int]] = [(0.0, 0)] * len(self.candidates)
        self.optimizer_state: Callable[[], list] = list  # set by the owner: its slot variables

    # -- state -----------------------------------------------------------------------------------
    def build(self, owner, var_list, engine) -> None:
        for exchange in self.exchanges:
            exchange.build(owner, var_list, engine)
        self.single.build(owner, var_list, engine)
        k = len(self.candidates)

        def var(name: str, shape=(), dtype="float64", value: Any = 0.0):
            return owner.add_variable(shape=shape, dtype=dtype, aggregation="none", name=name,
                                      initializer=lambda shape, dtype: tf.fill(
                                          shape, tf.constant(value, dtype)))

        self._state = var("auto_state", dtype="int64", value=0)
        self._current = var("auto_current", dtype="int64", value=0)
        self._count = var("auto_count", dtype="int64", value=0)
        self._decisions = var("auto_decisions", dtype="int64", value=0)
        self._step_s = var("auto_step_seconds", (k,), value=np.inf)
        self._exchange_s = var("auto_exchange_seconds", (k,), value=np.inf)
        self._estimate_s = var("auto_estimate_seconds", (k,), value=np.inf)
        self._link = var("auto_link", (2,), value=np.inf)  # latency s, seconds per byte
        self._t0 = var("auto_exchange_start")
        self._last = var("auto_last_step_end")
        self._exchange_now = var("auto_exchange_now")
        self._window = var("auto_window_seconds", value=np.inf)
        self._since = var("auto_since_check", dtype="int64", value=0)
        self._decided_s = var("auto_decided_seconds", value=np.inf)
        self._previous = var("auto_previous", dtype="int64", value=0)  # the last step's pick
        self.world_size = engine.world_size
        self.built = True

    def own_variables(self) -> list:
        return [self._state, self._current, self._count, self._decisions, self._step_s,
                self._exchange_s, self._estimate_s, self._link, self._t0, self._last,
                self._exchange_now, self._window, self._since, self._decided_s,
                self._previous]

    def variables(self) -> list:
        return [v for e in self.exchanges for v in e.variables()] + self.own_variables()

    def per_replica_variables(self) -> list:
        return [v for e in self.exchanges for v in e.per_replica_variables()]

    # -- the step ----------------------------------------------------------------------------
    def step(self, ctx, grads, next) -> None:
        if self.world_size == 1:  # nothing to choose: no exchange, nothing compressed
            self.single.step(ctx, grads, next)
            return
        holes = Holes(grads)
        ctx.comm.cond(tf.equal(self._state, PROBE_LINK), lambda: self._probe_link(ctx),
                      lambda: None)
        with tf.control_dependencies(holes.values):
            self._t0.assign(tf.timestamp())

        def timed_next(c, reduced):
            with tf.control_dependencies([r for r in reduced if r is not None]):
                self._exchange_now.assign(tf.timestamp() - self._t0)
            next(c.replace(comm=ctx.comm), reduced)

        def candidate(i):
            def run(*values):  # traced once per replica on some engines: each records its own
                recorder = _Recorder(ctx.comm.counter)
                comm = copy.copy(ctx.comm)
                comm.counter = recorder
                if isinstance(self.exchanges[i], _LocalSteps):
                    self._exchange_now.assign(0.0)  # its averaging round is modelled
                self.exchanges[i].step(ctx.replace(comm=comm), holes.refill(list(values)),
                                       timed_next)
                self.static[i] = (recorder.nbytes, recorder.ncalls)
                if isinstance(self.exchanges[i], _LocalSteps):
                    # One all-reduce of the model per round (its trace may be counted in
                    # another replica's recorder: the round runs under a merged cond).
                    self.static[i] = (ring_bytes("all_reduce", self._gradient_bytes(ctx),
                                                 self.world_size), 1)
            return run

        def switch(i, *values):
            if i == len(self.candidates) - 1:
                candidate(i)(*values)
            else:
                ctx.comm.cond(tf.equal(self._current, i), candidate(i),
                              lambda *v: switch(i + 1, *v), args=values)

        switch(0, *holes.values)
        self._bookkeeping(ctx)

    def _probe_link(self, ctx) -> None:
        """Times all-reduces of 4 bytes (latency, the fastest of 3: the first also absorbs the
        workers' skew) and of `probe_bytes` (bandwidth, the faster of 2). Where that moved in
        under `FAST_TRANSFER_S`, timer noise would dominate, so a `LARGE_PROBE_BYTES` all-reduce
        measures the bandwidth again. Each stage takes the slowest worker's numbers, so every
        worker probes alike and ends with the same link."""
        comm, n = ctx.comm, self.world_size
        gradient = self._gradient_bytes(ctx)
        small = max(1, min(self.probe_bytes, gradient) // 4)
        latency = _fastest(comm, 1, 3)
        transfer = tf.maximum(_fastest(comm, small, 2) - latency, 1e-6)
        latency, transfer = self._slowest(ctx, [latency, transfer])
        self._link.assign(tf.stack([latency, transfer / ring_bytes("all_reduce", 4 * small, n)]))
        large = max(1, min(LARGE_PROBE_BYTES, gradient) // 4)
        if large > small:
            ctx.comm.cond(transfer < FAST_TRANSFER_S, lambda: self._probe_large(ctx, large),
                          lambda: None)
        self._state.assign(PROBING)
        self._current.assign(0)
        self._count.assign(0)
        self._step_s.assign(tf.fill([len(self.candidates)], INF))
        self._exchange_s.assign(tf.fill([len(self.candidates)], INF))

    def _probe_large(self, ctx, elements: int) -> None:
        latency = self._link[0]
        (seconds,) = self._slowest(ctx, [_fastest(ctx.comm, elements, 2)])
        transfer = tf.maximum(seconds - latency, 1e-6)
        per_byte = transfer / ring_bytes("all_reduce", 4 * elements, self.world_size)
        self._link.assign(tf.stack([latency, per_byte]))

    @staticmethod
    def _gradient_bytes(ctx) -> int:
        return sum(4 * int(np.prod(v.shape)) for v in ctx.variables)

    def _bookkeeping(self, ctx) -> None:
        now = tf.timestamp()
        step_s = now - self._last
        valid = self._last > 0
        probing = tf.equal(self._state, PROBING)
        decided = tf.equal(self._state, DECIDED)
        measure = probing & valid & (self._count >= 1)
        here = tf.one_hot(self._current, len(self.candidates), on_value=True, off_value=False)
        self._step_s.assign(tf.where(measure & here, tf.minimum(self._step_s, step_s),
                                     self._step_s))
        self._exchange_s.assign(tf.where(measure & here,
                                         tf.minimum(self._exchange_s, self._exchange_now),
                                         self._exchange_s))
        self._count.assign_add(tf.cast(probing, tf.int64))
        self._window.assign(tf.where(decided & valid, tf.minimum(self._window, step_s),
                                     self._window))
        self._since.assign_add(tf.cast(decided, tf.int64))
        self._last.assign(now)
        ctx.comm.cond(probing & (self._count >= self.probe_steps), lambda: self._advance(ctx),
                      lambda: None)
        ctx.comm.cond(decided & (self._since >= self.recheck_every), lambda: self._recheck(ctx),
                      lambda: None)
        self._leave_local(ctx)

    def _leave_local(self, ctx) -> None:
        """Averages the models and the optimizer's slots (local steps moved each replica's own
        momentum) when the pick has just moved away from a local candidate (or a re-check starts
        measuring again), so every replica goes on from the same state."""
        local = [i for i, e in enumerate(self.exchanges) if isinstance(e, _LocalSteps)]
        if not local:
            return
        left = tf.not_equal(self._previous, self._current) | tf.equal(self._state, PROBE_LINK)
        for i in local:
            exchange = self.exchanges[i]
            assert isinstance(exchange, _LocalSteps)
            ctx.comm.cond(left & tf.equal(self._previous, i),
                          lambda e=exchange: e.average_now(ctx, self.optimizer_state()),
                          lambda: None)
        self._previous.assign(self._current)

    def _slowest(self, ctx, values: list) -> list:
        """Every worker's values all-gathered, the largest of each kept: the same on all."""
        sizes = [int(np.prod(v.shape)) if v.shape.rank else 1 for v in values]
        flat = tf.concat([tf.reshape(v, [-1]) for v in values], 0)
        gathered = ctx.comm.all_gather(flat[None])
        top = tf.reduce_max(gathered, axis=0)
        return [tf.reshape(part, v.shape) for part, v in
                zip(tf.split(top, sizes), values)]

    def _advance(self, ctx) -> None:
        step_s, exchange_s, link = self._slowest(
            ctx, [tf.convert_to_tensor(self._step_s), tf.convert_to_tensor(self._exchange_s),
                  tf.convert_to_tensor(self._link)])
        calls = tf.constant([float(c) for _, c in self.static], tf.float64)
        wire = tf.constant([b for b, _ in self.static], tf.float64)
        factors = tf.constant([c.steps_factor for c in self.candidates], tf.float64)
        periods = tf.constant([float(c.local_period) for c in self.candidates], tf.float64)
        nxt, best, estimate = next_move(step_s, exchange_s, link, calls, wire, factors,
                                        self._current, tf.constant(self.explore, tf.float64),
                                        periods)
        deciding = nxt < 0
        self._step_s.assign(step_s)
        self._exchange_s.assign(exchange_s)
        self._link.assign(link)
        self._estimate_s.assign(estimate)
        self._current.assign(tf.where(deciding, best, nxt))
        self._count.assign(0)
        self._state.assign(tf.where(deciding, tf.constant(DECIDED, tf.int64),
                                    tf.constant(PROBING, tf.int64)))
        self._decided_s.assign(tf.where(deciding, tf.gather(estimate, best), INF))
        self._decisions.assign_add(tf.cast(deciding, tf.int64))
        self._window.assign(np.inf)
        self._since.assign(0)
        tf.cond(deciding & tf.equal(ctx.comm.rank, 0),
                lambda: self._print(best, estimate, step_s, link), lambda: None)

    def _print(self, best, estimate, step_s, link):
        def ms(x):
            return tf.strings.as_string(1000.0 * x, precision=1)

        parts = []
        for i, c in enumerate(self.candidates):
            how = tf.where(tf.math.is_finite(step_s[i]), "measured", "modelled")
            parts.append(tf.strings.join([c.name, " ", ms(estimate[i]), " ms/step (", how,
                                          f") x {c.steps_factor:g}"]))
        names = tf.constant([c.name for c in self.candidates])
        mbps = tf.strings.as_string(8e-6 / link[1], precision=0)
        line = tf.strings.join(
            ["tfdist auto: picked ", tf.gather(names, best), " | ", tf.strings.join(parts, "; "),
             " | link ", mbps, " Mbit/s, latency ", ms(link[0]), " ms"])
        tf.print(line)  # to standard error

    def _recheck(self, ctx) -> None:
        (window,) = self._slowest(ctx, [tf.convert_to_tensor(self._window)])
        ratio = window / self._decided_s
        moved = (ratio > 1.0 + self.drift) | (ratio < 1.0 / (1.0 + self.drift))
        self._state.assign(tf.where(moved, tf.constant(PROBE_LINK, tf.int64), self._state))
        self._window.assign(np.inf)
        self._since.assign(0)

    # -- reading it -----------------------------------------------------------------------------
    @property
    def choice(self) -> str | None:
        """The candidate picked (None while measuring)."""
        if not self.built or self.world_size == 1:
            return "dense" if self.built else None
        if int(self._state.numpy()) != DECIDED:
            return None
        return self.candidates[int(self._current.numpy())].name

    def report(self) -> dict[str, Any]:
        """The last decision with its numbers (JSON-ready)."""
        if not self.built:
            return {"choice": None}
        if self.world_size == 1:
            return {"choice": self.choice, "reason": "one worker: nothing is exchanged"}
        step, estimate = self._step_s.numpy(), self._estimate_s.numpy()
        latency, per_byte = (float(x) for x in self._link.numpy())

        def number(x: float) -> float | None:
            return round(float(x), 6) if math.isfinite(x) else None

        return {
            "choice": self.choice,
            "decisions": int(self._decisions.numpy()),
            "latency_s": number(latency),
            "bandwidth_bytes_per_s": number(1.0 / per_byte) if per_byte > 0 else None,
            "candidates": [
                {"name": c.name, "measured": bool(math.isfinite(step[i])),
                 "step_s": number(estimate[i]), "steps_factor": c.steps_factor,
                 "local_period": c.local_period,
                 "wire_bytes_per_step": self.static[i][0] / c.local_period,
                 "collectives_per_step": self.static[i][1] / c.local_period}
                for i, c in enumerate(self.candidates)],
        }

    def get_config(self) -> dict[str, Any]:
        return {"candidates": [c.get_config() for c in self.candidates],
                "probe_steps": self.probe_steps, "probe_bytes": self.probe_bytes,
                "explore": self.explore, "recheck_every": self.recheck_every,
                "drift": self.drift}

    def __repr__(self) -> str:
        return f"AutoExchange(candidates={[c.name for c in self.candidates]})"
