"""The parameter-server cluster as TF_CONFIG describes it, and how variables are split over it.

TF_CONFIG names a "ps" job (the tasks that hold the variables and the optimizer) and the
training tasks: "worker" tasks, and optionally a "chief", which is worker 0 here (it writes the
run's files). `python -m tfdist.launch --ps P --workers W -- ...` writes such a TF_CONFIG for
every task.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from tfdist.security import job_secret

LAUNCH_HINT = ("start the tasks with `python -m tfdist.launch --ps 1 --workers 2 -- ...`, or set "
               'TF_CONFIG, e.g. {"cluster": {"ps": ["host:port"], "worker": ["host:port", ...]}, '
               '"task": {"type": "worker", "index": 0}}')


@dataclass(frozen=True)
class Cluster:
    """The tasks of a parameter-server job and this process's place in it.

    Attributes:
        ps: The parameter servers' addresses ("host:port"), in task order.
        workers: The training tasks' addresses: the chief first (if TF_CONFIG has one), then
            the "worker" tasks in order.
        task_type: "ps" or "worker" (a chief is worker 0).
        task_index: The index among the parameter servers, or the worker index.
        secret: The job's secret (`tfdist.security`): every RPC to a parameter server
            carries proof of it. `from_tf_config` reads it from the environment.

    Example:
        ```python
        # python -m tfdist.launch --ps 1 --workers 2 -- python train.py
        cluster = tfdist.ps.Cluster.from_tf_config()  # reads TF_CONFIG and the job's secret
        print(cluster.task_type, cluster.task_index, "of", cluster.num_workers, "workers")
        ```
    """

    ps: tuple[str, ...]
    workers: tuple[str, ...]
    task_type: str
    task_index: int
    secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_tf_config(cls, text: str | None = None) -> Cluster:
        """The cluster in `text` (default: the TF_CONFIG environment variable), with the job's
        secret from the environment (`tfdist.security.job_secret`).

        Raises:
            ValueError: TF_CONFIG is missing or malformed, has no "ps" or no training task, or
                names a task that is not in the cluster; the message says how to fix it.
        """
        text = os.environ.get("TF_CONFIG") if text is None else text
        if not text:
            raise ValueError(f"Parameter-server training needs TF_CONFIG: {LAUNCH_HINT}.")
        try:
            config = json.loads(text)
            cluster, task = config["cluster"], config["task"]
            task_type, index = str(task["type"]), int(task["index"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"TF_CONFIG is not a cluster description ({e!s}): "
                             f"{LAUNCH_HINT}.") from None
        ps = tuple(cluster.get("ps") or ())
        if not ps:
            raise ValueError(f"TF_CONFIG has no 'ps' job (jobs: {sorted(cluster)}); "
                             f"parameter-server training needs at least one: {LAUNCH_HINT}.")
        chief = tuple(cluster.get("chief") or ())
        if len(chief) > 1:
            raise ValueError(f"TF_CONFIG has {len(chief)} 'chief' tasks; at most one.")
        workers = chief + tuple(cluster.get("worker") or ())
        if not workers:
            raise ValueError(f"TF_CONFIG has no 'worker' or 'chief' task to train: {LAUNCH_HINT}.")
        if task_type == "chief":
            task_type, size = "worker", 1
        elif task_type == "worker":
            size = len(cluster.get("worker") or ())
        elif task_type == "ps":
            size = len(ps)
        else:
            raise ValueError(f"TF_CONFIG task type {task_type!r} has no part in parameter-server "
                             "training; use 'ps', 'worker' or 'chief'.")
        if not 0 <= index < size:
            raise ValueError(f"TF_CONFIG task index {index} is outside the {size} "
                             f"'{task['type']}' task(s).")
        if task["type"] == "worker":
            index += len(chief)
        return cls(ps, workers, task_type, index, job_secret())

    @property
    def is_ps(self) -> bool:
        return self.task_type == "ps"

    @property
    def num_workers(self) -> int:
        return len(self.workers)


def assign_shards(sizes: Sequence[int], num_ps: int) -> list[int]:
    """The parameter server of each variable: the largest first, each on the least loaded
    server (ties: the lower index), so the servers hold about equal bytes. The same on every
    task, from the variables' sizes alone.

    Example:
        ```python
        # 4 variables on 2 servers: the largest first, each on the least loaded
        assert tfdist.ps.assign_shards([100, 10, 50, 40], 2) == [0, 1, 1, 1]
        ```
    """
    if num_ps < 1:
        raise ValueError(f"`num_ps` must be >= 1. Received: {num_ps}")
    load = [0] * num_ps
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(num_ps), key=lambda p: (load[p], p))
        owner[i] = target
        load[target] += sizes[i]
    return owner


def nbytes(variable) -> int:
    """A variable's size in bytes (Keras or TensorFlow variable)."""
    return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def shard_of(variables: Sequence, index: int, num_ps: int) -> list:
    """The variables parameter server `index` of `num_ps` holds (`assign_shards`), in order.

    Example:
        ```python
        model = build_model()
        mine = tfdist.ps.shard_of(model.trainable_variables, index=0, num_ps=2)
        print([v.path for v in mine])  # what server 0 of 2 holds
        ```
    """
    owner = assign_shards([nbytes(v) for v in variables], num_ps)
    return [v for v, o in zip(variables, owner) if o == index]
