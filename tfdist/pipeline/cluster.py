"""Pipeline stages on other processes and hosts: the workers of a TF_CONFIG cluster.

TensorFlow's cluster runtime runs ops on the devices of other processes. `cluster_devices()`
connects worker 0 (the driver) to the cluster and names one device per worker; a `Pipeline`
whose stage j sits on worker j's device then runs that stage's forward, backward and update in
worker j's process, its variables and optimizer slots live there, and the activations go forward
and the gradients back as TensorFlow's own tensor transfers (gRPC) inside the traced step. Rows of
devices give data parallelism across pipelines (`Pipeline(..., devices=[row0, row1])`: each
replica's copy of a variable gets the sum of every replica's gradient).

Worker 0 runs the Python program (`fit`, callbacks, checkpoints, the data). Every other worker
only serves its devices: `cluster_devices()` there never returns; the process exits (status 0) once
worker 0 has ended, or (status 1) if worker 0 never comes up. Start the workers as for any
TF_CONFIG job, e.g. `python -m tfdist.launch --workers 4 -- python train.py`.

Faults: a serving worker that dies fails worker 0's next step; `PipelineModel`'s `fit`, `evaluate`
and `predict` then raise `tf.errors.UnavailableError` naming the lost workers
(`naming_lost_workers`).
The job stops there; re-run it, restoring a checkpoint, to go on.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import tensorflow as tf

from tfdist.arguments import check_int

__all__ = ["cluster_devices", "naming_lost_workers", "worker_device"]

JOB = "worker"
# How long a TensorFlow error is checked against the workers before it is taken as TensorFlow's
# own: a worker killed at this moment may reset its connections before its process has closed
# the port it serves on (it still accepts for a few milliseconds).
LOST_PROBE_SECONDS = 3.0
_connected: list[str] = []  # the workers' addresses, once this process drives a cluster


def _read_cluster(resolver) -> tuple[list[str], int, object]:
    """The workers' addresses and this task's index, checked."""
    if resolver is None:
        if not os.environ.get("TF_CONFIG"):
            raise ValueError("cluster_devices() reads TF_CONFIG, which is not set: start one "
                             "process per host, e.g. `python -m tfdist.launch --workers N -- "
                             "python train.py`, or pass a cluster resolver.")
        try:
            json.loads(os.environ["TF_CONFIG"])
        except ValueError as error:
            raise ValueError(f"TF_CONFIG is not JSON ({error}).") from None
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec().as_dict()
    other = sorted(set(spec) - {JOB})
    if other:
        raise ValueError(f"A pipeline across hosts runs on '{JOB}' tasks only; TF_CONFIG also "
                         f"has {other}: list every host as a worker (worker 0 drives).")
    workers = spec.get(JOB) or []
    if isinstance(workers, dict):  # sparse cluster specs: {index: address}
        workers = [workers[i] for i in sorted(workers)]
    if not workers:
        raise ValueError("TF_CONFIG's cluster has no workers.")
    if resolver.task_type != JOB:
        raise ValueError(f"This task is {resolver.task_type!r}; a pipeline across hosts runs on "
                         f"'{JOB}' tasks.")
    return list(workers), int(resolver.task_id), resolver


def worker_device(task: int, kind: str = "CPU") -> str:
    """Worker `task`'s first device of `kind`, as a full device name."""
    return f"/job:{JOB}/replica:0/task:{task}/device:{kind}:0"


def cluster_devices(stages: int | None = None, replicas: int = 1, resolver=None,
                    wait: float = 600.0) -> list[str] | list[list[str]]:
    """One device per TF_CONFIG worker, for a pipeline's stages (worker 0 drives).

    Args:
      stages: stages per pipeline (default: the number of workers / `replicas`).
      replicas: data-parallel pipelines; stage j of replica r runs on worker r * stages + j.
      resolver: a `tf.distribute.cluster_resolver.ClusterResolver` (default: TF_CONFIG's).
      wait: seconds a serving worker waits for worker 0 to come up.

    Returns (on worker 0 only; the other workers serve and exit): `stages` device names, or with
    `replicas` > 1 one row of `stages` devices per replica, for `Pipeline(devices=...)`. Each
    is the worker's first GPU if it has one, else its CPU.

    Raises `ValueError` before anything starts when stages x replicas is not the number of
    workers (a stage count above the hosts included).

    Example:
        ```python
        # python -m tfdist.launch --workers 2 -- python train.py  (TF_CONFIG on each worker)
        devices = tfdist.pipeline.cluster_devices()  # worker 0 drives; the others serve, then exit
        stages = [[keras.layers.Flatten(), keras.layers.Dense(128, activation="relu")],
                  [keras.layers.Dense(10)]]
        model = tfdist.pipeline.PipelineModel(
            tfdist.pipeline.Pipeline(stages, devices=devices, num_microbatches=4),
            input_shape=(8, 8, 1))
        ```
    """
    for name, value in (("stages", stages), ("replicas", replicas)):
        if value is not None:
            check_int(name, value, 1)
    workers, task, resolver = _read_cluster(resolver)
    n = len(workers)
    if stages is None:
        if n % replicas:
            raise ValueError(f"The cluster has {n} workers, which {replicas} pipeline replicas "
                             f"cannot share equally: start a multiple of {replicas} workers.")
        stages = n // replicas
    if stages * replicas != n:
        fix = (f"start {stages * replicas} workers (python -m tfdist.launch --workers "
               f"{stages * replicas}) or give fewer stages" if stages * replicas > n else
               f"start {stages * replicas} workers, or give stages={n // replicas}")
        raise ValueError(f"The pipeline has {stages} stages x {replicas} replicas = "
                         f"{stages * replicas} hosts, but the cluster has {n} workers "
                         f"(TF_CONFIG): each stage takes one worker; {fix}.")
    if task != 0:
        _serve(resolver, workers, task, wait)  # never returns
    tf.config.experimental_connect_to_cluster(resolver, job_name=JOB, task_index=0)
    _connected[:] = workers
    gpus = {tf.DeviceSpec.from_string(d.name).task for d in tf.config.list_logical_devices("GPU")}
    names = [worker_device(t, "GPU" if t in gpus else "CPU") for t in range(n)]
    if replicas == 1:
        return names
    return [names[r * stages:(r + 1) * stages] for r in range(replicas)]


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def _serve(resolver, workers: list[str], task: int, wait: float) -> None:
    """Serves this worker's devices until worker 0 (the driver) has come and gone; exits."""
    tf.distribute.Server(resolver.cluster_spec(), job_name=JOB, task_index=task,
                         protocol=resolver.rpc_layer or "grpc", start=True)
    print(f"[tfdist] pipeline: worker {task} serves its devices to worker 0 "
          f"({workers[0]})", flush=True)
    deadline, seen = time.monotonic() + wait, False
    while True:
        if _accepts(workers[0]):
            seen = True
        elif seen:
            break
        elif time.monotonic() > deadline:
            os.write(2, f"[tfdist] pipeline: worker 0 ({workers[0]}) did not come up in "
                        f"{wait:g} s; worker {task} stops\n".encode())
            os._exit(1)
        time.sleep(0.5)
    print(f"[tfdist] pipeline: worker 0 has ended; worker {task} stops", flush=True)
    os._exit(0)  # TensorFlow's server cannot be stopped; its threads would keep the process


@contextlib.contextmanager
def naming_lost_workers():
    """Re-raises a lost connection to a serving worker as `tf.errors.UnavailableError`, with the
    workers that no longer answer named. TensorFlow's own error names the RPC, not always the
    task, and its class depends on what was under way when the connection went (a step:
    UnavailableError; registering a traced function: "Failed to register function remotely
    due to Socket closed", another class); any TensorFlow error while a worker is gone is
    reported so."""
    try:
        yield
    except tf.errors.OpError as error:
        deadline = time.monotonic() + LOST_PROBE_SECONDS
        while True:
            lost = [f"worker {t} ({a})" for t, a in enumerate(_connected)
                    if t and not _accepts(a)]
            if lost or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not lost:
            raise
        raise tf.errors.UnavailableError(error.node_def, error.op, (
            f"Pipeline {', '.join(lost)} no longer answers: its process or host is gone, and "
            "with it the stages and variables it held. The job stops here; start it again "
            "(restoring the last checkpoint, e.g. with tfdist.callbacks.BackupAndRestore) to go "
            f"on. TensorFlow said: {error.message}")) from error
