"""`ElasticResize`: change the number of workers on purpose, from a measured signal;
`ElasticJoin`: grow the job when the launcher offers more workers.

Under `python -m tfdist.launch --elastic --workers N --min-workers A --max-workers B`, the job can
be restarted at another size; this callback measures the job's throughput (examples per second)
at each size it runs at, asks a policy which size to run at, and when that is another size backs
the job up, tells the launcher the size wanted (with its reason) and ends every process with
`RESIZE_EXIT`; the launcher restarts the job at the new size and it resumes from the backup.

The launcher and the job talk through the standard streams every launcher has, on one machine
or over ssh, and never through a file (`tfdist.callbacks.channel`): the sizes allowed and the
throughput measured so far in the environment, offers on the chief's standard input, the chief's
request on its standard output. Without them (not under the elastic launcher) the callbacks only
measure.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import keras
import tensorflow as tf

from tfdist.arguments import check_int, check_number
from tfdist.callbacks.backup import BackupAndRestore
from tfdist.callbacks.channel import launcher_channel
from tfdist.comm import resolve

RESIZE_EXIT = 75  # EX_TEMPFAIL: "run me again" (at the size the request names)


Policy = Callable[[dict[int, float], int, int, int], tuple[int, str]]


def throughput_policy(tolerance: float = 0.05) -> Policy:
    """Hill-climbing on measured throughput: run at the fewest workers within `tolerance` of
    the best throughput measured; from the best size, try one worker fewer (does the last one
    help?) and, while adding workers paid off, one more.

    The policy is a function (measured {size: examples/s}, current size, fewest, most) ->
    (size to run at, reason). Each size is measured once, so it settles after at most
    (most - fewest + 1) restarts.

    Example:
        ```python
        policy = tfdist.callbacks.throughput_policy(tolerance=0.05)
        # examples/s measured at 3, 2 and 1 workers; the job runs on 2, between 1 and 3 workers
        size, reason = policy({3: 300.0, 2: 290.0, 1: 150.0}, 2, 1, 3)
        assert size == 2  # within 5% of 3 workers' throughput: the third worker does not pay
        print(reason)
        ```
    """
    tolerance = check_number("tolerance", tolerance, 0, 1, high_open=True)

    def decide(measured: dict[int, float], size: int, low: int, high: int) -> tuple[int, str]:
        rate = measured[size]
        top = max(measured.values())
        best = min(s for s, r in measured.items() if r >= top * (1 - tolerance))
        if best != size:
            return best, (f"{best} workers ran at {measured[best]:.0f} examples/s, "
                          f"{size} at {rate:.0f}: " + ("fewer workers do as well"
                                                       if best < size else "more workers pay"))
        fewer, more = size - 1, size + 1
        if fewer >= low and fewer not in measured:
            return fewer, (f"{size} workers run at {rate:.0f} examples/s; trying {fewer} to see "
                           "whether the last worker helps")
        if more <= high and more not in measured and (
                fewer not in measured or rate > measured[fewer] * (1 + tolerance)):
            return more, (f"{size} workers run at {rate:.0f} examples/s"
                          + (f", {rate / measured[fewer]:.2f}x {fewer} workers'"
                             if fewer in measured else "") + f"; trying {more}")
        return size, f"{size} workers run at {rate:.0f} examples/s, the best measured: staying"

    return decide


class ElasticResize(keras.callbacks.Callback):
    """Measures throughput at each job size and moves the job to the size the policy picks.

    Pass it to `fit` on every worker, after the `BackupAndRestore` it uses to save the job
    before a resize. Once per start, after `warmup_steps` steps (tracing, first collectives),
    the chief times `every` steps and measures examples/s for the current size, which the
    launcher keeps across restarts (the first measurement of a size is kept, so a policy that
    moves only to the best measured or to an unmeasured size settles); the policy's choice is
    broadcast from the chief, so all workers agree; every decision is printed with its reason
    by the chief (and by the launcher).

    Args:
        backup: The job's `BackupAndRestore` (it must be in `fit`'s callbacks too, before this).
        global_batch_size: Examples per step over all workers.
        every: Steps measured at each size. Defaults to 50.
        warmup_steps: Steps after a start before measuring, >= 1. Defaults to 5.
        policy: (measured, size, fewest, most) -> (size, reason). Defaults to
            `throughput_policy()`.

    Example:
        ```python
        # python -m tfdist.launch --elastic --hostfile hosts.txt --min-workers 2 -- python train.py
        strategy = tfdist.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        backup = tfdist.callbacks.BackupAndRestore("/shared/backup", save_freq=20)
        resize = tfdist.callbacks.ElasticResize(backup, global_batch_size=64, every=50,
                                                policy=tfdist.callbacks.throughput_policy(0.05))
        model.fit(tfdist.data.distribute(strategy, x, y, 64, start=backup.data_start), epochs=10,
                  steps_per_epoch=22, callbacks=[backup, resize])
        ```
    """

    def __init__(self, backup: BackupAndRestore, global_batch_size: int, every: int = 50,
                 warmup_steps: int = 5, policy: Policy | None = None):
        super().__init__()
        if not isinstance(backup, BackupAndRestore):
            raise ValueError(f"`backup` must be a tfdist.callbacks.BackupAndRestore. Received: "
                             f"backup={backup!r}")
        self.backup = backup
        self.global_batch_size = check_int("global_batch_size", global_batch_size, 1)
        self.every = check_int("every", every, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1)
        self.policy = policy or throughput_policy()
        self.channel = launcher_channel()
        self.decisions: list[dict] = []

    def on_train_begin(self, logs=None):
        self._engine = resolve(getattr(self.model, "distribute_strategy", None))
        self._steps, self._start, self._decided = 0, None, False

    def on_train_batch_end(self, batch, logs=None):
        if self._decided or self.backup.skipping:
            return
        self._steps += 1
        if self._steps == self.warmup_steps:
            self._start = time.perf_counter()
        elif self._steps == self.warmup_steps + self.every and self._start is not None:
            self._decided = True
            self._decide(self.every * self.global_batch_size / (time.perf_counter() - self._start))

    def _decide(self, rate: float) -> None:
        engine, size, channel = self._engine, self._engine.process_count, self.channel
        low = size if channel.low is None else channel.low
        high = size if channel.high is None else channel.high
        target, reason = size, "not under the elastic launcher: measuring only"
        measured = dict(channel.measured)
        if engine.is_chief:
            measured.setdefault(size, rate)  # each size measured once: moves are finite
            if channel.active:
                target, reason = self.policy(measured, size, low, high)
                if not low <= target <= high:
                    raise ValueError(f"The resize policy chose {target} workers, outside "
                                     f"[{low}, {high}]")
            print(f"[tfdist] elastic: {reason}", flush=True)
        if engine.multi_process:  # every worker takes the chief's decision
            target = int(engine.run(lambda comm: comm.broadcast(
                [tf.constant(target, tf.int64)], root=0)[0]))
        self.decisions.append({"size": size, "examples_per_second": rate, "target": target,
                               "reason": reason if engine.is_chief else None})
        if target != size and channel.active:
            self.backup.save_now()
            if engine.is_chief:
                channel.request(target, reason, measured)
            raise SystemExit(RESIZE_EXIT)


class ElasticJoin(keras.callbacks.Callback):
    """Grows the job when the elastic launcher offers more workers (workers joining by
    themselves).

    Under `python -m tfdist.launch --elastic --hostfile F`, the launcher reads F again every
    second and, when it lists more slots than the job runs on, offers them on the chief's
    standard input. After each backup of `backup` (every process backs up at the same steps)
    the chief broadcasts the offer; if it is larger than the job, every process ends with
    `RESIZE_EXIT` and the launcher starts the job at the offered size, which resumes from that
    backup: nothing is trained twice or lost. Outside the elastic launcher it does nothing.
    `tfdist train` adds it by itself under the elastic launcher.

    Args:
        backup: The job's `BackupAndRestore` (in `fit`'s callbacks too, before this).

    Example:
        ```python
        # python -m tfdist.launch --elastic --hostfile hosts.txt --min-workers 2 -- python train.py
        strategy = tfdist.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        backup = tfdist.callbacks.BackupAndRestore("/shared/backup", save_freq=20)
        data = tfdist.data.distribute(strategy, x, y, 64, start=backup.data_start)
        model.fit(data, epochs=10, steps_per_epoch=22,
                  callbacks=[backup, tfdist.callbacks.ElasticJoin(backup)])
        ```
    """

    def __init__(self, backup: BackupAndRestore):
        super().__init__()
        if not isinstance(backup, BackupAndRestore):
            raise ValueError(f"`backup` must be a tfdist.callbacks.BackupAndRestore. Received: "
                             f"backup={backup!r}")
        self.backup = backup
        self.channel = launcher_channel()

    def on_train_begin(self, logs=None):
        self._engine = resolve(getattr(self.model, "distribute_strategy", None))
        self._seen = self.backup.last_saved
        if self._engine.is_chief:
            self.channel.listen()

    def on_train_batch_end(self, batch, logs=None):
        params = self.params or {}
        last = (params.get("epochs") is not None and params.get("steps") is not None
                and self._epoch == params["epochs"] - 1 and batch + 1 == params["steps"])
        self._after_backup(last)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self._after_backup(last=epoch == (self.params or {}).get("epochs", 0) - 1)

    def _after_backup(self, last: bool) -> None:
        if not self.channel.active or self.backup.last_saved == self._seen or last:
            return  # no new backup, or nothing left to train
        self._seen = self.backup.last_saved
        engine, size = self._engine, self._engine.process_count
        offered = self.channel.offer() if engine.is_chief else 0
        if engine.multi_process:  # every worker takes the chief's reading
            offered = int(engine.run(lambda comm: comm.broadcast(
                [tf.constant(offered, tf.int64)], root=0)[0]))
        if offered <= size:
            return
        reason = (f"{offered - size} more worker(s) offered by the launcher; the backup of "
                  f"step {self._seen} resumes on {offered}")
        if engine.is_chief:
            print(f"[tfdist] elastic: {reason}", flush=True)
            self.channel.request(offered, reason, self.channel.measured)
        raise SystemExit(RESIZE_EXIT)
