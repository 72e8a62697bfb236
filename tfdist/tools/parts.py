"""The library objects a validated config describes: its compressor, the optimizer's parts, its
offload, its metrics. Building them is also how a config is checked (`tfdist.tools.config`), so
the constructors' own rules apply; TensorFlow is imported only when one is built."""

from __future__ import annotations

import os
from typing import Any


def make_compressor(section: dict[str, Any]):
    """The compressor a validated `compression` section describes (None for "none")."""
    from tfdist import compression

    if section["name"] == "none" and not section["error_feedback"]:
        return None
    return compression.get({"name": section["name"], **section["options"],
                            "error_feedback": section["error_feedback"]})


def make_offload(opt: dict[str, Any]):
    """The `tfdist.zero.Offload` a validated `optimizer` section asks for, or None."""
    from tfdist.zero import Offload

    if opt["offload"] is None:
        return None
    directory = opt["offload_dir"] and os.path.expanduser(opt["offload_dir"])
    return Offload(opt["offload"], directory if opt["offload"] == "disk" else None,
                   budget_bytes=int(opt["offload_budget_mb"] * 2**20))


def metrics_of(train: dict[str, Any]) -> list[str]:
    """The metrics a validated `train` section asks for: `train.metrics`, or the task's (a
    crossentropy loss is a classification: accuracy; any other a regression: mae)."""
    if train["metrics"] is not None:
        return list(train["metrics"])
    return ["accuracy"] if "crossentropy" in train["loss"] else ["mae"]


def make_parts(c: dict[str, dict[str, Any]]) -> list:
    """The `tfdist.DistributedOptimizer` parts a config describes: its gradient exchange
    (`compression`), accumulation (`optimizer.accumulation_steps`) and local SGD (`averaging`).
    Building them is how the config is validated: the constructors' own checks apply."""
    return [part for _, make in part_makers(c) for part in make()]


def part_makers(c: dict[str, dict[str, Any]]):
    """(section, function building that section's parts), one per section."""
    from tfdist.averaging import HierarchicalSchedule, PeriodicSchedule
    from tfdist.optimizers import Accumulation, AutoExchange, GradientExchange, LocalSGD

    comp, avg, opt = c["compression"], c["averaging"], c["optimizer"]

    def exchange():
        if comp["name"] == "auto":  # picked from the measured link (tfdist.optimizers.auto)
            return [AutoExchange(**comp["options"])]
        bucket = None if comp["bucket_mb"] is None else max(1, int(comp["bucket_mb"] * 2**20))
        return [GradientExchange(make_compressor(comp), comp["min_size"], comp["compress_1d"],
                                 comp["start_step"], bucket)]

    def accumulation():
        steps = opt["accumulation_steps"]
        return [Accumulation(steps)] if steps > 1 else []

    def local_sgd():
        if avg["period"] is None:
            return []
        schedule = (PeriodicSchedule(avg["period"], avg["warmup_steps"])
                    if avg["intra_period"] is None else
                    HierarchicalSchedule(avg["intra_period"], avg["period"], avg["warmup_steps"],
                                         avg["host_size"]))
        return [LocalSGD(schedule, avg["outer"], avg["topology"],
                         avg["average_optimizer_state"])]

    # In the order the parts run: accumulation, local SGD, then the exchange.
    return [("optimizer", accumulation), ("averaging", local_sgd), ("compression", exchange)]
