"""Runs one training job from a validated config (what `tfdist train` does).

Each run gets a directory of its own under `train.output_dir` (named by `train.run_name`, by
default the run's start time), which the chief fills: `config.yaml` (the resolved config),
`summary.json`, `model.keras` (the trained model, loadable in plain Keras) and
`tensorboard/` (loss, accuracy, learning rate and the communication figures, as standard
scalars). A directory that holds a finished run is never written again.

The model and the data are built in (`model.name`: mlp, cnn; `data.name`: digits, synthetic)
or your own: `module.path:function` (see `user_function`).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf
import yaml

import tfdist
from tfdist import compression
from tfdist.callbacks import (
    BackupAndRestore,
    BackupError,
    CommunicationStats,
    ElasticJoin,
    ElasticResize,
    LearningRateWarmup,
    ScalarLog,
    StartAt,
    StepTimeline,
    StepTimer,
)
from tfdist.callbacks.backup import remove_folder
from tfdist.comm import Engine, ring_bytes
from tfdist.data import (
    global_batches,
    load_digits,
    resume,
    shard_batches,
    synthetic_classification,
)
from tfdist.optimizers import AutoExchange, DistributedOptimizer, chain_of
from tfdist.optimizers.nan_policy import NanPolicy
from tfdist.plan import embedding_rows
from tfdist.ps import (
    FinishCallback,
    HogwildSGD,
    ParameterServerEngine,
    serve,
)
from tfdist.ps.checkpoint import WorkerCheckpoint
from tfdist.ps.optimizer import SERVER_GONE, write_report
from tfdist.ps.server import JOB_OVER
from tfdist.tools import epilogue
from tfdist.tools import ps_notices as notices
from tfdist.tools.config import ConfigError, make_offload, make_parts, metrics_of
from tfdist.tools.cpu_load import MachineLoad
from tfdist.tools.engines import ENGINES, JobEngine, make_compressor
from tfdist.tools.models import MODELS, build_model
from tfdist.zero import ShardedModel, ZeroOptimizer

SUMMARY, MODEL, CONFIG, TENSORBOARD = "summary.json", "model.keras", "config.yaml", "tensorboard"
BACKUP, RUN_FILE = "backup", "run"  # train.output_dir/backup/run: the run being backed up


@dataclass
class Job:
    """The config's engine, as this process runs it."""

    name: str  # the config's engine.name
    strategy: tf.distribute.Strategy | None
    engine: Engine
    kind: JobEngine  # how `tfdist train` runs it (tfdist.tools.engines)

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def rank(self) -> int:
        return self.engine.process_index

    @property
    def is_chief(self) -> bool:
        return self.engine.is_chief

    @property
    def pushes(self) -> bool:
        """Workers push to parameter servers (`tfdist.ps`), whatever the engine's name: the
        servers hold each worker's step count and the checkpoints, and serve a task in the role
        `ps`."""
        return isinstance(self.engine, ParameterServerEngine)


def make_job(config: dict[str, Any]) -> Job:
    name = config["engine"]["name"]
    kind = ENGINES.lookup(name)()
    try:
        strategy, engine = kind.make(config)
    except ValueError as e:
        raise ConfigError(f"engine.name is {name!r}: {e}") from None
    return Job(name, strategy, engine, kind)


# -- the run directory -----------------------------------------------------------------------------
def run_directory(config: dict[str, Any]) -> Path:
    """Where the run's files go: `train.output_dir` / `train.run_name` (default: the start time,
    with a suffix if taken). A name that holds a finished run is refused. With
    `train.checkpoint_steps`, an unfinished run backed up in `train.output_dir/backup` is
    continued in its own directory."""
    parent = Path(config["train"]["output_dir"])
    unfinished = backed_up_run(config)
    if unfinished is not None:
        return unfinished
    name = config["train"]["run_name"]
    if name is not None:
        path = parent / name
        if (path / SUMMARY).exists():
            raise ConfigError(f"train.run_name: {path} holds a finished run ({SUMMARY}); choose "
                              "another name, remove it, or leave train.run_name null for a new "
                              "directory per run.")
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = parent / stamp, 1
    while path.exists():
        n += 1
        path = parent / f"{stamp}-{n}"
    return path


def clear_finished_backups(config: dict[str, Any]) -> None:
    """Removes backups left in `train.output_dir/backup` by a run that finished (stopped after
    its summary was written, before its backups were removed): they must not resume the next
    run. Called by the chief before anything else reads them."""
    if not config["train"]["checkpoint_steps"]:
        return
    directory = Path(config["train"]["output_dir"]) / BACKUP
    try:
        finished = Path((directory / RUN_FILE).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return
    if not (finished / SUMMARY).exists():
        return
    print(f"[tfdist] removing the backups left by the finished run {finished}", file=sys.stderr,
          flush=True)
    for path in directory.glob("process-*"):
        remove_folder(path)
    (directory / RUN_FILE).unlink(missing_ok=True)


def backed_up_run(config: dict[str, Any]) -> Path | None:
    """The unfinished run whose backups `train.output_dir/backup` holds, if any (and if
    `train.checkpoint_steps` is set)."""
    if not config["train"]["checkpoint_steps"]:
        return None
    record = Path(config["train"]["output_dir"]) / BACKUP / RUN_FILE
    try:
        path = Path(record.read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None
    return None if (path / SUMMARY).exists() or not path.name else path


class RunFiles:
    """The chief writes the run directory; other processes write only what the chief's save
    needs of them (a ZeRO model gathers every process's shards), to a temporary directory
    removed as soon as the save is done."""

    def __init__(self, path: Path, chief: bool):
        self.path = path
        self.chief = chief

    def start(self, config: dict[str, Any]) -> None:
        if self.chief:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))

    def save_model(self, model: keras.Model) -> Path:
        """Every process saves (a multi-process save may gather); the chief's file is kept,
        written whole or not at all (a temporary name, then renamed). Returns its path."""
        target = self.path / MODEL
        if not self.chief:
            with tempfile.TemporaryDirectory(prefix="tfdist-run-") as scratch:
                model.save(Path(scratch) / MODEL)
            return target
        partial = target.with_name(f".partial-{MODEL}")
        model.save(partial)
        os.replace(partial, target)
        return target

    def finish(self, summary: dict[str, Any]) -> None:
        """Writes summary.json (whole or not at all): from then on the run is finished."""
        if self.chief:
            partial = self.path / f".partial-{SUMMARY}"
            with open(partial, "w") as f:
                f.write(json.dumps(summary, indent=2))
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, self.path / SUMMARY)


# -- models and data -------------------------------------------------------------------------------
def user_function(spec: str, key: str):
    """The function `module.path:function` names (a config's model.name or data.name)."""
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({e}); run from the "
                          "directory that holds it, or add that directory to PYTHONPATH.") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"{key}: {module_name!r} has no function {function_name!r}.")
    return function


def _call(function, options: dict[str, Any], available: dict[str, Any], key: str = "options"):
    """`function(**options)`, plus those of `available` that its signature names; options it
    does not take are refused (`key` names them)."""
    parameters = inspect.signature(function).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    unknown = sorted(set(options) - set(parameters)) if not takes_any else []
    if unknown:
        raise ConfigError(f"{key}: {function.__name__}() takes no {', '.join(map(repr, unknown))}; "
                          f"it takes {', '.join(parameters) or 'nothing'}.")
    extra = {k: v for k, v in available.items() if k in parameters and k not in options}
    return function(**options, **extra)


@dataclass
class Data:
    """Training and test data: arrays, or tf.data datasets of (x, y) examples."""

    train: Any
    test: Any
    input_shape: tuple
    num_classes: int | None

    @property
    def arrays(self) -> bool:
        return not isinstance(self.train, tf.data.Dataset)

    @property
    def train_size(self) -> int | None:
        if self.arrays:
            return len(self.train[1])
        n = int(self.train.cardinality())
        return n if n >= 0 else None

    def global_batches(self, batch_size: int, seed: int, start=0) -> tf.data.Dataset:
        """The sequence of global batches every worker draws alike (a pure function of the
        seed and the epoch), repeated, from global batch `start` on; a dataset of your own
        keeps its own order."""
        if self.arrays:
            x, y = self.train
            return global_batches(x, y, batch_size, seed=seed, start=start)
        return resume(self.train.batch(batch_size, drop_remainder=True).repeat(), start)

    def test_batches(self):
        if self.arrays:
            x, y = self.test
            return [(x, y)]
        return self.test.batch(256)


def load_data(c: dict[str, Any]) -> Data:
    d = c["data"]
    if d["name"] == "digits":
        train = load_digits("train", d["test_fraction"], d["seed"])
        return Data(train, load_digits("test", d["test_fraction"], d["seed"]), (8, 8, 1), 10)
    if d["name"] == "synthetic":
        x, y = synthetic_classification(d["num_examples"], tuple(d["input_shape"]),
                                        d["num_classes"], d["seed"])
        n_test = max(1, int(round(len(y) * d["test_fraction"])))
        return Data((x[n_test:], y[n_test:]), (x[:n_test], y[:n_test]), tuple(d["input_shape"]),
                    d["num_classes"])
    out = _call(user_function(d["name"], "data.name"), dict(d["options"]), {"seed": d["seed"]},
                "data.options")
    try:
        train, test = out
    except (TypeError, ValueError):
        raise ConfigError(f"data.name: {d['name']} must return (train, test): two (x, y) array "
                          "pairs or two tf.data datasets of (x, y) examples.") from None
    if isinstance(train, tf.data.Dataset):
        x_spec = train.element_spec[0]
        return Data(train, test, tuple(x_spec.shape), d["num_classes"])
    (x, y), _ = train, test
    classes = int(np.max(y)) + 1 if np.issubdtype(np.asarray(y).dtype, np.integer) else None
    return Data(train, test, tuple(np.shape(x)[1:]), classes)  # None: regression targets


def make_model(c: dict[str, Any], data: Data) -> keras.Model:
    m = c["model"]
    if m["name"] in MODELS:
        return build_model(m["name"], data.input_shape, data.num_classes or 10, m["hidden"])
    model = _call(user_function(m["name"], "model.name"), dict(m["options"]),
                  {"input_shape": data.input_shape, "num_classes": data.num_classes},
                  "model.options")
    if not isinstance(model, keras.Model):
        raise ConfigError(f"model.name: {m['name']} must return a keras.Model; got "
                          f"{type(model).__name__}.")
    return model


def _check_data(c: dict[str, Any], data: Data) -> None:
    """A test set with at least one example."""
    if data.arrays and len(data.test[1]) == 0:
        raise ConfigError(f"data.test_fraction: {c['data']['test_fraction']:g} leaves no test "
                          f"example of {len(data.train[1]):,}; use a larger fraction.")


def _loss(name: str):
    """The Keras loss `name` names, or a ConfigError with the names Keras knows."""
    try:
        return keras.losses.get(name)
    except ValueError:
        known = sorted(n for n in dir(keras.losses) if n.islower() and not n.startswith("_")
                       and n not in ("deserialize", "get", "serialize"))
        near = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"train.loss: Keras knows no loss {name!r}{hint}; one of "
                          f"{', '.join(known)}.") from None


def _check_loss(name: str, model: keras.Model, data: Data) -> None:
    """Class labels (one integer per example) need a sparse_* loss when the model gives several
    outputs per example: any other loss would compare shapes that differ."""
    labels = data.train[1] if data.arrays else data.train.element_spec[1]
    rank = np.ndim(labels) if data.arrays else len(labels.shape) + 1  # with the batch's
    width = model.output_shape[-1] if isinstance(model.output_shape, tuple) else None
    if rank == 1 and width not in (None, 1) and not name.startswith("sparse_"):
        raise ConfigError(
            f"train.loss: {name!r} compares the model's output (shape {model.output_shape}) with "
            f"labels of one value per example, which are class labels: use "
            f"sparse_categorical_crossentropy, or your own data with targets shaped like the "
            "output (a regression).")


ACCURACY = {"sparse_categorical_crossentropy": keras.metrics.SparseCategoricalAccuracy,
            "categorical_crossentropy": keras.metrics.CategoricalAccuracy,
            "binary_crossentropy": keras.metrics.BinaryAccuracy}


def _metric(name: str, loss: str) -> keras.metrics.Metric:
    """A new Keras metric for `name` (with `loss`, which decides what "accuracy" compares, as
    `compile` does), or a ConfigError with the names Keras knows."""
    if name == "accuracy":
        return ACCURACY.get(loss, keras.metrics.Accuracy)(name="accuracy")
    try:
        found = keras.metrics.get(name)
    except ValueError:
        known = ["mae", "mse", "mape", "msle", "auc", "precision", "recall"] + sorted(
            n for n in dir(keras.metrics) if n.islower() and not n.startswith("_")
            and n not in ("deserialize", "get", "serialize"))
        near = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"train.metrics: Keras knows no metric {name!r}{hint}; e.g. accuracy, "
                          "mae, mse, auc, precision, recall.") from None
    if isinstance(found, keras.metrics.Metric):
        return found
    return keras.metrics.MeanMetricWrapper(found, name=name)


def evaluate(model: keras.Model, batches, loss: str, metrics: list[str]) -> dict[str, float]:
    """The mean loss and each metric of `model` over (x, y) batches, in forward passes (in
    this process alone, whatever the engine): {"loss": ..., name: ...}."""
    loss_fn, mean_loss = _loss(loss), keras.metrics.Mean()
    found = {name: _metric(name, loss) for name in metrics}
    for x, y in batches:
        predicted = model(x, training=False)
        mean_loss.update_state(loss_fn(y, predicted))
        for metric in found.values():
            metric.update_state(y, predicted)
    return {"loss": float(mean_loss.result()),
            **{name: float(metric.result()) for name, metric in found.items()}}


def keras_exchange(model: keras.Model, replica_batch: int, world_size: int) -> tuple[float, int]:
    """What Keras' own exchange on a tf.distribute strategy sends per worker and step, and in
    how many collective calls; it is not counted as it runs, so this is a formula. TF's
    CollectiveAllReduce all-reduces the dense gradients in one batched call. An embedding's
    gradient is rows (tf.IndexedSlices): it all-gathers them in three calls, the row counts,
    the rows and their int32 indices (tensorflow/python/distribute/cross_device_utils.py). A
    table's rows per step: the ids its layer looks up, its input's size per example (the first
    call's) times the replica's batch."""
    if world_size <= 1:
        return 0.0, 0
    dense, gathered, calls = 0, 0.0, 0
    for v, rows in zip(model.trainable_variables, embedding_rows(model, replica_batch),
                       strict=True):
        size = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        if rows:
            row_bytes = size // v.shape[0] + 4
            gathered += ring_bytes("all_gather", rows * row_bytes + 4, world_size)
            calls += 3
        else:
            dense += size
    calls += int(dense > 0)
    return ring_bytes("all_reduce", dense, world_size) + gathered, calls


# -- the optimizer -----------------------------------------------------------------------------------
def _state_bytes(optimizer) -> dict[str, int]:
    """Optimizer-state bytes per device (and host/disk when offloaded), as placed."""
    from tfdist.zero import memory_report

    return {device: kinds["optimizer_state"] for device, kinds in
            memory_report(optimizer).items() if kinds["optimizer_state"]}


def _wrap(job: Job, inner, config: dict):
    """The optimizer around `inner`: the engine's own (`JobEngine.optimizer`: `inner` itself
    for the keras_multi_worker baseline, the parameter servers' and Hogwild's), else the
    config's tfdist optimizer. The same classes serve every engine: the optimizer resolves its
    engine when built."""
    own = job.kind.optimizer(job.engine, inner, config)
    if own is not None:
        return own
    opt_cfg = config["optimizer"]
    if opt_cfg["zero_stage"] is None:
        return DistributedOptimizer(inner, *make_parts(config), loss_scale=opt_cfg["loss_scale"],
                                    nan_policy=opt_cfg["nan_policy"],
                                    fused_update=opt_cfg["fused_update"])
    return ZeroOptimizer(inner, stage=opt_cfg["zero_stage"],
                         accumulation_steps=opt_cfg["accumulation_steps"],
                         offload=make_offload(opt_cfg), nan_policy=opt_cfg["nan_policy"],
                         fused_update=opt_cfg["fused_update"])


def _compile_plain(model: keras.Model, config: dict[str, Any], job: Job, lr: float) -> None:
    """Compiles the trained `model` as model.keras carries it: with a fresh Keras optimizer of
    the run's class and settings (not its state, which the backups hold), the run's loss and
    metrics; plain Keras loads the file, without tfdist."""
    scope = job.strategy.scope() if job.strategy else contextlib.nullcontext()
    with scope:
        model.compile(optimizer=inner_optimizer(config["optimizer"], lr),
                      loss=config["train"]["loss"], metrics=metrics_of(config["train"]))


def inner_optimizer(c: dict[str, Any], learning_rate: float) -> keras.optimizers.Optimizer:
    """The Keras optimizer a config's `optimizer` section names (before tfdist wraps it)."""
    wd = c["weight_decay"] or None
    if c["name"] == "sgd":
        return keras.optimizers.SGD(learning_rate, momentum=c["momentum"], weight_decay=wd)
    if c["name"] == "adam":
        return keras.optimizers.Adam(learning_rate, weight_decay=wd)
    if c["name"] == "adamw":
        return keras.optimizers.AdamW(learning_rate, weight_decay=c["weight_decay"])
    return keras.optimizers.RMSprop(learning_rate, weight_decay=wd)


EVAL_TAG = "tfdist-eval "
STEP_SPANS_KEPT = 1000  # the steps whose begin and end a run's summary keeps


class EpochEvaluation(keras.callbacks.Callback):
    """The test loss and metrics after every epoch, next to the training time so far (the sum
    of the step times but the first, tracing, step) and the bytes sent; adds them to the logs
    as `test_loss`, `test_<metric>`; with `announce`, each record is also printed as one
    `tfdist-eval {json}` line (what `tfdist bench --suite comm` follows)."""

    def __init__(self, data: Data, timer: StepTimer, config: dict[str, Any],
                 announce: bool = False):
        super().__init__()
        self.data, self.timer, self.announce = data, timer, announce
        self.epochs, self.loss = config["train"]["epochs"], config["train"]["loss"]
        self.metrics = metrics_of(config["train"])
        self.log: list[dict[str, float]] = []

    def on_epoch_end(self, epoch, logs=None):
        chain = chain_of(self.model.optimizer)
        tested = evaluate(self.model, self.data.test_batches(), self.loss, self.metrics)
        record = {"epoch": epoch + 1, "epochs": self.epochs,
                  "steps": len(self.timer.times),
                  "train_seconds": round(float(sum(self.timer.times[1:])), 4),
                  **{f"test_{name}": value for name, value in tested.items()},
                  "bytes_sent": None if chain is None else float(chain.bytes_sent)}
        self.log.append(record)
        if logs is not None:
            logs.update({f"test_{name}": value for name, value in tested.items()})
        if self.announce:
            print(EVAL_TAG + json.dumps(record), flush=True)


class BatchCounter(keras.callbacks.Callback):
    """Global batches trained on in each epoch (steps x steps_per_execution)."""

    def __init__(self):
        super().__init__()
        self.batches_per_epoch: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches_per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.batches_per_epoch[-1] = batch + 1


def _verbosity(config: dict[str, Any], job: Job, progress: bool) -> int:
    """Keras' progress bar on a terminal, one line per epoch otherwise (logs, the launcher)."""
    if not (job.is_chief and progress):
        return 0
    verbose = config["train"]["verbose"]
    if verbose is None:
        verbose = 1 if sys.stdout.isatty() else 2
    return verbose


def _process_start() -> float | None:
    """When this process started (`time.time()` scale; Linux's /proc, else None)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _startup(started: float, timer: StepTimer) -> dict[str, float | None]:
    """Where the time before the second step went (seconds): `before_train` from the process'
    start to `train` (interpreter, imports, config; None where /proc is missing), `setup` to
    `fit` (cluster, data, model, compile), `fit_before_first_step` (the dataset's iterator,
    callbacks), `first_step` (tracing, first collectives), and their `total`."""
    process = _process_start()
    parts = {
        "before_train": None if process is None else max(started - process, 0.0),
        "setup": (timer.fit_began or started) - started,
        "fit_before_first_step": ((timer.first_step_began or 0.0) - (timer.fit_began or 0.0)
                                  if timer.first_step_began else None),
        "first_step": timer.times[0] if timer.times else None,
    }
    rounded: dict[str, float | None] = {k: None if v is None else round(v, 3)
                                        for k, v in parts.items()}
    rounded["total"] = round(sum(v for v in parts.values() if v is not None), 3)
    return rounded


def train(config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Trains as `config` says; returns the run summary, which the chief also writes, with the
    model and the config, to the run directory (`summary["run_dir"]`). A parameter-server worker
    that comes back after the job finished without it returns {"job_over": True}. A notice once
    training is over lets the run finish (`tfdist.tools.epilogue`)."""
    try:
        return _train(config, progress)
    except tf.errors.OpError as e:
        # A parameter-server task that ended after a notice. A worker may see its servers go
        # (they had the notice first) before its own notice arrives: it waits for it a little.
        if notices.NOTICED.is_set() or (notices.LISTENING.is_set() and SERVER_GONE in str(e)
                                        and notices.NOTICED.wait(notices.NOTICE_WAIT)):
            notices.exit_preempted()
        if JOB_OVER not in str(e):
            raise
        said = re.search(re.escape(JOB_OVER) + r".*?\(update \d+\)", str(e))
        print(f"{said.group(0) if said else JOB_OVER}; exiting", flush=True)
        return {"job_over": True}
    finally:
        epilogue.end()
        _fault_point("ended")


def _train(config: dict[str, Any], progress: bool) -> dict[str, Any]:
    started = time.time()
    job = make_job(config)
    if isinstance(job.engine, ParameterServerEngine) and job.engine.cluster.is_ps:
        return _serve(config, job)
    if job.is_chief:
        clear_finished_backups(config)
    run_dir = run_directory(config)
    files = RunFiles(run_dir, job.is_chief)
    keras.utils.set_random_seed(config["train"]["seed"])
    keras.config.set_dtype_policy(config["train"]["precision"])
    data = load_data(config)

    opt_cfg, data_cfg = config["optimizer"], config["data"]
    accumulation = opt_cfg["accumulation_steps"]
    micro_batch = data_cfg["global_batch_size"] // accumulation
    if micro_batch % job.world_size:
        raise ConfigError(
            f"data.global_batch_size / optimizer.accumulation_steps = {micro_batch} must divide by "
            f"the {job.world_size} workers/replicas: use a multiple of "
            f"{job.world_size * accumulation} for data.global_batch_size.")
    size = data.train_size
    if size is not None and micro_batch > size:
        raise ConfigError(f"data.global_batch_size: {data_cfg['global_batch_size']} is larger "
                          f"than the training set ({size} examples); use at most {size}.")
    _check_data(config, data)
    _loss(config["train"]["loss"])
    for name in metrics_of(config["train"]):
        _metric(name, config["train"]["loss"])
    scale = job.world_size if opt_cfg["scale_lr_by_workers"] else 1
    warmup = opt_cfg["warmup_epochs"] > 0 and scale > 1
    lr = opt_cfg["learning_rate"] * (1 if warmup else scale)

    scope = job.strategy.scope() if job.strategy else contextlib.nullcontext()
    with scope:
        model = make_model(config, data)
        _check_loss(config["train"]["loss"], model, data)
        if opt_cfg["zero_stage"] == 3:  # the parameters sharded too
            model = ShardedModel(model)
        optimizer = _wrap(job, inner_optimizer(opt_cfg, lr), config)
        model.compile(optimizer=optimizer, loss=config["train"]["loss"],
                      metrics=metrics_of(config["train"]),
                      **({"jit_compile": False} if job.kind.asynchronous else {}))
        if getattr(optimizer, "averaging", None) is not None:
            optimizer.average_also(model.non_trainable_variables)
        if getattr(optimizer, "skips_steps", False) and model.non_trainable_variables:
            optimizer.skip_also(model.non_trainable_variables)  # BatchNorm statistics
    steps = config["train"]["steps_per_epoch"] or (size // micro_batch if size else None)
    if not steps:
        raise ConfigError("train.steps_per_epoch: the training dataset's size is unknown; set "
                          "train.steps_per_epoch.")
    timeline = _timeline(config, run_dir, steps, job.is_chief)
    files.start(config)  # the run directory appears once the job is known to be valid
    if job.is_chief and progress:
        print(f"run directory     {run_dir}", flush=True)
    callbacks: list[keras.callbacks.Callback] = []
    backup, start = _backup(config, run_dir, job)
    if backup is not None:
        callbacks.append(backup)
        if config["train"]["resize_policy"] == "throughput":
            callbacks.append(ElasticResize(backup, micro_batch,
                                           every=config["train"]["resize_every"]))
        if os.environ.get("TFDIST_ELASTIC") == "1":  # grows when the launcher offers workers
            callbacks.append(ElasticJoin(backup))
    def batches():  # the same sequence of global batches, whichever engine slices it
        return data.global_batches(micro_batch, data_cfg["seed"], start)

    if job.pushes:
        # Joins the servers now: a worker started again, or a job resumed from the servers'
        # checkpoints, goes on at the step the servers hold for this worker.
        _on_notice(config, raising=False)
        start = optimizer.join(model.trainable_variables)
        directory = _ps_checkpoints(config)
        own = (WorkerCheckpoint(directory, config["train"]["checkpoint_steps"], job.rank)
               if directory else None)
        if own is not None:
            own.set_model(model)
            callbacks.append(own)
        callbacks.append(notices.StopOnNotice())  # after `own`: the step in flight is checkpointed
        if start:
            callbacks.append(StartAt(start, steps))
            restored = own is not None and own.restore(start)
            print(f"worker {job.rank}: resuming at step {start} (the parameter servers' count "
                  f"of its pushes); {'its' if restored else 'no'} checkpoint of the model's "
                  "non-trainable variables there", flush=True)
        dataset = shard_batches(batches(), job.rank, job.world_size)
        callbacks.append(finish := FinishCallback(
            log_dir=str(run_dir / TENSORBOARD) if job.is_chief else None))
        if warmup:
            callbacks.append(LearningRateWarmup(opt_cfg["warmup_epochs"], scale=scale))
    else:
        dataset, fed = job.kind.feed(job, batches, opt_cfg["warmup_epochs"] if warmup else 0)
        callbacks += fed
    if timeline is not None:  # before the timer: the profiler's start and stop are not timed
        callbacks.append(timeline)
    timer, counter, load = StepTimer(), BatchCounter(), MachineLoad()
    callbacks += [timer, load, counter]
    counted = job.kind.counts_bytes
    if job.kind.tfdist_optimizer:  # not the baseline; asynchronous engines count their pushes
        callbacks.append(CommunicationStats())
    evaluation = None
    if config["train"]["evaluate_each_epoch"]:
        evaluation = EpochEvaluation(data, timer, config, announce=job.is_chief)
        callbacks.append(evaluation)
    if job.is_chief:
        callbacks.append(ScalarLog(str(run_dir / TENSORBOARD)))

    try:
        history = model.fit(dataset, epochs=config["train"]["epochs"], steps_per_epoch=steps,
                            verbose=_verbosity(config, job, progress), callbacks=callbacks)
    except BackupError as e:
        raise ConfigError(f"{e} (train.output_dir holds the backups)") from None
    epilogue.begin(config["train"]["preemption_signals"])
    _fault_point("trained")
    # The last epoch's logs; a run resumed at its end trains nothing: the backup's.
    last_logs = ({k: v[-1] for k, v in history.history.items() if v} or
                 (dict(backup.restored.get("epoch_logs") or {})
                  if backup is not None and backup.restored else {}))
    train_seconds = time.time() - started

    hogwild = isinstance(optimizer, HogwildSGD)  # lock-free replicas: their updates' report
    if hogwild and job.is_chief:
        write_report(str(run_dir / TENSORBOARD / "hogwild"), optimizer.report())
    metrics = metrics_of(config["train"])
    tested = evaluate(model, data.test_batches(), config["train"]["loss"], metrics)
    total_steps = steps * config["train"]["epochs"]
    # A parameter-server worker's counters start with this process (the servers held the
    # rest): per-step figures are over the steps it ran.
    counted_steps = total_steps - start if job.pushes else total_steps
    params = int(model.count_params())
    unsharded = model.wrapped() if isinstance(model, ShardedModel) else model
    trainable = int(sum(np.prod(v.shape) for v in unsharded.trainable_weights))
    dense_per_step = ring_bytes("all_reduce", 4 * trainable, job.world_size) / accumulation
    if counted:
        bytes_sent, rounds = optimizer.bytes_sent, optimizer.communication_rounds
        calls = optimizer.collective_calls
    else:  # Keras' own exchange (not counted as it runs): its formula
        per_step, calls_per_step = keras_exchange(
            unsharded, micro_batch // job.world_size, job.world_size)
        bytes_sent, rounds = per_step / accumulation * total_steps, total_steps
        calls = calls_per_step * total_steps
    if isinstance(model, ShardedModel):  # model.keras holds the unsharded model
        model = model.load_into(make_model(config, data))
    if config["train"]["save_model"]:
        _compile_plain(model, config, job, lr)
    model_path = files.save_model(model) if config["train"]["save_model"] else None
    _fault_point("saved_model")
    summary = {
        "engine": job.name,
        "world_size": job.world_size,
        "run_dir": str(run_dir),
        "test_loss": tested["loss"],
        # The test set's metrics (train.metrics, or the task's); test_accuracy when measured.
        "test_metrics": {name: tested[name] for name in metrics},
        "test_accuracy": tested.get("accuracy"),
        "test_examples": _test_examples(data),
        "final_train_loss": last_logs.get("loss"),
        "final_train_metrics": {name: last_logs.get(name) for name in metrics},
        "final_train_accuracy": last_logs.get("accuracy"),
        "steps": total_steps,
        "parameters": params,
        "bytes_sent_total": bytes_sent,
        "bytes_sent_per_step": bytes_sent / max(counted_steps, 1),
        "bytes_counted": counted,
        "communication_rounds": rounds,
        # Collective calls per training step (= per gradient exchange when synchronous).
        "collectives_per_step": calls / max(counted_steps, 1),
        "averaging_period": (optimizer.averaging_period
                             if getattr(optimizer, "averaging", None) is not None else None),
        "trainable_parameters": trainable,
        "gradient_bytes_per_round": 4 * trainable,
        "compressor": compression.serialize(getattr(optimizer, "compressor", None)),
        "auto": _auto_report(optimizer),
        # Steps skipped whole for non-finite gradients (optimizer.nan_policy: skip).
        "nonfinite_steps_skipped": _skipped_steps(optimizer),
        "dense_bytes_per_step": dense_per_step,
        "bytes_ratio_vs_dense": (bytes_sent / max(counted_steps, 1) / dense_per_step
                                 if dense_per_step else None),
        "optimizer_state_bytes": (_state_bytes(optimizer)
                                  if job.kind.tfdist_optimizer else {}),
        # The parameter servers' counters, seen from the chief at the end (staleness).
        "parameter_server": finish.report if job.pushes else None,
        # Hogwild: updates applied and their staleness (other replicas' updates before it).
        "hogwild": optimizer.report() if hogwild else None,
        "train_seconds": round(train_seconds, 2),
        "startup_seconds": _startup(started, timer),
        # Median over all steps but the first epoch's first (tracing) step.
        "step_ms_median": 1000 * float(np.median(timer.times[1:] or timer.times)),
        # The first steps' [begin, end] (time.time(); at most STEP_SPANS_KEPT): which steps
        # of hosts sharing a clock ran at the same time (the benches' zero-communication limit).
        "step_spans": [[b, b + t] for b, t in
                       zip(timer.began[:STEP_SPANS_KEPT], timer.times[:STEP_SPANS_KEPT])],
        # The machine's cores busy during each epoch's steps after its first (all processes;
        # None without /proc/stat).
        "machine_load": load.summary(),
        # train.profile_step's timeline (timeline.json holds its ops' intervals), or None.
        "timeline": _timeline_summary(timeline, run_dir),
        "epoch_log": evaluation.log if evaluation else None,
        # Global batches the run resumed after (train.checkpoint_steps), or None; the
        # examples trained on in each epoch, all workers, across restarts.
        "resumed_from_step": (backup.restored["consumed"]
                              if backup is not None and backup.restored else
                              start or None if job.pushes else None),
        "examples_per_epoch": [b * micro_batch for b in (
            backup.batches_per_epoch if backup is not None else counter.batches_per_epoch)],
        "model_path": str(run_dir / MODEL) if model_path is not None else None,
        "versions": {"tfdist": tfdist.__version__, "tensorflow": tf.__version__,
                     "keras": keras.__version__, "python": platform.python_version()},
        "config": config,
    }
    files.finish(summary)  # the run's results are safe: now its backups may go
    _fault_point("finished")
    if backup is not None:
        backup.remove()
    if config["train"]["checkpoint_steps"] and job.is_chief:
        (backup_dir := Path(config["train"]["output_dir"]) / BACKUP).joinpath(
            RUN_FILE).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            backup_dir.rmdir()  # the last process out removes it
    if job.is_chief:
        summary["summary_path"] = str(run_dir / SUMMARY)
    keras.config.set_dtype_policy("float32")
    return summary


def _timeline(config: dict[str, Any], run_dir: Path, steps: int,
              chief: bool) -> StepTimeline | None:
    """train.profile_step's callback, on the chief; refuses a step past the run's end."""
    step = config["train"]["profile_step"]
    if step is None:
        return None
    total = steps * config["train"]["epochs"]
    if step > total:
        raise ConfigError(f"train.profile_step: {step} is past the run's last step ({total} = "
                          f"{steps} steps x {config['train']['epochs']} epochs); use at most "
                          f"{total}.")
    return StepTimeline(step, str(run_dir)) if chief else None


def _timeline_summary(timeline: StepTimeline | None, run_dir: Path) -> dict | None:
    """The profiled step's figures for summary.json; draws timeline.png beside timeline.json."""
    if timeline is None or timeline.result is None:
        return None
    from tfdist.tools.bench.plots import timeline as draw

    draw(timeline.result, run_dir / "timeline.png",
         title=f"step {timeline.step} on the chief")
    return {k: v for k, v in timeline.result.items() if k not in ("intervals", "collectives")}


def _serve(config: dict[str, Any], job: Job) -> dict[str, Any]:
    """A parameter-server task: builds the model as the workers do (same seed) and serves its
    shard of the variables, with the config's optimizer, until the workers are done."""
    cluster = job.engine.cluster if isinstance(job.engine, ParameterServerEngine) else None
    assert cluster is not None and cluster.is_ps
    keras.utils.set_random_seed(config["train"]["seed"])
    keras.config.set_dtype_policy(config["train"]["precision"])
    model = make_model(config, load_data(config))
    opt_cfg = config["optimizer"]
    scale = job.world_size if opt_cfg["scale_lr_by_workers"] else 1
    every = config["train"]["checkpoint_steps"]
    _on_notice(config, raising=True)
    try:
        report = _serve_until_done(model, config, cluster, scale, every)
        epilogue.begin(config["train"]["preemption_signals"])  # inside: a Notice just before
    except notices.Notice:
        notices.exit_preempted()
    if every:  # the last task out removes train.output_dir/backup
        with contextlib.suppress(OSError):
            (Path(config["train"]["output_dir"]) / BACKUP).rmdir()
    keras.config.set_dtype_policy("float32")
    return {"engine": job.name, "role": "ps", "task_index": cluster.task_index,
            **report}


def _on_notice(config: dict[str, Any], raising: bool) -> None:
    """A parameter-server task's answer to train.preemption_signals, with checkpoints
    (`tfdist.tools.ps_notices`)."""
    if config["train"]["checkpoint_steps"]:
        notices.listen(config["train"]["preemption_signals"], raising)


def _serve_until_done(model, config, cluster, scale, every) -> dict:
    """`tfdist.ps.serve` with the config's settings; returns the servers' report."""
    opt_cfg = config["optimizer"]
    return serve(model, inner_optimizer(opt_cfg, opt_cfg["learning_rate"] * scale),
                 staleness=config["engine"]["staleness"], cluster=cluster,
                 worker_timeout=config["engine"]["worker_timeout"],
                 scale_lr_by_staleness=config["engine"]["scale_lr_by_staleness"],
                 delay_compensation=config["engine"]["delay_compensation"],
                 compressor=make_compressor(config["compression"]),
                 min_compress_size=config["compression"]["min_size"],
                 compress_1d=config["compression"]["compress_1d"],
                 checkpoint_dir=_ps_checkpoints(config), checkpoint_every=every)


def _ps_checkpoints(config: dict[str, Any]) -> str | None:
    """Where a parameter-server job's tasks checkpoint (train.checkpoint_steps), or None."""
    if not config["train"]["checkpoint_steps"]:
        return None
    return str(Path(config["train"]["output_dir"]) / BACKUP / "ps")


def _skipped_steps(optimizer) -> int | None:
    """Steps the optimizer skipped for non-finite gradients, where it checks them."""
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.skipped_steps
    chain = chain_of(optimizer)
    policy = chain.part(NanPolicy) if chain is not None else None
    return policy.skipped_steps if policy is not None else None


def _auto_report(optimizer) -> dict[str, Any] | None:
    """compression.name auto: the exchange it picked, with the numbers it picked it on."""
    chain = chain_of(optimizer)
    auto = chain.part(AutoExchange) if chain is not None else None
    return auto.report() if auto is not None else None


def _backup(config: dict[str, Any], run_dir: Path, job: Job):
    """(BackupAndRestore, the data start) with train.checkpoint_steps, else (None, 0)."""
    every = config["train"]["checkpoint_steps"]
    if not every:
        return None, 0
    directory = Path(config["train"]["output_dir"]) / BACKUP
    if job.is_chief:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / RUN_FILE).write_text(str(run_dir))
    if job.pushes:  # the servers checkpoint (`_serve`); workers resume there
        return None, 0
    # Under `python -m tfdist.launch --elastic` the job may come back with fewer workers.
    backup = BackupAndRestore(directory, save_freq=every,
                              elastic=os.environ.get("TFDIST_ELASTIC") == "1",
                              delete_checkpoint=False,  # `train` removes them when done
                              job=job_identity(config),
                              preemption_signals=config["train"]["preemption_signals"],
                              on_preempted=_requeue if os.environ.get("TFDIST_REQUEUE") == "1"
                              and os.environ.get("SLURM_JOB_ID") else None)
    return backup, backup.data_start


def _requeue(step: int) -> None:
    """After a preemption backup (`python -m tfdist.launch --slurm --requeue`): puts this SLURM
    job back in the queue, where it starts again and resumes from the backup of `step`."""
    job = os.environ["SLURM_JOB_ID"]
    # Said first: SLURM ends the job's tasks as soon as it takes the job back, this one with them.
    print(f"[tfdist] requeueing SLURM job {job}: it resumes from the backup of step {step}",
          file=sys.stderr, flush=True)
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                          timeout=60)
    if done.returncode:
        print(f"[tfdist] could not requeue SLURM job {job} ({done.stderr.strip()}); submit it "
              "again to resume", file=sys.stderr, flush=True)


def _fault_point(point: str) -> None:
    """Fault injection for the tests of the end of a run: TFDIST_KILL_AT=<point> SIGKILLs
    this process there ("trained", "saved_model", "finished"); TFDIST_NOTICE_AT=<point> sends
    it a SIGTERM there (a termination notice; also "ended", as `train` returns)."""
    if os.environ.get("TFDIST_KILL_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("TFDIST_NOTICE_AT") == point:
        signal.raise_signal(signal.SIGTERM)


# Config keys a resumed run may change: they decide neither the data order nor the state.
CARRIED_OVER = frozenset({
    "train.epochs", "train.verbose", "train.evaluate_each_epoch", "train.save_model",
    "train.checkpoint_steps", "train.preemption_signals", "train.output_dir", "train.run_name",
    "train.resize_policy", "train.resize_every", "engine.devices", "engine.timeout_seconds",
    "engine.step_logs"})


def job_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The config values a backup belongs to (every key but `CARRIED_OVER`; the number of
    workers and replicas is checked by the backup itself)."""
    return {f"{section}.{key}": value for section, values in config.items()
            for key, value in values.items() if f"{section}.{key}" not in CARRIED_OVER}


def _test_examples(data: Data) -> int:
    return sum(int(np.shape(y)[0]) for _, y in data.test_batches())
