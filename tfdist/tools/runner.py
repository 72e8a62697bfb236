"""Runs one training job from a validated config (what `tfdist train` does)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist import compression
from tfdist.callbacks import CommunicationStats, LearningRateWarmup, StepTimer
from tfdist.comm import ring_bytes
from tfdist.data import (
    distribute,
    global_batches,
    load_digits,
    shard_batches,
    synthetic_classification,
)
from tfdist.optimizers import DistributedOptimizer, chain_of
from tfdist.tools.config import make_parts
from tfdist.tools.models import build_model
from tfdist.zero import Offload, ZeroOptimizer


def configure_devices(count: int) -> list[str]:
    """Makes `count` devices available: the first GPUs, else `count` logical CPU devices.

    Must run before TensorFlow initialises its runtime (before the first op).
    """
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < count:
            raise ValueError(f"engine.devices is {count} but only {len(gpus)} GPUs are visible.")
        return [f"/gpu:{i}" for i in range(count)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    # RuntimeError: the runtime is already initialised (e.g. in tests): use what exists.
    with contextlib.suppress(RuntimeError):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(names) < count:
        raise ValueError(
            f"engine.devices is {count} but TensorFlow was already initialised with "
            f"{len(names)} CPU devices; run tfdist train in a fresh process.")
    return names[:count]


@dataclass
class Engine:
    name: str
    strategy: tf.distribute.Strategy | None
    world_size: int
    rank: int

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


def make_engine(config: dict[str, Any]) -> Engine:
    name = config["engine"]["name"]
    if name == "horovod":
        import tfdist.horovod as thvd

        hierarchical = config["averaging"]["intra_period"] is not None
        thvd.init(process_sets="dynamic" if hierarchical else None)
        return Engine(name, None, thvd.size(), thvd.rank())
    if name in ("multi_worker", "keras_multi_worker"):
        if "TF_CONFIG" not in os.environ:
            raise ValueError(
                f"engine.name is {name!r} but TF_CONFIG is not set: start the workers with "
                "`python -m tfdist.launch --workers N -- tfdist train ...` (or set TF_CONFIG).")
        strategy = tfdist.MultiWorkerMirroredStrategy(
            timeout_seconds=config["engine"]["timeout_seconds"])
        return Engine(name, strategy, strategy.num_replicas_in_sync,
                      int(strategy.cluster_resolver.task_id or 0))
    if name == "mirrored":
        devices = configure_devices(config["engine"]["devices"])
        strategy = tfdist.strategies.new_mirrored_strategy(devices)
        return Engine(name, strategy, strategy.num_replicas_in_sync, 0)
    return Engine(name, None, 1, 0)


def _state_bytes(optimizer) -> dict[str, int]:
    """Optimizer-state bytes per device (and host/disk when offloaded), as placed."""
    from tfdist.zero import memory_report

    return {device: kinds["optimizer_state"] for device, kinds in
            memory_report(optimizer).items() if kinds["optimizer_state"]}


def _wrap(engine, inner, config: dict):
    """The config's tfdist optimizer around `inner` (`inner` itself for the keras_multi_worker
    baseline). The same classes serve every engine: the optimizer resolves its engine when
    built."""
    if engine.name == "keras_multi_worker":
        return inner
    opt_cfg = config["optimizer"]
    if opt_cfg["zero_stage"] is None:
        return DistributedOptimizer(inner, *make_parts(config), loss_scale=opt_cfg["loss_scale"])
    offload = opt_cfg["offload"]
    if offload == "disk":
        offload = Offload("disk", opt_cfg["offload_dir"],
                          budget_bytes=int(opt_cfg["offload_budget_mb"] * 2**20))
    return ZeroOptimizer(inner, stage=opt_cfg["zero_stage"],
                         accumulation_steps=opt_cfg["accumulation_steps"], offload=offload)


def _inner_optimizer(c: dict[str, Any], learning_rate: float) -> keras.optimizers.Optimizer:
    wd = c["weight_decay"] or None
    if c["name"] == "sgd":
        return keras.optimizers.SGD(learning_rate, momentum=c["momentum"], weight_decay=wd)
    if c["name"] == "adam":
        return keras.optimizers.Adam(learning_rate, weight_decay=wd)
    if c["name"] == "adamw":
        return keras.optimizers.AdamW(learning_rate, weight_decay=c["weight_decay"] or 0.004)
    return keras.optimizers.RMSprop(learning_rate, weight_decay=wd)


def _data(c: dict[str, Any]):
    d = c["data"]
    if d["name"] == "digits":
        train = load_digits("train", d["test_fraction"], d["seed"])
        test = load_digits("test", d["test_fraction"], d["seed"])
        return train, test, (8, 8, 1), 10
    x, y = synthetic_classification(d["num_examples"], tuple(d["input_shape"]), d["num_classes"],
                                    d["seed"])
    n_test = max(1, int(round(len(y) * d["test_fraction"])))
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test]), tuple(d["input_shape"]), \
        d["num_classes"]


def accuracy(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of `model` on (x, y), in one forward pass."""
    probabilities = np.asarray(model(x, training=False))
    return float(np.mean(np.argmax(probabilities, axis=1) == y))


EVAL_TAG = "tfdist-eval "


class EpochEvaluation(keras.callbacks.Callback):
    """Test accuracy after every epoch, next to the training time so far (the sum of the step
    times but the first, tracing, step) and the bytes sent; with `announce`, each record is also
    printed as one `tfdist-eval {json}` line (what `tfdist bench --suite comm` follows)."""

    def __init__(self, x, y, timer: StepTimer, epochs: int, announce: bool = False):
        super().__init__()
        self.x, self.y, self.timer, self.epochs, self.announce = x, y, timer, epochs, announce
        self.log: list[dict[str, float]] = []

    def on_epoch_end(self, epoch, logs=None):
        exchange = chain_of(self.model.optimizer)
        record = {"epoch": epoch + 1, "epochs": self.epochs,
                  "steps": len(self.timer.times),
                  "train_seconds": round(float(sum(self.timer.times[1:])), 4),
                  "test_accuracy": accuracy(self.model, self.x, self.y),
                  "bytes_sent": None if exchange is None else float(exchange.bytes_sent)}
        self.log.append(record)
        if self.announce:
            print(EVAL_TAG + json.dumps(record), flush=True)


def train(config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Trains as `config` says; returns (and on the chief writes) the run summary."""
    start = time.time()
    engine = make_engine(config)
    keras.utils.set_random_seed(config["train"]["seed"])
    keras.config.set_dtype_policy(config["train"]["precision"])
    (x, y), (x_test, y_test), input_shape, num_classes = _data(config)

    opt_cfg, data_cfg = config["optimizer"], config["data"]
    accumulation = opt_cfg["accumulation_steps"]
    micro_batch = data_cfg["global_batch_size"] // accumulation
    if micro_batch % engine.world_size:
        raise ValueError(
            f"data.global_batch_size / optimizer.accumulation_steps = {micro_batch} must divide by "
            f"the {engine.world_size} workers/replicas: use a multiple of "
            f"{engine.world_size * accumulation} for data.global_batch_size.")
    if micro_batch > len(y):
        raise ValueError(f"data.global_batch_size ({data_cfg['global_batch_size']}) is larger "
                         f"than the training set ({len(y)} examples).")
    scale = engine.world_size if opt_cfg["scale_lr_by_workers"] else 1
    warmup = opt_cfg["warmup_epochs"] > 0 and scale > 1
    lr = opt_cfg["learning_rate"] * (1 if warmup else scale)

    scope = engine.strategy.scope() if engine.strategy else contextlib.nullcontext()
    with scope:
        model = build_model(config["model"]["name"], input_shape, num_classes,
                            config["model"]["hidden"])
        inner = _inner_optimizer(opt_cfg, lr)
        optimizer = _wrap(engine, inner, config)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        if getattr(optimizer, "averaging", None) is not None:
            optimizer.average_also(model.non_trainable_variables)

    steps = config["train"]["steps_per_epoch"] or max(1, len(y) // micro_batch)
    seed = data_cfg["seed"]
    callbacks: list[keras.callbacks.Callback] = []
    if engine.name == "horovod":
        import tfdist.horovod as thvd

        dataset = shard_batches(global_batches(x, y, micro_batch, seed=seed), engine.rank,
                                engine.world_size)
        callbacks += [thvd.callbacks.BroadcastGlobalVariables(0), thvd.callbacks.MetricAverage()]
        if warmup:
            callbacks.append(thvd.callbacks.LearningRateWarmup(opt_cfg["warmup_epochs"]))
    elif engine.strategy is not None:
        dataset = distribute(engine.strategy, x, y, micro_batch, seed=seed)
        if warmup:
            callbacks.append(LearningRateWarmup(opt_cfg["warmup_epochs"]))
    else:
        dataset = global_batches(x, y, micro_batch, seed=seed)
    output = Path(config["train"]["output_dir"])
    timer = StepTimer()
    callbacks.append(timer)
    counted = engine.name != "keras_multi_worker"  # the baseline has no tfdist optimizer
    if counted:
        callbacks.append(CommunicationStats(log_dir=str(output / "tensorboard")
                                            if engine.is_chief else None))
    evaluation = None
    if config["train"]["evaluate_each_epoch"]:
        evaluation = EpochEvaluation(x_test, y_test, timer, config["train"]["epochs"],
                                     announce=engine.is_chief)
        callbacks.append(evaluation)

    verbose = config["train"]["verbose"] if (engine.is_chief and progress) else 0
    history = model.fit(dataset, epochs=config["train"]["epochs"], steps_per_epoch=steps,
                        verbose=verbose, callbacks=callbacks)
    train_seconds = time.time() - start

    test_accuracy = accuracy(model, x_test, y_test)
    total_steps = steps * config["train"]["epochs"]
    params = int(model.count_params())
    trainable = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    dense_per_step = ring_bytes("all_reduce", 4 * trainable, engine.world_size) / accumulation
    if counted:
        bytes_sent, rounds = optimizer.bytes_sent, optimizer.communication_rounds
        calls = optimizer.collective_calls
    else:  # Keras' own all-reduce sends what a dense ring all-reduce sends (not counted)
        bytes_sent, rounds = dense_per_step * total_steps, total_steps
        calls = total_steps if engine.world_size > 1 else 0  # one batched all-reduce per step
    summary = {
        "engine": engine.name,
        "world_size": engine.world_size,
        "test_accuracy": test_accuracy,
        "test_examples": int(len(y_test)),
        "final_train_loss": float(history.history["loss"][-1]),
        "final_train_accuracy": float(history.history["accuracy"][-1]),
        "steps": total_steps,
        "parameters": params,
        "bytes_sent_total": bytes_sent,
        "bytes_sent_per_step": bytes_sent / total_steps,
        "bytes_counted": counted,
        "communication_rounds": rounds,
        # Collective calls per training step (= per gradient exchange when synchronous).
        "collectives_per_step": calls / total_steps,
        "averaging_period": (optimizer.averaging_period
                             if getattr(optimizer, "local_sgd", None) is not None else None),
        "trainable_parameters": trainable,
        "gradient_bytes_per_round": 4 * trainable,
        "compressor": compression.serialize(getattr(optimizer, "compressor", None)),
        "dense_bytes_per_step": dense_per_step,
        "bytes_ratio_vs_dense": (bytes_sent / total_steps / dense_per_step
                                 if dense_per_step else None),
        "optimizer_state_bytes": _state_bytes(optimizer) if counted else {},
        "train_seconds": round(train_seconds, 2),
        # Median over all steps but the first epoch's first (tracing) step.
        "step_ms_median": 1000 * float(np.median(timer.times[1:] or timer.times)),
        "epoch_log": evaluation.log if evaluation else None,
        "versions": {"tfdist": tfdist.__version__, "tensorflow": tf.__version__,
                     "keras": keras.__version__, "python": platform.python_version()},
        "config": config,
    }
    if engine.is_chief:
        output.mkdir(parents=True, exist_ok=True)
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
        summary["summary_path"] = str(output / "summary.json")
    keras.config.set_dtype_policy("float32")
    return summary

