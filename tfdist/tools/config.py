"""Experiment configs: YAML files in configs/, validated before anything starts.

A config has seven sections (`model`, `data`, `engine`, `optimizer`, `compression`,
`averaging`, `train`); every key has a
default, a type and a rule. `load_config` fills defaults, applies `section.key=value` overrides
and reports *every* problem at once, each naming the key, the value received and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tfdist.compression import BUILT_IN as COMPRESSORS
from tfdist.tools.engines import ENGINES
from tfdist.tools.errors import ConfigError
from tfdist.tools.parts import make_offload, make_parts, metrics_of, part_makers  # noqa: F401

# The built-in models (`tfdist.tools.models.MODELS`, whose module imports Keras): named here so
# that checking a config never imports TensorFlow. tests/test_config.py keeps the two equal.
MODELS = ("cnn", "mlp", "resnet50", "transformer")


@dataclass(frozen=True)
class Field:
    default: Any
    types: tuple[type, ...]
    rule: str
    check: Callable[[Any], bool] = lambda v: True
    nullable: bool = False
    convert: Callable[[Any], Any] = lambda v: v
    choices: tuple = ()  # the names a text value may take: a misspelt one gets "did you mean"


def _int(rule: str, check: Callable[[int], bool], default, nullable=False,
         most: int = 2**31 - 1) -> Field:
    """An integer meeting `check`, and at most `most` (no key needs more)."""
    return Field(default, (int,), f"{rule} (at most {most:,})" if most != 2**31 - 1 else rule,
                 lambda v: check(v) and v <= most, nullable)


def _number(v: Any) -> float | None:
    """`v` as a float: a number, or text that reads as one. YAML 1.1 takes `1e-6` and `1.0e6`
    (no dot, or no sign in the exponent) for text, which Python and every user read as numbers."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v) if isinstance(v, str) and len(v) <= 64 else None
    except ValueError:
        return None


def _float(rule: str, check: Callable[[float], bool], default, nullable=False,
           most: float = 1e9) -> Field:
    """A finite number meeting `check`, at most `most`; integers (and text such as '1e-6') are
    taken as floats."""
    def ok(v: Any) -> bool:
        n = _number(v)
        return n is not None and math.isfinite(n) and check(n) and n <= most

    return Field(default, (int, float, str), f"{rule} (finite, at most {most:g})", ok, nullable,
                 _number)


SEED = _int("an integer >= 0", lambda v: v >= 0, 0, most=2**32 - 1)


def _choice(choices: tuple, default) -> Field:
    return Field(default, tuple({type(c) for c in choices if c is not None}) or (str,),
                 f"one of {list(choices)}", lambda v: v in choices, None in choices,
                 choices=choices)


def _positive_ints(v, most: int = 2**20, length: int = 64) -> bool:
    return isinstance(v, list) and 0 < len(v) <= length and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 < i <= most for i in v)


def _signal_names(v) -> bool:
    """A list of signal names that a process can catch (not SIGKILL or SIGSTOP)."""
    return isinstance(v, list) and len(v) <= 8 and all(
        isinstance(n, str) and n in signal.Signals.__members__
        and n not in ("SIGKILL", "SIGSTOP") for n in v)


def _text(rule: str, default, check: Callable[[str], bool] = lambda v: True,
          nullable=False) -> Field:
    """A string of at most 4,096 characters, without NUL."""
    return Field(default, (str,), rule,
                 lambda v: 0 < len(v) <= 4096 and "\0" not in v and check(v), nullable)


OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
# the optimizers `optimizer.fused_update: true` compiles with XLA (tfdist._hooks.optimizer)
XLA_FUSED = ("adam", "adamw")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
# Logical CPU devices each start thread pools of their own: 1,024 of them end in pthread_create
# failing; no machine holds more than a few dozen accelerators.
MAX_DEVICES = 64
ADAMW_WEIGHT_DECAY = 0.004  # keras.optimizers.AdamW's default

_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _did_you_mean(value: Any, choices: tuple) -> str:
    """' (did you mean 'X'?)' for a text value close to one of `choices`, else ''."""
    names = [c for c in choices if isinstance(c, str)]
    near = difflib.get_close_matches(value, names, n=1) if isinstance(value, str) else []
    return f" (did you mean '{near[0]}'?)" if near else ""


def _builtin_or_function(builtins: tuple[str, ...], default: str) -> Field:
    return Field(default, (str,), f"one of {list(builtins)}, or your own function as "
                 "'module.path:function'", lambda v: v in builtins or bool(_FUNCTION.match(v)),
                 choices=builtins)


SCHEMA: dict[str, dict[str, Field]] = {
    "model": {
        "name": _builtin_or_function(tuple(sorted(MODELS)), "cnn"),
        "hidden": Field([64], (list,), "a list of 1 to 64 integers in [1, 1,048,576] (Dense "
                        "widths)", _positive_ints),
        "options": Field({}, (dict,), "a mapping of keyword arguments for your own model "
                         "function"),
    },
    "data": {
        "name": _builtin_or_function(("digits", "synthetic", "records"), "digits"),
        # records: a record set written by `tfdist data convert` (each worker reads its slice).
        "path": _text("a directory (data.name records: a record set written by `tfdist data "
                      "convert`), or null", None, nullable=True),
        "decode": Field(None, (str, type(None)), "'module.path:function' decoding one record "
                        "to (x, y) (data.name records of your own records), or null",
                        lambda v: v is None or bool(_FUNCTION.match(v))),
        # records: read and decoded by the data workers of the tf.data service at this
        # dispatcher (`tfdist data serve`, or python -m tfdist.launch --data-hosts).
        "service": _text("the tf.data service dispatcher's host:port (data.name records), or "
                         "null (each trainer reads its own slice)", None,
                         lambda v: bool(re.fullmatch(r"(grpc://)?[^\s:/]+:\d{1,5}", v)),
                         nullable=True),
        "service_mode": Field("distributed_epoch", (str,), "distributed_epoch (every record "
                              "once per pass across the trainers) or parallel_epochs (each "
                              "trainer its own passes)",
                              lambda v: v in ("distributed_epoch", "parallel_epochs"),
                              choices=("distributed_epoch", "parallel_epochs")),
        "options": Field({}, (dict,), "a mapping of keyword arguments for your own data "
                         "function"),
        "global_batch_size": _int("an integer >= 1", lambda v: v >= 1, 64, most=2**24),
        "test_fraction": _float("a number in (0, 1)", lambda v: 0 < v < 1, 0.2),
        "seed": SEED,
        "num_examples": _int("an integer >= 2 (synthetic data only)", lambda v: v >= 2, 4096,
                             most=10**8),
        "input_shape": Field([32], (list,), "a list of 1 to 8 integers in [1, 65,536] "
                             "(synthetic data only)",
                             lambda v: _positive_ints(v, 2**16, 8) and math.prod(v) <= 10**8),
        "num_classes": _int("an integer >= 2 (synthetic data, and your own tf.data datasets)",
                            lambda v: v >= 2, 10, most=10**6),
    },
    "engine": {
        "name": Field("mirrored", (str,), f"one of {list(ENGINES)}, or your own JobEngine "
                      "subclass as 'module.path:Class' (tfdist.tools.engines)",
                      lambda v: v in ENGINES or bool(_FUNCTION.match(v)), choices=tuple(ENGINES)),
        "options": Field({}, (dict,), "a mapping of your own engine's options (the fields of "
                         "its JobEngine.Options; the built-in engines take none)"),
        "devices": _int("an integer >= 1 (this machine's devices, logical CPU devices when "
                        "there is no GPU; more come from more workers: engine.name "
                        "multi_worker)", lambda v: v >= 1, 2, most=MAX_DEVICES),
        "timeout_seconds": _float("a number > 0, or null", lambda v: v > 0, 600, nullable=True,
                                  most=10**7),
        # multi_worker: how long a worker may be silent (a network outage) before the job ends;
        # null: TensorFlow's own (about 6 s).
        "heartbeat_seconds": _float("a number in [1, 86,400] (seconds), or null (TensorFlow's "
                                    "own, about 6 s)", lambda v: v >= 1, 60, nullable=True,
                                    most=86400),
        # multi_worker: each step's logs averaged over the workers (Keras' way, a collective
        # per logged value every step) or each worker's own; null: the engine's own ("local";
        # "averaged" for the benchmarks' plain-Keras baseline). Epoch logs are averaged either
        # way.
        "step_logs": _choice((None, "local", "averaged"), None),
        # parameter_server: 0 synchronous, s >= 1 bounded staleness, null asynchronous.
        "staleness": _int("an integer >= 0 (0 synchronous, s bounded), or null (asynchronous)",
                          lambda v: v >= 0, 0, nullable=True, most=10**6),
        "worker_timeout": _float("a number > 0 (seconds of silence before a worker is lost)",
                                 lambda v: v > 0, 120, most=10**7),
        # parameter_server: a gradient of staleness t >= 1 gets the learning rate / t.
        "scale_lr_by_staleness": Field(False, (bool,), "true or false"),
        # horovod: ms between the rounds of Horovod's background thread (HOROVOD_CYCLE_TIME);
        # null: Horovod's own (1 ms, or the variable where it is set).
        "horovod_cycle_ms": _float("a number > 0 (ms), or null (Horovod's own)",
                                   lambda v: v > 0, None, nullable=True, most=1000),
        # parameter_server: DC-ASGD's lambda for stale gradients (e.g. 0.04), or null.
        "delay_compensation": _float("a number >= 0, or null", lambda v: v >= 0, None,
                                     nullable=True, most=1e6),
    },
    "optimizer": {
        "name": _choice(OPTIMIZERS, "adam"),
        "learning_rate": _float("a number > 0", lambda v: v > 0, 0.002, most=1e6),
        "momentum": _float("a number in [0, 1) (sgd only)", lambda v: 0 <= v < 1, 0.9),
        "weight_decay": _float("a number >= 0, or null (the optimizer's own: 0.004 for adamw, "
                               "none for the others)", lambda v: v >= 0, None, nullable=True,
                               most=1.0),
        "accumulation_steps": _int("an integer >= 1", lambda v: v >= 1, 1, most=2**16),
        "nan_policy": _choice(("raise", "skip"), "raise"),
        "fused_update": Field(True, (bool, str), f"true ({' and '.join(XLA_FUSED)} compiled "
                              "by XLA, sgd in one TensorFlow kernel per variable), xla (any "
                              "optimizer's own update, compiled by XLA) or false (Keras' own "
                              "update)", lambda v: isinstance(v, bool) or v == "xla",
                              choices=("xla",)),
        "loss_scale": _choice(("auto", "dynamic", None), "auto"),
        "scale_lr_by_workers": Field(False, (bool,), "true or false"),
        "warmup_epochs": _float("a number >= 0", lambda v: v >= 0, 0, most=10**6),
        "zero_stage": _choice((None, 1, 2, 3), None),
        "offload": _choice((None, "cpu", "disk"), None),
        "offload_dir": _text("an existing directory, or null (a temporary one)", None,
                             nullable=True),
        "offload_budget_mb": _float("a number > 0 (MiB of state in host memory at once)",
                                    lambda v: v > 0, 64, most=2**30),
    },
    "compression": {
        "name": Field("none", (str,), f"one of {['auto', *sorted(COMPRESSORS)]}, or your own "
                      "Compressor subclass as 'module.path:Class'",
                      lambda v: v == "auto" or v in COMPRESSORS or bool(_FUNCTION.match(v)),
                      choices=("auto", *sorted(COMPRESSORS))),
        "options": Field({}, (dict,), "a mapping of the compressor's arguments (e.g. ratio: 0.01; "
                         "for auto: probe_steps, explore, candidates, ...)"),
        "error_feedback": Field(False, (bool,), "true or false"),
        "min_size": _int("an integer >= 0 (smaller tensors are sent dense)", lambda v: v >= 0,
                         1024),
        "compress_1d": Field(False, (bool,), "true or false"),
        "start_step": _int("an integer >= 0 (exchanges sent dense first)", lambda v: v >= 0, 0),
        "bucket_mb": _float("a number > 0 (MiB per all-reduce of the dense exchange, last layers "
                            "first, overlapping the backward pass), or null (one all-reduce)",
                            lambda v: v > 0, 25, nullable=True, most=2**20),
    },
    "averaging": {
        "period": _int("an integer >= 1, or null for synchronous training", lambda v: v >= 1,
                       None, nullable=True),
        "warmup_steps": _int("an integer >= 0 (synchronous steps first)", lambda v: v >= 0, 0),
        "topology": _choice(("all", "ring"), "all"),
        "intra_period": _int("an integer >= 1 dividing averaging.period, or null (hierarchical "
                             "averaging off)", lambda v: v >= 1, None, nullable=True),
        "host_size": _int("an integer >= 1 dividing the number of replicas, or null (each "
                          "worker's devices)", lambda v: v >= 1, None, nullable=True),
        "outer": Field(None, (dict,), "null (plain averaging), or an outer rule with its options: "
                       "{name: slowmo, momentum: 0.5, learning_rate: 1.0}, {name: sma, alpha: "
                       "0.25, momentum: 0.5}, or your own OuterRule subclass as "
                       "{name: 'module.path:Class', ...options}", nullable=True),
        "average_optimizer_state": Field(False, (bool,), "true or false"),
    },
    "train": {
        "epochs": _int("an integer >= 1", lambda v: v >= 1, 15, most=10**6),
        "steps_per_epoch": _int("an integer >= 1, or null (one pass over the data)",
                                lambda v: v >= 1, None, nullable=True, most=10**9),
        "seed": SEED,
        "precision": _choice(PRECISIONS, "float32"),
        "output_dir": _text("a directory path (runs go in directories inside it)",
                            "runs/default"),
        "run_name": _text("a directory name (no '/'), or null for the run's start time", None,
                          lambda v: "/" not in v and v not in (".", ".."), nullable=True),
        "save_model": Field(True, (bool,), "true or false (model.keras in the run directory)"),
        "loss": _text("a Keras loss name", "sparse_categorical_crossentropy",
                      lambda v: v.isidentifier()),
        "metrics": Field(None, (list,), "a list of Keras metric names (e.g. [accuracy], [mae, "
                         "mse]), or null for the task's: accuracy with a crossentropy loss, mae "
                         "otherwise (a regression)",
                         lambda v: len(v) <= 16 and all(isinstance(m, str) and m.isidentifier()
                                                        for m in v), nullable=True),
        "verbose": _int("0, 1 or 2, or null (a progress bar on a terminal, a line per epoch "
                        "otherwise)", lambda v: v in (0, 1, 2), None, nullable=True),
        "evaluate_each_epoch": Field(False, (bool,), "true or false (test accuracy after every "
                                     "epoch, logged with the training time so far)"),
        "checkpoint_steps": _int("an integer >= 1 (steps between backups in "
                                 "train.output_dir/backup; the same command resumes), or null",
                                 lambda v: v >= 1, None, nullable=True, most=10**9),
        "preemption_signals": Field(
            ["SIGTERM", "SIGUSR1"], (list,), "a list of catchable signal names, e.g. [SIGTERM, "
            "SIGUSR1], or [] (with train.checkpoint_steps: on such a signal every worker backs "
            "up at the step in flight and exits with 76; the same command resumes)",
            _signal_names),
        "profile_step": _int("an integer >= 1 (the step, counted over epochs, whose timeline "
                             "the chief writes to timeline.json and timeline.png in the run "
                             "directory), or null", lambda v: v >= 1, None, nullable=True,
                             most=10**9),
        "resize_policy": _choice((None, "throughput"), None),
        "resize_every": _int("an integer >= 1 (steps measured at each size)", lambda v: v >= 1,
                             50, most=10**9),
    },
}


def defaults() -> dict[str, dict[str, Any]]:
    return {s: {k: copy.deepcopy(f.default) for k, f in fields.items()}
            for s, fields in SCHEMA.items()}


def _unknown(key: str, allowed) -> str:
    return (f"unknown key '{key}'{_did_you_mean(key, tuple(allowed))}; allowed: "
            f"{', '.join(sorted(allowed))}")


def validate(raw: Any) -> dict[str, dict[str, Any]]:
    """Returns the full config (defaults filled) or raises ConfigError listing every problem."""
    errors: list[str] = []
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"A config must be a mapping of sections; got {type(raw).__name__}.")
    config = defaults()
    for section, values in raw.items():
        if section not in SCHEMA:
            errors.append(_unknown(str(section), SCHEMA))
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            errors.append(f"{section}: must be a mapping of keys; got {_show(values)}")
            continue
        for key, value in values.items():
            field = SCHEMA[section].get(key)
            name = f"{section}.{key}"
            if field is None:
                errors.append(f"{section}: {_unknown(str(key), SCHEMA[section])}")
                continue
            if value is None and field.nullable:
                config[section][key] = None
                continue
            ok_type = isinstance(value, field.types) and not (
                isinstance(value, bool) and bool not in field.types)
            if not ok_type or not field.check(value):
                errors.append(f"{name}: got {_show(value)}; must be {field.rule}"
                              + _did_you_mean(value, field.choices))
                continue
            config[section][key] = field.convert(value)
    if not errors:
        errors += _cross_checks(config) + _given_checks(raw, config) + _memory_checks(config)
    if errors:
        shown = [_cut(e, 400) for e in errors[:MAX_ERRORS]]
        more = len(errors) - len(shown)
        raise ConfigError("Invalid config:\n  " + "\n  ".join(shown)
                          + (f"\n  ... and {more} more" if more else ""))
    opt = config["optimizer"]
    if opt["weight_decay"] is None:  # recorded as used (config.yaml, the backups' job identity)
        opt["weight_decay"] = ADAMW_WEIGHT_DECAY if opt["name"] == "adamw" else 0.0
    return config


def _given_checks(raw: dict, c: dict[str, dict[str, Any]]) -> list[str]:
    """Values that are valid alone but mean nothing with the rest: said, not ignored."""
    def given(section: str, key: str) -> bool:
        """Set, to another value than the default (a run's config.yaml lists every key)."""
        return isinstance(raw.get(section), dict) and key in raw[section] and \
            c[section][key] != SCHEMA[section][key].default

    errors = []
    if given("optimizer", "momentum") and c["optimizer"]["momentum"] and \
            c["optimizer"]["name"] != "sgd":
        errors.append(f"optimizer.momentum: optimizer.name {c['optimizer']['name']!r} takes no "
                      "momentum (adam's beta_1 plays that part); remove it, or use sgd")
    for section, builtins in (("model", MODELS), ("data", ("digits", "synthetic", "records"))):
        if c[section]["options"] and c[section]["name"] in builtins:
            errors.append(f"{section}.options: the built-in {section} {c[section]['name']!r} "
                          f"takes none (they are the arguments of your own {section} function, "
                          f"{section}.name 'module:function'); remove them")
    if c["data"]["name"] != "synthetic":
        for key in ("num_examples", "input_shape"):
            if given("data", key):
                errors.append(f"data.{key}: only for data.name synthetic; remove it")
    if c["data"]["name"] == "records" and not c["data"]["path"]:
        errors.append("data.path: data.name records reads a record set: give its directory "
                      "(written by `tfdist data convert`)")
    if c["data"]["name"] != "records":
        for key in ("path", "decode", "service"):
            if c["data"][key] is not None:
                errors.append(f"data.{key}: only for data.name records; remove it, or set "
                              "data.name: records")
    if given("data", "service_mode") and c["data"]["service"] is None:
        errors.append("data.service_mode: only with data.service (the tf.data service's "
                      "dispatcher); remove it, or give data.service")
    return errors


def _memory() -> int:
    """This machine's physical memory in bytes (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _memory_checks(c: dict[str, dict[str, Any]]) -> list[str]:
    """Sizes that would allocate until the machine runs out of memory: the synthetic set, and the
    Dense layers of the built-in mlp and cnn (weights, gradients and two optimizer slots, a copy
    per device of this machine)."""
    memory, errors = _memory(), list[str]()
    if not memory:
        return errors
    data, model = c["data"], c["model"]
    shape: list[int] | None = {"digits": [8, 8, 1], "synthetic": data["input_shape"]}.get(
        data["name"])
    if shape is not None and data["name"] == "synthetic":
        need = 4 * data["num_examples"] * math.prod(shape)
        if need > memory // 2:
            errors.append(f"data.num_examples: {data['num_examples']:,} examples of shape "
                          f"{shape} take {need / 2**30:,.1f} GiB, more than half of this "
                          f"machine's {memory / 2**30:,.1f} GiB; use fewer or smaller examples")
    if shape is not None and model["name"] in ("mlp", "cnn"):
        features = math.prod(shape) if model["name"] == "mlp" else (
            (shape[0] // 2) * (shape[1] // 2) * 64 if len(shape) == 3 else 0)
        widths = [features, *model["hidden"], data["num_classes"]]
        weights = sum(a * b for a, b in zip(widths, widths[1:]))
        try:
            replicated = _engine(c).devices_are_replicas
        except ValueError:  # reported by the cross-checks
            replicated = False
        copies = c["engine"]["devices"] if replicated else 1
        need = 4 * weights * 4 * copies
        if need > memory:
            errors.append(f"model.hidden: {model['hidden']} gives {weights:,} Dense weights, "
                          f"{need / 2**30:,.1f} GiB with gradients and optimizer state "
                          f"({copies} cop{'y' if copies == 1 else 'ies'}), more than this "
                          f"machine's {memory / 2**30:,.1f} GiB; use narrower layers")
    return errors


MAX_ERRORS = 20


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _show(value: Any) -> str:
    """`repr(value)`, at most 80 characters: errors stay readable whatever the input."""
    try:
        return _cut(repr(value), 80)
    except RecursionError:  # a self-referencing structure
        return f"<a {type(value).__name__} that contains itself>"


def _engine(c: dict[str, dict[str, Any]]):
    """The `tfdist.tools.engines.JobEngine` of a config whose engine.name is known (checked)."""
    return ENGINES.lookup(c["engine"]["name"])()


def _cross_checks(c: dict[str, dict[str, Any]]) -> list[str]:
    engine, data = c["engine"], c["data"]
    try:
        kind = _engine(c)
    except ValueError as e:  # a 'module:Class' that does not import
        return [f"engine.name: {e}"]
    errors = []
    if kind.devices_are_replicas and data["global_batch_size"] % engine["devices"]:
        errors.append(
            f"data.global_batch_size: got {data['global_batch_size']}; must divide by "
            f"engine.devices ({engine['devices']}): use a multiple of {engine['devices']}")
    if c["optimizer"]["accumulation_steps"] > 1 and \
            data["global_batch_size"] % c["optimizer"]["accumulation_steps"]:
        errors.append(
            f"data.global_batch_size: got {data['global_batch_size']}; must divide by "
            f"optimizer.accumulation_steps ({c['optimizer']['accumulation_steps']})")
    comp, avg = c["compression"], c["averaging"]
    if comp["name"] == "auto" and comp["error_feedback"]:
        errors.append("compression.error_feedback: compression.name 'auto' picks among exchanges "
                      "with their own error handling; set error_feedback to false")
    if avg["period"] is None:
        for key in ("outer", "intra_period", "host_size"):
            if avg[key] is not None:
                errors.append(f"averaging.{key}: needs averaging.period (local SGD)")
    if avg["host_size"] is not None and avg["intra_period"] is None:
        errors.append("averaging.host_size: needs averaging.intra_period (hierarchical averaging)")
    errors += _build_errors(c)
    errors += _zero_checks(c)
    if c["train"]["resize_policy"] is not None and not c["train"]["checkpoint_steps"]:
        errors.append("train.resize_policy: a resize restarts the job from a backup; set "
                      "train.checkpoint_steps too")
    if engine["horovod_cycle_ms"] is not None and engine["name"] != "horovod":
        errors.append(f"engine.horovod_cycle_ms: sets Horovod's cycle time; engine.name "
                      f"{engine['name']!r} does not run Horovod: set it to null, or use "
                      "engine.name horovod")
    try:
        kind.read_options(engine["options"])
    except ValueError as e:
        errors.append(f"engine.options: {e}")
    errors += kind.check(c)
    if c["optimizer"]["nan_policy"] == "skip" and not kind.tfdist_optimizer:
        errors.append(f"optimizer.nan_policy: 'skip' is a tfdist optimizer's check of the reduced "
                      f"gradients; engine.name {engine['name']!r} has none: use 'raise', or an "
                      "engine such as 'multi_worker'")
    if c["optimizer"]["loss_scale"] == "dynamic" and c["train"]["precision"] == "mixed_bfloat16":
        errors.append("optimizer.loss_scale: got 'dynamic'; bfloat16 needs no loss scaling, "
                      "use 'auto' or null")
    return errors


def _zero_checks(c: dict[str, dict[str, Any]]) -> list[str]:
    opt, errors = c["optimizer"], []
    if opt["zero_stage"] is None:
        for key in ("offload", "offload_dir"):
            if opt[key] is not None:
                errors.append(f"optimizer.{key}: needs optimizer.zero_stage (1, 2 or 3)")
        return errors
    if c["compression"]["name"] != "none" or c["averaging"]["period"] is not None:
        errors.append("optimizer.zero_stage: ZeRO shards the exchange itself, so it does not "
                      "combine with compression or local SGD; set compression.name to none and "
                      "averaging.period to null")
    from tfdist.zero import ZeroOptimizer

    try:  # the optimizer's own rules, as it would apply them
        ZeroOptimizer.check_dtype_policy(c["train"]["precision"])
    except ValueError as e:
        errors.append(f"train.precision: {e}")
    if opt["offload_dir"] is not None and opt["offload"] != "disk":
        errors.append("optimizer.offload_dir: only for optimizer.offload: disk")
    else:
        try:
            make_offload(opt)
        except ValueError as e:
            key = "offload_dir" if opt["offload_dir"] is not None else "offload_budget_mb"
            errors.append(f"optimizer.{key}: {e}")
    return errors


def _build_errors(c: dict[str, dict[str, Any]]) -> list[str]:
    errors = []
    for section, make in part_makers(c):
        try:
            make()
        except (TypeError, ValueError) as e:
            errors.append(f"{section}: {e}")
    return errors


MAX_DEPTH = 32  # nesting of lists and mappings; a config needs 3


class _Loader(yaml.SafeLoader):
    """YAML without aliases, duplicate keys or deep nesting: a config has no use for them, an
    alias bomb (a few lines that expand to millions of nodes) must not reach the validation or its
    messages, and of two values for one key YAML would keep the last without a word."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(f"YAML aliases (*name) are not allowed in a config (line "
                              f"{mark.line + 1}); write the value out.")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"Lists or mappings nested more than {MAX_DEPTH} deep (line "
                                  f"{mark.line + 1}, column {mark.column + 1}); a config needs 3.")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"Key {key!r} is given twice (lines {seen[key]} and {line}); "
                                  "keep one.")
            if isinstance(key, (str, int, float, bool)):
                seen[key] = line
        return super().construct_mapping(node, deep)


MAX_CONFIG_BYTES = 1 << 20


def load_yaml(text: str, where: str) -> Any:
    """`text` parsed as YAML (no aliases), or a ConfigError naming `where`."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {_cut(str(e), 400)}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, YAML-parsed value)."""
    path, sep, value = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(
            f"Override {_cut(repr(text), 80)} must look like section.key=value (e.g. "
            "train.epochs=3).")
    return section, key, load_yaml(value, f"Override {_cut(repr(text), 80)}: the value")


def configs_dir() -> Path:
    """configs/ of the working directory, else the one beside the package (a source checkout)."""
    here = Path("configs")
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "configs"


def _near_file(path: Path) -> str:
    """' Did you mean X?' for a YAML file of a close name (in the folder given, or configs/)."""
    candidates: dict[str, Path] = {}
    for folder in (path.parent, configs_dir()):
        if folder.is_dir():
            for found in folder.glob("*.y*ml"):
                candidates.setdefault(found.name, found)
    near = difflib.get_close_matches(path.name, list(candidates), n=1)
    return f" Did you mean {candidates[near[0]]}?" if near else ""


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML file's top-level mapping ({} for an empty file), or a ConfigError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what.capitalize()} not found: {p}.{_near_file(p)} The shipped "
                          f"configs are in {configs_dir()}: "
                          f"{', '.join(sorted(c.name for c in configs_dir().glob('*.yaml')))}.")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: {p.stat().st_size:,} bytes is not a {what} (at most "
                          f"{MAX_CONFIG_BYTES:,}).")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{p} is not a text file (a {what} is YAML text).") from None
    raw = load_yaml(text, str(p)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: a {what} must be a mapping of keys.")
    return raw


def read_config(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A YAML config (or {}) with the overrides applied, not validated: what the file and the
    overrides say, without the defaults (and without loading TensorFlow)."""
    raw = copy.deepcopy(read_yaml_mapping(path, "config file")) if path is not None else {}
    for text in overrides:
        section, key, value = parse_override(text)
        if not isinstance(raw.get(section), dict):
            raw[section] = {} if raw.get(section) is None else raw[section]
        if isinstance(raw[section], dict):
            raw[section][key] = value
    return raw


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Reads a YAML config (or starts from defaults), applies overrides, validates; an invalid
    one names the file (and the overrides) its problems are in."""
    try:
        return validate(read_config(path, overrides))
    except ConfigError as e:
        where = [str(path)] if path is not None else []
        where += ["--set " + " --set ".join(overrides)] if overrides else []
        if not where or not str(e).startswith("Invalid config:"):
            raise
        raise ConfigError(f"Invalid config ({', '.join(where)}):"
                          f"{str(e)[len('Invalid config:'):]}") from None
