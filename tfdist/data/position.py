"""The position of your own tf.data pipeline, kept in the run's backups.

`tfdist.data.resume(dataset, start=backup.data_start)` puts a `KeptPosition` between your
dataset and `fit`: each backup of `BackupAndRestore` then holds the pipeline's state
(`tf.train.Checkpoint(iterator=...)`: where each file is read, its shuffle and prefetch buffers)
and the few batches `fit`'s own read-ahead had taken from it but not yet trained on. A resume
restores both, so it reads nothing it read before and starts in constant time, whatever the
position.

Where the state cannot be saved (the pipeline holds Python state: `from_generator`, a
`py_function`, unless your dataset's options say `experimental_external_state_policy` WARN or
IGNORE), or the job resumes with another number of processes, a resume falls back to reading and
dropping the batches before the position, and says so in one line.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import threading

import numpy as np
import tensorflow as tf

IN_FLIGHT = 16  # batches a pipeline keeps for a backup: what fit's read-ahead may hold
_FOLDER = "input-{}"


class KeptPosition:
    """One input pipeline (`dataset`, endless) whose position `backup` saves and restores;
    `dataset()` is what `fit` reads. Made by `tfdist.data.resume`."""

    def __init__(self, dataset: tf.data.Dataset, backup):
        self._source = dataset
        self._spec = tf.nest.flatten(dataset.element_spec)
        self._lock = threading.Lock()
        self._readers: dict[int, _Reader] = {}  # the newest iterator's only
        self._opened = 0
        self._current: _Reader | None = None  # the iterator fit trains from (the newest)
        self._restore: tuple[str | None, int] = (None, 0)  # (saved state, batches trained)
        self._unsaved: str | None = None  # why the position cannot be saved, once known
        self.name = _FOLDER.format(backup.keep_input(self))

    # -- what fit reads ----------------------------------------------------------------------
    def dataset(self) -> tf.data.Dataset:
        """The pipeline's batches, each iterator of it a reader of its own: the first one made
        after a backup was restored starts at the backup's position."""
        dtypes = [s.dtype for s in self._spec]

        def pull(reader):
            flat = tf.py_function(self._pull, [reader], dtypes)
            flat = [tf.ensure_shape(t, s.shape) for t, s in zip(flat, self._spec)]
            return tf.nest.pack_sequence_as(self._source.element_spec, flat)

        # One reader per iterator, opened when the iterator reads its first batch.
        opened = tf.data.Dataset.from_tensors(np.int64(0)).map(
            lambda _: tf.ensure_shape(tf.py_function(self._open, [], tf.int64), []))
        batches = opened.flat_map(lambda r: tf.data.Dataset.from_tensors(r).repeat()).map(pull)
        options = tf.data.Options()
        # What fit's read-ahead holds must stay within IN_FLIGHT: no autotuned buffer here.
        options.experimental_optimization.inject_prefetch = False
        batches = batches.with_options(options)
        if self._source.cardinality() == tf.data.INFINITE_CARDINALITY:
            # Said to be endless, as its source: no per-step check that all workers have data.
            batches = batches.apply(tf.data.experimental.assert_cardinality(
                tf.data.INFINITE_CARDINALITY))
        return batches

    def _open(self) -> np.int64:
        state, trained = self._restore
        self._restore = (None, 0)  # only the first iterator after a restore resumes
        reader = _Reader(self._source, state, trained)
        with self._lock:
            key, self._opened = self._opened, self._opened + 1
            self._readers = {key: reader}  # an older iterator is done with (Keras' first)
            self._current = reader
        return np.int64(key)

    def _pull(self, key) -> list:
        with self._lock:
            reader = self._readers.get(int(key))
        if reader is None:
            raise StopIteration  # an iterator fit has left: its read-ahead ends here
        return reader.pull()

    # -- what BackupAndRestore calls ---------------------------------------------------------
    def save(self, folder: str, trained: int) -> None:
        """Writes the position after `trained` batches into backup folder `folder`: the
        pipeline's state and the batches read past it; nothing when that cannot be saved."""
        reader = self._current
        if reader is None or self._unsaved is not None:
            return
        problem = reader.save(os.path.join(folder, self.name), trained)
        if problem is not None:
            self._unsaved = problem
            print(f"[tfdist] data: the position of your dataset cannot be kept in the backups "
                  f"({problem}); a resume reads and drops the batches before it. Set "
                  "tf.data.Options().experimental_external_state_policy to IGNORE on it if "
                  "its Python functions keep no position (docs/guides/data.md)",
                  file=sys.stderr, flush=True)

    def restore(self, folder: str | None, trained: int) -> None:
        """The next iterator starts after `trained` batches: from the state saved in backup
        `folder` when it holds this pipeline's, else by reading and dropping them."""
        state = os.path.join(folder, self.name) if folder else None
        if state is None or not os.path.isdir(state):
            state = None
            if trained:
                why = ("another number of processes" if folder is None
                       else "the backup holds no position of this pipeline")
                print(f"[tfdist] data: resuming your dataset by reading and dropping its "
                      f"first {trained} batches ({why})", file=sys.stderr, flush=True)
        self._restore = (state, trained)


class _Reader:
    """One iterator over the pipeline: batches given out, and the last `IN_FLIGHT` of them
    (those fit's read-ahead holds when a backup is made)."""

    def __init__(self, dataset: tf.data.Dataset, state: str | None, trained: int):
        self._lock = threading.Lock()
        self.given = trained  # batches given out, counted from the start of the run
        self._recent: collections.deque = collections.deque(maxlen=IN_FLIGHT)
        self._replay: collections.deque = collections.deque()
        if state is None:
            self._iterator = iter(dataset.skip(trained))
            return
        self._iterator = iter(dataset)
        tf.train.Checkpoint(iterator=self._iterator).read(
            os.path.join(state, "pipeline")).expect_partial()
        ahead = os.path.join(state, "ahead.tfrecord")
        if os.path.exists(ahead):  # each batch's tensors in turn
            specs = tf.nest.flatten(dataset.element_spec)
            tensors = list(tf.data.TFRecordDataset(ahead))
            for i in range(0, len(tensors), len(specs)):
                self._replay.append([tf.io.parse_tensor(t, s.dtype)
                                     for t, s in zip(tensors[i:i + len(specs)], specs)])

    def pull(self) -> list:
        with self._lock:
            # The batches read past a backup first, then the pipeline's own.
            flat = (self._replay.popleft() if self._replay
                    else tf.nest.flatten(next(self._iterator)))
            self._recent.append(flat)
            self.given += 1
            return flat

    def save(self, folder: str, trained: int) -> str | None:
        """Writes the state and the batches given out past `trained` (None), or says why the
        state cannot be written."""
        with self._lock:
            ahead = self.given - trained
            if not 0 <= ahead <= len(self._recent):
                raise RuntimeError(
                    f"tfdist data: {ahead} batches were read past the backup's position, more "
                    f"than the {IN_FLIGHT} a pipeline keeps; this is a tfdist bug, please "
                    "report it")
            pending = list(self._recent)[len(self._recent) - ahead:] + list(self._replay)
            os.makedirs(folder, exist_ok=True)
            try:
                tf.train.Checkpoint(iterator=self._iterator).write(
                    os.path.join(folder, "pipeline"))
            except tf.errors.FailedPreconditionError as e:
                shutil.rmtree(folder, ignore_errors=True)
                return str(e.message).split("}}")[-1].split("[Op:")[0].strip() or "stateful"
            if pending:
                with tf.io.TFRecordWriter(os.path.join(folder, "ahead.tfrecord")) as writer:
                    for flat in pending:
                        for t in flat:
                            writer.write(tf.io.serialize_tensor(t).numpy())
        return None
