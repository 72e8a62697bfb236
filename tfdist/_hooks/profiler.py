"""Private runtime hooks: where a tf.function's nodes ran (run metadata) and when each op ran
(the profiler's trace). Used by the pipeline's tests and its benchmark; covered by
tests/test_hooks.py."""

from __future__ import annotations

import tensorflow as tf


def executed_devices(python_function, *args) -> dict[str, tuple[str, str]]:
    """Runs `python_function(*args)` as a new `tf.function` once and returns {node name:
    (device, op type)} for every node of the graphs the runtime partitioned and ran (the devices
    it assigned, not the ones asked for). Uses the eager context's run metadata, which has no
    public API and reports a function's graphs only when it is instantiated, hence the new
    tf.function."""
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        tf.function(python_function)(*args)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return {node.name: (node.device, node.op)
            for graph in metadata.function_graphs
            for partition in graph.partition_graphs
            for node in partition.node}


# -- when each op ran ----------------------------------------------------------------------------
def profile_op_intervals(function, logdir: str) -> list[tuple[str, int, int]]:
    """Runs `function()` under the TensorFlow profiler and returns (node name, start ns, end ns)
    for every op kernel executed (see `op_events`)."""
    tf.profiler.experimental.start(logdir)
    try:
        function()
    finally:
        tf.profiler.experimental.stop()
    return [(name, start, end) for name, _, start, end in op_events(logdir)]


def op_events(logdir: str) -> list[tuple[str, str, int, int]]:
    """(node name, op type, start ns, end ns) of every op kernel in the newest trace the
    TensorFlow profiler wrote under `logdir`, read from its XSpace (whose proto module is not
    part of the public API). An asynchronous kernel spans from its start to its completion:
    TensorFlow's collectives record that span themselves; for the others (Horovod's ops) it is
    read from the executor's `ProcessAsync::Start` and `::Done` events, which name the node and
    its op type in their stats and share a correlation id."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))
    if not paths:
        raise RuntimeError(f"The TensorFlow profiler wrote no trace under {logdir}.")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    out = []
    started: dict[int, tuple[str, str, int]] = {}  # correlation id -> (node, op type, start)
    done: dict[int, int] = {}  # correlation id -> end
    for plane in space.planes:
        names = plane.event_metadata
        stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                start = (base + event.offset_ps) // 1000
                end = start + event.duration_ps // 1000
                name = names[event.metadata_id].name
                if name.startswith(_ASYNC):
                    stats = {stat_names.get(s.metadata_id): (
                        stat_names.get(s.ref_value) if s.ref_value else s.int64_value or s.uint64_value)
                        for s in event.stats}
                    produced, consumed = int(stats.get("_p") or 0), int(stats.get("_c") or 0)
                    if name == _ASYNC + "Start" and produced:
                        started[produced] = (str(stats.get("name") or ""),
                                             str(stats.get("kernel_type") or ""), start)
                    elif name == _ASYNC + "Done" and consumed:
                        done[consumed] = end
                    continue
                node, _, op_type = name.partition(":")
                if op_type.isidentifier():  # op kernels are "node name:OpType"
                    out.append((node, op_type, start, end))
    recorded = {node for node, *_ in out}
    out += [(node, op_type, start, done[key]) for key, (node, op_type, start) in started.items()
            if key in done and node not in recorded and op_type.isidentifier()]
    return out


_ASYNC = "ExecutorState::ProcessAsync::"
