"""Placement on a process's devices, for pipelines and tensor-parallel layers: default devices,
checks, ops whose gradients run where their forward ran, and optimizer slots beside their
variables."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfdist._hooks.optimizer import place_on_variable_devices


def local_devices(count: int) -> list[str]:
    """`count` devices of this process: the first GPUs, else `count` logical CPU devices (the
    CPU split, so several replicas or stages run on a machine without GPUs).

    Call it before TensorFlow starts its runtime (before the first op); afterwards it returns
    the CPU devices that exist, or raises if there are fewer than `count`.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < count:
            raise ValueError(f"{count} devices asked for, but only {len(gpus)} GPUs are visible.")
        return [f"/gpu:{i}" for i in range(count)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    # RuntimeError: the runtime is already initialised (e.g. in tests): use what exists.
    with contextlib.suppress(RuntimeError):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(names) < count:
        raise ValueError(
            f"{count} devices asked for, but TensorFlow was already initialised with "
            f"{len(names)} CPU devices: call local_devices before TensorFlow runs anything "
            "(for tfdist train: run it in a fresh process).")
    return names[:count]


def default_devices(count: int) -> list[str]:
    """The first `count` logical GPUs, or logical CPUs when there are no GPUs."""
    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    if count > len(devices):
        raise ValueError(f"The pipeline has {count} stages but this process has {len(devices)} "
                         f"devices ({', '.join(d.name for d in devices)}): give at most "
                         f"{len(devices)} stages, or create logical devices "
                         "(tf.config.set_logical_device_configuration) before TensorFlow starts.")
    return [d.name for d in devices[:count]]


def check_devices(devices: list[str], who: str = "Pipeline") -> None:
    """Raises when a device of `devices` does not exist in this process (TensorFlow would place
    its ops on CPU:0 without a word)."""
    known = {tf.DeviceSpec.from_string(d.name).to_string() for d in tf.config.list_logical_devices()}
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        full = tf.DeviceSpec(job="localhost", replica=0, task=0).make_merged_spec(spec).to_string()
        if full not in known and spec.to_string() not in known:
            raise ValueError(f"{who} device {device!r} does not exist in this process; its "
                             f"devices are: {', '.join(sorted(known))}.")


def chosen_devices(devices, default_count: int, who: str) -> list[str]:
    """`devices` (a list of device names) checked to exist, or this process's first
    `default_count` devices."""
    if devices is None:
        return default_devices(default_count)
    if not isinstance(devices, (list, tuple)):
        raise TypeError(f"{who}(devices={devices!r}): give a list of device names, e.g. "
                        "['/gpu:0', '/gpu:1'].")
    if not devices:
        raise ValueError(f"{who}(devices={devices!r}): give a non-empty list of device names, "
                         "e.g. ['/gpu:0', '/gpu:1'], or None for this process' first devices.")
    names = [str(d) for d in devices]
    check_devices(names, who)
    full = [tf.DeviceSpec(job="localhost", replica=0, task=0).make_merged_spec(
        tf.DeviceSpec.from_string(n)).to_string().lower() for n in names]
    twice = sorted({n for n, f in zip(names, full, strict=True) if full.count(f) > 1})
    if twice:
        raise ValueError(f"{who}(devices={names!r}): {', '.join(map(repr, twice))} is given more "
                         "than once: each shard needs a device of its own; give distinct "
                         "devices.")
    return names


def place_slots(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """Makes `optimizer` create each slot (momentum, Adam m/v, ...) on its variable's device, and
    run each variable's update there.

    Outside a strategy Keras creates every slot, and runs every update's arithmetic, on the
    default device; a pipelined model needs them next to their stage (on another host, each
    step would otherwise send the stage's gradients to the default device and the new weights
    back). Call before the optimizer is built (before `fit`); returns it.
    `PipelineModel.compile` does this itself."""
    place_on_variable_devices(optimizer)
    return optimizer


def on_device(device: str, fn, *tensors):
    """`fn(*tensors)` with its forward and its gradient ops on `device` (a plain `tf.device`
    places only the forward). Variables `fn` reads (a Keras layer's weights) get their gradients
    there too.

    Example:
        ```python
        device = tfdist.devices.local_devices(2)[1]
        w = tf.Variable(tf.ones([4, 4]))
        with tf.GradientTape() as tape:
            y = tfdist.tensor_parallel.on_device(device, lambda a: tf.matmul(a, w), tf.ones([2, 4]))
        print(tape.gradient(y, w))  # the matmul and its gradient both ran on `device`
        ```
    """

    @tf.custom_gradient
    def placed(*inputs):
        with tf.device(device), tf.GradientTape() as tape:
            # One tensor given twice (attention's key and value) gets one gradient per use.
            xs = [tf.identity(x) for x in inputs]
            tape.watch(xs)
            y = fn(*xs)

        def grad(dy, variables=None):
            with tf.device(device):
                grads = tape.gradient(y, [*xs, *(variables or [])], output_gradients=dy)
            if variables is None:
                return grads
            return grads[:len(xs)], grads[len(xs):]

        return y, grad

    return placed(*tensors)
