"""Decoding off the trainers: a record set read through TensorFlow's tf.data service.

A dispatcher and data workers (`tfdist data serve`, or roles of a `python -m tfdist.launch
--data-hosts` job) run the reading, decoding and batching; each trainer reads finished batches
over gRPC. Two processing modes:

* ``distributed_epoch``: the data workers split the record set's files between them (the
  dispatcher hands out files as they ask), so each pass over the records reads every record
  once across all trainers together;
* ``parallel_epochs``: every data worker reads every file in each of its passes, each pass in
  an order of its own (two data workers do not hand out the same batches).

What is lost against reading the record set locally (`record_batches`): the batches are not a
function of the seed and the epoch, so N trainers do not train on one trainer's batches, and a
resume does not restore the position: the trainers rejoin the service's job where its
dispatcher still runs (going on from the records not yet handed out; the batches a trainer
had buffered are not trained on), else a new job starts a new pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable

MODES = ("distributed_epoch", "parallel_epochs")
SHUFFLE_RECORDS = 1024  # the data workers' shuffle buffer, in records
READ_AHEAD = 2  # batches a trainer asks for ahead of the one it trains on
CONNECT_SECONDS = 30.0  # how long a starting dispatcher may take to answer


class ServiceError(ConnectionError):
    """The tf.data service cannot be used as configured (said in one line)."""


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (a "grpc://" prefix allowed); a ServiceError naming the
    value otherwise."""
    bare = address.removeprefix("grpc://")
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ServiceError(f"data.service: {address!r} is not host:port (the dispatcher's "
                           "address, e.g. data-0:5050)")
    return host.strip("[]"), int(port)


def check_dispatcher(address: str, timeout: float | None = None) -> None:
    """Returns once the dispatcher at `address` accepts a connection (it may be starting); a
    ServiceError naming the address if nothing answers within `timeout` seconds (default
    `CONNECT_SECONDS`)."""
    host, port = split_address(address)
    timeout = CONNECT_SECONDS if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline -
                                                                    time.monotonic())):
                return
        except OSError as e:
            if time.monotonic() + 0.5 >= deadline:
                raise ServiceError(
                    f"data.service: no tf.data dispatcher answers at {host}:{port} within "
                    f"{timeout:g} s ({e.strerror or e}); start one (tfdist data serve "
                    "dispatcher --port PORT) or launch the job with --data-hosts") from None
            time.sleep(0.5)


def job_name(path: str, seed: int, mode: str) -> str:
    """The service's job the trainers of one job share: the same for every trainer of it
    (from TF_CONFIG's cluster, the data and the mode), another for another job."""
    cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
    key = json.dumps([cluster, os.path.abspath(path), seed, mode], sort_keys=True)
    return "tfdist-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def service_batches(files: list[str], batch_size: int, decode: Callable, dispatcher: str,
                    mode: str = "distributed_epoch", seed: int = 0, name: str | None = None):
    """Batches of `batch_size` decoded records of the TFRecord `files`, read, decoded and
    batched by the data workers of the tf.data service at `dispatcher`, endless.

    Args:
        files: The record files (a record set's `RecordSource.files`).
        batch_size: Examples per batch this trainer reads (its share of a global batch).
        decode: record -> (x, y), TensorFlow ops (they run on the data workers: no Python
            function, `tf.py_function` included, can be in it).
        dispatcher: The dispatcher's "host:port".
        mode: "distributed_epoch" (every record once per pass across all trainers) or
            "parallel_epochs" (each trainer its own passes).
        seed: Seed of the data workers' shuffle.
        name: The service's job, shared by the trainers of one job (default: `job_name`).

    Returns:
        A `tf.data.Dataset` of (x, y) batches.
    """
    import tensorflow as tf

    if mode not in MODES:
        raise ServiceError(f"data.service_mode: {mode!r} is not one of {list(MODES)}")
    host, port = split_address(dispatcher)
    service = f"grpc://{host}:{port}"
    records = tf.data.Dataset.from_tensor_slices([str(f) for f in files]).interleave(
        tf.data.TFRecordDataset, cycle_length=min(4, len(files)),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    if mode == "parallel_epochs":
        records = _own_order(records)
    batches = (records.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
               .shuffle(SHUFFLE_RECORDS, seed=seed)
               .batch(batch_size, drop_remainder=True)
               .repeat())
    sharding = (tf.data.experimental.service.ShardingPolicy.DYNAMIC if mode == MODES[0]
                else tf.data.experimental.service.ShardingPolicy.OFF)
    return batches.apply(tf.data.experimental.service.distribute(
        sharding, service, job_name=name or job_name(files[0], seed, mode),
        max_outstanding_requests=READ_AHEAD))


def _own_order(records):
    """`records` in an order of each pass's own, for parallel_epochs. Every data worker runs
    the same graph, seeds included: with only the seeded shuffle, two data workers would
    hand the trainers the same batches. Each pass first orders blocks of `SHUFFLE_RECORDS`
    encoded records by a seed the data worker takes from its clock as the pass starts."""
    import tensorflow as tf

    def ordered(seed, index, block):
        keys = tf.random.stateless_uniform(tf.shape(block), tf.stack([seed, index]))
        return tf.gather(block, tf.argsort(keys))

    def one_pass(seed):
        return (records.batch(SHUFFLE_RECORDS).enumerate()
                .map(lambda index, block: ordered(seed, index, block)).unbatch())

    clock = tf.data.Dataset.from_tensors(0).map(
        lambda _: tf.cast(tf.timestamp() * 1e6, tf.int64))
    return clock.flat_map(one_pass)


def serve(role: str, port: int, dispatcher: str | None = None,
          address: str | None = None) -> None:
    """Runs a tf.data service server in this process until it is stopped: the dispatcher on
    `port`, or a data worker on `port` that registers with `dispatcher` ("host:port") as
    `address` (the host name or address the trainers reach it at; default this host's name).
    TensorFlow's servers listen on every interface and check no secret: run them on a network
    only the job reaches (docs/security.md)."""
    import tensorflow as tf

    service = tf.data.experimental.service
    if role == "dispatcher":
        server = service.DispatchServer(service.DispatcherConfig(port=port))
    elif role == "worker":
        if dispatcher is None:
            raise ServiceError("a data worker needs its dispatcher: --dispatcher HOST:PORT")
        check_dispatcher(dispatcher)
        host, dispatcher_port = split_address(dispatcher)
        server = service.WorkerServer(service.WorkerConfig(
            dispatcher_address=f"{host}:{dispatcher_port}", port=port,
            worker_address=f"{address or socket.gethostname()}:%port%"))
    else:
        raise ServiceError(f"role {role!r}: give dispatcher or worker")
    print(f"[tfdist] data service: {role} serving on port {port}", flush=True)
    server.join()
