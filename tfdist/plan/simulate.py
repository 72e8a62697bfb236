"""Stragglers and asynchrony at scale, by simulation: who waits for whom.

`simulate(algorithm, workers, compute_s, steps, ...)` plays a job event by event (no TensorFlow,
no training): every worker runs `steps` steps of `compute_s` seconds, slowed as `Stragglers`
says, and waits where its algorithm makes it wait:

- **sync**: the all-reduce ends every step: the step takes the slowest worker's compute, then
  `exchange_s`.
- **local_sgd:H**: the models are averaged every H steps (and after the last): each worker runs
  its H steps on its own, then waits for the slowest, then `exchange_s`. Post-local SGD's
  synchronous start is `warmup_steps` steps of `sync`.
- **ssp:S** (parameter servers): a worker pulls the parameters (`transfer_s` / 2), computes,
  pushes its gradient (`transfer_s` / 2); the servers apply one push at a time, `apply_s` each,
  in arrival order, and the push returns when it is applied. A worker starts a step only while
  it is at most S pushes ahead of the slowest (bounded staleness). `ssp:0` is the synchronous
  parameter server: every worker's gradient of a step is summed into one update.
- **async**: parameter servers with no bound.

A push's staleness is the number of updates applied between its pull and its own update, as
the parameter servers count it (`tfdist.ps`), but without their last count, "63 or more": at a
thousand workers most pushes are staler than that (`Simulation.counted_staleness` folds the
histogram as the servers do, to set it beside theirs). The servers start
every worker together, once each has pulled the weights (`started`): a worker's first step
computes on that pull, version 0, whatever its late start (`Stragglers.late_s`, the start-up
that follows the pull: tracing the first step). Under `sync` and `local_sgd`, work a slow
worker's first step does after its exchange (`Stragglers.first_update_s`: XLA compiling the
update where it first runs) holds everyone's second exchange. The chief (worker 0) is never
the one slowed: its time is the job's clock, as in `tfdist bench --suite stragglers`. What the
simulation leaves out, it says: the steps an algorithm needs to reach an accuracy (give them,
as the planner's steps factors), contention for links and cores, and start-up.

Example:
    ```python
    from tfdist.plan import Stragglers, simulate

    slow = Stragglers(slow=1, slowdown=3.0)  # one worker 3x slower than the others
    for algorithm in ("sync", "local_sgd:8", "ssp:4", "async"):
        run = simulate(algorithm, workers=64, compute_s=0.1, steps=200, stragglers=slow,
                       exchange_s=0.02, transfer_s=0.01, apply_s=0.001)
        print(f"{algorithm}: {run.step_s * 1e3:.0f} ms per chief step, "
              f"{run.throughput:.0f} worker steps/s, staleness {run.staleness_mean:.1f}")
    ```
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import Counter
from collections.abc import Mapping

from tfdist.arguments import check_int, check_number

# The parameter servers' staleness histogram: 0 .. 62, then "63 or more" (tfdist.ps.server.BUCKETS).
STALENESS_BUCKETS = 64
ALGORITHM_HELP = "sync, local_sgd:PERIOD, ssp:STALENESS (0: synchronous parameter servers), async"


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """How the workers' compute steps differ.

    Args:
        slow: How many workers are slow: a count (1, 2, ...) or a share of the workers in
            (0, 1) (rounded, at least one). Workers 1, 2, ... are the slow ones; the chief
            (worker 0) never is.
        slowdown: How many times longer a slow worker's step takes (>= 1).
        sigma: Every step of every worker is also multiplied by a log-normal factor of mean 1
            and this spread (0: none; 0.5 and more: heavy-tailed step times, a few steps many
            times the median).
        late_s: The slow workers start their first step this many seconds after the others
            (their start-up, importing and tracing, is slowed too).
        first_update_s: The slow workers end their first step this many seconds after its
            exchange, the others at once: first-step work that follows the exchange (XLA
            compiling the update where it is first run, slowed too). Synchronous rounds
            (`sync`, `local_sgd`) wait for it at their second exchange; the parameter
            servers, which update on the servers, do not have it.

    Example:
        ```python
        from tfdist.plan import Stragglers

        assert Stragglers(slow=0.25, slowdown=2).slowed(64) == 16  # a quarter of 64 workers
        assert Stragglers(slow=1, slowdown=3).slowed(4) == 1
        ```
    """

    slow: float = 0
    slowdown: float = 1.0
    sigma: float = 0.0
    late_s: float = 0.0
    first_update_s: float = 0.0

    def __post_init__(self):
        check_number("slow", self.slow, 0)
        if self.slow >= 1 and not float(self.slow).is_integer():
            raise ValueError(f"`slow` must be a count of workers (1, 2, ...) or a share in "
                             f"(0, 1). Received: slow={self.slow!r}")
        check_number("slowdown", self.slowdown, 1)
        check_number("sigma", self.sigma, 0, 3)
        check_number("late_s", self.late_s, 0)
        check_number("first_update_s", self.first_update_s, 0)

    def slowed(self, workers: int) -> int:
        """How many of `workers` are slow (never the chief)."""
        if self.slow == 0 or self.slowdown == 1:
            return 0
        count = self.slow if self.slow >= 1 else max(1, round(self.slow * workers))
        return min(int(count), workers - 1)

    def speeds(self, workers: int) -> list[float]:
        """Each worker's step multiplier, before the per-step spread."""
        slowed = self.slowed(workers)
        return [self.slowdown if 1 <= i <= slowed else 1.0 for i in range(workers)]

    def starts(self, workers: int) -> list[float]:
        """When each worker starts its first step."""
        return [self.late_s if speed > 1 else 0.0 for speed in self.speeds(workers)]

    def first_updates(self, workers: int) -> list[float]:
        """How long after the first exchange each worker's first step ends."""
        return [self.first_update_s if speed > 1 else 0.0 for speed in self.speeds(workers)]

    def draw(self, rng: random.Random) -> float:
        """One step's spread factor (mean 1)."""
        if self.sigma == 0:
            return 1.0
        return math.exp(rng.gauss(0.0, self.sigma) - self.sigma ** 2 / 2)


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What `simulate` saw. Times in seconds.

    Attributes:
        algorithm: The algorithm simulated.
        workers: The worker count.
        steps: Steps each worker ran.
        seconds: The chief's time to finish its steps (the job's clock).
        job_seconds: When the last worker finished.
        updates: Updates applied to the model (all-reduce or averaging rounds count one each;
            parameter servers count each applied push, or each summed step under `ssp:0`).
        staleness: Histogram of the pushes' staleness (parameter servers; empty otherwise), each
            count as it is (the servers' own histogram ends in "63 or more":
            `counted_staleness`).
        waiting_share: The share of the workers' time spent waiting for others or for the
            servers (not computing, not sending).
        chief_clock: When each of the chief's steps ended (its step `k` is
            `chief_clock[k - 1]`): the time to reach an accuracy the chief measures at step k.

    Example:
        ```python
        from tfdist.plan import simulate

        run = simulate("async", workers=4, compute_s=0.1, steps=50)
        assert run.updates == 4 * 50 and run.staleness_max <= 3
        print(f"{run.throughput:.0f} worker steps/s, staleness {run.staleness_mean:.1f}")
        ```
    """

    algorithm: str
    workers: int
    steps: int
    seconds: float
    job_seconds: float
    updates: int
    staleness: Mapping[int, int]
    waiting_share: float
    chief_clock: tuple[float, ...] = ()

    @property
    def step_s(self) -> float:
        """The chief's mean step."""
        return self.seconds / self.steps

    @property
    def throughput(self) -> float:
        """Worker steps (batches trained on) per second over the whole job."""
        return self.workers * self.steps / self.job_seconds

    @property
    def staleness_mean(self) -> float:
        return histogram_mean(self.staleness)

    @property
    def staleness_max(self) -> int:
        return max(self.staleness, default=0)

    def counted_staleness(self) -> dict[int, int]:
        """The staleness histogram as the parameter servers count it (`tfdist.ps.server.BUCKETS`):
        every push staler than 62 in the last count, "63 or more". What a measured job's report
        can be compared with."""
        folded: Counter[int] = Counter()
        for k, n in self.staleness.items():
            folded[min(k, STALENESS_BUCKETS - 1)] += n
        return dict(sorted(folded.items()))

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "chief_clock": list(self.chief_clock),
                "staleness": dict(sorted(self.staleness.items())),
                "step_s": self.step_s, "throughput": self.throughput,
                "staleness_mean": self.staleness_mean, "staleness_max": self.staleness_max}


def histogram_mean(histogram: Mapping[int, int]) -> float:
    """The mean of a {value: count} histogram (0 when it is empty)."""
    count = sum(histogram.values())
    return sum(k * n for k, n in histogram.items()) / count if count else 0.0


def parse_algorithm(spec: str) -> tuple[str, int | None]:
    """'local_sgd:8' -> ('local_sgd', 8); 'async' -> ('async', None); a bad spec is refused with
    the forms that exist."""
    name, _, arg = str(spec).partition(":")
    try:
        if name in ("sync", "async") and not arg:
            return name, None
        if name == "local_sgd":
            return name, check_int("local_sgd period", int(arg or 8), 1)
        if name == "ssp" and arg:
            return name, check_int("ssp staleness", int(arg), 0)
    except ValueError as e:
        raise ValueError(f"algorithm {spec!r}: {e}; the forms are {ALGORITHM_HELP}") from None
    raise ValueError(f"algorithm {spec!r} is not simulated; the forms are {ALGORITHM_HELP}")


def simulate(algorithm: str, workers: int, compute_s: float, steps: int, *,
             stragglers: Stragglers = Stragglers(), exchange_s: float = 0.0,
             transfer_s: float = 0.0, apply_s: float = 0.0, warmup_steps: int = 0,
             seed: int = 0) -> Simulation:
    """Plays `steps` steps of `workers` workers under `algorithm` (`ALGORITHM_HELP`).

    Args:
        algorithm: 'sync', 'local_sgd:H', 'ssp:S' or 'async'.
        workers: Worker count (1 or more).
        compute_s: One step's compute on a worker that is not slow.
        steps: Steps each worker runs.
        stragglers: Who is slow, by how much, and the spread of every step.
        exchange_s: One all-reduce or averaging round (sync, local SGD): `tfdist.plan.predict`
            prices it for a model and a cluster.
        transfer_s: A worker's pull and push together (parameter servers).
        apply_s: The servers' work per applied update.
        warmup_steps: local SGD: synchronous steps before the local ones (post-local SGD).
        seed: The spread's random seed: the same seed gives the same run.

    Returns:
        A `Simulation`.

    Example:
        ```python
        from tfdist.plan import Stragglers, simulate

        slow = Stragglers(slow=1, slowdown=4.0)
        sync = simulate("sync", 8, compute_s=0.1, steps=20, stragglers=slow, exchange_s=0.02)
        assert abs(sync.step_s - (4 * 0.1 + 0.02)) < 1e-9  # every step waits for the slow one
        bounded = simulate("ssp:2", 8, compute_s=0.1, steps=20, stragglers=slow)
        print(f"staleness {bounded.staleness_mean:.1f}, at most {bounded.staleness_max}")
        ```
    """
    name, arg = parse_algorithm(algorithm)
    check_int("workers", workers, 1)
    check_int("steps", steps, 1)
    check_int("warmup_steps", warmup_steps, 0)
    for label, value in (("compute_s", compute_s), ("exchange_s", exchange_s),
                         ("transfer_s", transfer_s), ("apply_s", apply_s)):
        check_number(label, value, 0)
    rng = random.Random(seed)
    speeds = stragglers.speeds(workers)

    def step(i: int) -> float:
        return compute_s * speeds[i] * stragglers.draw(rng)

    if name in ("sync", "local_sgd"):
        period = 1 if name == "sync" else int(arg or 1)
        return _rounds(algorithm, workers, steps, period, step, exchange_s,
                       warmup_steps if name == "local_sgd" else 0, stragglers.starts(workers),
                       stragglers.first_updates(workers))
    if arg == 0:
        return _rounds(algorithm, workers, steps, 1, step, transfer_s + apply_s, 0,
                       stragglers.starts(workers), [0.0] * workers)
    return _servers(algorithm, workers, steps, arg, step, transfer_s, apply_s,
                    stragglers.starts(workers))


def _rounds(algorithm, workers, steps, period, step, exchange_s, warmup, starts,
            first_updates) -> Simulation:
    """Every `period` steps (every step for the first `warmup`) all workers meet: an all-reduce,
    an averaging, a summed update. A worker's first step ends `first_updates` later: after the
    first exchange when the first round is one step, else inside its first step."""
    busy = 0.0
    ready = list(starts)  # when each worker starts its next round
    chief: list[float] = []
    rounds = 0
    late = list(first_updates)  # the first round's: after its exchange, or in its first step
    while len(chief) < steps:
        block = 1 if len(chief) < warmup else min(period, steps - len(chief))
        times = [[step(i) for _ in range(block)] for i in range(workers)]
        if block > 1:  # no exchange before the local steps: the first update is in the first
            for i in range(workers):
                times[i][0] += late[i]
        busy += sum(map(sum, times)) + workers * exchange_s
        chief.extend(ready[0] + t for t in _cumulative(times[0]))
        clock = max(r + sum(t) for r, t in zip(ready, times)) + exchange_s
        chief[-1] = clock  # the chief's last step of a round ends with the round
        if block == 1:  # the first update follows the exchange
            ready = [clock + extra for extra in late]
            busy += sum(late)
        else:
            ready = [clock] * workers
        late = [0.0] * workers
        rounds += 1
    return Simulation(algorithm, workers, steps, clock, clock, rounds, {},
                      _share_waiting(busy, clock, workers), tuple(chief))


def _cumulative(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _share_waiting(busy: float, clock: float, workers: int) -> float:
    return max(0.0, 1.0 - busy / (clock * workers)) if clock > 0 else 0.0


def _servers(algorithm, workers, steps, bound, step, transfer_s, apply_s, starts) -> Simulation:
    """Pushes applied one at a time in arrival order; a worker starts a step only while it is at
    most `bound` pushes ahead of the slowest (None: no bound)."""
    half = transfer_s / 2
    done = [0] * workers  # applied pushes per worker
    pulled = [0] * workers  # the version each worker's step started from
    finished = [0.0] * workers
    chief: list[float] = []
    version = 0
    server_free = busy = 0.0
    staleness: Counter[int] = Counter()
    waiting: list[int] = []
    events: list[tuple[float, int, str, int]] = []  # (time, order, kind, worker)
    order = 0

    def schedule(time: float, kind: str, worker: int) -> None:
        nonlocal order
        heapq.heappush(events, (time, order, kind, worker))
        order += 1

    at = Counter({0: workers})  # how many workers have applied each count of pushes
    low = 0  # the slowest worker's count

    def may_start(i: int) -> bool:
        return bound is None or done[i] - low <= bound

    for i in range(workers):
        schedule(starts[i], "start", i)
    while events:
        time, _, kind, i = heapq.heappop(events)
        if kind == "start":
            if not may_start(i):
                waiting.append(i)
                continue
            pulled[i] = version if done[i] else 0  # the first step's pull: at the join
            compute = step(i)
            busy += compute + transfer_s
            schedule(time + half + compute + half, "arrive", i)
        elif kind == "arrive":
            server_free = max(server_free, time) + apply_s
            schedule(server_free, "applied", i)
        else:  # applied
            staleness[version - pulled[i]] += 1
            version += 1
            at[done[i]] -= 1
            if done[i] == low and not at[low]:
                low += 1
                ready = [w for w in waiting if may_start(w)]
                waiting = [w for w in waiting if not may_start(w)]
                for w in ready:
                    schedule(time, "start", w)
            done[i] += 1
            at[done[i]] += 1
            if i == 0:
                chief.append(time)
            if done[i] < steps:
                schedule(time, "start", i)
            else:
                finished[i] = time
    job = max(finished)
    return Simulation(algorithm, workers, steps, finished[0], job, version, dict(staleness),
                      _share_waiting(busy, job, workers), tuple(chief))
