"""Record sets: data larger than memory, each record read directly by its index.

A record set is a directory of TFRecord shards (`train-00000-of-00004.tfrecord`, ...), each
with an index of where its records start (`.index` beside it: int64 offsets, one per record plus
the shard's end), and `records.json` saying what the records hold. The shards are plain TFRecord
files (any TFRecord reader reads them); the index is what makes record i one seek and one read,
so that:

* the global batches stay a pure function of (seed, epoch) over record indices
  (`tfdist.data.epoch_order`), the same whatever the number of workers;
* worker i of N reads only the records of its slice of each global batch (`record_batches`
  with `shard=(i, N)`), and decodes them in parallel;
* a resume at global batch s computes where to read from s alone: nothing already trained on is
  read again, and the time to the first step does not grow with s.

Written by `tfdist data convert` (or `write_records`) from NumPy arrays or TFRecord files;
read by `RecordSource`. Records written from arrays are `tf.train.Example`s with the example's
raw bytes ("x") and its label ("y"), which `decode_example` turns back into tensors; records of
your own (TFRecord input) need a decode function of yours: `decode(record) -> (x, y)`, a
function of TensorFlow ops on one scalar string.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

META = "records.json"
FORMAT = "tfdist-records/1"
_HEADER = 12  # uint64 length + uint32 masked CRC of the length
_FOOTER = 4  # uint32 masked CRC of the data
READ_AHEAD = 1  # batches read at once, ahead of the one being decoded
RECENT = 16  # reads whose records `find_bad` looks through after a failure
OPEN_INDEXES = 64  # shards' indexes mapped at once by a RecordSource
DECODERS = max(2, os.cpu_count() or 2)  # records decoded at once


class RecordError(ValueError):
    """A record set that cannot be read as it should: the message names the file and the
    record, and what to do.

    Example:
        ```python
        try:
            tfdist.data.RecordSource("/nonexistent")
        except tfdist.data.RecordError as e:
            print(e)  # data.path: /nonexistent is not a directory; give the directory ...
        ```
    """


# -- reading -----------------------------------------------------------------------------------
class RecordSource:
    """The records of one split of a record set, by index: `len(source)`, `source.read(ids)`.

    Args:
        path: The record set's directory (written by `tfdist data convert`).
        split: "train" or "test". Defaults to "train".

    Attributes:
        meta: The record set's `records.json` (what a record holds, how many there are).
        records_read: Records this process has read so far (every `read`).

    Raises:
        RecordError: no shard of `split` in `path`, a shard without its index, or a shard
            shorter than its index says (truncated): naming the file.

    Example:
        ```python
        import tempfile

        path = tempfile.mkdtemp() + "/digits"
        tfdist.data.convert_arrays(path, *tfdist.data.load_digits("all"))
        source = tfdist.data.RecordSource(path)
        assert len(source) == 1438 and len(source.read([0, 5])) == 2
        ```
    """

    def __init__(self, path: str | os.PathLike, split: str = "train"):
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise RecordError(f"data.path: {self.path} is not a directory; give the directory "
                              "`tfdist data convert` wrote")
        self.meta = _read_meta(self.path)
        self.split = split
        self.files = sorted(self.path.glob(f"{split}-*.tfrecord"))
        if not self.files:
            raise RecordError(f"data.path: {self.path} holds no {split} records "
                              f"({split}-*.tfrecord); write them with `tfdist data convert`")
        counts = [len(_read_index(f)) - 1 for f in self.files]  # each checked, then let go
        self._indexes: dict[int, np.ndarray] = {}  # shard -> its offsets, mapped
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        said = self.meta["splits"].get(split, {})
        if said and (said["shards"], said["records"]) != (len(self.files), len(self)):
            raise RecordError(f"data.path: {self.path} holds {len(self.files)} {split} shard(s) "
                              f"of {len(self):,} records where its {META} says "
                              f"{said['shards']} of {said['records']:,}: files were added or "
                              "removed since; write the set again with `tfdist data convert`")
        self.records_read = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._recent: collections.deque = collections.deque(maxlen=RECENT)  # last reads' ids

    def __len__(self) -> int:
        return int(self._first[-1])

    def locate(self, index: int) -> tuple[Path, int]:
        """(the shard file, the record's number in it) of record `index`."""
        shard = int(np.searchsorted(self._first, index, side="right")) - 1
        return self.files[shard], int(index - self._first[shard])

    def read(self, indices: Iterable[int]) -> list[bytes]:
        """The records at `indices` (in that order), each one seek and one read."""
        indices = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices,
                             dtype=np.int64).reshape(-1)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise RecordError(f"record index out of range: {self.split} records of "
                              f"{self.path} are 0..{len(self) - 1}")
        shards = np.searchsorted(self._first, indices, side="right") - 1
        out = []
        for index, shard in zip(indices.tolist(), shards.tolist(), strict=True):
            within = index - int(self._first[shard])
            offsets = self._index(shard)
            begin, end = offsets[within], offsets[within + 1]
            handle = self._handle(shard)
            handle.seek(int(begin))
            framed = handle.read(int(end - begin))
            if len(framed) != end - begin:
                raise RecordError(f"{self.files[shard]}: record {within} (index {index}) is cut "
                                  "short: the file is truncated; write it again with `tfdist "
                                  "data convert`")
            (length,) = struct.unpack("<Q", framed[:8])
            if length != end - begin - _HEADER - _FOOTER:
                raise RecordError(f"{self.files[shard]}: record {within} (index {index}) does "
                                  "not match its index: the file or its .index changed; write "
                                  "them again with `tfdist data convert`")
            out.append(framed[_HEADER:_HEADER + length])
        with self._lock:
            self.records_read += len(out)
            self._recent.append(indices)
        return out

    def find_bad(self, decode: Callable, x_shape, y_shape,
                 classes: int | None = None) -> tuple[str, str] | None:
        """Which of the records read last (the last `RECENT` reads) `decode` fails on,
        decodes to other shapes than (`x_shape`, `y_shape`), or to a class label outside
        [0, `classes`): ("record i of FILE (record j there) <what>", what to do); None when
        they all decode. For an error in the middle of a run, which TensorFlow reports without
        the record."""
        import tensorflow as tf

        with self._lock:
            recent = list(self._recent)
        for index in dict.fromkeys(int(i) for ids in recent for i in ids):  # once each, in order
            try:
                x, y = decode(tf.constant(self.read([index])[0]))
                shapes = tuple(x.shape), tuple(y.shape)
                problem = None if shapes == (tuple(x_shape), tuple(y_shape)) else (
                    f"decodes to shapes {list(shapes[0])} and {list(shapes[1])} where record 0 "
                    f"decodes to {list(x_shape)} and {list(y_shape)}")
                fix = "Mend the record, or make data.decode accept it, and run the same command again"
                label = label_problem(y, classes) if problem is None else None
                if label is not None:
                    problem, fix = label, (
                        "Set data.num_classes to the number of classes, in another "
                        f"train.output_dir (the backups are of a model of {classes} classes)")
            except Exception as e:  # noqa: BLE001 (any failure of the user's function is said)
                said = getattr(e, "message", None) or str(e)  # TensorFlow's: not its op's name
                said = said.split("}}")[-1].split("[Op:")[0].strip().splitlines()
                said = said[0] if said else ""
                problem = f"does not decode: {type(e).__name__}: {said}"
            if problem is not None:
                file, number = self.locate(index)
                return f"record {index} of {file} (record {number} there) {problem}", fix
        return None

    def _index(self, shard: int) -> np.ndarray:
        """Shard `shard`'s record offsets, mapped from its index file, not read into this
        process: the page cache holds what is read of them, once for all the processes of a
        host. At most OPEN_INDEXES are mapped at once (each holds a file descriptor): the one
        mapped first goes first."""
        offsets = self._indexes.get(shard)
        if offsets is None:
            offsets = _read_index(self.files[shard])
            with self._lock:
                self._indexes[shard] = offsets
                while len(self._indexes) > OPEN_INDEXES:
                    del self._indexes[next(iter(self._indexes))]
        return offsets

    def _handle(self, shard: int):
        """This thread's open file of `shard` (tf.data calls `read` from several threads)."""
        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = {}
        if shard not in handles:
            handles[shard] = open(self.files[shard], "rb")  # noqa: SIM115 (kept open)
        return handles[shard]


AGAIN = "write the set again with `tfdist data convert`"


def label_problem(y, classes: int | None) -> str | None:
    """What is wrong with a decoded class label `y` (one integer) for a model of `classes`
    classes, or None (also for other labels, or no classes)."""
    if classes is None or not y.dtype.is_integer or y.shape.rank != 0:
        return None
    label = int(y)
    if 0 <= label < classes:
        return None
    return f"has label {label}, outside the model's {classes} classes (data.num_classes)"


def _load(path: Path, read: Callable[[Path], Any], missing: str):
    """`read(path)`, or a RecordError: `missing` when there is no such file, else what was
    wrong with it."""
    try:
        return read(path)
    except FileNotFoundError:
        raise RecordError(f"{missing}; {AGAIN}") from None
    except (OSError, ValueError) as e:
        raise RecordError(f"{path}: unreadable ({e}); {AGAIN}") from None


def _read_meta(path: Path) -> dict[str, Any]:
    meta = _load(path / META, lambda p: json.loads(p.read_text()),
                 f"data.path: {path} has no {META}: it is not a record set written by `tfdist "
                 "data convert`")
    if meta.get("format") != FORMAT:
        raise RecordError(f"{path / META}: format {meta.get('format')!r}, this tfdist reads "
                          f"{FORMAT!r}; convert the data again")
    return meta


def _read_index(shard: Path) -> np.ndarray:
    """`shard`'s offsets (its record starts, then its end), mapped from its index file and
    checked against the shard's size."""
    index = shard.with_name(shard.name + ".index")
    offsets = _load(index, lambda p: np.load(p, mmap_mode="r", allow_pickle=False),
                    f"{shard}: no index ({index.name})").view(np.ndarray)
    size = shard.stat().st_size
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[-1] != size:
        end = int(offsets[-1]) if offsets.ndim == 1 and len(offsets) else 0
        raise RecordError(f"{shard}: {size:,} bytes where its index says {end:,} (a truncated "
                          "or replaced file); write the set again with `tfdist data convert`")
    return offsets


# -- the global batches, read by index ---------------------------------------------------------
def default_decoder(meta: dict[str, Any]) -> Callable | None:
    """The decode function of a record set tfdist wrote from arrays or images (`meta`: its
    records.json); None for records of your own."""
    return {"arrays": decode_example, "images": decode_image}.get(meta.get("source"),
                                                                 lambda _: None)(meta)


def decode_image(meta: dict[str, Any]) -> Callable:
    """The decode function of records written from images (`convert_images`): one serialized
    `tf.train.Example` -> (the image resized to meta's image_size, float32 in [0, 1], its
    label as int32)."""
    import tensorflow as tf

    features = {"image": tf.io.FixedLenFeature([], tf.string),
                "label": tf.io.FixedLenFeature([], tf.int64)}
    size, channels = meta["image_size"], meta["channels"]

    def decode(record):
        parsed = tf.io.parse_single_example(record, features)
        image = tf.io.decode_image(parsed["image"], channels=channels, expand_animations=False)
        image = tf.image.resize(tf.cast(image, tf.float32) / 255.0, size)
        return tf.ensure_shape(image, [*size, channels]), tf.cast(parsed["label"], tf.int32)

    return decode


def decode_example(meta: dict[str, Any]) -> Callable:
    """The decode function of records written from arrays (`write_records`): one serialized
    `tf.train.Example` -> (x, y) with the dtypes and shapes `meta` (records.json) gives."""
    import tensorflow as tf

    x_spec, y_spec = meta["x"], meta["y"]
    x_dtype, y_dtype = tf.as_dtype(x_spec["dtype"]), tf.as_dtype(y_spec["dtype"])
    features = {"x": tf.io.FixedLenFeature([], tf.string),
                "y": tf.io.FixedLenFeature([], tf.string)}

    def decode(record):
        parsed = tf.io.parse_single_example(record, features)
        x = tf.reshape(tf.io.decode_raw(parsed["x"], x_dtype), x_spec["shape"])
        y = tf.reshape(tf.io.decode_raw(parsed["y"], y_dtype), y_spec["shape"])
        return x, y

    return decode


def record_batches(source: RecordSource, global_batch_size: int, seed: int = 0,
                   decode: Callable | None = None, shard: tuple[int, int] = (0, 1),
                   shuffle: bool = True, repeat: bool = True,
                   start: int | Callable[[], int] = 0):
    """Slice `shard[0]` of `shard[1]` of each global batch of `source`, reading only that slice.

    The global batches are those `tfdist.data.global_batches` makes of arrays of the same
    length: data epoch e is the records in the order `epoch_order(len(source), seed, e)`, cut
    into len(source) // global_batch_size batches. So 1 worker (`shard=(0, 1)`) and N workers
    (`shard=(i, N)`, each reading 1/N of every batch) train on the same examples, and arrays
    and their record set give the same batches.

    Args:
        source: The records (`RecordSource`).
        global_batch_size: Examples per global batch, in [1, len(source)]; divides by
            `shard[1]`.
        seed: Seed of the shuffle (an int >= 0).
        decode: record -> (x, y), TensorFlow ops on one scalar string. Defaults to the decoder
            of records written from arrays (`decode_example`).
        shard: (this reader's slice, the number of slices). Defaults to (0, 1), everything.
        shuffle: Shuffle each epoch (else the stored order). Defaults to True.
        repeat: Epoch after epoch forever (else to the end of the epoch `start` is in).
        start: Global batches already trained on: an int, or a callable called whenever an
            iterator is made (`BackupAndRestore.data_start`). Nothing before it is read.

    Returns:
        A `tf.data.Dataset` of (x, y) batches of global_batch_size // shard[1] examples.

    Example:
        ```python
        import tempfile

        path = tempfile.mkdtemp() + "/digits"
        tfdist.data.convert_arrays(path, *tfdist.data.load_digits("all"))
        source = tfdist.data.RecordSource(path)
        mine = tfdist.data.record_batches(source, 64, seed=0, shard=(1, 2))  # worker 1 of 2
        images, labels = next(iter(mine))
        assert images.shape == (32, 8, 8, 1) and source.records_read < 64 * 8
        ```
    """
    import tensorflow as tf

    from tfdist.data.datasets import _origin, batch_indices

    n = len(source)
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"`shard` must be (index, count) with 0 <= index < count. Received: "
                         f"shard={shard!r}")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or not 1 <= global_batch_size <= n or global_batch_size % count:
        raise ValueError(f"`global_batch_size` must be in [1, {n}] (the records) and divide by "
                         f"{count} (the slices). Received: global_batch_size={global_batch_size!r}")
    decode = decode or decode_example(source.meta)
    local = global_batch_size // count

    def sequence(first):  # index vectors only: nothing read
        return batch_indices(n, global_batch_size, seed, shuffle, repeat, first, shard)

    def read(ids):
        return tf.ensure_shape(tf.py_function(lambda i: _EXIT.read(source, i.numpy()),
                                              [ids], tf.string), [local])

    # Reads run READ_AHEAD batches ahead, decodes DECODERS records at once: what a run reads
    # and never trains on stays a few batches (tf.data's autotuning buffers far more, and
    # Keras' fit under a strategy draws one batch of a first iterator it then drops).
    batches = (_origin(start).flat_map(sequence)
               .map(read, num_parallel_calls=READ_AHEAD)
               .map(_decoding_each(decode))
               .prefetch(1))
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False  # its buffers autotune upwards
    batches = batches.with_options(options)
    return batches.apply(tf.data.experimental.assert_cardinality(
        tf.data.INFINITE_CARDINALITY)) if repeat else batches


def test_batches(source: RecordSource, batch_size: int = 256, decode: Callable | None = None):
    """Every record of `source` once, in order, in batches (the last one partial)."""
    import tensorflow as tf

    decode = decode or decode_example(source.meta)
    n = len(source)
    return (tf.data.Dataset.range(0, n, batch_size)
            .map(lambda b: tf.ensure_shape(tf.py_function(
                lambda s: _EXIT.read(source, range(int(s), min(int(s) + batch_size, n))),
                [b], tf.string), [None]))
            .map(_decoding_each(decode)))


class _ReadsAtExit:
    """The reads tf.data's threads make for record datasets (their `py_function`s), ended
    before the interpreter's: an iterator still alive then (one in a global) is destroyed while
    the interpreter finalizes, and waits for a read in flight that can no longer take the GIL,
    forever. At exit (`atexit`, registered with the first read), reads stop: each one still
    asked for returns at once, and the exit waits until none has run for a moment."""

    QUIET_S = 0.2  # no read started for this long: tf.data's threads wait for their consumer
    LONGEST_S = 10.0

    def __init__(self):
        self._lock = threading.Lock()
        self._ending = False
        self._registered = False
        self._last = 0.0  # when the last read started or ended
        self._running = 0

    def read(self, source: RecordSource, indices) -> np.ndarray:
        with self._lock:
            if not self._registered:
                import atexit

                atexit.register(self.end)
                self._registered = True
            self._running += 1
            self._last = time.monotonic()
        try:
            if self._ending:  # empty records, which nothing trains on: an error would print
                return np.array([b""] * len(indices), dtype=object)
            return np.array(source.read(indices), dtype=object)
        finally:
            with self._lock:
                self._running -= 1
                self._last = time.monotonic()

    def end(self) -> None:
        self._ending = True
        deadline = time.monotonic() + self.LONGEST_S
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running and time.monotonic() - self._last > self.QUIET_S:
                    return
            time.sleep(0.02)


_EXIT = _ReadsAtExit()


def _decoding_each(decode: Callable) -> Callable:
    """A batch of serialized records -> the batch of what `decode` makes of each, DECODERS
    records at once. One map over the batch, not a dataset element per record: tf.data's cost
    per element would be more than half the input's time for a batch of 64 small records."""
    import tensorflow as tf

    produced = tf.data.Dataset.from_tensors(tf.constant("")).map(decode).element_spec

    def decode_batch(records):
        return tf.map_fn(decode, records, fn_output_signature=produced,
                         parallel_iterations=DECODERS)

    return decode_batch


# -- writing -----------------------------------------------------------------------------------
class _ShardWriter:
    """Writes one split's shards of at most `shard_bytes` each, with their indexes."""

    def __init__(self, out: Path, split: str, shard_bytes: int):
        self.out, self.split, self.shard_bytes = out, split, shard_bytes
        self.written: list[Path] = []
        self.count = 0
        self._file = None

    def add(self, record: bytes) -> None:
        framed = _HEADER + len(record) + _FOOTER
        if self._file is None or (self._offsets[-1] + framed > self.shard_bytes
                                  and len(self._offsets) > 1):
            self._close()
            import tensorflow as tf

            path = self.out / f"{self.split}-{len(self.written):05d}.partial"
            self._file, self._offsets = tf.io.TFRecordWriter(str(path)), [0]
            self.written.append(path)
        self._file.write(record)
        self._offsets.append(self._offsets[-1] + framed)
        self.count += 1

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            np.save(self.written[-1].with_suffix(".index.npy"),
                    np.asarray(self._offsets, np.int64))
            self._file = None

    def finish(self) -> list[Path]:
        """Closes the last shard and names them `split-0000i-of-0000n.tfrecord` (+ .index)."""
        self._close()
        final = []
        for i, partial in enumerate(self.written):
            name = f"{self.split}-{i:05d}-of-{len(self.written):05d}.tfrecord"
            os.replace(partial.with_suffix(".index.npy"), self.out / f"{name}.index")
            os.replace(partial, self.out / name)
            final.append(self.out / name)
        return final


def _example(x: np.ndarray, y: np.ndarray) -> bytes:
    import tensorflow as tf

    feature = {k: tf.train.Feature(bytes_list=tf.train.BytesList(value=[v.tobytes()]))
               for k, v in (("x", x), ("y", y))}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_records(out: str | os.PathLike,
                  records: Iterable[tuple[str, bytes]] | Mapping[str, Iterable[bytes]],
                  meta: dict[str, Any], shard_mb: float = 256.0,
                  progress: Callable[[str, int], None] | None = None,
                  splits: tuple[str, ...] = ("train", "test")) -> dict[str, Any]:
    """Writes a record set in one pass over `records`, (split, serialized record) pairs (or
    a mapping of each split to its records, the splits then being its keys): each split of
    `splits` into shards of at most `shard_mb` MB with their indexes, and `records.json`
    (`meta` plus each split's counts, 0 for a split given no record). The shards are written in
    `out/.writing` and moved into `out` once every record is written, then `records.json`
    (last): a set is complete only once it is there, and a write that fails leaves no shard
    behind. A directory that holds a set, or shards of one, is refused. Returns the meta
    written."""
    out = Path(out)
    if (out / META).exists():
        raise RecordError(f"{out} already holds a record set; choose another directory or "
                          "remove it")
    if not 0 < shard_mb <= 2**20:
        raise ValueError(f"`shard_mb` must be in (0, 1048576]. Received: shard_mb={shard_mb}")
    left = sorted(out.glob("*-of-*.tfrecord*")) if out.is_dir() else []
    if left:
        raise RecordError(f"{out} holds shards without a {META} ({left[0].name}, ...: a "
                          "conversion that was stopped?); remove them or choose another "
                          "directory")
    if isinstance(records, Mapping):
        splits, records = tuple(records), ((s, r) for s, rs in records.items() for r in rs)
    created = not out.exists()
    staging = out / ".writing"
    shutil.rmtree(staging, ignore_errors=True)  # a stopped write's: only this function's files
    staging.mkdir(parents=True)
    writers = {split: _ShardWriter(staging, split, int(shard_mb * 2**20)) for split in splits}
    try:
        for split, record in records:
            if split not in writers:
                raise ValueError(f"a record of split {split!r}, not one of splits={splits!r}")
            writers[split].add(record)
            if progress is not None:
                progress(split, writers[split].count)
        shards = [shard for writer in writers.values() for shard in writer.finish()]
        counts = {split: {"records": w.count, "shards": len(w.written)}
                  for split, w in writers.items()}
        if not any(c["records"] for c in counts.values()):
            raise RecordError("the input holds no records; nothing was written")
        for shard in shards:
            os.replace(shard.with_name(shard.name + ".index"), out / f"{shard.name}.index")
            os.replace(shard, out / shard.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    staging.rmdir()
    meta = {"format": FORMAT, **meta, "splits": counts}
    partial = out / f".partial-{META}"
    partial.write_text(json.dumps(meta, indent=2))
    os.replace(partial, out / META)
    return meta


def convert_arrays(out: str | os.PathLike, x: np.ndarray, y: np.ndarray,
                   test_fraction: float = 0.2, seed: int = 0, shard_mb: float = 256.0,
                   progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """A record set of arrays (x, y): split as `tfdist.data.load_digits` splits, by a seeded
    permutation whose first `test_fraction` is the test split and the rest the train split, in
    that order (so the digits set converted gives `load_digits("train", test_fraction, seed)`,
    and `record_batches` the same batches as `global_batches` of those arrays). Returns the
    meta written.

    Example:
        ```python
        import tempfile

        x, y = tfdist.data.load_digits("all")
        meta = tfdist.data.convert_arrays(tempfile.mkdtemp() + "/digits", x, y, test_fraction=0.2)
        assert meta["splits"]["train"]["records"] == 1438
        ```
    """
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y) or len(y) < 2:
        raise ValueError(f"`x` and `y` must have the same length, at least 2. Received: "
                         f"{len(x)} and {len(y)}")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"`test_fraction` must be in [0, 1). Received: {test_fraction}")
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    meta = {"source": "arrays",
            "x": {"dtype": x.dtype.name, "shape": list(x.shape[1:])},
            "y": {"dtype": y.dtype.name, "shape": list(y.shape[1:])}}
    if np.issubdtype(y.dtype, np.integer):
        meta["num_classes"] = int(y.max()) + 1
    return write_records(out, ((split, _example(x[i], y[i]))
                               for split, ids in (("train", train), ("test", test))
                               for i in ids), meta, shard_mb, progress)


def convert_tfrecords(out: str | os.PathLike, files: list[str], test_fraction: float = 0.2,
                      seed: int = 0, shard_mb: float = 256.0,
                      progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """A record set of the records of TFRecord `files` (read once, in order, in one pass that
    writes both splits, never held in memory whole): record k goes to the test split when a
    seeded hash of k falls below `test_fraction`. Each file may be uncompressed, GZIP or ZLIB
    (found from its first record); the set's shards are uncompressed, as random reads need.
    The records stay yours: train on them with your decode function (`data.decode`). Returns
    the meta written. A file that is no TFRecord, or a record cut short or corrupt, is named
    with the record, and nothing is left that looks like a record set.

    Example:
        ```python
        import tempfile

        folder = tempfile.mkdtemp()
        with tf.io.TFRecordWriter(f"{folder}/mine.tfrecord") as writer:
            for k in range(100):
                writer.write(tf.io.serialize_tensor(tf.fill([4], float(k))).numpy())
        meta = tfdist.data.convert_tfrecords(f"{folder}/records", [f"{folder}/mine.tfrecord"])
        assert sum(s["records"] for s in meta["splits"].values()) == 100
        ```
    """
    import tensorflow as tf

    if not files:
        raise RecordError("no TFRecord file to convert; give files or a glob that matches")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise RecordError(f"{missing[0]}: no such file")
    compression = {f: _compression_of(f) for f in files}

    def records() -> Iterator[tuple[str, bytes]]:
        k = 0
        for name in files:
            read = tf.data.TFRecordDataset(name, compression_type=compression[name])
            good = 0  # records of this file read
            try:
                for record in read.as_numpy_iterator():
                    yield "test" if _in_test(k, test_fraction, seed) else "train", record
                    k, good = k + 1, good + 1
            except tf.errors.DataLossError:
                raise RecordError(f"{name}: record {good} is cut short or corrupt"
                                  f"{' (' + compression[name] + ')' if compression[name] else ''}"
                                  "; mend or leave out that file") from None

    return write_records(out, records(), {"source": "tfrecord"}, shard_mb, progress)


def _compression_of(name: str) -> str:
    """"" (uncompressed), "GZIP" or "ZLIB": the first that reads `name`'s first record."""
    import tensorflow as tf

    empty = os.path.getsize(name) == 0
    for kind in ("", "GZIP", "ZLIB"):
        try:
            first = list(tf.data.TFRecordDataset(name, compression_type=kind).take(1))
        except tf.errors.OpError:
            continue
        if first or kind or empty:  # bytes that read as no record are no TFRecord
            return kind
    raise RecordError(f"{name}: not a TFRecord file (read as uncompressed, GZIP and ZLIB); "
                      "give TFRecord files, or convert with --from npz or --from images")


IMAGE_TYPES = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


def convert_images(out: str | os.PathLike, folder: str | os.PathLike,
                   image_size: tuple[int, int] | None = None, channels: int = 3,
                   test_fraction: float = 0.2, seed: int = 0, shard_mb: float = 256.0,
                   progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """A record set of the images in `folder`, one subfolder per class (the classes are the
    subfolders' names in sorted order, labels 0, 1, ...): each record the image's file as it
    is (JPEG, PNG, GIF or BMP, checked to decode) and its label; image k (by class, then
    name) goes to the test split when a seeded hash of k falls below `test_fraction`. The set
    decodes by itself (`decode_image`): to `image_size` (height, width; default: the first
    image's) with `channels` channels, float32 in [0, 1]. Returns the meta written.

    Example:
        ```python
        import tempfile
        from pathlib import Path

        folder = Path(tempfile.mkdtemp())
        for label in ("cat", "dog"):
            (folder / label).mkdir()
            for k in range(5):
                image = tf.cast(tf.random.uniform([12, 16, 3], 0, 255), tf.uint8)
                (folder / label / f"{k}.png").write_bytes(tf.io.encode_png(image).numpy())
        meta = tfdist.data.convert_images(f"{folder}/records", folder, image_size=(8, 8))
        assert meta["classes"] == ["cat", "dog"] and meta["image_size"] == [8, 8]
        ```
    """
    import tensorflow as tf

    folder = Path(folder)
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    images = [(f, label) for label, name in enumerate(classes)
              for f in sorted((folder / name).iterdir()) if f.suffix.lower() in IMAGE_TYPES]
    if not images:
        raise RecordError(f"{folder}: no images in subfolders (one subfolder per class, "
                          f"holding {', '.join(IMAGE_TYPES)} files)")
    if channels not in (1, 3):
        raise ValueError(f"`channels` must be 1 or 3. Received: channels={channels!r}")

    def decoded(path: Path) -> tuple[bytes, Any]:
        data = path.read_bytes()
        try:
            return data, tf.io.decode_image(data, channels=channels, expand_animations=False)
        except (tf.errors.InvalidArgumentError, ValueError) as e:
            said = (getattr(e, "message", None) or str(e)).split("}}")[-1].split("[Op:")[0]
            raise RecordError(f"{path}: not an image TensorFlow decodes ({said.strip()}); "
                              "remove or convert it") from None

    if image_size is None:
        image_size = tuple(int(n) for n in decoded(images[0][0])[1].shape[:2])
    if len(image_size) != 2 or any(not isinstance(n, int) or n < 1 for n in image_size):
        raise ValueError(f"`image_size` must be (height, width), each >= 1. Received: "
                         f"image_size={image_size!r}")

    def records() -> Iterator[tuple[str, bytes]]:
        for k, (path, label) in enumerate(images):
            features = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(
                            value=[decoded(path)[0]])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}
            yield ("test" if _in_test(k, test_fraction, seed) else "train",
                   tf.train.Example(features=tf.train.Features(
                       feature=features)).SerializeToString())

    meta = {"source": "images", "classes": classes, "num_classes": len(classes),
            "image_size": list(image_size), "channels": channels}
    return write_records(out, records(), meta, shard_mb, progress)


def _in_test(k: int, test_fraction: float, seed: int) -> bool:
    """Whether record k goes to the test split: a seeded, stateless hash of k below
    `test_fraction`."""
    key = np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    with np.errstate(over="ignore"):
        h = (np.uint64(k) * np.uint64(0xBF58476D1CE4E5B9) ^ key) * np.uint64(0x94D049BB133111EB)
    return float(h >> np.uint64(11)) / 2**53 < test_fraction


class Progress:
    """The records written so far, each split's, with their rate: one line redrawn on a
    terminal, the line once at the end elsewhere."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.began = time.time()
        self.counts: dict[str, int] = {}

    def __call__(self, split: str, count: int) -> None:
        self.counts[split] = count
        if self.tty and count % 1000 == 0:
            self._show("\r")

    def _show(self, start: str) -> None:
        total = sum(self.counts.values())
        rate = total / max(time.time() - self.began, 1e-9)
        said = ", ".join(f"{n:,} {split}" for split, n in self.counts.items())
        self.stream.write(f"{start}records written: {said} ({rate:,.0f}/s)")
        self.stream.flush()

    def done(self) -> None:
        if self.counts:
            self._show("\r" if self.tty else "")
            self.stream.write("\n")
            self.counts = {}
