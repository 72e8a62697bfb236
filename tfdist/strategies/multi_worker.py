"""`tfdist.MultiWorkerMirroredStrategy`: tf.distribute's multi-worker strategy that Keras 3 `fit` can use.

Keras 3 calls `strategy.reduce("MEAN", (x, y), axis=None)` on a whole data batch when it builds
the model, and `strategy.reduce("MEAN", metric, axis=0)` on scalar metrics; TF's collective
strategy accepts neither a nested structure nor axis=0 on a scalar, so plain
`tf.distribute.MultiWorkerMirroredStrategy` fails under `fit` (keras-team/keras#20585,
tensorflow/tensorflow#72388). This subclass reduces structures leaf by leaf and scalars over
replicas only. Everything else is TF's strategy, unchanged: `isinstance(s,
tf.distribute.MultiWorkerMirroredStrategy)` holds.

`step_logs="local"` spares every step Keras' averaging of its logs over the workers (one
collective per logged value); the hook is `tfdist._hooks.training.keep_step_logs_local`.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist._hooks.training import keep_step_logs_local
from tfdist.arguments import check_choice, check_number

STEP_LOGS = ("averaged", "local")


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Drop-in `tf.distribute.MultiWorkerMirroredStrategy` with which Keras 3 `fit` works.

    Workers are described by `TF_CONFIG` (or `cluster_resolver`), as with TF's strategy.

    Args:
        cluster_resolver: Optional cluster resolver; defaults to reading `TF_CONFIG`.
        communication_options: Optional `tf.distribute.experimental.CommunicationOptions`.
        timeout_seconds: If set (and `communication_options` is not), every collective fails
            after this many seconds instead of waiting forever for a worker that died; with
            `heartbeat_seconds`, the job's start too waits this long at most for every worker
            to join (else TensorFlow waits far longer: over 10 minutes measured).
        step_logs: "averaged" (Keras' way, the default): each step's logs (loss, metrics) are
            averaged over the workers, one collective per value at every step. "local": each
            worker's step logs are its own, with no collective, so steps that exchange nothing
            (local SGD's) do not wait for the other workers; the epoch's logs, and
            `evaluate`'s results, are averaged over every worker either way. With "local", a
            callback that decides on a step's logs (`keras.callbacks.TerminateOnNaN`) may
            decide differently on each worker.
        heartbeat_seconds: How long a worker may be silent (a network outage, a frozen
            process) before TensorFlow's coordination service declares it lost and ends the
            job. Defaults to None: TensorFlow's own, about 6 s, which a network blink outlasts.
            A link that returns within this time and within `timeout_seconds` changes nothing
            of the run.

    Example:
        ```python
        # python -m tfdist.launch --workers 2 -- python train.py  (TF_CONFIG on each worker)
        strategy = tfdist.MultiWorkerMirroredStrategy(timeout_seconds=300, heartbeat_seconds=60)
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam()),
                          loss="sparse_categorical_crossentropy")
        model.fit(tfdist.data.distribute(strategy, x, y, 64), epochs=3, steps_per_epoch=20)
        ```
    """

    def __init__(
        self,
        cluster_resolver=None,
        communication_options: tf.distribute.experimental.CommunicationOptions | None = None,
        timeout_seconds: float | None = None,
        step_logs: str = "averaged",
        heartbeat_seconds: float | None = None,
    ):
        self.step_logs = check_choice("step_logs", step_logs, STEP_LOGS)
        if heartbeat_seconds is not None:
            check_number("heartbeat_seconds", heartbeat_seconds, 1, 86400)
            from tfdist._hooks.coordination import configure

            resolver = cluster_resolver or \
                tf.distribute.cluster_resolver.TFConfigClusterResolver()
            configure(resolver.cluster_spec(), resolver.task_type,
                      int(heartbeat_seconds * 1000), int((timeout_seconds or 0) * 1000))
        if step_logs == "local":
            keep_step_logs_local()
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ValueError(
                f"`timeout_seconds` must be > 0 or None. Received: timeout_seconds={timeout_seconds}"
            )
        if communication_options is None and timeout_seconds is not None:
            communication_options = tf.distribute.experimental.CommunicationOptions(
                timeout_seconds=timeout_seconds
            )
        super().__init__(
            cluster_resolver=cluster_resolver, communication_options=communication_options
        )

    def reduce(self, reduce_op, value, axis):
        """Like `Strategy.reduce`, over nested structures; `axis` is ignored for scalars."""

        def reduce_one(v):
            leaf_axis = axis
            if leaf_axis is not None and _rank(self, v) == 0:
                leaf_axis = None
            return super(MultiWorkerMirroredStrategy, self).reduce(reduce_op, v, axis=leaf_axis)

        return tf.nest.map_structure(reduce_one, value)


def _rank(strategy: tf.distribute.Strategy, value) -> int | None:
    if isinstance(value, tf.distribute.DistributedValues):
        value = strategy.experimental_local_results(value)[0]
    return tf.convert_to_tensor(value).shape.rank
