"""Record sets (`tfdist.data.records`): the same global batches as arrays in memory, each
reader reading only its slice, a resume reading nothing before its position, and a set that is
cut short or decodes wrong said in one line naming the file and the record."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.test_resume import Crash, CrashAfter
from tfdist.data import RecordError, RecordSource, convert_arrays, record_batches

BATCH = 64


@pytest.fixture(scope="module")
def digits_records(tmp_path_factory):
    """The digits set as a record set of several shards, and its train split as arrays."""
    out = tmp_path_factory.mktemp("records") / "digits"
    x, y = tfdist.data.load_digits("all")
    convert_arrays(out, x, y, test_fraction=0.2, seed=0, shard_mb=0.05)
    return out, tfdist.data.load_digits("train", 0.2, 0)


def _batches(dataset, n):
    return list(dataset.take(n).as_numpy_iterator())


def test_a_record_set_gives_the_global_batches_of_its_arrays(digits_records, monkeypatch):
    """Converted digits == load_digits' split; its batches == global_batches' over 3 epochs
    (across epoch boundaries), from step 0 and from a later step, with no more than 2 of its
    shards' indexes mapped at once."""
    from tfdist.data import records

    monkeypatch.setattr(records, "OPEN_INDEXES", 2)
    path, (x, y) = digits_records
    source = RecordSource(path)
    assert len(source.files) > 2 and len(source) == len(y)
    per_epoch = len(y) // BATCH
    for start in (0, per_epoch - 1):
        mine = _batches(record_batches(source, BATCH, seed=7, start=start), 3 * per_epoch)
        theirs = _batches(tfdist.data.global_batches(x, y, BATCH, seed=7, start=start),
                          3 * per_epoch)
        for (a, b), (c, d) in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, d)


def test_past_the_stored_order_each_batch_is_computed_alone_to_the_same_batches(
        digits_records, monkeypatch):
    """Of more examples than `STORED_ORDER_MAX` (lowered here to 100) an epoch's order is a
    keyed bijection, computed batch by batch: still every example once an epoch, another order
    each epoch and seed; a record set's slices, and the global batches of its arrays, are that
    order cut into batches, from any start, and a resume reads nothing before its position."""
    from tfdist.data import datasets

    monkeypatch.setattr(datasets, "STORED_ORDER_MAX", 100)
    for n in (101, 1024, 1025, 4099):
        orders = [tfdist.data.epoch_order(n, seed, e).numpy() for seed, e in
                  ((7, 0), (7, 1), (8, 0))]
        for order in orders:
            assert sorted(order.tolist()) == list(range(n))
        assert (orders[0] != orders[1]).mean() > 0.9 and (orders[0] != orders[2]).mean() > 0.9
    path, (x, y) = digits_records
    per_epoch = len(y) // BATCH
    order = np.concatenate([tfdist.data.epoch_order(len(y), 7, e).numpy()[:per_epoch * BATCH]
                            for e in range(3)]).reshape(-1, BATCH)
    for start in (0, per_epoch - 1):
        expected = order[start:start + per_epoch + 2]
        arrays = _batches(tfdist.data.global_batches(x, y, BATCH, seed=7, start=start),
                          len(expected))
        slices = [_batches(record_batches(RecordSource(path), BATCH, seed=7, shard=(i, 2),
                                          start=start), len(expected)) for i in range(2)]
        for step, ids in enumerate(expected):
            np.testing.assert_array_equal(arrays[step][1], y[ids])
            np.testing.assert_array_equal(np.concatenate([s[step][0] for s in slices]), x[ids])
    source = RecordSource(path)
    first = _batches(record_batches(source, BATCH, seed=7, start=10_000), 1)[0]
    ids = tfdist.data.epoch_order(len(y), 7, 10_000 // per_epoch).numpy()
    at = 10_000 % per_epoch * BATCH
    np.testing.assert_array_equal(first[1], y[ids[at:at + BATCH]])
    assert source.records_read < per_epoch * BATCH


@pytest.mark.parametrize("count", [2, 4])
def test_each_reader_reads_only_its_slice_and_the_slices_make_the_global_batch(digits_records,
                                                                               count):
    """N readers: reader i's batches are slice i of each global batch, and over one epoch each
    reads exactly its 1/N of the epoch's records."""
    path, (x, y) = digits_records
    per_epoch = len(y) // BATCH
    whole = _batches(tfdist.data.global_batches(x, y, BATCH, seed=1, repeat=False), per_epoch)
    slices = []
    for i in range(count):
        source = RecordSource(path)
        slices.append(list(record_batches(source, BATCH, seed=1, shard=(i, count),
                                          repeat=False).as_numpy_iterator()))
        assert source.records_read == per_epoch * BATCH // count
    for step, (gx, gy) in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([s[step][0] for s in slices]), gx)
        np.testing.assert_array_equal(np.concatenate([s[step][1] for s in slices]), gy)


def test_a_resume_reads_no_record_before_its_position(digits_records):
    """Starting at global batch 10,000 (455 epochs in) reads what the prefetch asks, no more
    than from batch 10: not the job so far; the first batch is the uninterrupted run's."""
    path, (x, y) = digits_records
    read = {}
    for start in (10, 10_000):
        source = RecordSource(path)
        first = _batches(record_batches(source, BATCH, seed=3, start=start), 1)[0]
        expected = _batches(tfdist.data.global_batches(x, y, BATCH, seed=3, start=start), 1)[0]
        np.testing.assert_array_equal(first[0], expected[0])
        read[start] = source.records_read
    epoch = (len(y) // BATCH) * BATCH
    assert read[10_000] < epoch and read[10] < epoch, read


def test_a_script_holding_a_reading_iterator_at_its_end_exits(digits_records):
    """Scripts whose iterators over a record set (its train and test batches) are still alive,
    reading ahead, when they end, exit. The interpreter's exit used to wait forever for a read
    it could no longer run, in most such runs (4 of 6 here): 3 are run at once."""
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, worker_env

    path, _ = digits_records
    script = ("import tfdist\n"
              f"ahead = iter(tfdist.data.record_batches(tfdist.data.RecordSource({str(path)!r}),"
              " 64, seed=0))\n"
              "batches = [next(ahead) for _ in range(3)]\n"
              "tests = iter(tfdist.data.records.test_batches(tfdist.data.RecordSource("
              f"{str(path)!r}, 'test'), 16))\n"
              "first = next(tests)\n"
              "print(int(batches[0][1].shape[0]), int(first[1].shape[0]))\n")
    scripts = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=worker_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(3)]
    deadline = time.monotonic() + 120
    try:
        for run in scripts:
            out, err = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert run.returncode == 0 and out.split() == ["64", "16"], err[-3000:]
            assert "Traceback" not in err, err[-3000:]
    finally:
        for run in scripts:
            run.kill()


def test_a_truncated_or_missing_file_is_said_naming_it(digits_records, tmp_path):
    path, _ = digits_records
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = sorted(broken.glob("train-*.tfrecord"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(RecordError, match=f"{shard.name}: .* bytes where its index says"):
        RecordSource(broken)
    shard.with_name(shard.name + ".index").unlink()
    with pytest.raises(RecordError, match=f"{shard.name}: no index"):
        RecordSource(broken)
    with pytest.raises(RecordError, match="holds no test records"):
        for f in broken.glob("test-*"):
            f.unlink()
        RecordSource(broken, "test")
    with pytest.raises(RecordError, match="has no records.json: it is not a record set"):
        RecordSource(tmp_path)
    with pytest.raises(RecordError, match="already holds a record set"):
        convert_arrays(path, np.zeros((4, 2)), np.zeros(4))


def test_a_decode_function_that_does_not_fit_stops_before_training(digits_records, tmp_path,
                                                                   monkeypatch):
    """data.decode that fails on a record, or records of one's own without a decode function:
    one line naming the key, the file and the record, before anything trains."""
    from tfdist.tools.config import load_config
    from tfdist.tools.errors import ConfigError
    from tfdist.tools.workload import load_data

    path, _ = digits_records
    (tmp_path / "bad_decode.py").write_text(
        "import tensorflow as tf\n\n\ndef decode(record):\n"
        "    return tf.io.decode_raw(record, tf.float64), 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["data.name=records", f"data.path={path}",
                                "data.decode=bad_decode:decode"])
    with pytest.raises(ConfigError, match=r"data.decode: record 0 of .*train-00000-of-.*"
                                          r"\.tfrecord \(record 0 there\) does not decode"):
        load_data(config)
    with pytest.raises(ConfigError, match="data.path: data.name records reads a record set"):
        load_config(None, ["data.name=records"])
    with pytest.raises(ConfigError, match="data.path: only for data.name records"):
        load_config(None, [f"data.path={path}"])


def test_records_of_ones_own_train_with_ones_decode_function(tmp_path, monkeypatch):
    """TFRecord files of one's own, converted (each record kept as written), train with the
    user's decode function; without one, the run is refused naming data.decode."""
    from tfdist.data import convert_tfrecords
    from tfdist.tools.config import load_config
    from tfdist.tools.errors import ConfigError
    from tfdist.tools.workload import load_data

    x, y = tfdist.data.synthetic_classification(300, (6,), 3, seed=0)
    files = [str(tmp_path / f"part-{i}.tfrecord") for i in range(3)]
    for i, name in enumerate(files):
        with tf.io.TFRecordWriter(name) as writer:
            for k in range(i * 100, (i + 1) * 100):
                writer.write(tf.io.serialize_tensor(
                    tf.concat([x[k], [float(y[k])]], 0)).numpy())
    meta = convert_tfrecords(tmp_path / "mine", files, test_fraction=0.25, seed=0)
    assert meta["splits"]["train"]["records"] + meta["splits"]["test"]["records"] == 300
    assert 45 <= meta["splits"]["test"]["records"] <= 105
    (tmp_path / "my_decode.py").write_text(
        "import tensorflow as tf\n\n\ndef decode(record):\n"
        "    v = tf.ensure_shape(tf.io.parse_tensor(record, tf.float32), [7])\n"
        "    return v[:6], tf.cast(v[6], tf.int32)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="data.decode: the records at .* are your own"):
        load_data(load_config(None, ["data.name=records", f"data.path={tmp_path / 'mine'}"]))
    data = load_data(load_config(None, ["data.name=records", f"data.path={tmp_path / 'mine'}",
                                        "data.decode=my_decode:decode", "data.num_classes=3"]))
    assert data.input_shape == (6,) and data.num_classes == 3
    batch = _batches(data.global_batches(32, seed=0), 1)[0]
    rows = {tuple(np.round(r, 5)) for r in x}
    assert all(tuple(np.round(r, 5)) in rows for r in batch[0])


def test_compressed_or_broken_tfrecord_files_convert_or_are_named_leaving_nothing(tmp_path,
                                                                                  capsys):
    """TFRecord files written uncompressed, GZIP and ZLIB convert to the records of the
    uncompressed files, in their order. A file cut short, one that is no TFRecord, and input
    with no record each stop the conversion with one line naming the file (and the record),
    leaving no directory; shards without a records.json are refused, and so is a set whose
    shards are not the ones its records.json counts."""
    from tfdist.data import convert_tfrecords

    rows = [tf.io.serialize_tensor(tf.fill([3], float(k))).numpy() for k in range(300)]
    files = []
    for i, kind in enumerate(["", "GZIP", "ZLIB"]):
        files.append(str(tmp_path / f"part-{i}.tfrecord"))
        with tf.io.TFRecordWriter(files[-1], tf.io.TFRecordOptions(compression_type=kind)) as w:
            for row in rows[i * 100:(i + 1) * 100]:
                w.write(row)
    plain = str(tmp_path / "plain.tfrecord")
    with tf.io.TFRecordWriter(plain) as w:
        for row in rows:
            w.write(row)
    convert_tfrecords(tmp_path / "mixed", files, test_fraction=0.2, seed=3)
    convert_tfrecords(tmp_path / "plain", [plain], test_fraction=0.2, seed=3)
    for split in ("train", "test"):
        mixed, reference = RecordSource(tmp_path / "mixed", split), RecordSource(
            tmp_path / "plain", split)
        assert len(mixed) == len(reference) > 0
        assert mixed.read(range(len(mixed))) == reference.read(range(len(reference)))

    cut = tmp_path / "cut.tfrecord"
    cut.write_bytes(Path(files[1]).read_bytes()[:-40])  # GZIP, its end cut off
    (tmp_path / "notes.tfrecord").write_text("not records\n")
    (tmp_path / "empty.tfrecord").write_bytes(b"")
    for given, said in (([files[0], str(cut)], rf"{cut}: record \d+ is cut short or corrupt "
                                                r"\(GZIP\)"),
                        ([str(tmp_path / "notes.tfrecord")], "notes.tfrecord: not a TFRecord"),
                        ([str(tmp_path / "empty.tfrecord")], "the input holds no records")):
        with pytest.raises(RecordError, match=said):
            convert_tfrecords(tmp_path / "failed", given)
        assert not (tmp_path / "failed").exists()
    from tfdist.tools.cli import main

    assert main(["data", "convert", "--from", "tfrecord", str(cut), "--out",
                 str(tmp_path / "failed")]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"\ntfdist data convert: {re.escape(str(cut))}: record \d+ is cut short "
                     r"or corrupt \(GZIP\); mend or leave out that file\n$", err), err
    assert "Traceback" not in err

    stopped = tmp_path / "stopped"
    shutil.copytree(tmp_path / "mixed", stopped)
    (stopped / "records.json").unlink()
    with pytest.raises(RecordError, match="holds shards without a records.json"):
        convert_tfrecords(stopped, files)
    grown = tmp_path / "grown"
    shutil.copytree(tmp_path / "mixed", grown)
    for f in grown.glob("train-00000-of-*"):
        shutil.copy(f, grown / f.name.replace("train-00000", "train-00001"))
    with pytest.raises(RecordError, match=r"holds 2 train shard\(s\) of \d+ records where its "
                                          r"records.json says 1 of"):
        RecordSource(grown)


def test_a_conversion_killed_mid_write_leaves_no_set_and_the_next_one_writes_it(tmp_path):
    """`tfdist data convert` killed (SIGKILL) while writing leaves nothing that reads as a
    record set; the same command run again writes the set a conversion never stopped writes."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, worker_env
    from tfdist.data import convert_tfrecords
    from tfdist.tools.cli import main

    files = [str(tmp_path / f"part-{i}.tfrecord.gz") for i in range(4)]
    row = np.arange(2000, dtype=np.float32).tobytes()
    for name in files:
        with tf.io.TFRecordWriter(name, tf.io.TFRecordOptions(compression_type="GZIP")) as w:
            for k in range(1500):
                w.write(row[k % 64:] + k.to_bytes(4, "little"))
    command = [sys.executable, "-m", "tfdist.tools.cli", "data", "convert", "--from", "tfrecord", *files,
               "--out", str(tmp_path / "killed"), "--shard-mb", "2"]
    writing = tmp_path / "killed" / ".writing"
    process = subprocess.Popen(command, cwd=ROOT, env=worker_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (writing.is_dir() and any(writing.iterdir())):
            assert process.poll() is None and time.monotonic() < deadline, "never wrote"
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=120) == -signal.SIGKILL
    finally:
        process.kill()
    with pytest.raises(RecordError, match="has no records.json"):
        RecordSource(tmp_path / "killed")
    assert main(command[3:]) == 0  # the same command again, in this process
    convert_tfrecords(tmp_path / "whole", files, shard_mb=2)
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir())
    for split in ("train", "test"):
        killed, whole = RecordSource(tmp_path / "killed", split), RecordSource(
            tmp_path / "whole", split)
        assert len(killed) == len(whole) > 0
        assert killed.read(range(len(killed))) == whole.read(range(len(whole)))


@pytest.mark.parametrize("fault", ["garbled", "wrong shape"])
def test_a_record_that_does_not_decode_mid_run_is_named(tmp_path, monkeypatch, fault):
    """A record set of one's own with one bad record, first read in step 11: `tfdist train`
    stops with one line naming the record, its file and what is wrong with it; the backups
    made before it are kept."""
    from tfdist.data.records import write_records
    from tfdist.tools.config import load_config
    from tfdist.tools.errors import ConfigError
    from tfdist.tools.runner import train

    x, y = tfdist.data.synthetic_classification(720, (6,), 3, seed=0)
    rows = [tf.io.serialize_tensor(tf.concat([x[k], [float(y[k])]], 0)).numpy()
            for k in range(720)]
    bad = int(tfdist.data.epoch_order(640, seed=0, epoch=0)[10 * 32])  # step 11's first
    rows[bad] = (b"not a tensor" if fault == "garbled"
                 else tf.io.serialize_tensor(tf.zeros([5])).numpy())
    write_records(tmp_path / "mine", {"train": rows[:640], "test": rows[640:]},
                  {"source": "tfrecord"}, shard_mb=0.01)
    (tmp_path / "mid_run_decode.py").write_text(
        "import tensorflow as tf\n\n\ndef decode(record):\n"
        "    v = tf.io.parse_tensor(record, tf.float32)\n"
        "    return v[:-1], tf.cast(v[-1], tf.int32)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, [
        "data.name=records", f"data.path={tmp_path / 'mine'}",
        "data.decode=mid_run_decode:decode",
        "data.num_classes=3", "data.global_batch_size=32", "model.name=mlp",
        "train.checkpoint_steps=4", f"train.output_dir={tmp_path / 'out'}",
        "train.run_name=run", "train.verbose=0", "engine.name=single"])
    file, number = RecordSource(tmp_path / "mine").locate(bad)
    what = "does not decode: InvalidArgumentError" if fault == "garbled" else \
        r"decodes to shapes \[4\] and \[\] where record 0 decodes to \[6\] and \[\]"
    with pytest.raises(ConfigError, match=rf"^data.path: record {bad} of {file} \(record "
                                          rf"{number} there\) {what}"):
        train(config, progress=False)
    assert sorted(p.name for p in (tmp_path / "out" / "backup" / "process-0").iterdir()
                  if not p.name.endswith(".partial")) == ["step-4", "step-8"]


def test_labels_outside_the_models_classes_are_named_first_record_before_training(
        tmp_path, monkeypatch):
    """Records of one's own with 20 classes, trained without data.num_classes (so 10): the
    run stops with one line naming a record whose label is 10 or more, data.num_classes and
    the fix, instead of TensorFlow's error of the loss. Where record 0's label is such, the
    run is refused before anything is made."""
    from tfdist.data.records import write_records
    from tfdist.tools.config import load_config
    from tfdist.tools.errors import ConfigError
    from tfdist.tools.runner import train

    x, _ = tfdist.data.synthetic_classification(400, (6,), 3, seed=0)
    rows = [tf.io.serialize_tensor(tf.concat([x[k], [float((k + 3) % 20)]], 0)).numpy()
            for k in range(400)]
    (tmp_path / "twenty_decode.py").write_text(
        "import tensorflow as tf\n\n\ndef decode(record):\n"
        "    v = tf.io.parse_tensor(record, tf.float32)\n"
        "    return v[:-1], tf.cast(v[-1], tf.int32)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, first in (("later", rows), ("first", [rows[10], *rows[1:]])):  # label 3, or 13
        write_records(tmp_path / name, {"train": first[:320], "test": first[320:]},
                      {"source": "tfrecord"})
        config = load_config(None, [
            "data.name=records", f"data.path={tmp_path / name}",
            "data.decode=twenty_decode:decode", "data.global_batch_size=32", "model.name=mlp",
            f"train.output_dir={tmp_path / name / 'out'}", "train.verbose=0",
            "engine.name=single"])
        said = (r"record \d+ of .* \(record \d+ there\) has label 1\d, outside the model's 10 "
                r"classes \(data.num_classes\)")
        if name == "later":
            said += "; training stopped there.*Set data.num_classes to the number of classes"
        else:
            said = said.replace(r"record \d+ of", "record 0 of") + ": set data.num_classes"
        with pytest.raises(ConfigError, match=f"^data.path: {said}"):
            train(config, progress=False)
    assert not (tmp_path / "first" / "out").exists()  # refused before the run directory


def _train_on_records(strategy, path, directory=None, stop=None):
    """The digits MLP on 2 replicas, 3 epochs of the record set, backed up every 8 steps;
    returns (the model, the records this run read)."""
    from tests.workers import common

    source = RecordSource(path)
    with strategy.scope():
        model = common.make_model(hidden=(32,))
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
                      loss="sparse_categorical_crossentropy")
    callbacks, start = [], 0
    if directory is not None:
        backup = tfdist.callbacks.BackupAndRestore(directory, save_freq=8)
        callbacks, start = [backup], backup.data_start
    if stop is not None:
        callbacks.append(CrashAfter(stop))
    data = tfdist.data.distribute_shards(strategy, lambda p, n: record_batches(
        source, BATCH, seed=3, shard=(p, n), start=start))
    with contextlib.suppress(Crash):
        model.fit(data, epochs=3, steps_per_epoch=STEPS, verbose=0, callbacks=callbacks)
    return model, source.records_read


STEPS = 22  # one epoch of the digits' 1,438 training records in batches of 64


def test_a_run_on_records_resumes_exactly_and_reads_only_what_is_left(mirrored, digits_records,
                                                                      tmp_path):
    """Stopped after step 59 of 66 (last backup at step 56), run again: the weights of a run
    never stopped, and the rerun read the 10 batches left, not the 56 before them. What it
    reads beyond them does not grow with the position: tf.data's read-ahead (about 8 batches
    here) and the batch of the first iterator Keras' fit draws and drops under a strategy."""
    path, _ = digits_records
    straight, _ = _train_on_records(mirrored(2), path)
    _train_on_records(mirrored(2), path, tmp_path / "backup", stop=59)
    resumed, read = _train_on_records(mirrored(2), path, tmp_path / "backup")
    for a, b in zip(straight.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    left = (3 * STEPS - 56) * BATCH
    assert left <= read <= left + 24 * BATCH < 56 * BATCH, read / BATCH


class CopyBackupAfter(keras.callbacks.Callback):
    """Copies the backups in `directory` to `to` after global step `step`: what a run killed
    there would leave behind, while this run goes on."""

    def __init__(self, step, directory, to):
        super().__init__()
        self.step, self.directory, self.to, self.seen = step, directory, to, 0

    def on_train_batch_end(self, batch, logs=None):  # once per `steps_per_execution` steps
        self.seen += self.model.steps_per_execution
        if self.seen == self.step:
            shutil.copytree(self.directory, self.to)


def test_a_resume_at_step_10000_gives_the_weights_of_the_run_never_stopped(digits_records,
                                                                         tmp_path):
    """One device, 10,200 steps (10 epochs of 1,020, 20 steps a call of the train function),
    backed up at step 10,000 (epoch 10, step 820): the backups as a kill at step 10,020 leaves
    them, run again, give the weights of the run never stopped bit for bit, reading the 200
    batches left and tf.data's read-ahead, not the 10,000 before them."""
    from tests.workers import common

    path, _ = digits_records

    def run(directory, copy_to=None):
        source = RecordSource(path)
        model = common.make_model(hidden=(32,))
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy", steps_per_execution=20)
        backup = tfdist.callbacks.BackupAndRestore(directory, save_freq=10_000)
        callbacks = [backup] + ([CopyBackupAfter(10_020, directory, copy_to)] if copy_to else [])
        data = record_batches(source, BATCH, seed=3, start=backup.data_start)
        model.fit(data, epochs=10, steps_per_epoch=1_020, verbose=0, callbacks=callbacks)
        return model.get_weights(), source.records_read

    straight, _ = run(tmp_path / "straight", copy_to=tmp_path / "killed")
    resumed, read = run(tmp_path / "killed")
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(b, a)
    assert 200 * BATCH <= read <= 224 * BATCH, read / BATCH


def _own_pipeline(folder, parsed, stateless=True):
    """A pipeline of one's own over `folder`'s TFRecord files (interleave, map, shuffle,
    batch, prefetch) that counts the records it parses in `parsed`."""
    def count(v):
        parsed[0] += 1
        return v

    def parse(record):
        v = tf.ensure_shape(tf.io.parse_tensor(record, tf.float32), [9])
        v = tf.ensure_shape(tf.py_function(count, [v], tf.float32), [9])
        return tf.ensure_shape(v[:8], [8]), tf.cast(v[8], tf.int32)

    files = tf.data.Dataset.list_files(f"{folder}/part-*.tfrecord", shuffle=False)
    batches = (files.interleave(tf.data.TFRecordDataset, cycle_length=4).map(parse)
               .shuffle(256, seed=1).batch(BATCH, drop_remainder=True).repeat().prefetch(2))
    if not stateless:
        return batches
    options = tf.data.Options()  # `count` keeps no position: the state may be saved
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return batches.with_options(options)


@pytest.fixture(scope="module")
def own_records(tmp_path_factory):
    """16 TFRecord files of 128 serialized rows (8 features and a label of 4 classes)."""
    folder = tmp_path_factory.mktemp("own")
    x, y = tfdist.data.synthetic_classification(2048, (8,), 4, seed=0)
    rows = np.concatenate([x, y[:, None].astype(np.float32)], 1)
    for i in range(16):
        with tf.io.TFRecordWriter(str(folder / f"part-{i:02d}.tfrecord")) as writer:
            for row in rows[i * 128:(i + 1) * 128]:
                writer.write(tf.io.serialize_tensor(row).numpy())
    return folder


def _train_own(strategy, folder, directory=None, stop=None, stateless=True):
    """3 epochs of 32 steps on one's own pipeline through `tfdist.data.resume`, backed up
    every 8 steps; returns (the model, the records parsed)."""
    from tests.workers import common

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = common.build_model("mlp", (8,), 4, (32,))
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
                      loss="sparse_categorical_crossentropy")
    callbacks, start, parsed = [], 0, [0]
    if directory is not None:
        backup = tfdist.callbacks.BackupAndRestore(directory, save_freq=8)
        callbacks, start = [backup], backup.data_start
    if stop is not None:
        callbacks.append(CrashAfter(stop))
    data = tfdist.data.distribute_batches(strategy, lambda: tfdist.data.resume(
        _own_pipeline(folder, parsed, stateless), start))
    with contextlib.suppress(Crash):
        model.fit(data, epochs=3, steps_per_epoch=32, verbose=0, callbacks=callbacks)
    return model, parsed[0]


def test_your_own_pipeline_resumes_from_its_saved_position(mirrored, own_records, tmp_path,
                                                           capfd):
    """Stopped after step 75 of 96 (last backup at step 72) and run again with
    `tfdist.data.resume(dataset, backup.data_start)`: the weights of a run never stopped, the
    rerun parsing what is left (24 batches), its read-ahead and one shuffle buffer (the first
    iterator fit draws one batch from, then drops), not the 72 batches before. A pipeline
    whose state cannot be saved (a `py_function` under TensorFlow's default policy) still
    resumes exactly, by reading those batches again, and says so in one line."""
    straight, _ = _train_own(mirrored(2), own_records)
    _train_own(mirrored(2), own_records, tmp_path / "kept", stop=75)
    resumed, parsed = _train_own(mirrored(2), own_records, tmp_path / "kept")
    for a, b in zip(straight.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    left = (96 - 72) * BATCH
    assert left <= parsed <= 1.1 * left + 256 + 12 * BATCH < 72 * BATCH, parsed / BATCH
    assert "cannot be kept" not in capfd.readouterr().err

    _train_own(mirrored(2), own_records, tmp_path / "skipped", stop=75, stateless=False)
    said = capfd.readouterr().err
    assert said.count("[tfdist] data: the position of your dataset cannot be kept") == 1, said
    resumed, parsed = _train_own(mirrored(2), own_records, tmp_path / "skipped",
                                 stateless=False)
    assert "reading and dropping its first 72 batches" in capfd.readouterr().err
    for a, b in zip(straight.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    assert parsed >= 96 * BATCH


@pytest.mark.multiprocess
def test_workers_given_different_record_sets_stop_before_the_model_is_built(digits_records,
                                                                           tmp_path):
    """Hosts that share nothing each hold a copy of the record set (data.path may differ from
    host to host): a copy converted otherwise (another test fraction) stops both TF_CONFIG
    workers before the model is built, naming the sizes on each; before, each worker read its
    slices of its own set."""
    import subprocess
    import sys

    from tests.conftest import ROOT, worker_env
    from tfdist.tools.launch import held_ports, release_ports, tf_config

    path, _ = digits_records
    other = tmp_path / "other"
    convert_arrays(other, *tfdist.data.load_digits("all"), test_fraction=0.25, seed=0)
    sizes = [len(RecordSource(p, "train")) for p in (path, other)]
    assert sizes[0] != sizes[1]
    ports = held_ports(2)
    try:
        workers = [subprocess.Popen(
            [sys.executable, "-m", "tfdist.tools.cli", "train", "--set",
             "engine.name=multi_worker", "--set", "engine.devices=1", "--set", "data.name=records",
             "--set", f"data.path={p}", "--set", f"train.output_dir={tmp_path / str(i)}"],
            cwd=ROOT, env={**worker_env(), "TF_CONFIG": tf_config(i, ports)}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i, p in enumerate((path, other))]
        done = [p.communicate(timeout=120) for p in workers]
    finally:
        release_ports()
    said = (f"the training set is {sizes[0]} examples on worker 0, {sizes[1]} examples on "
            "worker 1")
    for p, (out, err) in zip(workers, done, strict=True):
        assert p.returncode == 2, err[-3000:]
        assert "tfdist train: the workers differ: " in err and said in err, err[-3000:]
        assert "the record set at data.path is records.json 0x" in err
        assert "Traceback" not in err and "Epoch 1/" not in out
    assert not (tmp_path / "0").exists() and not (tmp_path / "1").exists()


@pytest.mark.multiprocess
def test_workers_on_a_record_set_read_their_share_and_train_the_one_device_job(digits_records,
                                                                              tmp_path):
    """`tfdist train` on the digits record set, 10 epochs: one device, 2 and 4 TF_CONFIG workers
    (and 2 Horovod ranks where Horovod is built) end with the same weights as one device on the
    digits arrays, and each of N workers read its 1/N of the records the job trained on, plus
    a read-ahead that does not grow with the job (at most 20 of its slices): 55% at most at
    2 workers."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, horovod_available, worker_env
    from tfdist.tools.launch import run_horovod, run_tf_workers

    path, _ = digits_records

    def job(run, engine, *data):
        return [sys.executable, "-m", "tfdist.tools.cli", "train", "--set",
                f"engine.name={engine}", "--set", "train.epochs=10", "--set", "model.name=mlp",
                "--set", f"train.output_dir={tmp_path}", "--set", f"train.run_name={run}",
                "--set", "train.verbose=0", *data]

    records = ["--set", "data.name=records", "--set", f"data.path={path}"]
    for run, engine, data in (("arrays", "single", []), ("records", "single", records)):
        out = subprocess.run(job(run, engine, *data), capture_output=True, text=True, cwd=ROOT,
                             env=worker_env(), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    runs, sizes = ["records"], {"records": 1}
    for n in (2, 4):
        workers = run_tf_workers(job(f"multi_worker_{n}", "multi_worker", *records), n, 300,
                                 env=worker_env())
        assert [r.returncode for r in workers] == [0] * n, workers[0].output[-3000:]
        runs.append(f"multi_worker_{n}")
        sizes[runs[-1]] = n
    if horovod_available():
        result = run_horovod(job("horovod", "horovod", *records), 2, 300, env=worker_env())
        assert result.returncode == 0, result.output[-3000:]
        runs.append("horovod")
        sizes["horovod"] = 2
    summary = {run: json.loads((tmp_path / run / "summary.json").read_text())
               for run in ["arrays", *runs]}
    trained = 10 * STEPS * BATCH
    assert summary["records"]["records_read"] >= trained
    for run in runs[1:]:
        read, n = summary[run]["records_read"], sizes[run]
        assert summary[run]["world_size"] == n
        assert trained / n <= read <= (trained + 20 * BATCH) / n, (run, read)
    assert summary["multi_worker_2"]["records_read"] <= 0.55 * trained
    weights = {run: keras.saving.load_model(tmp_path / run / "model.keras").get_weights()
               for run in ["arrays", *runs]}
    for run in runs:
        for a, b in zip(weights["arrays"], weights[run], strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=run)


PIPELINE = '''
import atexit
import json
import os
import signal

import numpy as np
import tensorflow as tf

PARSED = [0]  # records this process parsed
FOLDER = os.environ["RECORDS_FOLDER"]
atexit.register(lambda: open(f"{FOLDER}/parsed-{os.getpid()}", "w").write(str(PARSED[0])))
# A termination notice to worker 1 once it has parsed this many records (a test's fault).
NOTICE = int(os.environ.get("NOTICE_AFTER", 0))
WORKER = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)


def _count(x):
    PARSED[0] += 1
    if PARSED[0] == NOTICE and WORKER == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return x


def _parse(record):
    v = tf.ensure_shape(tf.io.parse_tensor(record, tf.float32), [9])
    v = tf.ensure_shape(tf.py_function(_count, [v], tf.float32), [9])
    return tf.ensure_shape(v[:8], [8]), tf.cast(v[8], tf.int32)


def sharded(seed, shard=(0, 1)):
    """16 TFRecord files, interleaved, parsed: input pipeline i of n reads files i, i+n, ..."""
    index, count = shard
    files = tf.data.Dataset.list_files(f"{FOLDER}/part-*.tfrecord", shuffle=False)
    train = (files.shard(count, index)
             .interleave(tf.data.TFRecordDataset, cycle_length=4)
             .map(_parse)
             .shuffle(256, seed=seed))
    options = tf.data.Options()  # _count holds no position: the pipeline's state can be saved
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    test = tf.data.TFRecordDataset(f"{FOLDER}/test.tfrecord").map(_parse)
    return train.with_options(options), test


def whole(seed):
    return sharded(seed)
'''


@pytest.mark.multiprocess
def test_your_own_pipeline_read_by_file_on_each_worker(tmp_path):
    """A TFRecord pipeline of one's own (16 files, interleave, map, shuffle) on 2 TF_CONFIG
    workers: given a `shard` parameter, each worker parses half the records the job trains on
    plus a read-ahead that does not grow with the job (at most 96 batches of 32; over 10 epochs,
    at most 65% of the records); without one, each parses them all, and the run says so in one
    line. Stopped by a termination notice in epoch 9 and run again, the job ends with the
    weights of the run never stopped, and the rerun parses what was left to train (its half),
    not the 8 epochs before: the pipeline's position is in the backup."""
    import sys

    from tests.conftest import ROOT, worker_env
    from tfdist.tools.launch import run_tf_workers

    x, y = tfdist.data.synthetic_classification(2048 + 256, (8,), 4, seed=0)
    rows = np.concatenate([x, y[:, None].astype(np.float32)], 1)
    for i in range(16):
        with tf.io.TFRecordWriter(str(tmp_path / f"part-{i:02d}.tfrecord")) as writer:
            for row in rows[i * 128:(i + 1) * 128]:
                writer.write(tf.io.serialize_tensor(row).numpy())
    with tf.io.TFRecordWriter(str(tmp_path / "test.tfrecord")) as writer:
        for row in rows[2048:]:
            writer.write(tf.io.serialize_tensor(row).numpy())
    (tmp_path / "my_pipeline.py").write_text(PIPELINE)
    env = {**worker_env(), "RECORDS_FOLDER": str(tmp_path),
           "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    def job(function, epochs, output, *extra):
        for old in tmp_path.glob("parsed-*"):
            old.unlink()
        return run_tf_workers(
            [sys.executable, "-m", "tfdist.tools.cli", "train", "--set",
             "engine.name=multi_worker", "--set", f"data.name=my_pipeline:{function}",
             "--set", "data.num_classes=4", "--set", "model.name=mlp", "--set",
             f"train.epochs={epochs}", "--set", "train.steps_per_epoch=32", "--set",
             f"train.output_dir={tmp_path / output}", "--set", "train.verbose=0",
             "--set", "train.run_name=run", *extra], 2, 300, env=env)

    def parsed_by_each():  # but the test set (256 records, each worker evaluates it)
        return [int(f.read_text()) - 256 for f in tmp_path.glob("parsed-*")]

    for function, epochs in (("sharded", 10), ("whole", 2)):
        workers = job(function, epochs, function)
        assert [r.returncode for r in workers] == [0, 0], workers[0].output[-3000:]
        parsed = parsed_by_each()
        trained = epochs * 32 * 64  # the 2,048 training records in batches of 64
        warned = "reads the whole dataset and keeps 1/2 of each batch" in workers[0].output
        assert len(parsed) == 2 and warned == (function == "whole")
        if function == "sharded":
            # Its half, and tf.data's and Keras' read-ahead, which does not grow with the job
            # (the iterator fit draws one batch from and drops, the prefetch at its end; up to
            # 37 of its batches measured on a busy machine).
            assert all(trained / 2 <= p <= trained / 2 + 96 * 32 for p in parsed), parsed
        else:
            assert all(p >= trained for p in parsed), parsed

    # Backed up every 64 steps; worker 1 gets a notice in epoch 9 (its 8.5 epochs' records).
    backups = ("--set", "train.checkpoint_steps=64")
    env["NOTICE_AFTER"] = str(int(8.5 * 32 * 32) + 256)
    noticed = job("sharded", 10, "resumed", *backups)
    assert [r.returncode for r in noticed] == [76, 76], noticed[1].output[-3000:]
    stopped_at = int(re.search(r"backed up step (\d+)", noticed[0].output + noticed[1].output)[1])
    env["NOTICE_AFTER"] = "0"
    again = job("sharded", 10, "resumed", *backups)
    assert [r.returncode for r in again] == [0, 0], again[0].output[-3000:]
    left = (10 * 32 - stopped_at) * 32  # records each worker has left to train
    parsed = parsed_by_each()
    # What is left, tf.data's and Keras' read-ahead (the first iterator fit draws a batch from
    # and drops fills one shuffle buffer too), not the 8 epochs before: 1.1x + a constant.
    assert all(left <= p <= 1.1 * left + 256 + 24 * 32 for p in parsed), (parsed, left)
    straight = keras.saving.load_model(tmp_path / "sharded" / "run" / "model.keras")
    resumed = keras.saving.load_model(tmp_path / "resumed" / "run" / "model.keras")
    for a, b in zip(straight.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_a_folder_of_images_converts_and_trains(tmp_path, capsys):
    """`tfdist data convert --from images`: a folder with a subfolder per class, images of
    several sizes and formats, becomes a record set that decodes by itself to the size asked
    for, every image in it once with its class's label; `tfdist train` trains on it. A file that
    is not an image, a folder without class subfolders and a bad size are each refused in one
    line naming it."""
    from tfdist.tools.cli import main
    from tfdist.tools.config import load_config
    from tfdist.tools.runner import train
    from tfdist.tools.workload import load_data

    images = tmp_path / "images"
    expected = {}  # (class, index) -> label
    for label, name in enumerate(["cat", "dog", "owl"]):
        (images / name).mkdir(parents=True)
        for k in range(12):
            size = (10 + k % 3, 14 + k % 2)
            pixels = np.full([*size, 3], 40 * label + 3 * k, np.uint8)  # one value: its tag
            encoded = tf.io.encode_png(pixels) if k % 2 else tf.io.encode_jpeg(pixels, quality=100)
            (images / name / f"{k:02d}.{'png' if k % 2 else 'jpg'}").write_bytes(encoded.numpy())
            expected[40 * label + 3 * k] = label
    (images / "cat" / "notes.txt").write_text("not an image: skipped by its suffix")
    out = tmp_path / "records"
    assert main(["data", "convert", "--from", "images", str(images), "--out", str(out),
                 "--image-size", "8,8"]) == 0
    assert "train on it       tfdist train --set data.name=records --set data.path=" \
        f"{out}\n" in capsys.readouterr().out
    data = load_data(load_config(None, ["data.name=records", f"data.path={out}"]))
    assert data.input_shape == (8, 8, 3) and data.num_classes == 3
    seen = []
    for source in (data.train, data.test):
        for record in source.read(range(len(source))):
            x, y = data.decode(tf.constant(record))
            tag = int(round(float(x[4, 4, 0]) * 255))
            assert expected[min(expected, key=lambda t: abs(t - tag))] == int(y)
            seen.append(min(expected, key=lambda t: abs(t - tag)))
    assert sorted(seen) == sorted(expected)  # every image once
    summary = train(load_config(None, [
        "data.name=records", f"data.path={out}", "model.name=mlp", "data.global_batch_size=8",
        "train.epochs=2", f"train.output_dir={tmp_path / 'run'}", "train.verbose=0",
        "engine.name=single"]), progress=False)
    assert summary["test_examples"] == len(data.test) and 0 <= summary["test_accuracy"] <= 1

    (images / "dog" / "broken.png").write_bytes(b"not a png")
    assert main(["data", "convert", "--from", "images", str(images), "--out",
                 str(tmp_path / "b")]) == 2
    assert f"{images / 'dog' / 'broken.png'}: not an image TensorFlow decodes" in \
        capsys.readouterr().err
    for args, said in (([str(tmp_path / "records")], "no images in subfolders"),
                       ([str(images), "--image-size", "8"], "--image-size '8': give height,width")):
        assert main(["data", "convert", "--from", "images", *args, "--out",
                     str(tmp_path / "c")]) == 2
        assert said in capsys.readouterr().err


MEMORY_CGROUP = "/sys/fs/cgroup/memory"


SHARED_MEMORY = "/dev/shm"


@pytest.mark.skipif(not os.access(MEMORY_CGROUP, os.W_OK),
                    reason="needs the cgroup v1 memory controller (a cap on a process tree)")
@pytest.mark.skipif(not os.path.isdir(SHARED_MEMORY) or
                    shutil.disk_usage(SHARED_MEMORY).free < 4 * 2**30,
                    reason="needs 4 GiB free in /dev/shm for the 3.2 GB of records")
def test_a_record_set_three_times_the_memory_cap_trains_to_the_same_losses(tmp_path):
    """3.2 GB of records (264,000 x 3,072 float32, 4,000 examples written over and over), one
    epoch of an MLP, its process tree in a cgroup capped at 1 GiB of memory (TensorFlow alone
    takes about 700 MB): the run ends as the uncapped run does, the same test and training loss
    bit for bit; nothing holds the training set in memory. The records sit in /dev/shm, outside
    the cap as a host's page cache is, and off the disk (removing 3.2 GB there stalled the test
    over 20 s in a suite run)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from tests.conftest import ROOT, worker_env
    from tfdist.data.records import _example, write_records

    def examples(count, seed, distinct=4000):  # serialized once, written over and over
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((min(count, distinct), 3072), dtype=np.float32)
        y = (x[:, 0] > 0).astype(np.int32)
        records = [_example(x[i], y[i]) for i in range(len(x))]
        return (records[i % len(records)] for i in range(count))

    folder = tempfile.mkdtemp(prefix="tfdist-test-", dir=SHARED_MEMORY)
    cgroup = f"{MEMORY_CGROUP}/tfdist-test-{os.getpid()}"
    os.makedirs(cgroup)
    try:
        records = Path(folder) / "big"
        write_records(records, {"train": examples(264_000, 1), "test": examples(2000, 2)},
                      {"source": "arrays", "x": {"dtype": "float32", "shape": [3072]},
                       "y": {"dtype": "int32", "shape": []}, "num_classes": 2})
        assert sum(f.stat().st_size for f in records.glob("train-*")) > 3 * 2**30
        with open(f"{cgroup}/memory.limit_in_bytes", "w") as f:
            f.write(str(2**30))
        runs = {}
        for name, prefix in (("free", []), ("capped", [
                "sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"])):
            done = subprocess.run(
                [*prefix, sys.executable, "-m", "tfdist.tools.cli", "train", "--set",
                 "data.name=records", "--set", f"data.path={records}", "--set",
                 "model.name=mlp", "--set", "data.global_batch_size=1024", "--set",
                 "train.epochs=1", "--set", "engine.name=single", "--set",
                 f"train.output_dir={tmp_path / name}", "--set", "train.run_name=run", "--set",
                 "train.verbose=0", "--set", "train.save_model=false"],
                cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (name, done.stderr[-3000:])
            runs[name] = json.loads((tmp_path / name / "run" / "summary.json").read_text())
        with open(f"{cgroup}/memory.max_usage_in_bytes") as f:
            assert int(f.read()) <= 2**30  # the cap held
    finally:
        os.rmdir(cgroup)
        shutil.rmtree(folder)  # 3.2 GB of memory
    for key in ("test_loss", "final_train_loss"):
        assert runs["capped"][key] == runs["free"][key], key
