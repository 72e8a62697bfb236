"""What a config trains: its data, model, loss, metrics and Keras optimizer, and the global
batches every engine slices alike.

The model and the data are built in (`model.name`: mlp, cnn, resnet50, transformer;
`data.name`: digits, synthetic) or your own: `module.path:function` (see `user_function`).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import json
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.callbacks import StepTimer
from tfdist.data import (
    RecordError,
    RecordSource,
    global_batches,
    load_digits,
    record_batches,
    resume,
    shard_batches,
    synthetic_classification,
)
from tfdist.data.records import default_decoder, label_problem
from tfdist.data.records import test_batches as record_test_batches
from tfdist.data.service import ServiceError, check_dispatcher, service_batches
from tfdist.optimizers import chain_of
from tfdist.tools.errors import ConfigError
from tfdist.tools.models import MODELS, build_model
from tfdist.tools.parts import metrics_of

EVAL_TAG = "tfdist-eval "


class Workload:
    """A config's job as every process builds it alike: the seed and precision set, the data
    loaded and checked against the batch size, the loss and metrics known to Keras."""

    def __init__(self, config: dict[str, Any], world_size: int):
        self.config = config
        keras.utils.set_random_seed(config["train"]["seed"])
        keras.config.set_dtype_policy(config["train"]["precision"])
        self.data = load_data(config)
        data, opt = config["data"], config["optimizer"]
        self.micro_batch = data["global_batch_size"] // opt["accumulation_steps"]
        if self.micro_batch % world_size:
            raise ConfigError(
                f"data.global_batch_size / optimizer.accumulation_steps = {self.micro_batch} "
                f"must divide by the {world_size} workers/replicas: use a multiple of "
                f"{world_size * opt['accumulation_steps']} for data.global_batch_size.")
        size = self.data.train_size
        if size is not None and self.micro_batch > size:
            raise ConfigError(f"data.global_batch_size: {data['global_batch_size']} is larger "
                              f"than the training set ({size} examples); use at most {size}.")
        _check_data(config, self.data)
        self.loss, self.metrics = config["train"]["loss"], metrics_of(config["train"])
        _loss(self.loss)
        for name in self.metrics:
            _metric(name, self.loss)
        self.steps = config["train"]["steps_per_epoch"] or (
            size // self.micro_batch if size else None)
        if not self.steps:
            raise ConfigError("train.steps_per_epoch: the training dataset's size is unknown; "
                              "set train.steps_per_epoch.")
        # optimizer.scale_lr_by_workers: the rate times the workers, reached at once or over
        # optimizer.warmup_epochs.
        self.scale = world_size if opt["scale_lr_by_workers"] else 1
        self.warmup_epochs = opt["warmup_epochs"] if opt["warmup_epochs"] > 0 and \
            self.scale > 1 else 0
        self.learning_rate = opt["learning_rate"] * (1 if self.warmup_epochs else self.scale)

    def model(self) -> keras.Model:
        """A new model as the config describes it (the same weights in every process)."""
        model = make_model(self.config, self.data)
        _check_loss(self.loss, model, self.data)
        return model

    def inner_optimizer(self, learning_rate: float | None = None) -> keras.optimizers.Optimizer:
        """The config's Keras optimizer, at `learning_rate` (default: the run's)."""
        rate = self.learning_rate if learning_rate is None else learning_rate
        return inner_optimizer(self.config["optimizer"], rate)

    def compile(self, model: keras.Model, optimizer, **options) -> None:
        """`model.compile` with the config's loss and metrics."""
        model.compile(optimizer=optimizer, loss=self.loss, metrics=self.metrics, **options)

    def input(self, start=0) -> Input:
        """The global batches from `start` on, as an engine feeds them to `fit`."""
        return Input(self.data, self.micro_batch, self.config["data"]["seed"], start)

    def evaluate(self, model: keras.Model) -> dict[str, float]:
        """The test set's loss and metrics (`evaluate`)."""
        return evaluate(model, self.data.test_batches(), self.loss, self.metrics)

    def test_examples(self) -> int:
        return sum(int(np.shape(y)[0]) for _, y in self.data.test_batches())

    @contextlib.contextmanager
    def reading(self):
        """Where the data is read (training, the evaluation): a TensorFlow error there caused
        by a record of the record set that does not decode becomes one naming the record
        (TensorFlow's names the op only)."""
        try:
            yield
        except tf.errors.OpError as e:
            if LABEL_OUTSIDE in str(e):  # your own dataset's (`_labels_checked`)
                raise ConfigError(f"data.name: {self.config['data']['name']} gave a label "
                                  f"outside the model's {self.data.num_classes} classes (below 0, "
                                  f"or {self.data.num_classes} or more: data.num_classes); set "
                                  "data.num_classes to the number of classes") from None
            bad = self.data.find_bad()
            if bad is None:
                raise
            record, fix = bad
            raise ConfigError(f"data.path: {record}; training stopped there, the backups are "
                              f"kept. {fix}") from e


@dataclass
class Input:
    """What an engine feeds `fit`: the run's global batches (`global_batches`), or one
    worker's slice of each (`shard`), from global batch `start` on (an int, or a function
    giving it once a backup is restored)."""

    data: Data
    batch_size: int  # the global batch (of one accumulation step)
    seed: int
    start: Any = 0

    def global_batches(self):
        return self.shard(0, 1)

    def shard(self, index: int, count: int):
        """Slice `index` of `count` of each global batch: a record set reads only it."""
        return self.data.shard(self.batch_size, self.seed, self.start, index, count)


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
    """Training and test data: arrays, tf.data datasets of (x, y) examples, or record sets
    (`tfdist.data.RecordSource`, read by index with `decode`)."""

    train: Any
    test: Any
    input_shape: tuple
    num_classes: int | None
    decode: Any = None  # records: record -> (x, y)
    # Your own datasets from a function taking `shard`: (index, count) -> that slice's train
    # dataset (its own files), read by input pipeline `index` of `count`.
    sharded: Any = None
    name: str = ""  # data.name, for what is said about it
    label_shape: tuple | None = None  # records: one example's label, as decoded
    # records through the tf.data service: (the dispatcher's host:port, the processing mode)
    service: tuple[str, str] | None = None
    # Integer labels are class indices (a sparse crossentropy loss), each checked to be one of
    # the model's `num_classes` as it is read (records and your own datasets).
    class_labels: bool = False

    @property
    def classes(self) -> int | None:
        """The classes each integer label must be one of, or None: not checked."""
        return self.num_classes if self.class_labels else None

    def label_rank(self) -> int | None:
        """The dimensions of a batch of labels (None: not known before they are read)."""
        if self.arrays:
            return int(np.ndim(self.train[1]))
        shape = self.label_shape if self.records else self.train.element_spec[1].shape
        return None if shape is None or tf.TensorShape(shape).rank is None else len(shape) + 1

    _warned = False  # said once: every pipeline reads the whole dataset

    @property
    def arrays(self) -> bool:
        return not isinstance(self.train, (tf.data.Dataset, RecordSource))

    @property
    def records(self) -> bool:
        return isinstance(self.train, RecordSource)

    @property
    def train_size(self) -> int | None:
        if self.arrays:
            return len(self.train[1])
        if self.records:
            return len(self.train)
        n = int(self.train.cardinality())
        return n if n >= 0 else None

    def facts(self) -> dict[str, str]:
        """What every process of a job must have loaded alike (`JobEngine.agree`): the
        splits' sizes, an example's shape and a record set's records.json. A data function
        taking `shard` reads each worker's own files: its training set is each one's own."""
        splits = {"test": self.test} if self.sharded is not None else \
            {"training": self.train, "test": self.test}
        sizes = {name: len(split[1]) if self.arrays else len(split) if self.records else
                 int(split.cardinality()) for name, split in splits.items()}
        facts = {f"the {name} set": f"{n} examples" if n >= 0 else "of unknown size"
                 for name, n in sizes.items()}
        facts["an example"] = f"of shape {tuple(self.input_shape)}"
        if self.records:
            meta = json.dumps(self.train.meta, sort_keys=True).encode()
            facts["the record set at data.path"] = f"records.json {zlib.crc32(meta):#010x}"
        return facts

    def shard(self, batch_size: int, seed: int, start, index: int, count: int):
        """Slice `index` of `count` of each global batch, from global batch `start` on. The
        sequence of global batches every worker draws alike is a pure function of the seed and
        the epoch (a dataset of your own keeps its own order); a record set is read only where
        the slice is."""
        if self.records and self.service:  # read and decoded by the data workers
            dispatcher, mode = self.service
            return service_batches(self.train.files, batch_size // count, self._shaped(),
                                   dispatcher, mode, seed)
        if self.records:
            return record_batches(self.train, batch_size, seed, self._shaped(), (index, count),
                                  start=start)
        if self.arrays:
            x, y = self.train
            batches = global_batches(x, y, batch_size, seed=seed, start=start)
        elif self.sharded is not None and count > 1:  # each pipeline reads its own files
            local = self.sharded(index, count).batch(batch_size // count, drop_remainder=True)
            return resume(_labels_checked(local, self.classes).repeat(), start)
        else:
            if count > 1 and not self._warned:
                self._warned = True
                print(f"[tfdist] data.name {self.name}: each of the {count} input pipelines "
                      f"reads the whole dataset and keeps 1/{count} of each batch ({count}x the "
                      "reading of its share); give the function a `shard` parameter to read "
                      "only its own files (docs/guides/data.md)", file=sys.stderr, flush=True)
            batches = resume(_labels_checked(self.train.batch(batch_size, drop_remainder=True),
                                             self.classes).repeat(), start)
        return batches if count == 1 else shard_batches(batches, index, count)

    def global_batches(self, batch_size: int, seed: int, start=0) -> tf.data.Dataset:
        """The whole global batches (`shard` of one slice)."""
        return self.shard(batch_size, seed, start, 0, 1)

    def _shaped(self):
        """The records' decode function, held to the shapes record 0 decodes to (which the
        model is built for): a record that decodes otherwise stops the run there."""
        def shaped(record):
            x, y = self.decode(record)
            return (tf.ensure_shape(x, self.input_shape),
                    tf.ensure_shape(y, self.label_shape))

        return shaped

    def find_bad(self) -> tuple[str, str] | None:
        """A record set's record read last that does not decode as record 0 did, or whose
        label the model has no class for, and what to do (`RecordSource.find_bad`); None: none
        (or no record set)."""
        if not self.records:
            return None
        return next(filter(None, (source.find_bad(self.decode, self.input_shape, self.label_shape,
                                                  self.classes)
                                  for source in (self.train, self.test))), None)

    def test_batches(self):
        if self.arrays:
            x, y = self.test
            return [(x, y)]
        if self.records:
            return record_test_batches(self.test, decode=self._shaped())
        return _labels_checked(self.test.batch(256), self.classes)


def _records(d: dict[str, Any], class_labels: bool) -> Data:
    """data.name records: the train and test splits of the record set at data.path, decoded
    by data.decode (default: the decoder of records converted from arrays); the first record
    decoded now, so a decode function that does not fit says so before training."""
    try:
        train, test = RecordSource(d["path"], "train"), RecordSource(d["path"], "test")
    except RecordError as e:
        raise ConfigError(str(e)) from None
    if d["decode"] is not None:
        decode = user_function(d["decode"], "data.decode")
    else:
        decode = default_decoder(train.meta)
    if decode is None:
        raise ConfigError(f"data.decode: the records at {d['path']} are your own "
                          f"({train.meta.get('source')}); name your function that decodes one "
                          "(module.path:function, record -> (x, y))")
    first = train.read([0])[0]
    try:
        x, y = decode(tf.constant(first))
        shape = tuple(int(n) for n in x.shape)
    except Exception as e:  # noqa: BLE001 (any failure of the user's function is said)
        file, number = train.locate(0)
        raise ConfigError(f"data.decode: record 0 of {file} (record {number} there) does not "
                          f"decode to (x, y) tensors of a known shape: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None
    classes = train.meta.get("num_classes", d["num_classes"])
    if not y.dtype.is_integer:
        classes = None  # regression targets
    wrong = label_problem(y, classes if class_labels else None)
    if wrong is not None:
        file, number = train.locate(0)
        raise ConfigError(f"data.path: record 0 of {file} (record {number} there) {wrong}: "
                          "set data.num_classes to the number of classes")
    service = None
    if d["service"] is not None:
        try:
            check_dispatcher(d["service"])
        except ServiceError as e:
            raise ConfigError(str(e)) from None
        service = (d["service"], d["service_mode"])
        print(f"[tfdist] data: the tf.data service at {d['service']} reads and decodes the "
              f"records ({d['service_mode']}); its batches are not a local reading's, and a "
              "resume does not restore the data position (docs/guides/data.md)",
              file=sys.stderr, flush=True)
    return Data(train, test, shape, classes, decode, label_shape=tuple(y.shape),
                service=service, class_labels=class_labels)


LABEL_OUTSIDE = "tfdist: a class label outside [0, data.num_classes)"


def _labels_checked(batches: tf.data.Dataset, classes: int | None) -> tf.data.Dataset:
    """Your own dataset's batches of (x, y) with integer class labels, each batch's labels
    checked to be among the model's `classes` as it is read (the loss would fail with
    TensorFlow's error, and a traceback); other batches as they are. A check per batch costs
    next to nothing, where one per example took 42% of a trivial pipeline's throughput."""
    spec = batches.element_spec
    if classes is None or not (isinstance(spec, tuple) and len(spec) == 2
                               and spec[1].dtype.is_integer and spec[1].shape.rank == 1):
        return batches

    def check(x, y):
        inside = tf.reduce_all(tf.logical_and(y >= 0, y < tf.cast(classes, y.dtype)))
        with tf.control_dependencies([tf.debugging.Assert(inside, [LABEL_OUTSIDE, y])]):
            return x, tf.identity(y)

    return batches.map(check)


def load_data(c: dict[str, Any]) -> Data:
    d = c["data"]
    loss = c["train"]["loss"].lower()
    class_labels = "sparse" in loss and "crossentropy" in loss  # labels are class indices
    if d["name"] == "records":
        return _records(d, class_labels)
    if d["name"] == "digits":
        train = load_digits("train", d["test_fraction"], d["seed"])
        return Data(train, load_digits("test", d["test_fraction"], d["seed"]), (8, 8, 1), 10)
    if d["name"] == "synthetic":
        x, y = synthetic_classification(d["num_examples"], tuple(d["input_shape"]),
                                        d["num_classes"], d["seed"])
        n_test = max(1, int(round(len(y) * d["test_fraction"])))
        return Data((x[n_test:], y[n_test:]), (x[:n_test], y[:n_test]), tuple(d["input_shape"]),
                    d["num_classes"])
    function = user_function(d["name"], "data.name")
    options = dict(d["options"])

    def call(shard: tuple[int, int]):
        out = _call(function, options, {"seed": d["seed"], "shard": shard}, "data.options")
        try:
            train, test = out
        except (TypeError, ValueError):
            raise ConfigError(f"data.name: {d['name']} must return (train, test): two (x, y) "
                              "array pairs or two tf.data datasets of (x, y) examples.") from None
        return train, test

    train, test = call((0, 1))
    if isinstance(train, tf.data.Dataset):
        x_spec = train.element_spec[0]
        takes_shard = "shard" in inspect.signature(function).parameters
        return Data(train, test, tuple(x_spec.shape), d["num_classes"], class_labels=class_labels,
                    sharded=(lambda i, n: call((i, n))[0]) if takes_shard else None,
                    name=d["name"])
    (x, y), _ = train, test
    classes = int(np.max(y)) + 1 if np.issubdtype(np.asarray(y).dtype, np.integer) else None
    return Data(train, test, tuple(np.shape(x)[1:]), classes)  # None: regression targets


def make_model(c: dict[str, Any], data: Data) -> keras.Model:
    m = c["model"]
    if m["name"] in MODELS:
        try:
            return build_model(m["name"], data.input_shape, data.num_classes or 10, m["hidden"])
        except ValueError as e:  # the model does not fit the data (or model.hidden)
            raise ConfigError(str(e)) from None
    model = _call(user_function(m["name"], "model.name"), dict(m["options"]),
                  {"input_shape": data.input_shape, "num_classes": data.num_classes},
                  "model.options")
    if not isinstance(model, keras.Model):
        raise ConfigError(f"model.name: {m['name']} must return a keras.Model; got "
                          f"{type(model).__name__}.")
    return model


def _check_data(c: dict[str, Any], data: Data) -> None:
    """A test set with at least one example."""
    if data.records and len(data.test) == 0:
        raise ConfigError(f"data.path: the record set at {c['data']['path']} has no test "
                          "record; convert it with a test fraction > 0.")
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
    rank = data.label_rank()
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
