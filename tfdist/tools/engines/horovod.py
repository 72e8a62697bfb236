"""One process per `horovodrun` rank: the Horovod engine."""

from __future__ import annotations

import os
import sys

from tfdist.tools.engines.base import JobEngine, register

# What horovodrun (Gloo) or an MPI launcher sets in each rank's environment.
LAUNCHED = ("HOROVOD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


@register("horovod")
class Horovod(JobEngine):
    """One process per `horovodrun` rank: the Horovod engine. Each rank reads its slice of the
    global batches; rank 0's initial weights reach every rank."""

    def make(self, config):
        import tfdist.horovod as thvd
        from tfdist.comm import resolve

        hierarchical = config["averaging"]["intra_period"] is not None
        thvd.init(process_sets="dynamic" if hierarchical else None,
                  cycle_ms=config["engine"]["horovod_cycle_ms"])
        engine = resolve()
        if engine.world_size == 1 and not any(v in os.environ for v in LAUNCHED):
            print("[tfdist] engine.name horovod outside horovodrun: this process trains alone "
                  "(1 rank); start the job with `horovodrun -np N -H host:slots tfdist train "
                  "...`", file=sys.stderr, flush=True)
        return None, engine

    def feed(self, source, warmup_epochs, scale):
        import tfdist.horovod as thvd

        callbacks = [thvd.callbacks.BroadcastGlobalVariables(0), thvd.callbacks.MetricAverage()]
        if warmup_epochs:
            callbacks.append(thvd.callbacks.LearningRateWarmup(warmup_epochs))
        return source.shard(self.rank, self.world_size), callbacks
