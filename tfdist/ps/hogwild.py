"""Hogwild on one host (Recht et al., NeurIPS 2011): replicas on the local devices update one
shared copy of the weights with plain SGD, without locks and without waiting for each other.

`HogwildStrategy(devices)` is a `CentralStorageStrategy`: the variables live once, on the
parameter device (the host CPU by default), and every device computes a replica's gradients on
its share of the batch (batch normalization's moving statistics follow the first replica).
`HogwildSGD(learning_rate)` is the optimizer to compile with under it:
each replica applies its own gradient to the shared weights as soon as it has it
(`ResourceApplyGradientDescent` with `use_locking=False`), with no all-reduce and no merge; a
replica's gradient is computed on weights some of the others' updates may not have reached yet.

Counted as the parameter servers count them: every replica's update is one push of its
gradient's bytes to the parameter device, and the staleness of each update is the number of
other replicas' updates of the same step applied before it (those its gradient did not see,
since every replica reads the weights when the step begins), in a histogram (`report()`).
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfdist._hooks.distribute import central_variable
from tfdist._hooks.optimizer import built_variables
from tfdist.devices import local_devices
from tfdist.ps.cluster import nbytes
from tfdist.ps.server import BUCKETS, staleness_report


class HogwildStrategy(tf.distribute.experimental.CentralStorageStrategy):
    """Replicas on `devices` sharing one copy of the variables on `parameter_device`.

    Args:
        devices: The compute devices: their names, or a count (this machine's first GPUs,
            else that many logical CPU devices; `tfdist.devices.local_devices`).
        parameter_device: Where the shared variables live. Defaults to "/cpu:0".

    Example:
        ```python
        strategy = tfdist.ps.HogwildStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.ps.HogwildSGD(0.05),
                          loss="sparse_categorical_crossentropy", jit_compile=False)
        model.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    def __init__(self, devices, parameter_device: str = "/cpu:0"):
        names = local_devices(devices) if isinstance(devices, int) else list(devices)
        if not names:
            raise ValueError("HogwildStrategy needs at least one device. Received: devices="
                             f"{devices!r}")
        super().__init__(compute_devices=names, parameter_device=parameter_device)

    @contextlib.contextmanager
    def scope(self):
        """The strategy's scope, where variables that do not say how replicas combine their
        updates (batch normalization's moving statistics, updated by the layers themselves)
        take the first replica's: the shared weights themselves are updated by `HogwildSGD`."""
        with super().scope(), tf.variable_creator_scope(_first_replica_updates):
            yield self


def _first_replica_updates(next_creator, **kwargs):
    if kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE) and \
            not kwargs.get("trainable", True):
        kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
    return next_creator(**kwargs)


@keras.saving.register_keras_serializable(package="tfdist")
class HogwildSGD(keras.optimizers.Optimizer):
    """Plain SGD whose replicas update the shared weights without locks (see the module
    docstring). Under any other strategy, or none, with one replica it is plain SGD; with
    several replicas of a strategy that copies the variables it is refused.

    Args:
        learning_rate: A float or a schedule.
        name: Optional name.

    Example:
        ```python
        strategy = tfdist.ps.HogwildStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.ps.HogwildSGD(0.05),
                          loss="sparse_categorical_crossentropy", jit_compile=False)
        model.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    def __init__(self, learning_rate=0.01, name: str | None = None, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name or "hogwild_sgd", **kwargs)

    def build(self, var_list):
        super().build(var_list)
        strategy = tf.distribute.get_strategy()
        self._replicas = strategy.num_replicas_in_sync
        if self._replicas > 1 and not isinstance(
                strategy, tf.distribute.experimental.CentralStorageStrategy):
            raise ValueError(
                f"HogwildSGD shares one copy of the weights between replicas; "
                f"{type(strategy).__name__} gives each replica its own. Build the model and "
                "compile under tfdist.ps.HogwildStrategy(devices).")
        self._push_bytes = sum(nbytes(v) for v in var_list)
        with tf.init_scope():
            self._version = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="hogwild_version")
            # Row r: replica r's updates by staleness (only replica r writes it: no races).
            self._histogram = tf.Variable(tf.zeros([self._replicas, BUCKETS], tf.int64),
                                          trainable=False, name="hogwild_staleness")

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = list(trainable_variables or built_variables(self))
        context = tf.distribute.get_replica_context()
        replica = (tf.get_static_value(context.replica_id_in_sync_group)
                   if context is not None else 0)
        lr = tf.cast(self.learning_rate, tf.float32)
        updates = []
        for g, v in zip(grads, variables):
            if g is None:
                continue
            target = central_variable(v)
            if isinstance(g, tf.IndexedSlices):
                updates.append(tf.raw_ops.ResourceScatterSub(
                    resource=target.handle, indices=g.indices,
                    updates=tf.cast(lr, g.values.dtype) * g.values))
            else:
                updates.append(tf.raw_ops.ResourceApplyGradientDescent(
                    var=target.handle, alpha=tf.cast(lr, g.dtype), delta=g, use_locking=False))
        with tf.control_dependencies(updates):
            version = central_variable(self._version).assign_add(1)
            stale = (version - 1) % self._replicas
            tf.raw_ops.ResourceScatterNdAdd(
                ref=central_variable(self._histogram).handle,
                indices=tf.reshape(tf.stack([tf.constant(int(replica or 0), tf.int64),
                                             tf.minimum(stale, BUCKETS - 1)]), [1, 2]),
                updates=tf.ones([1], tf.int64))
            if not replica:
                central_variable(self.iterations).assign_add(1)

    # -- counters (the names every tfdist optimizer uses) ---------------------------------------
    def report(self) -> dict:
        """Updates applied and their staleness (`tfdist.ps.staleness_report`'s keys)."""
        if not self.built:
            return staleness_report(np.zeros(BUCKETS + 4, np.int64))
        histogram = np.asarray(self._histogram.numpy()).sum(axis=0)
        version = int(self._version.numpy())
        return staleness_report(np.concatenate([histogram, [version, version, 0, 0]]))

    @property
    def bytes_sent(self) -> float:
        """Bytes the replicas wrote to the shared weights (one gradient per update)."""
        return float(self._push_bytes * int(self._version.numpy())) if self.built else 0.0

    @property
    def communication_rounds(self) -> int:
        return int(self._version.numpy()) if self.built else 0

    @property
    def collective_calls(self) -> int:
        return 0
