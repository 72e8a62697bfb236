"""The workers' side of parameter-server training: a Keras optimizer whose step pushes the
gradients to the parameter servers, waits as their consistency rule says, and pulls the weights.

Each worker runs plain `model.fit` on its own shard of the data; the inner optimizer (and its
state) lives on the parameter servers (`tfdist.ps.serve`). The worker's step, inside Keras'
traced train step:

    push(gradients of each server's shard, the weights' version, the learning rate)
    while not every server says ready: sleep `poll_seconds`, ask again
    pull every shard's weights into the model

The RPCs are TensorFlow's own (`tf.distribute.experimental.rpc`, gRPC), called from the graph.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import keras
import tensorflow as tf

from tfdist import compression
from tfdist._hooks.optimizer import built_variables
from tfdist.arguments import check_bool, check_int, check_number
from tfdist.callbacks.scalars import ScalarWriter
from tfdist.optimizers.parts import dense_gradient
from tfdist.ps.cluster import Cluster, assign_shards, nbytes
from tfdist.ps.codec import MIN_SIZE, codecs_for, push_nbytes
from tfdist.ps.server import REQUEST, STATS_LEN, SetupMismatch, server_name, staleness_report
from tfdist.security import require_secret, sign

SERVER_GONE = "failed to answer"  # in the error of a call its server did not answer
SCALAR = tf.TensorSpec([], tf.int64)


def connect(address: str, name: str, timeout: float):
    """An RPC client of the parameter server at `address`, retried until it answers.

    Raises:
        ConnectionError: nothing answered within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return tf.distribute.experimental.rpc.Client.create("grpc", address, name=name,
                                                                timeout_in_ms=5000)
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.InternalError) as e:
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"No parameter server answered at {address} within {timeout:g} s "
                    f"({e.message.splitlines()[0] if e.message else type(e).__name__}): start "
                    "the ps task(s) (`python -m tfdist.launch --ps 1 --workers N -- ...` starts "
                    "them all), or raise `connect_timeout`.") from None
            time.sleep(0.5)


@keras.saving.register_keras_serializable(package="tfdist")
class ParameterServerOptimizer(keras.optimizers.Optimizer):
    """A worker's optimizer in parameter-server training (see the module docstring).

    The optimizer that updates the weights runs on the parameter servers
    (`tfdist.ps.serve(model, optimizer, ...)`); this one only carries the learning rate (sent
    with every push, so schedules and warm-up callbacks on the worker steer the servers) and
    the traffic counters. Compile with `jit_compile=False` (the RPCs do not compile with XLA).
    Add `tfdist.ps.FinishCallback()` to `fit` so the servers know when a worker is done.

    Args:
        learning_rate: The learning rate (a float or a schedule).
        cluster: The `tfdist.ps.Cluster`; default: from TF_CONFIG when the optimizer is built
            (so a saved model loads anywhere).
        poll_seconds: Pause between two "may I go on?" questions while waiting.
        connect_timeout: Seconds to wait for the parameter servers to answer at the start.
        call_timeout: Seconds after which one RPC fails (a parameter server that hangs).
        compressor: A `tfdist.compression` compressor (instance, name or config) for the
            pushes, e.g. `{"name": "topk", "ratio": 0.01, "error_feedback": True}`; the servers
            must be given the same. Its state (error-feedback residuals) stays on the worker.
        min_compress_size: Tensors with fewer elements go uncompressed. Defaults to 1024.
        compress_1d: Compress 1-D tensors (biases) too. Defaults to False.
        setup: What every task of the job must have alike, as texts: given to each server
            when this worker joins; where a server's differs, the build raises
            `tfdist.ps.SetupMismatch` naming each key and both values (and the server stops).
        name: Optional name.

    Example (every task runs the same script; see `tfdist.ps.serve` for the ps side):
        ```python
        # python -m tfdist.launch --ps 1 --workers 2 -- python train.py
        cluster = tfdist.ps.Cluster.from_tf_config()
        model = build_model()  # the same seed on every task
        if cluster.is_ps:
            tfdist.ps.serve(model, keras.optimizers.Adam(1e-3), staleness=0)
        else:
            model.compile(optimizer=tfdist.ps.ParameterServerOptimizer(1e-3),
                          loss="sparse_categorical_crossentropy", jit_compile=False)
            model.fit(x, y, batch_size=64, epochs=3, callbacks=[tfdist.ps.FinishCallback()])
        ```
    """

    built: bool  # set by Keras

    def __init__(self, learning_rate=0.001, cluster: Cluster | None = None,
                 poll_seconds: float = 0.002, connect_timeout: float = 300.0,
                 call_timeout: float = 600.0, compressor=None,
                 min_compress_size: int = MIN_SIZE, compress_1d: bool = False,
                 setup: Mapping[str, str] | None = None, name: str | None = None, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name or "parameter_server", **kwargs)
        self._cluster = cluster
        self.compressor = compression.get(compressor)
        self.min_compress_size = check_int("min_compress_size", min_compress_size, 0)
        self.compress_1d = check_bool("compress_1d", compress_1d)
        self.poll_seconds = check_number("poll_seconds", poll_seconds, 0)
        self.connect_timeout = check_number("connect_timeout", connect_timeout, 0, low_open=True)
        self.call_timeout = check_number("call_timeout", call_timeout, 0, low_open=True)
        self.setup = dict(setup or {})
        self._clients: list = []
        self.report: dict | None = None
        self.start_step = 0  # steps this worker had pushed before this process (a restart)

    @property
    def cluster(self) -> Cluster:
        if self._cluster is None:
            self._cluster = Cluster.from_tf_config()
        if self._cluster.is_ps:
            raise ValueError(f"This task is parameter server {self._cluster.task_index}: it "
                             "runs `tfdist.ps.serve(model, optimizer)`, not a worker's optimizer.")
        return self._cluster

    @property
    def worker(self) -> int:
        """This worker's index (the chief is 0)."""
        return self.cluster.task_index

    # -- Keras optimizer API ---------------------------------------------------------------------
    def build(self, var_list):
        super().build(var_list)
        owner = assign_shards([nbytes(v) for v in var_list], len(self.cluster.ps))
        self._shards = [[i for i, o in enumerate(owner) if o == p]
                        for p in range(len(self.cluster.ps))]
        empty = [p for p, shard in enumerate(self._shards) if not shard]
        if empty:
            raise ValueError(f"{len(self.cluster.ps)} parameter servers for {len(var_list)} "
                             "trainable variables leave some servers without any; use at most "
                             f"{len(var_list)} ps tasks.")
        self._codecs = codecs_for(self.compressor, var_list, self.min_compress_size,
                                  self.compress_1d)
        self._push_bytes = push_nbytes(self._codecs, var_list)
        with tf.init_scope():
            # The compressor's state per variable (error-feedback residuals): this worker's.
            self._states = [
                {} if codec is None else
                {k: tf.Variable(value, trainable=False, name=f"compressor_{i}_{k}")
                 for k, value in codec.compressor.init_state(v.shape, v.dtype, i).items()}
                for i, (codec, v) in enumerate(zip(self._codecs, var_list))]
            # Counters for this worker's process only (the servers hold the training state).
            self._version = [tf.Variable(0, dtype=tf.int64, trainable=False,
                                         name=f"ps{p}_version")
                             for p in range(len(self.cluster.ps))]
            self._counters = {key: tf.Variable(0, dtype=tf.int64, trainable=False, name=key)
                              for key in ("bytes_pushed", "bytes_pulled", "pushes", "calls")}
            self._secret = require_secret(self.cluster.secret,
                                          f"Parameter-server worker {self.cluster.task_index}")
            self._clients = [connect(address, f"tfdist_ps{p}", self.connect_timeout)
                             for p, address in enumerate(self.cluster.ps)]
            if self.setup:
                self._agree()
            self._pull(var_list)  # start from the servers' weights
            self._wait_for_all_workers()
            # A worker started again (or a job resumed from the servers' checkpoints) goes on
            # where the servers say it is; a fresh one is at 0.
            worker = tf.constant(self.worker, tf.int64)
            self.start_step = min(int(self._call(p, "clock", [worker], SCALAR))
                                  for p in range(len(self._clients)))
            self.iterations.assign(self.start_step)

    def apply(self, grads, trainable_variables=None):
        self.join(trainable_variables)
        variables = list(trainable_variables or built_variables(self))
        grads = [tf.zeros_like(v) if g is None else dense_gradient(g, v)
                 for g, v in zip(grads, variables)]
        worker = tf.constant(self.worker, tf.int64)
        lr = tf.cast(self.learning_rate, tf.float32)
        parts = [self._encode(i, g, v) for i, (g, v) in enumerate(zip(grads, variables))]
        pushed = [self._call(p, "push", [worker, self._version[p], lr,
                                         *[t for i in shard for t in parts[i]]], SCALAR)
                  for p, shard in enumerate(self._shards)]
        with tf.control_dependencies(pushed):
            ready = tf.while_loop(lambda ok: tf.logical_not(ok), lambda ok: self._ready(True),
                                  [self._ready(False)])
        with tf.control_dependencies([ready]):
            self._pull(variables)
        self._count("bytes_pushed", self._push_bytes)
        self._count("pushes", 1)
        self.iterations.assign_add(1)

    def join(self, variables) -> int:
        """Builds the optimizer for `variables` now (connects to the servers, takes their
        weights, waits for the other workers) and returns `start_step`: the steps this worker
        had already pushed, where its data and `fit` go on (`tfdist.callbacks.StartAt`)."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        return self.start_step

    def _encode(self, i: int, grad, variable) -> list:
        """What the push carries for variable i: its gradient, or its compressed payload."""
        codec = self._codecs[i]
        if codec is None:
            return [tf.cast(grad, variable.dtype)]
        state = {k: s.read_value() for k, s in self._states[i].items()}
        payload, _, state = codec.compressor.compress(grad, state, self.iterations, self.worker)
        for k, value in state.items():
            self._states[i][k].assign(value)
        return list(payload)

    # -- the RPCs --------------------------------------------------------------------------------
    def _call(self, p: int, method: str, args: list, specs):
        """`method` of server `p` (`tfdist.ps.server.REQUEST`): its results, shaped as `specs`
        (one spec or a list). Fails the step with the server's one-line reason when it does
        not answer or refuses."""
        secret, worker = self._secret, self.worker if args else -1
        token = tf.py_function(lambda: sign(secret, method, worker, server=server_name(p)), [],
                               tf.string)
        token.set_shape([])
        arguments = (tf.stack([tf.io.serialize_tensor(a) for a in args]) if args else
                     tf.constant([], tf.string))
        status = self._clients[p].call(
            REQUEST, [token, tf.constant(method), tf.constant(worker, tf.int64), arguments],
            output_specs=tf.TensorSpec([None], tf.string),
            timeout_in_ms=int(1000 * self.call_timeout))
        _, message = status.get_error()
        answered = tf.debugging.Assert(status.is_ok(), [
            f"tfdist: parameter server {p} at {self.cluster.ps[p]} {SERVER_GONE} "
            f"{method} (it stopped or hangs; with checkpoints, run the job again to resume):",
            message])
        self._count("calls", 1)
        with tf.control_dependencies([answered]):
            answer = tf.identity(status.get_value())
        taken = tf.debugging.Assert(tf.equal(answer[0], ""), [
            f"tfdist: parameter server {p} at {self.cluster.ps[p]} did not take {method}:",
            answer[0]])
        listed = specs if isinstance(specs, list) else [specs]
        with tf.control_dependencies([taken]):
            results = [tf.ensure_shape(tf.io.parse_tensor(answer[i + 1], spec.dtype), spec.shape)
                       for i, spec in enumerate(listed)]
        return results if isinstance(specs, list) else results[0]

    def _agree(self) -> None:
        """Gives every server this worker's `setup`; raises SetupMismatch with the first
        server's account of a difference."""
        worker = tf.constant(self.worker, tf.int64)
        setup = tf.constant(json.dumps(self.setup, sort_keys=True))
        for p in range(len(self._clients)):
            said = self._call(p, "agree", [worker, setup], tf.TensorSpec([], tf.string))
            if said.numpy():
                raise SetupMismatch(said.numpy().decode())

    def _wait_for_all_workers(self) -> None:
        """Returns once every worker has joined (or is lost): training starts together."""
        deadline = time.monotonic() + self.connect_timeout
        worker = tf.constant(self.worker, tf.int64)
        while not all(bool(self._call(p, "started", [worker], tf.TensorSpec([], tf.bool)))
                      for p in range(len(self._clients))):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Worker {self.worker}: the other workers did not join within "
                    f"{self.connect_timeout:g} s (the servers declare a worker lost after their "
                    "worker_timeout); start them, or raise `connect_timeout`.")
            time.sleep(0.05)

    def _ready(self, pause: bool):
        waits = []
        if pause:
            waits.append(tf.py_function(self._pause, [], tf.bool))
        with tf.control_dependencies(waits):
            worker = tf.constant(self.worker, tf.int64)
            answers = [self._call(p, "ready", [worker], tf.TensorSpec([], tf.bool))
                       for p in range(len(self._clients))]
            return tf.reduce_all(tf.stack(answers))

    def _pause(self) -> bool:
        time.sleep(self.poll_seconds)
        return True

    def _pull(self, variables: list) -> None:
        worker = tf.constant(self.worker, tf.int64)
        for p, shard in enumerate(self._shards):
            specs = [SCALAR] + [tf.TensorSpec(variables[i].shape, variables[i].dtype)
                                for i in shard]
            version, *values = self._call(p, "pull", [worker], specs)
            self._version[p].assign(version)
            for i, value in zip(shard, values):
                variables[i].assign(value)
        self._count("bytes_pulled", sum(nbytes(v) for v in variables))

    def _count(self, key: str, amount: int) -> None:
        if self._counters:
            self._counters[key].assign_add(tf.constant(amount, tf.int64))

    # -- the end of training ----------------------------------------------------------------------
    def finish(self, chief: bool | None = None, timeout: float = 3600.0) -> dict:
        """Tells the servers this worker is done. The chief (worker 0, by default) then waits
        until every worker has finished or is lost, pulls the final weights into the model, and
        lets the servers end; it returns the servers' report (`staleness_report`, summed over
        servers), the others an empty dict."""
        chief = self.worker == 0 if chief is None else chief
        worker = tf.constant(self.worker, tf.int64)
        for p in range(len(self._clients)):
            self._call(p, "finish", [worker], SCALAR)
        if not chief:
            return {}
        deadline = time.monotonic() + timeout
        while True:
            stats = [self._call(p, "stats", [], tf.TensorSpec([STATS_LEN], tf.int64)).numpy()
                     for p in range(len(self._clients))]
            reports = [staleness_report(s) for s in stats]
            if all(r["workers_finished"] + r["workers_lost"] >= self.cluster.num_workers
                   for r in reports) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self._pull(built_variables(self))
        for p in range(len(self._clients)):
            self._call(p, "release", [], SCALAR)
        self.report = reports[0] if len(reports) == 1 else _combine(reports)
        return self.report

    # -- counters (the names every tfdist optimizer uses) ---------------------------------------
    @property
    def bytes_sent(self) -> float:
        """Bytes this worker pushed (gradients)."""
        return float(self._counters["bytes_pushed"].numpy()) if self._counters else 0.0

    @property
    def bytes_received(self) -> float:
        return float(self._counters["bytes_pulled"].numpy()) if self._counters else 0.0

    @property
    def communication_rounds(self) -> int:
        return int(self._counters["pushes"].numpy()) if self._counters else 0

    @property
    def collective_calls(self) -> int:
        """RPCs made (pushes, pulls and the waiting's questions)."""
        return int(self._counters["calls"].numpy()) if self._counters else 0

    def get_config(self):
        config = super().get_config()
        config.update(poll_seconds=self.poll_seconds, connect_timeout=self.connect_timeout,
                      call_timeout=self.call_timeout,
                      compressor=compression.serialize(self.compressor),
                      min_compress_size=self.min_compress_size, compress_1d=self.compress_1d)
        return config


def _combine(reports: list[dict]) -> dict:
    """One report for several servers: the first server's versions and staleness (every worker
    pushes to every server at once, so they agree), the workers lost on any server."""
    combined = dict(reports[0])
    combined["workers_lost"] = max(r["workers_lost"] for r in reports)
    return combined


class FinishCallback(keras.callbacks.Callback):
    """Ends a worker's part in parameter-server training when `fit` ends (see
    `ParameterServerOptimizer.finish`); the chief's report is in `report` afterwards.

    Args:
        chief: Whether this worker waits for the others and pulls the final weights (default:
            worker 0).
        log_dir: Where the chief writes the report to TensorBoard (`parameter_server/`:
            staleness mean and max, updates, workers lost, and the staleness histogram), or
            None.

    Example:
        ```python
        # python -m tfdist.launch --ps 1 --workers 2 -- python train.py
        model = build_model()
        model.compile(optimizer=tfdist.ps.ParameterServerOptimizer(1e-3),
                      loss="sparse_categorical_crossentropy", jit_compile=False)
        model.fit(x, y, batch_size=64, epochs=3, callbacks=[tfdist.ps.FinishCallback()])
        ```
    """

    def __init__(self, chief: bool | None = None, log_dir: str | None = None):
        super().__init__()
        self.chief = chief
        self.log_dir = log_dir
        self.report: dict | None = None

    def on_train_end(self, logs=None):
        optimizer = self.model.optimizer
        if not isinstance(optimizer, ParameterServerOptimizer):
            raise TypeError("tfdist.ps.FinishCallback needs a model compiled with "
                            f"tfdist.ps.ParameterServerOptimizer; got {type(optimizer).__name__}.")
        self.report = optimizer.finish(self.chief)
        if self.report and self.log_dir:
            write_report(f"{self.log_dir}/parameter_server", self.report)


def write_report(log_dir: str, report: dict) -> None:
    """Writes a staleness report (`staleness_report`'s keys) to TensorBoard under `log_dir`:
    the staleness mean and max, the updates, the workers lost, and the staleness histogram."""
    writer = ScalarWriter(log_dir)
    step = report["version"]
    writer.write({key: report[key] for key in (
        "staleness_mean", "staleness_max", "version", "workers_lost")}, step)
    writer.histogram("staleness", report["staleness_histogram"], step)
    writer.close()
