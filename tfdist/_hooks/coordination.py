"""Private TensorFlow API: the coordination service's key-value store of a multi-worker job.

TensorFlow starts a coordination service for `MultiWorkerMirroredStrategy` (hosted by worker 0;
every worker's runtime connects to it) and uses its key-value store internally; the eager
context's `set_config_key_value`, `get_config_key_value` and `delete_config_key_value` reach it,
with no public API. Used by `tfdist.comm.kv.CoordinationStore` (the watchdog's heartbeats).
Covered by tests/test_hooks.py.
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
