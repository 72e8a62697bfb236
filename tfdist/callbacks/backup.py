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
kept (`keep` >= 2) until the next one is complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist._hooks.training import set_initial_epoch
from tfdist.arguments import check_bool, check_int
from tfdist.callbacks.start import SkippedSteps
from tfdist.comm import replica_copies, resolve

FORMAT = 1
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
    resumes too (any other deterministic dataset: skip `backup.data_start()` elements of it).

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

    Example:
        ```python
        backup = tfdist.callbacks.BackupAndRestore("backup", save_freq=50)
        data = tfdist.data.distribute(strategy, x, y, 64, start=backup.data_start)
        model.fit(data, epochs=10, steps_per_epoch=100, callbacks=[backup])
        ```
    """

    def __init__(self, directory, save_freq: str | int = "epoch", keep: int = 2,
                 delete_checkpoint: bool = True, elastic: bool = False):
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
        self.batches_per_epoch: list[int] = []  # global batches trained on, per epoch
        self.restored: dict[str, Any] | None = None  # the backup's meta.json, when resumed
        self._consumed = 0  # global batches (dataset elements) fit has consumed
        self._epoch_start = 0
        self._resumed_batch = 0  # steps of the resumed epoch done before the backup
        self._skipped: SkippedSteps | None = None  # the resumed epoch's finished steps
        self._pending_metrics: list = []  # (replica copies, values) set when an epoch begins
        self.last_saved: int | None = None  # the step (global batches) of the last backup made

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
        if self.elastic:
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

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch=epoch + 1, batch=0)

    def on_train_end(self, logs=None):
        if self._skipped is not None:
            self._skipped.remove()
            self._skipped = None
        set_initial_epoch(self.model, None)
        if self.delete_checkpoint:
            shutil.rmtree(self._process_dir, ignore_errors=True)
            if self.elastic and self._engine.is_chief:  # those of processes now gone
                for name in os.listdir(self.directory) if os.path.isdir(self.directory) else []:
                    index = name[len("process-"):]
                    if name.startswith("process-") and index.isdigit() \
                            and int(index) >= self._engine.process_count:
                        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)  # the last process out removes the directory

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
            "time": time.time(),
        }
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            self._checkpoint().write(os.path.join(partial, STATE))
            copies = {str(i): np.stack([np.asarray(c.numpy()) for c in replica_copies(v)])
                      for i, v in enumerate(variables)}
            np.savez(os.path.join(partial, COPIES), **copies)  # type: ignore[arg-type]
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
            shutil.rmtree(os.path.join(self._process_dir, f"{PREFIX}{old}"), ignore_errors=True)

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

    def _agreed_backup(self) -> int | None:
        """The newest backup every process completed (None: start from scratch)."""
        mine = self._complete()[-self.keep:]
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
            with open(os.path.join(first, f"{PREFIX}{step}", META)) as f:
                count = json.load(f)["process_count"]
            if all(os.path.isfile(os.path.join(self.directory, f"process-{j}", f"{PREFIX}{step}",
                                               META)) for j in range(count)):
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
        # The data goes on at the next batch; fit's loop passes the epoch's finished steps
        # without running them (and without reading data).
        self._consumed, self._resumed_batch = meta["consumed"], meta["batch"]
        skip = meta["batch"] // meta.get("steps_per_execution", 1)
        set_initial_epoch(self.model, meta["epoch"])
        if skip:
            self._skipped = SkippedSteps(self.model, skip)


def merged(copies: np.ndarray) -> np.ndarray:
    """One value for the copies the replicas of a job of another size held: the value itself
    where they agree (replicated state), else their mean (local SGD's local models and slots,
    error-feedback residuals, PowerSGD's Q: what the next averaging round would make of them);
    integer state takes replica 0's."""
    if all(np.array_equal(copies[0], c) for c in copies[1:]) or copies.dtype.kind not in "fc":
        return copies[0]
    return copies.mean(axis=0).astype(copies.dtype)
