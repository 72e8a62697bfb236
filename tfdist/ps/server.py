"""A parameter server: one shard of the model's variables, the optimizer state for them, and the
consistency rule that decides when a worker may go on.

Workers talk to it through TensorFlow's own RPC layer (`tf.distribute.experimental.rpc`, gRPC),
from inside their traced train steps (see `ParameterServerOptimizer`). It offers:

* `push(worker, based_on, lr, *grads)`: a worker's gradients for this shard, computed on the
  weights of version `based_on`, and its current learning rate;
* `started(worker)`: whether every worker has joined (pulled once) or is lost: training starts
  together, as it does with collectives, so a late worker's start-up is nobody's training time;
* `ready(worker)`: whether the worker may pull and go on (the consistency rule below);
* `pull(worker)`: the version and the shard's weights;
* `clock(worker)`: the pushes taken from the worker: where a worker that starts again resumes;
* `agree(worker, setup)`: whether the worker was given this server's `setup` (what every task
  of the job must have alike): a server that finds a difference says it and stops;
* `finish(worker)`, `stats()`, `release()`: the end of a worker, the counters, the end of the job.

`staleness` is the one knob:

* 0, synchronous: the gradients of one round (one push per worker still training) are averaged
  and applied once; nobody goes on before the round is applied. Equals synchronous data
  parallelism on the same global batches.
* s >= 1, bounded staleness (SSP, Ho et al. 2013): every gradient is applied as it arrives; a
  worker waits while it is more than s pushes ahead of the slowest worker still training.
* None, asynchronous (Downpour-style): every gradient is applied as it arrives; nobody waits.

With `scale_lr_by_staleness`, a gradient of staleness t >= 1 is applied with the learning rate
divided by t (staleness-aware asynchronous SGD, Zhang et al., IJCAI 2016): a straggler's old
gradients move the weights less. With `delay_compensation=lambda`, a stale gradient g gets the
first-order correction g + lambda g * g * (w_now - w_pulled) (DC-ASGD, Zheng et al., ICML 2017;
MXNet uses lambda = 0.04), w_pulled being the weights the worker computed it on (the server
keeps a copy per worker).

By default a server keeps its shard as one flat vector and the optimizer updates that vector in
one call (`flat=True`): the same update as per variable for element-wise optimizers (SGD,
Adam, AdamW, RMSprop, Adagrad, ...), and 6-7x cheaper (Adam on the main job's 10 variables:
2.8 ms instead of 18.8 ms per update, eagerly). Optimizers with per-variable rules (`clipnorm`,
Adafactor's factored moments, weight-decay exclusions by name) need `flat=False`.

The staleness of each applied gradient (versions applied between the worker's pull and its
push) is counted in a histogram. A worker silent for `worker_timeout` seconds is declared lost
and the others go on without it (it is taken back if it speaks again, and a worker started
again resumes at its clock); the server ends when every worker has finished or is lost.

With `checkpoint_dir`, the server writes its shard, optimizer state and counters every
`checkpoint_every` updates (`tfdist.ps.checkpoint`); `serve` resumes from them. A checkpoint
that cannot be written stops the server with the reason (the previous one stays intact).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping

import keras
import numpy as np
import tensorflow as tf

from tfdist.arguments import check_bool, check_int, check_number
from tfdist.compression import Compressor
from tfdist.ps import checkpoint
from tfdist.ps.cluster import Cluster, nbytes, shard_of
from tfdist.ps.codec import MIN_SIZE, codecs_for, decode, push_specs
from tfdist.security import Verifier, require_secret

BUCKETS = 64  # staleness histogram: 0 .. 62, and 63 or more
# What a server answers a worker that comes back after being declared lost once the job has
# finished without it (the worker then exits 0: tfdist.tools.runner).
JOB_OVER = "tfdist: the job is over"
LINGER_SECONDS = 15.0  # how long servers wait for lost workers to come back and hear it
# The one RPC method a server registers: (token, method name, worker, arguments) -> answer.
REQUEST = "tfdist_ps"
REQUEST_SIGNATURE = [tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.string),
                     tf.TensorSpec([], tf.int64), tf.TensorSpec([None], tf.string)]
STATS_LEN = BUCKETS + 4  # the histogram, then version, pushes, lost and finished workers
_TENSOR_PROTO = type(tf.make_tensor_proto(0))  # what tf.io.serialize_tensor writes
RELEASE_GRACE_SECONDS = 30.0  # how long the server waits for the chief's last pull


def server_name(index: int) -> str:
    """What a token names parameter server `index` by (`tfdist.security.sign`): a token
    made for one server is refused by the others."""
    return f"ps-{index}"


def check_staleness(staleness) -> int | None:
    if staleness is None:
        return None
    return check_int("staleness", staleness, 0)


def check_delay_compensation(delay_compensation, staleness) -> float | None:
    """DC-ASGD's lambda: a number >= 0, or None; only where gradients can be stale (the servers'
    rule, which `tfdist train` applies to a config as well)."""
    if delay_compensation is None:
        return None
    check_number("delay_compensation", delay_compensation, 0)
    if staleness == 0:
        raise ValueError("`delay_compensation` corrects stale gradients; with staleness=0 there "
                         "are none: use staleness >= 1 or None.")
    return delay_compensation


class SetupMismatch(ValueError):
    """A worker and a parameter server were given different setups (`serve(setup=...)`,
    `ParameterServerOptimizer(setup=...)`): the message names each key and both values.

    Example:
        ```python
        # python -m tfdist.launch --ps 1 --workers 2 -- python train.py
        cluster = tfdist.ps.Cluster.from_tf_config()
        model = build_model()
        setup = {"learning rate": "0.001", "examples": str(len(x))}  # alike on every task
        if cluster.is_ps:
            tfdist.ps.serve(model, keras.optimizers.Adam(1e-3), setup=setup)  # raises it too
        else:
            optimizer = tfdist.ps.ParameterServerOptimizer(1e-3, setup=setup)
            try:
                optimizer.join(model.trainable_variables)  # connects, compares, pulls
            except tfdist.ps.SetupMismatch as e:
                print(e)  # worker 1 and parameter server 0 differ: examples is 900 on worker 1, ...
        ```
    """


class ParameterServer:
    """Serves `variables` (this server's shard) to `num_workers` workers (see module docstring).

    Args:
        variables: The shard's variables, in the order the workers' plan gives
            (`tfdist.ps.shard_of`).
        optimizer: The Keras optimizer that applies the gradients (built here). Its learning
            rate follows the pushing worker's unless it is a schedule.
        num_workers: The training tasks.
        staleness: 0 (synchronous), s >= 1 (bounded), or None (asynchronous).
        worker_timeout: Seconds of silence after which a worker is declared lost.
        index: This server's task index (for messages).
        flat: Update the shard as one flat vector (see the module docstring). The variables
            get the served values when serving ends (`write_back`).
        scale_lr_by_staleness: Divide the learning rate by a gradient's staleness (>= 1).
        delay_compensation: DC-ASGD's lambda (>= 0), or None; not with staleness 0.
        compressor: The `tfdist.compression` compressor the workers compress their pushes
            with (`tfdist.ps.codec`), or None.
        checkpoint_dir: Where to write checkpoints (`tfdist.ps.checkpoint`), or None.
        checkpoint_every: Updates between two checkpoints (>= 1), with `checkpoint_dir`.
        setup: What every task must have alike, as texts: a worker that joins with another
            stops the server (`agree`; see `serve`).

    Example:
        ```python
        # python -m tfdist.launch --ps 1 --workers 2 -- python train.py
        # tfdist.ps.serve builds one for this task's shard and runs it; by hand:
        cluster = tfdist.ps.Cluster.from_tf_config()
        model = build_model()
        shard = tfdist.ps.shard_of(model.trainable_variables, cluster.task_index, len(cluster.ps))
        server = tfdist.ps.ParameterServer(shard, keras.optimizers.Adam(1e-3), cluster.num_workers)
        ```
    """

    def __init__(self, variables, optimizer: keras.optimizers.Optimizer, num_workers: int,
                 staleness: int | None = 0, worker_timeout: float = 120.0, index: int = 0,
                 flat: bool = True, scale_lr_by_staleness: bool = False,
                 delay_compensation: float | None = None,
                 compressor: Compressor | None = None, min_compress_size: int = MIN_SIZE,
                 compress_1d: bool = False, checkpoint_dir: str | None = None,
                 checkpoint_every: int | None = None, setup: Mapping[str, str] | None = None):
        self.variables = list(variables)
        self.setup = dict(setup or {})
        if not self.variables:
            raise ValueError(f"Parameter server {index} holds no variables: use fewer "
                             "parameter servers than the model has trainable variables.")
        self.optimizer = optimizer
        self.num_workers = check_int("num_workers", num_workers, 1)
        self.staleness = check_staleness(staleness)
        self.worker_timeout = check_number("worker_timeout", worker_timeout, 0, low_open=True)
        self.index = index
        self.scale_lr_by_staleness = check_bool("scale_lr_by_staleness", scale_lr_by_staleness)
        self.delay_compensation = check_delay_compensation(delay_compensation, self.staleness)
        self._pulled: dict[int, list[np.ndarray]] = {}  # per worker, its last pull (DC-ASGD)
        self.codecs = codecs_for(compressor, self.variables,
                                 check_int("min_compress_size", min_compress_size, 0),
                                 check_bool("compress_1d", compress_1d))
        self.flat = bool(flat) and len({tf.as_dtype(v.dtype) for v in self.variables}) == 1
        self._shapes = [tuple(v.shape) for v in self.variables]
        self._offsets = np.cumsum([0] + [int(np.prod(s)) for s in self._shapes])
        self._targets = ([keras.Variable(np.concatenate(
            [np.ravel(v.numpy()) for v in self.variables]), name=f"ps{index}_flat")]
            if self.flat else self.variables)  # what the optimizer updates
        optimizer.build(self._targets)
        self._follow_lr = not isinstance(optimizer.get_config().get("learning_rate"), dict)
        self._lock = threading.Lock()
        self.version = 0
        self.pushes = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        now = time.monotonic()
        self._seen = [now] * num_workers
        self._clock = [0] * num_workers
        self._finished: set[int] = set()
        self._joined: set[int] = set()
        self._lost: set[int] = set()
        self._told: set[int] = set()  # lost workers that came back and were told the job is over
        self._pending: list[np.ndarray] | None = None  # in the targets' layout
        self._pending_from: set[int] = set()
        self._pending_stale: list[int] = []
        self._pending_lr = 0.0
        self._histogram = np.zeros(BUCKETS, np.int64)
        self._released = False
        self._server = None
        self.verifier: Verifier | None = None  # set by `start`
        self.checkpoint_dir = None if checkpoint_dir is None else str(checkpoint_dir)
        self.checkpoint_every = (None if checkpoint_dir is None else
                                 check_int("checkpoint_every", checkpoint_every, 1))
        self.resumed_from: int | None = None
        # what stops the server: a checkpoint that could not be written, a worker's other setup
        self._failure: BaseException | None = None

    # -- what the workers call (through the RPC functions of `start`) ----------------------------
    def push(self, worker: int, based_on: int, lr: float, parts: list[np.ndarray]) -> int:
        """Takes a worker's push: `parts` are its gradients, or their compressed payloads
        (`tfdist.ps.codec`), for this server's variables."""
        grads = decode(self.codecs, parts)
        with self._lock:
            self._touch(worker)
            self._clock[worker] += 1
            self.pushes += 1
            self.bytes_received += sum(p.nbytes for p in parts)
            stale = self.version - based_on
            grads = self._to_targets(grads)
            if self.staleness == 0:
                self._pending = (list(grads) if self._pending is None else
                                 [a + b for a, b in zip(self._pending, grads)])
                self._pending_from.add(worker)
                self._pending_stale.append(stale)
                self._pending_lr = lr
                self._apply_round()
            else:
                self._count(stale)
                if self.scale_lr_by_staleness and stale > 1:
                    lr /= stale
                if self.delay_compensation and stale > 0 and worker in self._pulled:
                    grads = self._compensate(grads, self._pulled[worker])
                self._apply(grads, lr)
            return self.version

    def ready(self, worker: int) -> bool:
        with self._lock:
            self._touch(worker)
            self._check_lost()
            if self.staleness == 0:
                self._apply_round()
                return worker not in self._pending_from
            if self.staleness is None:
                return True
            training = self._training()
            return not training or \
                self._clock[worker] - min(self._clock[i] for i in training) <= self.staleness

    def pull(self, worker: int) -> list:
        with self._lock:
            self._touch(worker)
            self._joined.add(worker)
            values = self.values()
            if self.delay_compensation is not None:
                self._pulled[worker] = [t.numpy() for t in self._targets]
            self.bytes_sent += sum(v.nbytes for v in values)
            return [np.int64(self.version), *values]

    def started(self, worker: int) -> bool:
        with self._lock:
            self._touch(worker)
            self._check_lost()
            return all(i in self._joined or i in self._lost for i in range(self.num_workers))

    def clock(self, worker: int) -> int:
        with self._lock:
            self._touch(worker)
            return self._clock[worker]

    def agree(self, worker: int, setup: dict[str, str]) -> str:
        """"" when the worker's `setup` is this server's; else one line naming each key that
        differs (the first 4), and the server stops (`serve` raises SetupMismatch with it)."""
        differ = sorted(k for k in set(setup) | set(self.setup)
                        if setup.get(k) != self.setup.get(k))
        if not differ:
            return ""
        message = f"worker {worker} and parameter server {self.index} differ: " + "; ".join(
            f"{k} is {setup.get(k, 'not set')} on worker {worker}, "
            f"{self.setup.get(k, 'not set')} on parameter server {self.index}"
            for k in differ[:4]) + (f" (and {len(differ) - 4} more)" if len(differ) > 4 else "")
        with self._lock:
            self._failure = self._failure or SetupMismatch(message)
        return message

    def finish(self, worker: int) -> int:
        with self._lock:
            self._finished.add(worker)
            self._lost.discard(worker)
            self._apply_round()
            return self.version

    def stats(self) -> np.ndarray:
        with self._lock:
            return np.concatenate([self._histogram, np.array(
                [self.version, self.pushes, len(self._lost), len(self._finished)], np.int64)])

    def release(self) -> int:
        with self._lock:
            self._released = True
            return self.version

    # -- state changes (under the lock) ----------------------------------------------------------
    def _touch(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker} is not one of the {self.num_workers} workers")
        self._seen[worker] = time.monotonic()
        if worker in self._lost and (self._released or (self._finished and not self._training())):
            self._told.add(worker)
            raise RuntimeError(f"{JOB_OVER}: worker {worker} was declared lost after "
                               f"{self.worker_timeout:g} s of silence, and the other workers "
                               f"have finished (update {self.version})")
        if worker in self._lost:
            self._lost.discard(worker)
            print(f"parameter server {self.index}: worker {worker} is back (clock "
                  f"{self._clock[worker]})", flush=True)

    def _training(self) -> list[int]:
        return [i for i in range(self.num_workers)
                if i not in self._finished and i not in self._lost]

    def _check_lost(self) -> None:
        now = time.monotonic()
        for i in self._training():
            if now - self._seen[i] > self.worker_timeout:
                self._lost.add(i)
                print(f"parameter server {self.index}: worker {i} silent for "
                      f"{self.worker_timeout:g} s at clock {self._clock[i]}: going on without it",
                      flush=True)

    def _apply_round(self) -> None:
        """Synchronous rounds: applies the mean of the round's gradients once every worker
        still training has pushed."""
        if self._pending is None or not set(self._training()) <= self._pending_from:
            return
        n = len(self._pending_from)
        for stale in self._pending_stale:
            self._count(stale)
        grads = [g / np.asarray(n, g.dtype) for g in self._pending]
        self._pending, self._pending_from, self._pending_stale = None, set(), []
        self._apply(grads, self._pending_lr)

    def _apply(self, grads: list[np.ndarray], lr: float) -> None:
        if self._follow_lr:
            self.optimizer.learning_rate = lr
        # Eagerly: the RPC handlers run on TensorFlow's inter-op threads, and a tf.function
        # called from one can wait for a free thread forever while the others wait for the lock.
        self.optimizer.apply([tf.convert_to_tensor(g) for g in grads], self._targets)
        self.version += 1
        if self.checkpoint_every and self.version % self.checkpoint_every == 0:
            self._save()

    def _compensate(self, grads: list[np.ndarray], pulled: list[np.ndarray]) -> list[np.ndarray]:
        """DC-ASGD: g + lambda * g * g * (w_now - w_pulled), in the targets' layout."""
        lam = self.delay_compensation
        return [g + lam * g * g * (t.numpy() - w) for g, t, w in zip(grads, self._targets, pulled)]

    def _to_targets(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        return [np.concatenate([np.ravel(g) for g in grads])] if self.flat else list(grads)

    def values(self) -> list[np.ndarray]:
        """The served weights, one array per variable (copies)."""
        if not self.flat:
            return [v.numpy() for v in self.variables]
        flat = self._targets[0].numpy()
        return [flat[a:b].reshape(shape) for a, b, shape in
                zip(self._offsets[:-1], self._offsets[1:], self._shapes)]

    def write_back(self) -> None:
        """Assigns the served weights to the variables (what `serve` does at the end)."""
        if self.flat:
            with self._lock:
                for variable, value in zip(self.variables, self.values()):
                    variable.assign(value)

    # -- checkpoints (under the lock) ------------------------------------------------------------
    def _meta(self) -> dict:
        return {"index": self.index, "num_workers": self.num_workers, "flat": self.flat,
                "shapes": [list(s) for s in self._shapes],
                "optimizer": [list(v.shape) for v in self.optimizer.variables]}

    def _save(self) -> None:
        arrays = {f"target_{i}": t.numpy() for i, t in enumerate(self._targets)}
        arrays |= {f"optimizer_{i}": np.asarray(v.numpy())
                   for i, v in enumerate(self.optimizer.variables)}
        arrays |= {"clock": np.array(self._clock, np.int64), "histogram": self._histogram,
                   "counters": np.array([self.version, self.pushes, self.bytes_received,
                                         self.bytes_sent], np.int64)}
        assert self.checkpoint_dir is not None
        try:
            checkpoint.save(self.checkpoint_dir, self.index, self.version, arrays, self._meta())
        except OSError as e:
            self._failure = OSError(
                e.errno, f"Parameter server {self.index} could not write its checkpoint of "
                f"update {self.version} to {self.checkpoint_dir} ({e.strerror or e}); it stops "
                "so no progress is lost unnoticed. Its last complete checkpoint is intact: free "
                "space (or choose another directory) and run the job again to resume.")
            raise self._failure from e

    def restore(self, step: int) -> None:
        """Takes this server's checkpoint of `step` from `checkpoint_dir` (before serving)."""
        assert self.checkpoint_dir is not None
        arrays, meta = checkpoint.load(self.checkpoint_dir, self.index, step)
        mine = self._meta()
        for key, what in (("num_workers", "workers"), ("shapes", "variables' shapes"),
                          ("flat", "layout"), ("optimizer", "optimizer variables")):
            if meta[key] != mine[key]:
                raise ValueError(
                    f"Parameter server {self.index}: the checkpoint of step {step} in "
                    f"{self.checkpoint_dir} was written for other {what} ({meta[key]}; here "
                    f"{mine[key]}). Resume with the same model, optimizer and number of "
                    "workers, or remove the directory to start afresh.")
        with self._lock:
            for i, target in enumerate(self._targets):
                target.assign(arrays[f"target_{i}"])
            for i, variable in enumerate(self.optimizer.variables):
                variable.assign(arrays[f"optimizer_{i}"])
            self._clock = [int(c) for c in arrays["clock"]]
            self._histogram = arrays["histogram"].astype(np.int64)
            self.version, self.pushes, self.bytes_received, self.bytes_sent = (
                int(c) for c in arrays["counters"])
            self.resumed_from = step

    def _count(self, stale: int) -> None:
        self._histogram[min(max(stale, 0), BUCKETS - 1)] += 1

    # -- serving -----------------------------------------------------------------------------
    def start(self, address: str, secret: bytes | str | None) -> None:
        """Starts serving at `address` ("host:port", the address bound) on TensorFlow's gRPC
        RPC server. Every call must carry a token proving `secret` (`tfdist.security`): one
        that does not is refused before its arguments are read, and learns nothing but that.

        The server registers one RPC method, `REQUEST`: (token, method name, worker,
        arguments serialized as tensors) -> (status, results serialized): what TensorFlow's
        server lists to any caller is that signature, not the methods or the shapes of the
        model's variables; a refusal or an error is a status line, never a traceback."""
        verifier = Verifier(require_secret(secret, f"Parameter server {self.index}"),
                            server=server_name(self.index))
        scalar = tf.TensorSpec([], tf.int64)
        push_in = [scalar, scalar, tf.TensorSpec([], tf.float32),
                   *push_specs(self.codecs, self.variables)]
        count, flag = np.int64, np.bool_  # the results' types, as the workers parse them
        self._methods = {  # name: (Python handler on NumPy arguments -> results, input specs)
            "push": (lambda w, b, r, *g: [count(self.push(int(w), int(b), float(r), list(g)))],
                     push_in),
            "ready": (lambda w: [flag(self.ready(int(w)))], [scalar]),
            "pull": (lambda w: self.pull(int(w)), [scalar]),
            "started": (lambda w: [flag(self.started(int(w)))], [scalar]),
            "clock": (lambda w: [count(self.clock(int(w)))], [scalar]),
            "agree": (lambda w, setup: [self.agree(int(w), json.loads(setup.item())).encode()],
                      [scalar, tf.TensorSpec([], tf.string)]),
            "finish": (lambda w: [count(self.finish(int(w)))], [scalar]),
            "stats": (lambda: [self.stats()], []),
            "release": (lambda: [count(self.release())], []),
        }
        self.verifier = verifier

        @tf.function(input_signature=REQUEST_SIGNATURE)
        def request(token, method, worker, arguments):
            answer = tf.py_function(self._answer, [token, method, worker, arguments], tf.string)
            answer.set_shape([None])
            return answer

        server = tf.distribute.experimental.rpc.Server.create("grpc", address)
        server.register(REQUEST, request)
        server.start()
        self._server = server

    def _answer(self, token, method, worker, arguments) -> np.ndarray:
        """One call: `[status, *results]` as bytes, status b"" when it was answered."""
        method = method.numpy().decode("ascii", "replace")
        worker = int(worker.numpy())
        verifier = self.verifier
        assert verifier is not None  # set by `start`
        if not verifier.check(token.numpy(), method, worker):
            if verifier.refused in (1, 10, 100, 1000) or verifier.refused % 10000 == 0:
                print(f"parameter server {self.index}: refused a call without proof of the "
                      f"job's secret ({verifier.refused} refused so far)", flush=True)
            return np.array([b"refused: no proof of the job's secret"], dtype=object)
        handler, specs = self._methods.get(method, (None, None))
        arguments = arguments.numpy()
        if handler is None or len(arguments) != len(specs):
            return np.array([f"refused: {method!r} with {len(arguments)} arguments is not a "
                             f"call of this server".encode()], dtype=object)
        try:
            values = [tf.make_ndarray(_TENSOR_PROTO.FromString(a)) for a in arguments]
        except Exception:  # not serialized tensors (protobuf's and NumPy's errors vary)
            values = None
        if values is None or any(
                v.dtype != spec.dtype.as_numpy_dtype or not spec.shape.is_compatible_with(v.shape)
                for v, spec in zip(values, specs)):
            return np.array([f"refused: the arguments of {method} are not those of this "
                             "server".encode()], dtype=object)
        if specs and int(values[0]) != worker:
            return np.array([b"refused: the call names another worker than its token"],
                            dtype=object)
        try:
            results = handler(*values)
        except Exception as e:  # the job is over, a failed checkpoint, ...: the worker says it
            return np.array([(str(e) or type(e).__name__).encode()], dtype=object)
        return np.array([b"", *(tf.make_tensor_proto(r).SerializeToString() for r in results)],
                        dtype=object)

    def serve(self, address: str, secret: bytes | str | None,
              poll_seconds: float = 0.2) -> dict:
        """Serves at `address` until every worker has finished or is lost (and the chief has
        pulled the final weights, or `RELEASE_GRACE_SECONDS` passed); returns `report()`.

        Raises:
            RuntimeError: every worker was lost before finishing.
            SetupMismatch: a worker was given another `setup`.
        """
        self.start(address, secret)
        size = sum(nbytes(v) for v in self.variables)
        rule = {0: "synchronous", None: "asynchronous"}.get(
            self.staleness, f"bounded staleness {self.staleness}")
        resumed = ("" if self.resumed_from is None else
                   f", resumed from its checkpoint of update {self.resumed_from}")
        print(f"parameter server {self.index}: serving {len(self.variables)} variables "
              f"({size / 2**20:.2f} MiB) to {self.num_workers} workers at {address}, "
              f"{rule}{resumed}", flush=True)
        done_since: float | None = None
        while True:
            time.sleep(poll_seconds)
            with self._lock:
                if self._failure is not None:
                    raise self._failure
                self._check_lost()
                self._apply_round()
                done = not self._training()
                released = self._released
            if not done:
                continue
            done_since = time.monotonic() if done_since is None else done_since
            if released or time.monotonic() - done_since > RELEASE_GRACE_SECONDS:
                break
        self._linger()
        self.write_back()
        report = self.report()
        print(f"parameter server {self.index}: done, {report['version']} updates from "
              f"{report['pushes']} pushes; staleness {describe_staleness(report)}; workers lost "
              f"{report['workers_lost']}", flush=True)
        if not self._finished:
            raise RuntimeError(f"Parameter server {self.index}: every worker was lost before "
                               "finishing; the job can resume from its last checkpoint.")
        if self.checkpoint_dir is not None:
            checkpoint.remove(self.checkpoint_dir, self.index)
        return report

    def _linger(self) -> None:
        """Serves on for up to `LINGER_SECONDS` while workers declared lost have not come back:
        one that was only frozen (stopped, swapping) then hears that the job is over and exits
        0, instead of failing on a server that is gone."""
        deadline = time.monotonic() + LINGER_SECONDS
        while time.monotonic() < deadline:
            with self._lock:
                if self._lost <= self._told:
                    return
            time.sleep(0.1)

    def report(self) -> dict:
        return staleness_report(self.stats()) | {
            "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent}


def staleness_report(stats) -> dict:
    """The counters `ParameterServer.stats()` returns, as a dict: updates applied, pushes, lost
    and finished workers, and the staleness of the applied gradients (histogram, mean, max).

    Example:
        ```python
        # python -m tfdist.launch --ps 1 --workers 2 -- python train.py
        cluster = tfdist.ps.Cluster.from_tf_config()
        model = build_model()
        if cluster.is_ps:
            report = tfdist.ps.serve(model, keras.optimizers.Adam(1e-3), staleness=2)
            print(report["staleness_mean"], report["staleness_max"])  # staleness_report's dict
        ```
    """
    stats = np.asarray(stats, np.int64)
    histogram = stats[:BUCKETS]
    count = int(histogram.sum())
    values = np.arange(BUCKETS)
    seen = np.nonzero(histogram)[0]
    return {
        "version": int(stats[BUCKETS]),
        "pushes": int(stats[BUCKETS + 1]),
        "workers_lost": int(stats[BUCKETS + 2]),
        "workers_finished": int(stats[BUCKETS + 3]),
        "staleness_histogram": {int(k): int(histogram[k]) for k in seen},
        "staleness_mean": float((histogram * values).sum() / count) if count else 0.0,
        "staleness_max": int(seen[-1]) if len(seen) else 0,
    }


def describe_staleness(report: dict) -> str:
    """`staleness_report`'s mean and max in words. The histogram's last count is "63 or more"
    (`BUCKETS`): when pushes landed there, the max is at least 63 and the mean at least what it
    says."""
    capped = report["staleness_max"] >= BUCKETS - 1
    at_least = "at least " if capped else ""
    return (f"mean {at_least}{report['staleness_mean']:.2f}, max {report['staleness_max']}"
            f"{' or more' if capped else ''}")


def serve(model, optimizer: keras.optimizers.Optimizer, staleness: int | None = 0,
          cluster: Cluster | None = None, worker_timeout: float = 120.0,
          scale_lr_by_staleness: bool = False, delay_compensation: float | None = None,
          compressor: Compressor | None = None,
          min_compress_size: int = MIN_SIZE, compress_1d: bool = False,
          checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
          setup: Mapping[str, str] | None = None) -> dict:
    """Runs this task as its parameter server until the job ends; returns its report.

    Args:
        model: The model the workers train (built the same way, same seed), or its list of
            trainable variables: this server keeps its shard of them.
        optimizer: The optimizer that updates the weights (e.g. `keras.optimizers.Adam(1e-3)`).
        staleness: 0 (synchronous), s >= 1 (bounded staleness), None (asynchronous).
        cluster: The `tfdist.ps.Cluster`; default: from TF_CONFIG.
        worker_timeout: Seconds of silence after which a worker is declared lost.
        scale_lr_by_staleness: Divide the learning rate by each gradient's staleness (>= 1).
        delay_compensation: DC-ASGD's lambda for stale gradients, or None.
        compressor: The compressor of the workers' pushes (the same as theirs), or None;
            `min_compress_size` and `compress_1d` as theirs.
        checkpoint_dir: A directory every ps task shares: the servers checkpoint there every
            `checkpoint_every` updates and resume from the newest step they all completed
            (removed when the job ends normally). None: no checkpoints.
        setup: What every task of the job must have alike, as texts (e.g. {"learning rate":
            "0.001", "data": "records.json 0x1a2b3c4d"}); the workers give theirs
            (`ParameterServerOptimizer(setup=...)`) when they join, and a difference stops
            the server (SetupMismatch, naming each key and both values) and the worker.

    Example:
        ```python
        # python -m tfdist.launch --ps 1 --workers 2 -- python train.py
        cluster = tfdist.ps.Cluster.from_tf_config()
        model = build_model()
        if cluster.is_ps:  # serves until every worker finished; then the report
            print(tfdist.ps.serve(model, keras.optimizers.Adam(1e-3), staleness=2))
        ```
    """
    cluster = Cluster.from_tf_config() if cluster is None else cluster
    if not cluster.is_ps:
        raise ValueError(f"This task is worker {cluster.task_index}; only a 'ps' task serves. "
                         "Workers compile with tfdist.ps.ParameterServerOptimizer.")
    variables = list(getattr(model, "trainable_variables", model))
    shard = shard_of(variables, cluster.task_index, len(cluster.ps))
    if not shard:
        raise ValueError(f"{len(cluster.ps)} parameter servers for {len(variables)} trainable "
                         "variables leave some servers without any; use fewer ps tasks.")
    server = ParameterServer(shard, optimizer, cluster.num_workers, staleness=staleness,
                             worker_timeout=worker_timeout, index=cluster.task_index,
                             scale_lr_by_staleness=scale_lr_by_staleness,
                             delay_compensation=delay_compensation, compressor=compressor,
                             min_compress_size=min_compress_size, compress_1d=compress_1d,
                             checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                             setup=setup)
    if checkpoint_dir is not None:
        step = checkpoint.common_step(str(checkpoint_dir), len(cluster.ps),
                                      cluster.num_workers if staleness == 0 else 0)
        if step is not None:
            server.restore(step)
    # The address TF_CONFIG gives this task, and no other: not every interface of the host.
    return server.serve(cluster.ps[cluster.task_index], cluster.secret)
