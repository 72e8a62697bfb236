"""The engines `tfdist train` runs a config on: one `JobEngine` class per `engine.name`, each
owning its part of the run (`tfdist.tools.engines.base`).

The built-in names are the launch layouts a config picks (`single`: one device, `mirrored`: the
devices of one process, `multi_worker`: TF_CONFIG workers, `horovod`: horovodrun ranks,
`parameter_server`: TF_CONFIG ps and worker tasks, `hogwild`: lock-free replicas), each running
on one of the library's engines (`tfdist.comm`: distribute, horovod, local, parameter servers).

An engine of your own is one file: a `JobEngine` subclass with `make` (the strategy, if any,
and the `tfdist.comm.Engine`), overriding the steps of the run that differ (its role, serving,
optimizer, feed, callbacks, report), named in a config by its import path
(`tfdist train --set engine.name=my_engine:MyJob`) or registered with `@register("name")` in a
module imported first:

    class MyJob(JobEngine):
        def make(self, config):
            return None, MyEngine()      # (strategy or None, tfdist engine)

Looking an engine up imports no TensorFlow; a config's values are checked against the schema
before any engine's `check` runs.
"""

from __future__ import annotations

from tfdist.tools.engines import data_parallel, hogwild, horovod, parameter_server  # noqa: F401
from tfdist.tools.engines.base import ENGINES, JobEngine, register

__all__ = ["ENGINES", "JobEngine", "register"]
