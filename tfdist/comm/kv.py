"""Key-value stores every process of a job reaches through the job's own channel (no shared
file): small values (a heartbeat) that one process writes and the others read.

* `CoordinationStore`: TensorFlow's coordination service of a multi-worker job (hosted by
  worker 0, reached over the job's gRPC channel).
* `RendezvousStore`: the HTTP key-value store of Horovod's Gloo rendezvous (horovodrun's, or
  task 0's under `python -m tfdist.launch --slurm --horovod`), values as JSON text, in the
  store's "tfdist" scope (Horovod's own client would unpickle what it reads).

`Engine.key_value_store()` gives the one its job has, or None.
"""

from __future__ import annotations

import abc
import os
import urllib.error
import urllib.request

from tfdist._hooks.coordination import kv_delete, kv_get, kv_insert

MAX_VALUE = 4096  # characters; a store carries small values


class KeyValueStore(abc.ABC):
    @abc.abstractmethod
    def put(self, key: str, value: str) -> None:
        """Sets `key` (overwriting); raises OSError when the store cannot be reached."""

    @abc.abstractmethod
    def get(self, key: str) -> str | None:
        """The value of `key`, or None when it is not set or the store cannot be reached."""


class CoordinationStore(KeyValueStore):
    """TensorFlow's coordination service (multi-worker jobs)."""

    def put(self, key: str, value: str) -> None:
        try:
            kv_delete(key)
            kv_insert(key, value[:MAX_VALUE])
        except Exception as e:  # noqa: BLE001 (TensorFlow's errors, whatever their class)
            raise OSError(f"coordination service: {e}") from None

    def get(self, key: str) -> str | None:
        try:
            return kv_get(key, timeout_ms=500)
        except Exception:  # noqa: BLE001 (not set, or the service is gone)
            return None


class RendezvousStore(KeyValueStore):
    """Horovod's Gloo rendezvous store at `address`:`port`."""

    def __init__(self, address: str, port: int, timeout: float = 2.0):
        self.url = f"http://{address}:{port}/tfdist"
        self.timeout = timeout

    @classmethod
    def from_environment(cls) -> RendezvousStore | None:
        address = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        return cls(address, int(port)) if address and port and port.isdigit() else None

    def put(self, key: str, value: str) -> None:
        request = urllib.request.Request(f"{self.url}/{key}", data=value[:MAX_VALUE].encode(),
                                         method="PUT")
        try:
            urllib.request.urlopen(request, timeout=self.timeout).close()
        except (urllib.error.URLError, OSError) as e:
            raise OSError(f"Horovod's rendezvous store: {e}") from None

    def get(self, key: str) -> str | None:
        try:
            with urllib.request.urlopen(f"{self.url}/{key}", timeout=self.timeout) as response:
                return response.read(MAX_VALUE + 1).decode(errors="replace")
        except (urllib.error.URLError, OSError, ValueError):
            return None
