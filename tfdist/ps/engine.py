"""The parameter-server engine: this process's role in a parameter-server job, as an `Engine`.

Workers train alone and talk only to the parameter servers (`ParameterServerOptimizer`), so the
engine has no collectives between them; it gives the algorithms and the tools the process role
(world size = the workers, the worker index, the chief = worker 0).
"""

from __future__ import annotations

from tfdist.comm.engine import Engine, register
from tfdist.ps.cluster import Cluster


@register
class ParameterServerEngine(Engine):
    """A task of a parameter-server job (never detected: chosen by name or created).

    Example:
        ```python
        # python -m tfdist.launch --ps 1 --workers 2 -- python train.py
        engine = tfdist.ps.ParameterServerEngine(tfdist.ps.Cluster.from_tf_config())
        print(engine.world_size)  # the workers of the job
        ```
    """

    name = "parameter_server"

    def __init__(self, cluster: Cluster | None = None):
        self.cluster = Cluster.from_tf_config() if cluster is None else cluster

    def communicator(self, counter=None):
        raise NotImplementedError(
            "Workers of a parameter-server job run no collectives with each other: their "
            "gradients go to the parameter servers through tfdist.ps.ParameterServerOptimizer.")

    @property
    def world_size(self) -> int:
        return self.cluster.num_workers

    @property
    def process_count(self) -> int:
        return self.cluster.num_workers

    @property
    def process_index(self) -> int:
        return self.cluster.task_index if not self.cluster.is_ps else -1

    @property
    def is_chief(self) -> bool:
        return not self.cluster.is_ps and self.cluster.task_index == 0

    def __repr__(self) -> str:
        role = f"{self.cluster.task_type} {self.cluster.task_index}"
        return (f"ParameterServerEngine({role}; {len(self.cluster.ps)} ps, "
                f"{self.cluster.num_workers} workers)")
