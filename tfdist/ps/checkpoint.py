"""Parameter servers' checkpoints: each server's shard, optimizer state and counters.

Every `every` updates a server writes `directory/ps-<i>/step-<version>.npz` (under a temporary
name, synced, then renamed, so a server killed while writing leaves its previous checkpoint);
it keeps the newest `KEEP`. A job started again on the same directory resumes from the newest
step that every server completed, and in synchronous training every worker too (`common_step`);
each worker then resumes at the step the servers hold for it (its clock), so synchronous
training goes on to the weights of a run never stopped. The directory must be one the ps tasks
share (one host, or a network file system).

What lives on the workers and not on the servers, the model's non-trainable variables (batch
normalization's moving statistics: the chief's end up in the saved model), is checkpointed by
each worker at the same steps (`WorkerCheckpoint`, `worker-<i>/step-<n>.npz`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import keras
import numpy as np

KEEP = 2
PREFIX, SUFFIX = "step-", ".npz"


def shard_directory(directory: str, index: int | str) -> str:
    """Server `index`'s directory (`ps-<index>`), or the one named `index` (`worker-1`)."""
    return os.path.join(directory, index if isinstance(index, str) else f"ps-{index}")


def complete_steps(directory: str, index: int | str) -> list[int]:
    """Steps of server `index`'s (or `worker-<i>`'s) complete checkpoints, oldest first."""
    path = shard_directory(directory, index)
    if not os.path.isdir(path):
        return []
    return sorted(int(name[len(PREFIX):-len(SUFFIX)]) for name in os.listdir(path)
                  if name.startswith(PREFIX) and name.endswith(SUFFIX)
                  and name[len(PREFIX):-len(SUFFIX)].isdigit())


def common_step(directory: str, num_servers: int, workers: int = 0) -> int | None:
    """The newest step every one of `num_servers` servers completed; None when none has any.
    With `workers` (synchronous training, where a worker's steps are the servers' updates),
    the newest of those that each of the workers keeping their own checkpoints
    (`WorkerCheckpoint`) also completed: a server writes its checkpoint of a step while the
    workers still finish it, and a worker stopped in between has none there.

    Raises:
        ValueError: the servers hold checkpoints but none in common (another job's, or a
            directory that is not shared).
    """
    held = {i: complete_steps(directory, i) for i in range(num_servers)}
    common = set(held[0]).intersection(*map(set, held.values()))
    if common:
        own = [set(steps) for steps in (complete_steps(directory, f"worker-{w}")
                                        for w in range(workers)) if steps]
        return max(common.intersection(*own) or common)
    if any(held.values()):
        raise ValueError(
            f"The parameter servers hold no checkpoint in common under {directory!r} (steps "
            f"per server: {held}). Every ps task must see the same directory, with as many "
            "servers as wrote it; remove it to start afresh.")
    return None


def save(directory: str, index: int | str, step: int, arrays: dict[str, np.ndarray],
         meta: dict) -> str:
    """Writes server `index`'s checkpoint of `step` (arrays and a JSON-able meta); keeps the
    newest `KEEP`. Raises OSError (the disk is full, ...) with the previous checkpoint intact."""
    path = shard_directory(directory, index)
    os.makedirs(path, exist_ok=True)
    final = os.path.join(path, f"{PREFIX}{step}{SUFFIX}")
    partial = final + ".partial"
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.array(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
    try:
        with open(partial, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, final)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    for old in complete_steps(directory, index)[:-KEEP]:
        os.unlink(os.path.join(path, f"{PREFIX}{old}{SUFFIX}"))
    return final


def load(directory: str, index: int | str, step: int) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, meta) of server `index`'s checkpoint of `step`."""
    path = os.path.join(shard_directory(directory, index), f"{PREFIX}{step}{SUFFIX}")
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files if key != "meta"}
        meta = json.loads(str(data["meta"]))
    return arrays, meta


def remove(directory: str, index: int | str) -> None:
    """Removes server `index`'s checkpoints (and the directory, once every server's are gone)."""
    shutil.rmtree(shard_directory(directory, index), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


class WorkerCheckpoint(keras.callbacks.Callback):
    """Saves a parameter-server worker's own state, the model's non-trainable variables, every
    `every` steps (counted by the worker's optimizer, like the servers' updates) to
    `directory/worker-<worker>/`; `restore(step)` takes it back when the worker resumes.

    Args:
        directory: The servers' checkpoint directory.
        every: Steps between two checkpoints (the servers' `checkpoint_every`).
        worker: This worker's index.
    """

    def __init__(self, directory: str, every: int, worker: int):
        super().__init__()
        self.directory, self.every, self.name = str(directory), every, f"worker-{worker}"
        self._last: int | None = None

    def restore(self, step: int) -> bool:
        """Takes back the state saved at `step`; False (nothing changed) when there is none."""
        if step not in complete_steps(self.directory, self.name):
            return False
        arrays, _ = load(self.directory, self.name, step)
        variables = self.model.non_trainable_variables
        if len(arrays) != len(variables):
            raise ValueError(f"The checkpoint of {self.name} in {self.directory} holds "
                             f"{len(arrays)} non-trainable variables; this model has "
                             f"{len(variables)}. Resume with the same model, or remove it.")
        for i, variable in enumerate(variables):
            variable.assign(arrays[f"v{i}"])
        self._last = step
        return True

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step % self.every == 0 and step != self._last:
            save(self.directory, self.name, step,
                 {f"v{i}": np.asarray(v.numpy())
                  for i, v in enumerate(self.model.non_trainable_variables)},
                 {"step": step})
            self._last = step

    def on_train_end(self, logs=None):
        remove(self.directory, self.name)
