"""Private TensorFlow API: the coordination service of a multi-worker job: its heartbeat, and
its key-value store.

TensorFlow starts a coordination service for `MultiWorkerMirroredStrategy` (hosted by worker 0;
every worker's runtime connects to it) and uses its key-value store internally; the eager
context's `set_config_key_value`, `get_config_key_value` and `delete_config_key_value` reach it,
with no public API. Used by `tfdist.comm.kv.CoordinationStore` (the watchdog's heartbeats).
`configure` sets the service up before the strategy does (TensorFlow 2.21's
`MultiWorkerMirroredStrategy` configures it only where nothing did, with the system's heartbeat
timeout: a peer silent for about 6 s ends the job, so a network blink of a few seconds kills
it), and the time a start waits for every task to join (without one, a start waited for a
missing task for over 10 minutes here).
Covered by tests/test_hooks.py (heartbeat, store) and tests/test_cli.py (a worker that never
joins ends the start after `register_ms`).
"""

from __future__ import annotations


def _context():
    from tensorflow.python.eager import context

    return context.context()


def kv_insert(key: str, value: str) -> None:
    """Sets `key` (fails if it is set)."""
    _context().set_config_key_value(key, value)


def kv_get(key: str, timeout_ms: int) -> str:
    """The value of `key`; raises after `timeout_ms` when it is not set."""
    return _context().get_config_key_value(key, timeout_ms)


def kv_delete(key: str) -> None:
    """Removes `key` (nothing if it is not set)."""
    _context().delete_config_key_value(key)


def available() -> bool:
    """Whether this process's runtime is connected to a coordination service."""
    return bool(_context().coordination_service)


def configure(cluster_spec, task_type: str, heartbeat_ms: int, register_ms: int = 0) -> bool:
    """Configures the coordination service as `MultiWorkerMirroredStrategy` would (its chief and
    worker jobs, led by their first task), with `heartbeat_ms`: how long a task may be silent
    before the service declares it unhealthy and ends the job, and `register_ms`: how long the
    job's start waits for every task to join (0: TensorFlow's, far longer). Call it before the
    strategy is made. Returns False where a service is configured already (and leaves it)."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util

    context = _context()
    if context.coordination_service is not None or task_type not in ("chief", "worker"):
        return False
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs]
    context.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        coordinated_jobs=jobs, heartbeat_timeout_in_ms=int(heartbeat_ms),
        cluster_register_timeout_in_ms=int(register_ms))
    if register_ms:  # every task must join within it, else each one's start fails
        context.coordination_service.cluster_register_with_barrier = True
    return True


def heartbeat_ms() -> int | None:
    """The configured heartbeat timeout (ms; 0: the system's), or None without a service."""
    service = _context().coordination_service
    return None if service is None else int(service.heartbeat_timeout_in_ms)
