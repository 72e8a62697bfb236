"""Bytes of optimizer variables actually placed on each device, by kind."""

from __future__ import annotations

from collections import defaultdict

from tfdist.comm import replica_copies
from tfdist.optimizers import Accumulation, chain_of

KINDS = ("optimizer_state", "param_shard", "gradient_buffers", "other")


def _kinds(optimizer) -> dict[int, str]:
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    kinds = {id(v): "optimizer_state" for v in inner.variables if len(v.shape) >= 1}
    chain = chain_of(optimizer)
    accumulation = chain.part(Accumulation) if chain is not None else None
    for v in accumulation.buffers if accumulation is not None else []:
        kinds[id(v)] = "gradient_buffers"
    if getattr(optimizer, "_shard", None) is not None:
        kinds[id(optimizer._shard)] = "param_shard"
    return kinds


def memory_report(optimizer) -> dict[str, dict[str, int]]:
    """{device: {kind: bytes}} for every variable of a built Keras optimizer (a tfdist wrapper,
    a `ZeroOptimizer` or a plain Keras optimizer), read from where each copy was placed.

    Kinds: "optimizer_state" (the inner optimizer's per-element state: momentum, Adam moments),
    "param_shard" (ZeroOptimizer's flat fp32 parameter shard; at stage 3 the model's
    parameters themselves), "gradient_buffers" (accumulators)
    and "other" (counters, scalars).

    Offloaded state (`ZeroOptimizer(offload=...)`) is reported under "host" (offload="cpu":
    all of it; "disk": the update's working copy of one chunk per slot) and "disk:<directory>".

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.ZeroOptimizer(keras.optimizers.Adam(), stage=1),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        for device, kinds in tfdist.zero.memory_report(model.optimizer).items():
            print(device, kinds["optimizer_state"], "bytes of Adam moments")  # half on each
        ```
    """
    kinds = _kinds(optimizer)
    report: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
    parameters = getattr(optimizer, "parameter_shard", None)  # stage 3: the model's shard
    if parameters is not None:
        kinds[id(parameters)] = "param_shard"
    for var in [*optimizer.variables, *([] if parameters is None else [parameters])]:
        kind = kinds.get(id(var), "other")
        for copy in replica_copies(var):
            report[copy.device][kind] += int(copy.shape.num_elements()) * copy.dtype.size
    offloaded = getattr(optimizer, "offloaded", None)
    if offloaded is not None:
        if offloaded.offload.kind == "cpu":
            report["host"]["optimizer_state"] += offloaded.stored_bytes()
        else:
            report["host"]["optimizer_state"] += offloaded.working_bytes()
            report[f"disk:{offloaded.directory}"]["optimizer_state"] += offloaded.stored_bytes()
    return dict(report)
