"""`BackupAndRestore`: exact resume from any step, on every engine.

Keras 3's own `BackupAndRestore(save_freq=N)` restarts an interrupted epoch from its first batch
with mid-epoch weights, replays the data from the start, saves one replica's copy of variables
that differ between replicas, and with the documented shared directory makes the workers of a
multi-worker job lock each other's file. This one:

* saves everything a step depends on: the model's and optimizer's variables (the inner
  optimizer's, the compressor state, accumulators, counters, the loss scale) with **every
  replica's copy** (local SGD's local models and slots, error-feedback residuals, PowerSGD's Q
  differ between replicas), the metrics' running totals and the layers' RNG state; through
  `tf.train.Checkpoint` too, so a ZeRO optimizer's offloaded state is included;
* saves where the data is: the global batches consumed, and resumes the interrupted epoch at
  the next batch (`data_start` positions the tfdist data helpers; `fit` runs the epoch's
  finished steps without training on them);
* writes one directory per process (`process-<i>`), so no file is shared and nothing locks;
  every process saves at the same steps (what a ZeRO optimizer's gather across processes
  needs), and on restart the processes agree on the newest backup they all completed.

A backup is a directory `step-<n>` (n global batches consumed) made under a temporary name and
renamed when complete, so a process killed while saving leaves the previous backup, which is
kept (`keep` >= 2) until the next one is complete. Each backup lists its files with their sizes
and SHA-256 digests (meta.json); at a restart a backup that does not match (a truncated or
garbled file) is set aside as `step-<n>.corrupt` and the newest intact one is used, said in one
line. With `job`, a backup records what the job was (batch size, data seed, optimizer, ...), and
a restart of another job is refused before training, naming each difference.

Preemption (`preemption_signals`): a termination notice (SIGTERM from a cloud or Kubernetes,
SLURM's `--signal=USR1@60`, `scancel --signal=TERM`) delivered to any process lets the step in
flight finish; then every process agrees on it (one small all-gather per step while the job has
several processes), backs up at that same step and ends with `PREEMPTED_EXIT` (76), the status
that means "run me again": the same command resumes from that backup exactly.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist._hooks.training import set_initial_epoch
from tfdist.arguments import check_bool, check_int
from tfdist.callbacks.channel import launcher_channel
from tfdist.callbacks.start import SkippedSteps
from tfdist.comm import replica_copies, resolve

FORMAT = 1
PREEMPTED_EXIT = 76  # "preempted, backed up: run me again" (75, RESIZE_EXIT, asks for a new size)
META = "meta.json"
COPIES = "copies.npz"
STATE = "state"
PREFIX = "step-"


class BackupAndRestore(keras.callbacks.Callback):
    """Backs training up every `save_freq` steps (or epoch) and resumes it exactly.

    Pass it to `fit` on every process (TF_CONFIG worker, Horovod rank), with the same
    `directory`; run the same program again after a failure and training goes on from the last
    backup to the weights an uninterrupted run ends with. Feed `fit` from
    `tfdist.data.distribute` / `global_batches` with `start=backup.data_start` so the data
    resumes too; a dataset of your own through `tfdist.data.resume(dataset,
    start=backup.data_start)`, which keeps its position in the backups.

    Resuming needs the same model, optimizer and number of replicas per process; anything else
    is refused with a message naming the difference. The metrics' running totals are restored
    when the model is built before training (under a `tf.distribute` strategy); otherwise the
    resumed epoch's logged metrics count from the resume point (the weights are exact either
    way). Callbacks' own Python state is not saved.

    Args:
        directory: Where backups go (each process writes `directory/process-<i>`).
        save_freq: "epoch" (at the end of every epoch) or an int N (after every N-th step,
            counted over the whole run). Defaults to "epoch".
        keep: Backups kept per process, >= 2. Defaults to 2.
        delete_checkpoint: Remove this process's backups when training ends normally.
            Defaults to True (as Keras' callback).
        elastic: Resume with another number of processes too (the directory must be shared
            by all, as on one machine or a network file system): replicated state is
            restored, state that differs between replicas (local SGD's models and slots,
            residuals, Q) becomes the mean over the old replicas, a ZeRO optimizer's shards
            are re-cut for the new world, and the metrics of the resumed epoch restart.
            Defaults to False (the same number of processes; no shared directory needed).
        job: What determines this job's data order and state, as a JSON-able dict (e.g.
            {"batch_size": 64, "data_seed": 3, "optimizer": "adam"}); recorded with every
            backup and compared at a restart, which is refused (`BackupMismatch`) naming each
            value that differs. None: not recorded. Defaults to None.
        preemption_signals: Signals (names such as "SIGTERM", "SIGUSR1", or numbers) that mean
            "this job is about to be stopped": the step in flight ends, every process backs
            up at that same step and exits with `PREEMPTED_EXIT` (see the module docstring).
            The handlers are installed for the duration of `fit` (from the main thread) and
            the previous ones restored after. Defaults to () (signals keep their usual effect).
        on_preempted: Called on the chief with the backed-up step just before the exit (e.g.
            to requeue a scheduler job); None: nothing. Defaults to None.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        backup = tfdist.callbacks.BackupAndRestore("backup", save_freq=10)
        data = tfdist.data.distribute(strategy, x, y, 64, start=backup.data_start)
        model.fit(data, epochs=2, steps_per_epoch=20, callbacks=[backup])  # again: resumes
        ```
    """

    def __init__(self, directory, save_freq: str | int = "epoch", keep: int = 2,
                 delete_checkpoint: bool = True, elastic: bool = False,
                 job: dict[str, Any] | None = None,
                 preemption_signals: Sequence[str | int] = (),
                 on_preempted: Callable[[int], None] | None = None):
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ValueError(f"`directory` must be a non-empty path. Received: {directory!r}")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(
                save_freq, (int, np.integer)) or save_freq < 1):
            raise ValueError('`save_freq` must be "epoch" or an integer >= 1 (steps between '
                             f"backups). Received: save_freq={save_freq!r}")
        self.directory = os.fspath(directory)
        self.save_freq = save_freq
        self.keep = check_int("keep", keep, 2)
        self.delete_checkpoint = check_bool("delete_checkpoint", delete_checkpoint)
        self.elastic = check_bool("elastic", elastic)
        if job is not None:
            try:
                job = json.loads(json.dumps(job))
            except (TypeError, ValueError):
                raise ValueError(f"`job` must be a JSON-able dict. Received: job={job!r}") from None
            if not isinstance(job, dict):
                raise ValueError(f"`job` must be a dict. Received: job={job!r}")
        self.job = job
        self.preemption_signals = check_signals(preemption_signals)
        if on_preempted is not None and not callable(on_preempted):
            raise ValueError(f"`on_preempted` must be callable or None. Received: "
                             f"on_preempted={on_preempted!r}")
        self.on_preempted = on_preempted
        self.preempted: dict[str, Any] | None = None  # {"signal", "step"} once preempted
        self._notice: int | None = None  # the signal this process received
        self._previous_handlers: dict[int, Any] = {}
        self.batches_per_epoch: list[int] = []  # global batches trained on, per epoch
        self.restored: dict[str, Any] | None = None  # the backup's meta.json, when resumed
        self._consumed = 0  # global batches (dataset elements) fit has consumed
        self._epoch_start = 0
        self._resumed_batch = 0  # steps of the resumed epoch done before the backup
        self._skipped: SkippedSteps | None = None  # the resumed epoch's finished steps
        self._pending_metrics: list = []  # (replica copies, values) set when an epoch begins
        self.last_saved: int | None = None  # the step (global batches) of the last backup made
        self._epoch_logs: dict[str, float] = {}  # the last finished epoch's logs
        self._inputs: list = []  # input pipelines whose position the backups keep

    def keep_input(self, pipeline) -> int:
        """Keeps `pipeline`'s position in every backup (`tfdist.data.resume` with
        `start=backup.data_start` does this); returns its number in this process."""
        self._inputs.append(pipeline)
        return len(self._inputs) - 1

    @property
    def skipping(self) -> bool:
        """Whether `fit` is passing a finished step of the resumed epoch (nothing ran)."""
        return self._skipped is not None and self._skipped.skipping

    def save_now(self) -> None:
        """Backs up now, at the step just finished (call it from `on_train_batch_end` of a
        callback after this one, on every process alike)."""
        self._save(epoch=self._epoch, batch=self._consumed - self._epoch_start)

    # -- where the data is -----------------------------------------------------------------
    def data_start(self) -> int:
        """Global batches consumed before now: pass the method itself as `start=` to the tfdist
        data helpers (called when `fit` creates its iterator)."""
        return self._consumed

    # -- Keras hooks -------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        engine = resolve(getattr(self.model, "distribute_strategy", None))
        self._engine = engine
        self._process_dir = os.path.join(self.directory, f"process-{engine.process_index}")
        self._steps_per_call = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self._consumed = self._epoch_start = self._epoch = 0
        self.restored = None
        self._pending_metrics = []
        self.batches_per_epoch = []
        self.preempted, self._notice = None, None
        self._clean_leftovers()
        self._install_handlers()
        if self.elastic:
            self._check_shared()
            found = self._elastic_backup()
            if found is not None:
                self._restore(*found)
        else:
            step = self._agreed_backup()
            if step is not None:
                self._restore(step, self._engine.process_count)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._epoch_start = epoch, self._consumed - self._resumed_batch
        self._resumed_batch = 0
        for copies, value in self._pending_metrics:  # the resumed epoch's running totals
            for copy, v in zip(copies, value):
                copy.assign(v)
        self._pending_metrics = []

    def on_train_batch_end(self, batch, logs=None):
        if self.skipping:  # a finished step of the resumed epoch: no data read, nothing saved
            return
        before, self._consumed = self._consumed, self._epoch_start + batch + 1
        while len(self.batches_per_epoch) <= self._epoch:
            self.batches_per_epoch.append(0)
        self.batches_per_epoch[self._epoch] += self._consumed - before
        if self.save_freq != "epoch" and before // self.save_freq < self._consumed // self.save_freq:
            self._save(epoch=self._epoch, batch=batch + 1)
        if self.preemption_signals:
            self._check_preemption(batch)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_logs = {k: float(v) for k, v in (logs or {}).items()
                            if isinstance(v, (int, float, np.number))}
        if self.save_freq == "epoch":
            self._save(epoch=epoch + 1, batch=0)

    def on_train_end(self, logs=None):
        self._restore_handlers()
        if self._skipped is not None:
            self._skipped.remove()
            self._skipped = None
        set_initial_epoch(self.model, None)
        self.final_logs = dict(logs or {})
        if self.delete_checkpoint:
            self.remove()
        elif self.last_saved != self._consumed:
            # The end of training is backed up: a run stopped before its results are written
            # resumes here and trains nothing more.
            self._save(epoch=self._epoch + 1, batch=0)

    def remove(self) -> None:
        """Removes this process's backups (and, on the chief of an elastic job, those of
        processes now gone): call it once the run's results are safe. Each folder is renamed
        before it is deleted, so a kill midway leaves nothing that looks like a backup (the
        next start clears what is left)."""
        doomed = [self._process_dir]
        if self.elastic and self._engine.is_chief:  # those of processes now gone
            for name in os.listdir(self.directory) if os.path.isdir(self.directory) else []:
                index = name[len("process-"):]
                if name.startswith("process-") and index.isdigit() \
                        and int(index) >= self._engine.process_count:
                    doomed.append(os.path.join(self.directory, name))
        for path in doomed:
            remove_folder(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)  # the last process out removes the directory

    def _clean_leftovers(self) -> None:
        """Removes what a process killed while saving or removing left behind."""
        for parent in (self.directory, self._process_dir):
            if not os.path.isdir(parent):
                continue
            for name in os.listdir(parent):
                if name.endswith((".partial", REMOVING)):
                    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)

    def _check_shared(self) -> None:
        """Raises the same BackupError on every process unless every process sees the others'
        files in `directory` (an elastic job resumes from files other processes wrote)."""
        engine = self._engine
        if not engine.multi_process:
            return
        mine = int(np.random.default_rng().integers(1, 2**53))
        token = int(engine.run(lambda comm: comm.broadcast(
            [tf.constant(mine, tf.int64)], root=0)[0]))
        probe = os.path.join(self.directory, ".shared-check")
        mark = os.path.join(probe, f"{token}-{engine.process_index}")
        with contextlib.suppress(OSError):
            os.makedirs(probe, exist_ok=True)
            with open(mark, "w") as f:
                f.write(str(engine.process_index))
        engine.run(lambda comm: comm.all_gather(tf.constant([1.0], tf.float64)))  # all written
        seen = sum(os.path.isfile(os.path.join(probe, f"{token}-{i}"))
                   for i in range(engine.process_count))
        counts = np.asarray(engine.run(lambda comm: comm.all_gather(
            tf.constant([seen], tf.float64)))).astype(int)
        engine.run(lambda comm: comm.all_gather(tf.constant([1.0], tf.float64)))  # all read
        with contextlib.suppress(OSError):
            os.remove(mark)
            os.rmdir(probe)
        short = {i: int(c) for i, c in enumerate(counts) if c < engine.process_count}
        if short:
            raise BackupError(
                f"BackupAndRestore(elastic=True) needs a directory every process of the job "
                f"sees, and {self.directory} is not shared: process(es) "
                f"{', '.join(f'{i} see(s) {c}' for i, c in short.items())} of the "
                f"{engine.process_count} processes' files. Put it on storage every host mounts "
                "at the same path (NFS, a cluster file system; train.output_dir for tfdist "
                "train), or run without --elastic.")

    # -- preemption ----------------------------------------------------------------------------
    def _install_handlers(self) -> None:
        if not self.preemption_signals:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "BackupAndRestore(preemption_signals=...) installs signal handlers, which Python "
                "allows only in the main thread; call fit from the main thread, or pass "
                "preemption_signals=() and stop the job another way.")
        for number in self.preemption_signals:
            self._previous_handlers[number] = signal.signal(number, self._on_signal)
        launcher_channel().listen()  # notices the launcher passes on as lines (over ssh)

    def _restore_handlers(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers = {}

    def _on_signal(self, number, frame) -> None:
        if self._notice is None:
            self._notice = number
            print(f"[tfdist] {signal.Signals(number).name} received: backing up at the end of "
                  "the step in flight, then exiting", file=sys.stderr, flush=True)

    def _check_preemption(self, batch: int) -> None:
        """Backs up and exits with PREEMPTED_EXIT on every process as soon as any process
        received a preemption signal (all agree at the same step)."""
        noticed = self._notice or 0
        if self._engine.multi_process:  # one tiny all-gather: the same answer everywhere
            every = self._engine.gather_values([noticed])[:, 0]
            noticed = next((int(n) for n in every if n), 0)
        if not noticed:
            return
        step = self._consumed
        if self.last_saved != step:
            self._save(epoch=self._epoch, batch=batch + 1)
        if self._engine.multi_process:  # nobody exits before every process has its backup
            self._engine.gather_values([1.0])
        name = signal.Signals(noticed).name
        self.preempted = {"signal": name, "step": step}
        self._restore_handlers()
        if self._engine.is_chief:
            print(f"[tfdist] preempted ({name}): backed up step {step} in {self.directory}; "
                  f"exiting with {PREEMPTED_EXIT}. Run the same command again to resume.",
                  file=sys.stderr, flush=True)
            if self.on_preempted is not None:
                self.on_preempted(step)
        raise SystemExit(PREEMPTED_EXIT)

    # -- what is saved -------------------------------------------------------------------------
    def _groups(self) -> dict[str, list]:
        """The variables saved, by group, each in its (construction) order: the model's, the
        optimizer's (inner optimizer and parts included), the metrics'."""
        model, seen = self.model, set()
        optimizer = getattr(model, "optimizer", None)
        groups: dict[str, list] = {}
        for key, variables in (("model", model.variables),
                               ("optimizer", optimizer.variables if optimizer else []),
                               ("metrics", model.metrics_variables)):
            groups[key] = []
            for v in variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    groups[key].append(v)
        return groups

    def _checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)

    def _save(self, epoch: int, batch: int) -> None:
        step = self._consumed
        final = os.path.join(self._process_dir, f"{PREFIX}{step}")
        partial = final + ".partial"
        groups = self._groups()
        variables = [v for group in groups.values() for v in group]
        meta = {
            "format": FORMAT, "epoch": epoch, "batch": batch, "consumed": step,
            "steps_per_execution": self._steps_per_call,
            "process_index": self._engine.process_index,
            "process_count": self._engine.process_count,
            "groups": {key: [[v.path, list(v.shape), v.dtype] for v in group]
                       for key, group in groups.items()},
            "batches_per_epoch": self.batches_per_epoch,
            "epoch_logs": self._epoch_logs,
            "job": self.job,
            "time": time.time(),
        }
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            self._checkpoint().write(os.path.join(partial, STATE))
            for pipeline in self._inputs:
                pipeline.save(partial, step)
            copies = {str(i): np.stack([np.asarray(c.numpy()) for c in replica_copies(v)])
                      for i, v in enumerate(variables)}
            np.savez(os.path.join(partial, COPIES), **copies)  # type: ignore[arg-type]
            meta["files"] = _manifest(partial)
            with open(os.path.join(partial, META), "w") as f:
                json.dump(meta, f)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
        except (OSError, tf.errors.OpError) as e:  # TensorFlow's writer: ResourceExhausted...
            shutil.rmtree(partial, ignore_errors=True)
            last = self._complete()
            reason = getattr(e, "strerror", None) or getattr(e, "message", None) or str(e)
            code = getattr(e, "errno", None) or (errno.ENOSPC if "No space" in reason
                                                 else errno.EIO)
            raise OSError(code, f"tfdist BackupAndRestore could not write the backup of step "
                          f"{step} to {final} ({reason.strip()}); training stops here so no "
                          f"progress is lost unnoticed. The last complete backup, "
                          f"{'step ' + str(last[-1]) if last else 'none'}, is intact: free "
                          "space (or choose another directory) and run again to resume.") from e
        self.last_saved = step
        for old in self._complete()[:-self.keep]:
            remove_folder(os.path.join(self._process_dir, f"{PREFIX}{old}"))

    # -- restoring ---------------------------------------------------------------------------------
    def _complete(self, directory: str | None = None) -> list[int]:
        """Steps of the complete backups in `directory` (this process's), oldest first."""
        directory = directory or self._process_dir
        if not os.path.isdir(directory):
            return []
        steps = []
        for name in os.listdir(directory):
            if name.startswith(PREFIX) and name[len(PREFIX):].isdigit() and os.path.isfile(
                    os.path.join(directory, name, META)):
                steps.append(int(name[len(PREFIX):]))
        return sorted(steps)

    def _verified(self) -> list[int]:
        """The steps of this process's complete backups whose files match their manifest,
        oldest first; the others are set aside as `step-<n>.corrupt` (kept, said)."""
        good = []
        for step in self._complete():
            path = os.path.join(self._process_dir, f"{PREFIX}{step}")
            problem = _check(path)
            if problem is None:
                good.append(step)
                continue
            aside = path + ".corrupt"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            print(f"[tfdist] the backup of step {step} is damaged ({problem}); set aside as "
                  f"{aside}; using the newest intact backup", file=sys.stderr, flush=True)
        return good

    def _agreed_backup(self) -> int | None:
        """The newest backup every process completed (None: start from scratch)."""
        mine = self._verified()[-self.keep:]
        if not self._engine.multi_process:
            return mine[-1] if mine else None
        row = np.full([1, self.keep], -1.0)
        row[0, :len(mine)] = mine
        table = np.asarray(self._engine.run(
            lambda comm: comm.all_gather(tf.constant(row, tf.float64))))
        common = set(table[0]).intersection(*map(set, table[1:])) - {-1.0}
        if common:
            return int(max(common))
        if any((r >= 0).any() for r in table):
            held = {i: sorted(int(s) for s in r if s >= 0) for i, r in enumerate(table)}
            raise ValueError(
                f"The processes hold no backup in common under {self.directory!r} (steps per "
                f"rank: {held}). Every process must see the same directory; remove it to start "
                "afresh.")
        return None

    def _elastic_backup(self) -> tuple[int, int] | None:
        """(step, process count) of the newest backup that every process of the job that wrote
        it completed, read from the shared directory (any number of processes now)."""
        first = os.path.join(self.directory, "process-0")
        for step in reversed(self._complete(first)):
            if _check(os.path.join(first, f"{PREFIX}{step}")) is not None:
                continue  # damaged: an older one
            with open(os.path.join(first, f"{PREFIX}{step}", META)) as f:
                count = json.load(f)["process_count"]
            if all(_check(os.path.join(self.directory, f"process-{j}", f"{PREFIX}{step}"))
                   is None for j in range(count)):
                return step, count
        return None

    def _restore(self, step: int, writers: int) -> None:
        """Restores backup `step`, written by `writers` processes: this process's own when the
        job has as many processes (exact), else all of them merged (elastic)."""
        same = writers == self._engine.process_count
        owner = self._process_dir if same else os.path.join(self.directory, "process-0")
        path = os.path.join(owner, f"{PREFIX}{step}")
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        differences = _differences(meta.get("job"), self.job)
        if differences:
            raise BackupMismatch(
                f"The backup in {path} belongs to another job: {'; '.join(differences)}. Run "
                "with the backup's values to resume it, or back up to another directory to "
                "start afresh.")
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        if meta["process_count"] != self._engine.process_count and not self.elastic:
            raise ValueError(
                f"The backup in {path} was written by {meta['process_count']} processes; this "
                f"job has {self._engine.process_count}. Resume with the same number of workers "
                "(or elastic=True), or remove the directory to start afresh.")
        groups, saved = self._groups(), meta["groups"]
        for key in ("model", "optimizer"):
            if len(groups[key]) != len(saved[key]):
                raise ValueError(
                    f"The backup in {path} does not fit this {key}: it holds "
                    f"{len(saved[key])} {key} variables, this {key} has {len(groups[key])}. "
                    f"Resume with the same model and optimizer, or remove the directory.")
        if len(groups["metrics"]) != len(saved["metrics"]) or not same:
            groups["metrics"] = []  # not built yet (no strategy), or another world: restart
        # ZeRO shards: restored (re-sharded for this world) from the checkpoint.
        sharded = {id(v) for holder in (self.model, optimizer)  # (a ShardedModel's too)
                   for v in getattr(holder, "sharded_variables", list)()}
        self._checkpoint().read(os.path.join(path, STATE)).expect_partial()
        files = [os.path.join(self.directory, f"process-{j}", f"{PREFIX}{step}", COPIES)
                 for j in range(writers)] if not same else [os.path.join(path, COPIES)]
        with contextlib.ExitStack() as stack:
            arrays = [stack.enter_context(np.load(f)) for f in files]
            index = 0
            for key, records in saved.items():
                for offset, (name, shape, dtype) in enumerate(records):
                    if not groups[key] or (not same and id(groups[key][offset]) in sharded):
                        continue
                    # Every saved replica's copy, in rank order.
                    value = np.concatenate([a[str(index + offset)] for a in arrays])
                    variable = groups[key][offset]
                    copies = replica_copies(variable)
                    if (list(variable.shape) != shape or variable.dtype != dtype
                            or (same and len(copies) != len(value))):
                        raise ValueError(
                            f"The backup in {path} does not fit: {key} variable {name!r} was "
                            f"saved as {dtype}{shape} on {len(value)} replica(s); here "
                            f"{variable.path!r} is {variable.dtype}{list(variable.shape)} on "
                            f"{len(copies)}. Resume with the same model, optimizer and "
                            "replicas per process, or remove the directory.")
                    values = list(value) if same else [merged(value)] * len(copies)
                    if key == "metrics":  # fit resets the metrics after on_train_begin
                        self._pending_metrics.append((copies, values))
                    else:
                        for copy, v in zip(copies, values):
                            copy.assign(v)
                index += len(records)
        self.restored = {**meta, "process_count": writers}
        self.batches_per_epoch = list(meta.get("batches_per_epoch", []))
        self._epoch_logs = dict(meta.get("epoch_logs") or {})
        # The data goes on at the next batch; fit's loop passes the epoch's finished steps
        # without running them (and without reading data).
        self._consumed, self._resumed_batch = meta["consumed"], meta["batch"]
        for pipeline in self._inputs:
            pipeline.restore(path if same else None, meta["consumed"])
        self.last_saved = meta["consumed"]
        skip = meta["batch"] // meta.get("steps_per_execution", 1)
        set_initial_epoch(self.model, meta["epoch"])
        if skip:
            self._skipped = SkippedSteps(self.model, skip)
        if self._engine.is_chief:
            print(f"[tfdist] resuming from the backup of step {meta['consumed']} (epoch "
                  f"{meta['epoch'] + 1}, step {meta['batch']} of it done) in {owner}",
                  file=sys.stderr, flush=True)


def merged(copies: np.ndarray) -> np.ndarray:
    """One value for the copies the replicas of a job of another size held: the value itself
    where they agree (replicated state), else their mean (local SGD's local models and slots,
    error-feedback residuals, PowerSGD's Q: what the next averaging round would make of them);
    integer state takes replica 0's."""
    if all(np.array_equal(copies[0], c) for c in copies[1:]) or copies.dtype.kind not in "fc":
        return copies[0]
    return copies.mean(axis=0).astype(copies.dtype)


def check_signals(signals) -> tuple[int, ...]:
    """Signal names ("SIGTERM", "TERM") or numbers -> numbers, refusing ones that cannot be
    caught."""
    if isinstance(signals, (str, int)):
        signals = (signals,)
    if not isinstance(signals, (list, tuple)):
        raise ValueError(f"`preemption_signals` must be a list of signal names or numbers, e.g. "
                         f"['SIGTERM', 'SIGUSR1']. Received: {signals!r}")
    numbers = []
    for item in signals:
        try:
            if isinstance(item, str):
                name = item.upper()
                number = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
            elif isinstance(item, int) and not isinstance(item, bool):
                number = signal.Signals(item)
            else:
                raise KeyError(item)
        except (KeyError, ValueError):
            raise ValueError(f"`preemption_signals`: {item!r} is not a signal; use names such as "
                             "'SIGTERM' or 'SIGUSR1'") from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"`preemption_signals`: {number.name} cannot be caught; use "
                             "SIGTERM, SIGUSR1 or another catchable signal")
        numbers.append(int(number))
    return tuple(dict.fromkeys(numbers))


REMOVING = ".removing"


class BackupError(ValueError):
    """Backups cannot be used as configured (the message says why and what to do).

    Example:
        ```python
        try:
            tfdist.callbacks.BackupAndRestore("backup", save_freq=0)
        except (tfdist.callbacks.BackupError, ValueError) as e:
            print(e)  # what is wrong and what to do
        ```
    """


class BackupMismatch(BackupError):
    """A backup was written by another job (`BackupAndRestore(job=...)` differs).

    Example:
        ```python
        backup = tfdist.callbacks.BackupAndRestore("backup", save_freq=10, job={"batch_size": 64})
        # a restart with job={"batch_size": 128} finds this job's backup and raises
        # BackupMismatch, naming batch_size: 64 -> 128
        assert issubclass(tfdist.callbacks.BackupMismatch, tfdist.callbacks.BackupError)
        ```
    """


def _differences(saved: dict | None, now: dict | None) -> list[str]:
    """'key: backup X, now Y' for each value of `job` that differs (none if either is None)."""
    if saved is None or now is None:
        return []
    return [f"{key} was {saved.get(key, '(unset)')!r} and is now {now.get(key, '(unset)')!r}"
            for key in sorted(set(saved) | set(now)) if saved.get(key) != now.get(key)]


def remove_folder(path: str | os.PathLike) -> None:
    """Deletes a folder so that a kill midway leaves a `.removing` folder, never half a
    backup (the next start clears it)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return
    doomed = path + REMOVING
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _digest(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def _manifest(folder: str) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file under `folder` but meta.json."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative != META:
                files[relative] = [os.path.getsize(path), _digest(path)]
    return files


def _check(folder: str) -> str | None:
    """What is wrong with the backup in `folder`, or None if its files match its manifest."""
    try:
        with open(os.path.join(folder, META)) as f:
            meta = json.load(f)
        files = meta.get("files")
        for key in ("consumed", "epoch", "batch", "groups", "process_count"):
            meta[key]  # noqa: B018 (a KeyError is the answer)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{META} unreadable: {type(e).__name__}"
    if files is None:
        return None  # written before manifests existed
    for relative, (size, digest) in files.items():
        path = os.path.join(folder, relative)
        try:
            actual = os.path.getsize(path)
        except OSError:
            return f"{relative} missing"
        if actual != size:
            return f"{relative} has {actual} bytes, {size} were written"
        if _digest(path) != digest:
            return f"{relative} does not match its checksum"
    return None
