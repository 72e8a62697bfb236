"""Suite "input": what reading the data costs, on a record set against the alternatives.

    tfdist bench --suite input [--quick] [--out DIR]

Six measurements, on the digits set converted to a record set in OUT/records (and, for the
comparisons, the same records read as a plain TFRecord pipeline, or as arrays in memory):

* reads: `tfdist train` on the record set as 1, 2 and 4 TF_CONFIG workers (processes on
  127.0.0.1): the records worker 0 read, against the records the whole job trained on;
* resume: the time to the first batch and the records read, for a run resumed at global batch
  0, 1,000 and 10,000: the record set (reads from the position) against a TFRecord pipeline
  whose state is not in the backup (a `py_function` in it), which `tfdist.data.resume` can
  only skip to the position, reading and dropping what came before;
* step: the median training step of one device on arrays in memory, on the record set, and on
  the record set with a decode costing about 0.5 ms of CPU per record (an image's decode and
  augmentation): where the input, not the model, bounds the step;
* service: 2 TF_CONFIG workers on the record set, reading it themselves and through the tf.data
  service with 2 data workers (processes here): the training records decoded by the trainers
  and by the data workers (each decode leaves a trace file where it ran, `traced`), and the
  median step;
* format: random batches of 64 records read from a record set (TFRecord files with an index of
  byte offsets) against the same records in ArrayRecord (Grain's format; measured where the
  `array-record` package is installed): records per second and the files' size;
* order: what one of 8 readers spends on an epoch's order of 1, 50 and 200 million examples,
  stored whole (a shuffle) against each batch's indices computed alone (tfdist's way past
  `tfdist.data.datasets.STORED_ORDER_MAX` examples): time and peak memory.

On hosts that share this machine's 2 cores the reads and the resume are what to look at; a
decode's cost per step depends on the cores a host has.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tfdist.tools.bench.machine import stamp

BATCH = 64
EPOCHS = 10
HEAVY_MATMULS = 40  # 64x64 matmuls in the heavy decode, per record


def _records(out: Path) -> Path:
    """OUT/records: the digits set as a record set (made once)."""
    import tfdist

    path = out / "records"
    if not (path / "records.json").exists():
        tfdist.data.convert_arrays(path, *tfdist.data.load_digits("all"), shard_mb=0.05)
    return path


def read_rows(path: Path, workers: tuple[int, ...], epochs: int, progress) -> list[dict]:
    """`tfdist train` on the record set at each number of TF_CONFIG workers: worker 0's reads."""
    from tfdist.tools.launch import run_tf_workers

    rows = []
    with tempfile.TemporaryDirectory(prefix="tfdist-input-") as scratch:
        for n in workers:
            progress(f"bench: input: {n} TF_CONFIG worker(s), {epochs} epochs on the record set")
            argv = [sys.executable, "-m", "tfdist.tools.cli", "train", "--set",
                    "engine.name=multi_worker", "--set", "data.name=records", "--set",
                    f"data.path={path}", "--set", "model.name=mlp", "--set",
                    f"train.epochs={epochs}", "--set", f"train.output_dir={scratch}/{n}",
                    "--set", "train.verbose=0", "--set", "train.save_model=false"]
            results = run_tf_workers(argv, n, 600)
            if any(r.returncode != 0 for r in results):
                raise RuntimeError(f"the {n}-worker run failed: {results[0].output[-2000:]}")
            (summary,) = Path(scratch, str(n)).glob("*/summary.json")
            s = json.loads(summary.read_text())
            trained = s["steps"] * BATCH
            rows.append({"kind": "reads", "workers": n, "trained": trained,
                         "read": s["records_read"], "share": s["records_read"] / trained})
    return rows


class _Counter:
    """Counts what passes through it (a py_function of a stream)."""

    def __init__(self):
        self.count = 0

    def __call__(self, value):
        self.count += 1
        return value


def _first_batch(dataset) -> float:
    began = time.perf_counter()
    next(iter(dataset))
    return time.perf_counter() - began


def resume_rows(path: Path, starts: tuple[int, ...], progress) -> list[dict]:
    """Time to the first batch and records read, resumed at each global batch of `starts`:
    the record set against the same records as a TFRecord stream."""
    import tensorflow as tf

    import tfdist
    from tfdist.data.records import decode_example

    rows = []
    for start in starts:
        progress(f"bench: input: resuming at global batch {start:,}")
        source = tfdist.data.RecordSource(path)
        records_s = _first_batch(tfdist.data.record_batches(source, BATCH, seed=0,
                                                            start=start))
        decode, parsed = decode_example(source.meta), _Counter()
        stream = tf.data.TFRecordDataset([str(f) for f in source.files]).map(
            lambda r, count=parsed: tf.ensure_shape(tf.py_function(count, [r], tf.string), [])
        ).map(decode)
        resumed = tfdist.data.resume(stream.batch(BATCH, drop_remainder=True).repeat(), start)
        stream_s = _first_batch(resumed)
        rows.append({"kind": "resume", "start": start, "records_s": records_s,
                     "records_read": source.records_read, "stream_s": stream_s,
                     "stream_read": parsed.count})
    return rows


def heavy(decode):
    """`decode` plus about HEAVY_MATMULS small matmuls of CPU work per record."""
    import tensorflow as tf

    def decode_heavily(record):
        x, y = decode(record)
        m = tf.fill([64, 64], tf.reduce_mean(x) * 1e-3)
        for _ in range(HEAVY_MATMULS):
            m = tf.linalg.matmul(m, m) * 1e-3
        return x + tf.reduce_sum(m) * 0.0, y

    return decode_heavily


def step_rows(path: Path, steps: int, progress) -> list[dict]:
    """The median step of one device (the digits MLP) on arrays, the record set, and the record
    set with a heavy decode; and that decode's own cost per record."""
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist.data.records import decode_example
    from tfdist.tools.models import build_model

    source = tfdist.data.RecordSource(path)
    decode = decode_example(source.meta)
    x, y = tfdist.data.load_digits("train", 0.2, 0)
    inputs = {"arrays in memory": lambda: tfdist.data.global_batches(x, y, BATCH, seed=0),
              "record set": lambda: tfdist.data.record_batches(source, BATCH, seed=0),
              "record set, heavy decode": lambda: tfdist.data.record_batches(
                  source, BATCH, seed=0, decode=heavy(decode))}
    one = tf.constant(source.read([0])[0])
    slow = tf.function(heavy(decode))
    slow(one)
    began = time.perf_counter()
    for _ in range(200):
        slow(one)
    decode_ms = (time.perf_counter() - began) / 200 * 1e3
    rows = []
    for name, make in inputs.items():
        progress(f"bench: input: {steps} steps on {name}")
        timer = tfdist.callbacks.StepTimer()
        keras.utils.set_random_seed(0)
        model = build_model("mlp", (8, 8, 1), 10, (64,))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(make(), epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        rows.append({"kind": "step", "input": name,
                     "step_ms": 1e3 * statistics.median(timer.times[1:]),
                     "decode_ms_per_record": decode_ms if "heavy" in name else None})
    return rows


def format_rows(out: Path, count: int, size: int, progress) -> list[dict]:
    """Random access to `count` records of `size` random bytes: a record set against the same
    records in ArrayRecord (one record per chunk, no read-ahead: its random-access setting),
    read in 1,000 batches of 64 random indices (the best of 3 passes, the files cached)."""
    import numpy as np

    import tfdist
    from tfdist.data.records import write_records

    progress(f"bench: input: {count:,} records of {size:,} bytes, read at random")
    rng = np.random.default_rng(0)
    records = [rng.bytes(size) for _ in range(count)]
    batches = [rng.integers(0, count, 64) for _ in range(1_000)]
    folder = Path(tempfile.mkdtemp(prefix="formats-", dir=out))
    began = time.perf_counter()
    write_records(folder / "records", {"train": records}, {})
    written = time.perf_counter() - began
    source = tfdist.data.RecordSource(folder / "records")
    readers = {"record set (TFRecord with an index)": (
        source.read, written, sum(f.stat().st_size for f in (folder / "records").iterdir()))}
    try:
        from array_record.python import array_record_module
    except ImportError:
        progress("bench: input: array-record is not installed (pip install array-record): "
                 "the record set alone")
    else:
        path = folder / "records.array_record"
        began = time.perf_counter()
        writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
        for record in records:
            writer.write(record)
        writer.close()
        reader = array_record_module.ArrayRecordReader(str(path), "readahead_buffer_size:0")
        readers["ArrayRecord"] = (lambda ids: reader.read(ids.tolist()),
                                  time.perf_counter() - began, path.stat().st_size)
    rows = []
    for name, (read, written, size_bytes) in readers.items():
        if read(batches[0])[3] != records[batches[0][3]]:
            raise RuntimeError(f"{name} read back another record than was written")
        passes = []
        for _ in range(3):
            began = time.perf_counter()
            for ids in batches:
                read(ids)
            passes.append(time.perf_counter() - began)
        rows.append({"kind": "format", "format": name, "record_bytes": size,
                     "records": count, "per_s": 64 * len(batches) / min(passes),
                     "write_s": written, "mb": size_bytes / 1e6})
    shutil.rmtree(folder)
    return rows


DIGITS = {"x": {"dtype": "float32", "shape": [8, 8, 1]}, "y": {"dtype": "int32", "shape": []}}


def fingerprint(record):
    """A record's fingerprint (a string tensor), as `traced` names its traces."""
    import tensorflow as tf

    return tf.strings.as_string(tf.strings.to_hash_bucket_fast(record, 2**62))


def traced(decode, directory: str):
    """`decode` that also leaves an empty file DIRECTORY/<fingerprint>-<random> for each record
    it decodes, in the process that decodes it (TensorFlow ops only: it runs on the tf.data
    service's data workers too); a relative DIRECTORY is the process's working directory's."""
    import tensorflow as tf

    def decode_traced(record):
        name = tf.strings.join([directory, "/", fingerprint(record), "-", tf.strings.as_string(
            tf.random.uniform([], 0, 2**62, tf.int64))])
        with tf.control_dependencies([tf.io.write_file(name, "")]):
            return tuple(tf.identity(t) for t in decode(record))

    return decode_traced


def traced_digits(record):
    """data.decode of the suite's service rows: the digits record, traced in ./decoded."""
    from tfdist.data.records import decode_example

    return traced(decode_example(DIGITS), "decoded")(record)


def _trained_traces(folder: Path, train: set[str]) -> int:
    """Traces in FOLDER/decoded of training records (not the test split's)."""
    return sum(1 for f in (folder / "decoded").iterdir() if f.name.split("-")[0] in train)


def service_rows(path: Path, epochs: int, progress) -> list[dict]:
    """2 TF_CONFIG workers on the record set, reading it themselves, then through a tf.data
    service of a dispatcher and 2 data workers started here (their own working directory, so
    their traces are apart): the training records each side decoded, and the median step."""
    import shlex
    import subprocess

    import tensorflow as tf

    import tfdist
    from tfdist.tools.launch import free_ports, run_tf_workers

    def fingerprints(split):
        source = tfdist.data.RecordSource(path, split)
        return set(fingerprint(tf.constant(source.read(range(len(source))))).numpy().astype(str))

    train = fingerprints("train") - fingerprints("test")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tfdist-service-") as scratch:
        for service in (False, True):
            trainers, data = Path(scratch, f"trainers-{service}"), Path(scratch, "data")
            for side in (trainers, data):
                (side / "decoded").mkdir(parents=True, exist_ok=True)
            servers, extra = [], []
            if service:
                port, *ports = free_ports(3)
                serve = [sys.executable, "-m", "tfdist.tools.cli", "data", "serve"]
                servers = [subprocess.Popen([*serve, "dispatcher", "--port", str(port)],
                                            cwd=data, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)]
                servers += [subprocess.Popen([*serve, "worker", "--port", str(p), "--dispatcher",
                                              f"127.0.0.1:{port}", "--address", "127.0.0.1"],
                                             cwd=data, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL) for p in ports]
                extra = ["--set", f"data.service=127.0.0.1:{port}"]
            name = "through the tf.data service" if service else "reading locally"
            progress(f"bench: input: 2 TF_CONFIG workers, {epochs} epochs, {name}")
            argv = [sys.executable, "-m", "tfdist.tools.cli", "train", "--set",
                    "engine.name=multi_worker", "--set", "data.name=records", "--set",
                    f"data.path={path}", "--set",
                    "data.decode=tfdist.tools.bench.input:traced_digits", "--set",
                    "model.name=mlp", "--set", f"train.epochs={epochs}", "--set",
                    f"train.output_dir={trainers}/out", "--set", "train.verbose=0", "--set",
                    "train.save_model=false", *extra]
            try:
                results = run_tf_workers(["sh", "-c", f"cd {shlex.quote(str(trainers))} && "
                                          f"exec {shlex.join(argv)}"], 2, 600)
            finally:
                for server in servers:
                    server.kill()
                    server.wait()
            if any(r.returncode != 0 for r in results):
                raise RuntimeError(f"the run {name} failed: {results[0].output[-2000:]}")
            (summary,) = trainers.glob("out/*/summary.json")
            s = json.loads(summary.read_text())
            rows.append({"kind": "service", "input": name, "trained": s["steps"] * BATCH,
                         "trainers_decoded": _trained_traces(trainers, train),
                         "data_decoded": _trained_traces(data, train) if service else 0,
                         "step_ms": s["step_ms_median"],
                         "test_accuracy": s["test_accuracy"]})
    return rows


# One reader's epoch order, in a process of its own (its peak memory is the process'):
# `stored` holds the whole epoch's shuffle, as tfdist does up to STORED_ORDER_MAX examples.
_ORDER = """
import json, sys, time
import tensorflow as tf
from tfdist.data import datasets
n, way, batch, readers = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
datasets.STORED_ORDER_MAX = n if way == "stored" else 0
def kb(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))
with open("/proc/self/clear_refs", "w") as peak:
    peak.write("5")  # the peak resident memory starts again from here
before = kb("VmRSS:")
began = time.perf_counter()
slices = iter(datasets.batch_indices(n, batch, 0, True, True, tf.constant(0, tf.int64),
                                     (0, readers)))
next(slices)
first = time.perf_counter() - began
began = time.perf_counter()
for _ in range(2000):
    next(slices)
print(json.dumps({"first_s": first, "per_s": 2000 / (time.perf_counter() - began),
                  "mb": (kb("VmHWM:") - before) / 1024}))
"""


def order_rows(sizes: tuple[int, ...], progress) -> list[dict]:
    """What one of 8 readers spends on each epoch's order of `sizes` examples (global batch
    1,024): the whole epoch's shuffle stored, against each batch's indices computed alone (a
    keyed bijection, what tfdist does past `STORED_ORDER_MAX`): the time to the first slice,
    slices per second after it, and the process' peak memory above its start."""
    import subprocess

    rows = []
    for n in sizes:
        for way in ("stored", "keyed"):
            progress(f"bench: input: an epoch's order of {n:,} examples, {way}")
            done = subprocess.run([sys.executable, "-c", _ORDER, str(n), way, "1024", "8"],
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"the order of {n:,} ({way}) failed: {done.stderr[-2000:]}")
            rows.append({"kind": "order", "examples": n, "way": way,
                         **json.loads(done.stdout.splitlines()[-1])})
    return rows


def run_input(quick: bool, out: str) -> dict:
    """Runs the suite; writes OUT/input.md, .json and .png."""
    from tfdist.tools.bench import plots

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "tfdist bench --suite input" + (" --quick" if quick else "")
    path = _records(out_dir)

    def progress(text):
        print(text, flush=True)

    workers, starts = ((1, 2), (0, 1_000)) if quick else ((1, 2, 4), (0, 1_000, 10_000))
    epochs = 3 if quick else EPOCHS
    rows = (read_rows(path, workers, epochs, progress) + resume_rows(path, starts, progress)
            + step_rows(path, 30 if quick else 100, progress)
            + service_rows(path, epochs, progress)
            + format_rows(out_dir, 5_000 if quick else 100_000, 3_072, progress)
            + order_rows((1_000_000, 20_000_000) if quick
                         else (1_000_000, 50_000_000, 200_000_000), progress))
    result = {**stamp(command), "batch": BATCH, "epochs": epochs, "rows": rows}
    table = page_table(result)
    (out_dir / "input.md").write_text(f"Command: `{command}`\n\n{table}\n")
    (out_dir / "input.json").write_text(json.dumps(result, indent=2))
    png = plots.input_suite(rows, out_dir / "input.png")
    print(table)
    print(f"bench: wrote {out_dir / 'input.md'}, {out_dir / 'input.json'} and {png}")
    return result


ORDER_WAYS = {"stored": "stored whole (a shuffle)", "keyed": "each batch's computed alone"}


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f} ms"


def page_table(result: dict) -> str:
    """The suite's three tables (what its page shows)."""
    rows = result["rows"]
    reads = ["| workers | records the job trained on | read by worker 0 | share |",
             "|---:|---:|---:|---:|"]
    reads += [f"| {r['workers']} | {r['trained']:,} | {r['read']:,} | {r['share']:.1%} |"
              for r in rows if r["kind"] == "reads"]
    resume = ["| resumed at global batch | record set: first batch | records read | TFRecord "
              "stream, skipped: first batch | records read |", "|---:|---:|---:|---:|---:|"]
    resume += [f"| {r['start']:,} | {r['records_s']:.2f} s | {r['records_read']:,} | "
               f"{r['stream_s']:.2f} s | {r['stream_read']:,} |"
               for r in rows if r["kind"] == "resume"]
    step = ["| input | median step | decode per record |", "|---|---:|---:|"]
    step += [f"| {r['input']} | {r['step_ms']:.1f} ms | {_ms(r['decode_ms_per_record'])} |"
             for r in rows if r["kind"] == "step"]
    service = ["| 2 TF_CONFIG workers | training records | decoded on the trainers | decoded on "
               "the data workers | median step | test accuracy |",
               "|---|---:|---:|---:|---:|---:|"]
    service += [f"| {r['input']} | {r['trained']:,} | {r['trainers_decoded']:,} | "
                f"{r['data_decoded']:,} | {r['step_ms']:.1f} ms | {r['test_accuracy']:.4f} |"
                for r in rows if r["kind"] == "service"]
    service = ["", "Decoding off the trainers (the tf.data service, 2 data workers):", "",
               *service] if len(service) > 2 else []
    formats = ["| format | random records/s | write | on disk |", "|---|---:|---:|---:|"]
    formats += [f"| {r['format']} | {r['per_s']:,.0f} | {r['write_s']:.2f} s | {r['mb']:.1f} MB |"
                for r in rows if r["kind"] == "format"]
    if len(formats) > 2:
        r = next(r for r in rows if r["kind"] == "format")
        formats = ["", f"Random access to {r['records']:,} records of {r['record_bytes']:,} "
                   "bytes (batches of 64 random indices):", "", *formats]
    else:
        formats = []
    order = ["| examples | the epoch's order | first slice | slices/s | peak memory |",
             "|---:|---|---:|---:|---:|"]
    order += [f"| {r['examples']:,} | {ORDER_WAYS[r['way']]} | {r['first_s']:.2f} s | "
              f"{r['per_s']:,.0f} | {r['mb']:,.0f} MB |" for r in rows if r["kind"] == "order"]
    order = ["", "One of 8 readers' epoch order (global batch 1,024, slices of 128):", "",
             *order] if len(order) > 2 else []
    return "\n".join([f"Each worker's reads ({result['epochs']} epochs of the digits record set, "
                      f"global batch {result['batch']}):", "", *reads, "",
                      "A resumed run's first batch:", "", *resume, "",
                      "One device's training step (the digits MLP):", "", *step, *service,
                      *formats, *order])
