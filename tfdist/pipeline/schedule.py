"""Pipeline schedules as pure clock tables.

A schedule for M micro-batches over K stages is a list of clock ticks; each tick holds the tasks
that run during it, at most one per stage. A task is `Task("F" | "B", micro, stage)`: the forward
or the backward of one micro-batch on one stage. Every task takes one tick (the unit-time model
the GPipe and PipeDream papers draw), so the tables give the theoretical bubble; `tfdist bench
--suite pipeline` measures the real one.

* `gpipe(m, k)`: all forwards, then all backwards (GPipe). Stage j holds the activations of all
  M micro-batches at the turn.
* `one_f_one_b(m, k)`: PipeDream-Flush: stage j runs min(K - j - 1, M) forwards to fill the
  pipe, then alternates one forward and one backward, then drains. Stage j holds at most
  min(K - j, M) micro-batches of activations, so memory is bounded by K, not M.

Both take 2 (M + K - 1) ticks, so both idle (K - 1) / (M + K - 1) of the time.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Task", "SCHEDULES", "gpipe", "one_f_one_b", "build", "in_flight", "bubble_fraction",
           "idle_fraction"]


class Task(NamedTuple):
    """One cell of a clock table: the forward ("F") or backward ("B") of micro-batch `micro` on
    stage `stage`, shown as `F0.1`.

    Example:
        ```python
        first = tfdist.pipeline.schedule.gpipe(2, 2)[0]  # the tasks of the first tick
        print(first)  # [F0.0]: the forward of micro-batch 0 on stage 0
        ```
    """

    kind: str  # "F" (forward) or "B" (backward)
    micro: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}.{self.stage}"


Table = list[list[Task]]


def _check(m: int, k: int) -> None:
    for name, value in (("num_microbatches", m), ("num_stages", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def gpipe(m: int, k: int) -> Table:
    """GPipe: forwards fill and drain the pipe, then backwards do the same in reverse stage order.

    Forward of micro-batch i on stage j runs at tick i + j; its backward at
    (M + K - 1) + i + (K - 1 - j).

    Example:
        ```python
        table = tfdist.pipeline.schedule.gpipe(4, 2)  # 4 micro-batches, 2 stages
        print(len(table), "ticks; stage idle share",
              tfdist.pipeline.schedule.idle_fraction(table, 2))
        ```
    """
    _check(m, k)
    ticks = m + k - 1
    forward = [[Task("F", t - j, j) for j in range(k) if 0 <= t - j < m] for t in range(ticks)]
    backward = [[Task("B", t - (k - 1 - j), j) for j in reversed(range(k)) if 0 <= t - (k - 1 - j) < m]
                for t in range(ticks)]
    return forward + backward


def _one_f_one_b_order(m: int, k: int, stage: int) -> list[Task]:
    warmup = min(k - stage - 1, m)
    order = [Task("F", i, stage) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Task("F", warmup + i, stage), Task("B", i, stage)]
    order += [Task("B", i, stage) for i in range(m - warmup, m)]
    return order


def one_f_one_b(m: int, k: int) -> Table:
    """1F1B (PipeDream-Flush): each stage's own order, each task run at the first tick its inputs
    are ready (the forward of the stage before, or the backward of the stage after).

    Example:
        ```python
        table = tfdist.pipeline.schedule.one_f_one_b(8, 4)
        print(tfdist.pipeline.schedule.in_flight(table, 4))  # at most 4, 3, 2, 1 kept per stage
        ```
    """
    _check(m, k)
    orders = [_one_f_one_b_order(m, k, j) for j in range(k)]
    done: set[Task] = set()
    position = [0] * k
    table: Table = []
    while any(position[j] < len(orders[j]) for j in range(k)):
        tick = []
        for j in range(k):
            if position[j] == len(orders[j]):
                continue
            task = orders[j][position[j]]
            if task.kind == "F":
                ready = j == 0 or Task("F", task.micro, j - 1) in done
            else:
                ready = Task("F", task.micro, j) in done and (
                    j == k - 1 or Task("B", task.micro, j + 1) in done)
            if ready:
                tick.append(task)
                position[j] += 1
        if not tick:  # cannot happen for a valid order; guards the loop
            raise RuntimeError(f"1F1B schedule for m={m}, k={k} deadlocked")
        done.update(tick)
        table.append(tick)
    return table


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(schedule: str, m: int, k: int) -> Table:
    """The clock table of `schedule` (a name of `SCHEDULES`: "gpipe" or "1f1b") for `m`
    micro-batches on `k` stages.

    Example:
        ```python
        table = tfdist.pipeline.schedule.build("1f1b", 8, 4)  # or "gpipe"
        ```
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline schedule {schedule!r}; use one of "
                         f"{', '.join(repr(s) for s in SCHEDULES)}.")
    return SCHEDULES[schedule](m, k)


def in_flight(table: Table, k: int) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and whose backward did not yet.

    Example:
        ```python
        table = tfdist.pipeline.schedule.build("gpipe", 8, 4)
        assert tfdist.pipeline.schedule.in_flight(table, 4) == [8, 8, 8, 8]  # GPipe keeps every one
        ```
    """
    live, peak = [0] * k, [0] * k
    for tick in table:
        for task in tick:
            live[task.stage] += 1 if task.kind == "F" else -1
            peak[task.stage] = max(peak[task.stage], live[task.stage])
    return peak


def idle_fraction(table: Table, k: int) -> list[float]:
    """Per stage, the fraction of the table's ticks in which the stage runs nothing.

    Example:
        ```python
        table = tfdist.pipeline.schedule.build("gpipe", 8, 4)
        print(tfdist.pipeline.schedule.idle_fraction(table, 4))
        ```
    """
    busy = [0] * k
    for tick in table:
        for task in tick:
            busy[task.stage] += 1
    return [1 - b / len(table) for b in busy]


def bubble_fraction(m: int, k: int) -> float:
    """The GPipe paper's bubble: (K - 1) / (M + K - 1).

    Example:
        ```python
        assert tfdist.pipeline.schedule.bubble_fraction(8, 4) == 3 / 11
        ```
    """
    _check(m, k)
    return (k - 1) / (m + k - 1)
