"""The planner (`tfdist.plan`, `tfdist plan`): the bytes it predicts are the bytes the library
counts on a run, the memory it predicts is what the optimizers hold (`memory_report`), its link
model agrees with the arithmetic worked by hand, and the command answers without TensorFlow."""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import tfdist
from tests.conftest import ROOT, worker_env
from tfdist import compression
from tfdist.plan import Calibration, Cluster, Link, Stragglers, Workload, predict, simulate
from tfdist.plan.simulate import STALENESS_BUCKETS
from tfdist.ps.server import BUCKETS
from tfdist.zero import memory_report

REPLICAS = 4
STEPS = 3


def _model():
    """A kernel PowerSGD compresses (32 x 48), one it sends dense (48 x 2: it would not pay)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(48, activation="relu"),
                             keras.layers.Dense(48, activation="relu"), keras.layers.Dense(2)])


OPTIMIZERS = {  # FP16 and ZeRO-1 send as the dense rest and ZeRO-2 do, by the same rules
    "dense": lambda: tfdist.DistributedOptimizer(keras.optimizers.SGD(0.01)),
    "powersgd:2": lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.01), compressor=compression.PowerSGD(rank=2)),
    "topk:0.05": lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.01), compressor=compression.TopK(0.05)),
    "zero2": lambda: tfdist.ZeroOptimizer(keras.optimizers.SGD(0.01), stage=2),
}


@pytest.mark.parametrize("spec", list(OPTIMIZERS))
def test_the_planned_bytes_are_the_bytes_the_library_counts(mirrored, spec):
    strategy = mirrored(REPLICAS)
    with strategy.scope():
        model = _model()
        model.compile(optimizer=OPTIMIZERS[spec](), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * STEPS * REPLICAS, 32)).astype("float32")
    y = rng.standard_normal((8 * STEPS * REPLICAS, 2)).astype("float32")
    model.fit(x, y, batch_size=8 * REPLICAS, epochs=1, verbose=0)
    counted = float(model.optimizer.bytes_sent) / STEPS
    # MirroredStrategy's replicas reduce-scatter for real, as Horovod's ranks do
    cluster = Cluster(REPLICAS, Link(1.0), engine="horovod")
    (estimate,) = predict(Workload.from_keras(model, 0.0), cluster, [spec]).estimates
    assert estimate.wire_bytes == pytest.approx(counted, rel=1e-9), spec


def test_an_embeddings_planned_rows_are_the_bytes_the_library_counts(mirrored):
    """An embedding's gradient comes as the rows the batch looks up: the dense exchange
    all-gathers them with their indices (`sparse_all_reduce`) and all-reduces the rest; the
    planner, told the worker's batch, prices the same bytes, and the whole table when not."""
    strategy = mirrored(REPLICAS)
    batch, ids, vocab, width = 8, 6, 500, 4
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((ids,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(vocab, width)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
        model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (batch * STEPS * REPLICAS, ids)).astype("int32")
    y = rng.standard_normal((batch * STEPS * REPLICAS, 2)).astype("float32")
    model.fit(x, y, batch_size=batch * REPLICAS, epochs=1, verbose=0)
    counted = float(model.optimizer.bytes_sent) / STEPS
    assert tfdist.plan.embedding_rows(model, batch) == (batch * ids, 0, 0)
    cluster = Cluster(REPLICAS, Link(1.0), engine="horovod")
    (rows,) = predict(Workload.from_keras(model, 0.0, batch=batch), cluster, ["dense"]).estimates
    assert rows.wire_bytes == pytest.approx(counted, rel=1e-9)
    dense = 4 * (ids * width * 2 + 2)  # the kernel and the bias, all-reduced
    gathered = batch * ids * (4 * width + 4)  # each worker's rows and their int32 indices
    assert counted == pytest.approx(2 * (REPLICAS - 1) / REPLICAS * dense
                                    + (REPLICAS - 1) * gathered, rel=1e-9)
    (table,) = predict(Workload.from_keras(model, 0.0), cluster, ["dense"]).estimates
    assert table.wire_bytes == pytest.approx(
        2 * (REPLICAS - 1) / REPLICAS * 4 * model.count_params(), rel=1e-9)
    assert rows.calls == table.calls + 1  # the rows' own all-gather


def test_rows_are_planned_as_the_table_where_the_table_sends_less():
    """Each worker's rows reach the N - 1 others: 1,024 rows of 256 floats (the models suite's
    encoder at 16 tokens x 64) against its 8,192 x 256 table cost less up to 8 workers, more
    from 16. The planner prices what the exchange then sends (`gathers_rows`, as it does)."""
    from tfdist.plan.costs import gathers_rows, ring_bytes

    table, row = 4 * 8192 * 256, 4 * 256
    assert gathers_rows(1024, row, table, 8) and not gathers_rows(1024, row, table, 16)
    assert gathers_rows(None, row, table, 1024)  # not known when traced: rows
    work = Workload(((8192, 256), (256,)), 0.0, sparse_rows=(1024, 0))
    for n in (8, 16, 1024):
        (e,) = predict(work, Cluster(n, Link(1.0)), ["dense"]).estimates
        rows = ring_bytes("all_gather", 1024 * (row + 4), n) + ring_bytes("all_reduce", 4 * 256, n)
        whole = ring_bytes("all_reduce", table + 4 * 256, n)
        assert e.wire_bytes == pytest.approx(min(rows, whole), rel=1e-12), n
        assert e.note == ("1 of 1 embedding table(s) sent as the rows the batch looks up" if n == 8
                          else "1 of 1 sent whole: every worker's rows would send more"), e.note


def test_bad_row_counts_are_refused_by_name():
    with pytest.raises(ValueError, match="sparse_rows"):
        Workload(((10, 4), (4,)), 0.0, sparse_rows=(3,))
    with pytest.raises(ValueError, match="sparse_rows"):
        Workload(((10, 4), (4,)), 0.0, sparse_rows=(-1, 0))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_planned_memory_is_what_the_optimizer_holds(mirrored, stage):
    """Per replica, with accumulation (so the gradients are buffers that memory_report sees),
    against Adam's state as placed: stage 0 is tfdist's dense exchange."""
    strategy = mirrored(REPLICAS)
    with strategy.scope():
        model = _model()
        planned_workload = Workload.from_keras(model, 0.0, optimizer_slots=2)
        if stage == 3:
            model = tfdist.zero.ShardedModel(model)
        optimizer = (tfdist.ZeroOptimizer(keras.optimizers.Adam(), stage=stage,
                                          accumulation_steps=2) if stage else
                     tfdist.DistributedOptimizer(keras.optimizers.Adam(), accumulation_steps=2))
        optimizer.build(model.trainable_variables)
    held = {tuple(sorted(kinds.items())) for kinds in memory_report(optimizer).values()}
    assert len(held) == 1, "the replicas hold different amounts"
    held = dict(held.pop())
    spec = f"zero{stage}" if stage else "dense"
    (estimate,) = predict(planned_workload, Cluster(REPLICAS, Link(1.0)), [spec]).estimates
    planned = estimate.memory
    assert planned["optimizer_state"] == held["optimizer_state"]
    assert planned["gradients"] == held["gradient_buffers"]
    if stage in (1, 2):
        assert planned["algorithm_state"] == held["param_shard"]  # the flat fp32 shard
    if stage == 3:
        assert planned["parameters"] == held["param_shard"]  # the model's own shard


def test_the_link_model_worked_by_hand():
    work = Workload.from_parameters(1_000_000, compute_s=0.1)  # 4,000,000 bytes of gradients
    cluster = Cluster(4, Link(1.0, latency_us=50))
    plan = predict(work, cluster, ["dense", "local_sgd:8", "ps:1", "pipeline:2x4", "zero2"])
    by = {e.algorithm: e for e in plan.estimates}
    # ring all-reduce over 4: each sends 2 x 3/4 x 4e6 = 6e6 bytes at 1 Gbit/s, 6 hops of 50 us
    assert by["dense"].wire_bytes == 6e6
    assert by["dense"].exchange_s == pytest.approx(6e6 * 8 / 1e9 + 6 * 50e-6)
    assert by["dense"].step_s == pytest.approx(0.1 + 0.048 + 0.0003)
    assert by["local_sgd"].exchange_s == pytest.approx((0.048 + 0.0003) / 8)
    # one server receives 4 x 4e6 bytes, then sends as much: twice 128 ms, two latencies
    assert by["ps:1"].exchange_s == pytest.approx(2 * (4 * 4e6 * 8 / 1e9 + 50e-6))
    # 2 stages x 4 micro-batches: bubble 1/4 of the compute; 2 replicas all-reduce half the model
    pipe = by["pipeline:2x4"]
    assert pipe.bubble_s == pytest.approx(0.025)
    assert pipe.exchange_s == pytest.approx(2e6 * 8 / 1e9 + 2 * 50e-6)
    # ZeRO-2 across TF_CONFIG workers: an all-reduce of 4 shards of 250,000 elements and a
    # count each, an all-gather of the shards
    assert by["zero2"].wire_bytes == 2 * 3 / 4 * 4 * 4 * (250_000 + 1) + 3 * 4 * 250_000
    assert by["dense"].memory == {"parameters": 4e6, "gradients": 4e6, "optimizer_state": 8e6,
                                  "algorithm_state": 0, "activations": 0}
    # a device too small for the dense state: ZeRO-2 is the one left
    small = predict(work, Cluster(4, Link(1.0), device_memory=10_000_000), ["dense", "zero2"])
    assert small.best.algorithm == "zero2" and "do not fit" in small.reason
    none = predict(work, Cluster(4, Link(1.0), device_memory=1000), ["dense"])
    assert none.best is None and "no algorithm fits" in none.reason


def test_a_calibration_is_fitted_from_the_collectives_rows(tmp_path):
    rows = [{"transport": "horovod", "splits": 1, "processes": 2, "size_mb": mb, "median_ms": ms}
            for mb, ms in ((1.0, 5.0), (21.0, 25.0), (81.0, 85.0))]  # 2 ms per call + 1 ms/MB
    (tmp_path / "collectives.json").write_text(json.dumps({"rows": rows}))
    # between 4 processes: 12 ms per call, 2 ns per byte of the ring (1.5x the tensor per process)
    rows += [{"transport": "horovod", "splits": 1, "processes": 4, "size_mb": mb,
              "median_ms": 12.0 + 2e-6 * 1.5 * mb * 1e6} for mb in (1.0, 21.0, 81.0)]
    (tmp_path / "collectives.json").write_text(json.dumps({"rows": rows}))
    cal = Calibration.from_results(tmp_path, "horovod")
    assert cal.seconds_per_byte == pytest.approx(1e-9) and cal.processes == 2  # the fewest
    assert cal.hop_s == pytest.approx(4e-3 / 2)  # an all-reduce between 2 has 2 hops
    four = Calibration.from_results(tmp_path, "horovod", processes=4)
    assert four.seconds_per_byte == pytest.approx(2e-9) and four.processes == 4
    assert four.hop_s == pytest.approx(12e-3 / 6)  # between 4, 6 hops
    assert Calibration.from_results(tmp_path, "horovod", processes=8).processes == 2
    assert cal.compressor_ms_per_mb == {} and cal.compressor_processes == 0  # no such file
    # the compressors measured alone (an older file: no count) and in 4 processes at once
    alone = [{"config": {"name": "topk"}, "ms_per_mb": 2.0}, {"config": None, "ms_per_mb": 0.1},
             {"config": {"name": "fp16"}, "ms_per_mb": 0.25}]
    shared = [{"config": {"name": "topk"}, "ms_per_mb": 5.0, "processes": 4},
              {"config": {"name": "powersgd"}, "ms_per_mb": 3.0, "processes": 4}]
    (tmp_path / "compressors.json").write_text(json.dumps({"rows": alone + shared}))
    assert Calibration.from_results(tmp_path, "horovod").compressor_ms_per_mb == \
        {"topk": 2.0, "fp16": 0.25}
    four = Calibration.from_results(tmp_path, "horovod", processes=4)
    assert four.compressor_ms_per_mb == {"topk": 5.0, "powersgd": 3.0}
    assert four.compressor_processes == 4 and "4 processes" in four.source
    eight = Calibration.from_results(tmp_path, "horovod", processes=8)  # none: the fewest
    assert eight.compressor_processes == 1 and eight.compressor_ms_per_mb["topk"] == 2.0
    with pytest.raises(ValueError, match="does not exist"):
        Calibration.from_results(tmp_path / "missing")


def test_a_calibration_is_scaled_to_hosts_that_share_the_cores():
    """The plan suite's emulated hosts share the machine's cores: each CPU-bound cost grows
    with the processes per core, the engine's from the count its collectives were measured
    at, the compressors' from one process."""
    from tfdist.tools.bench.machine import cores_of
    from tfdist.tools.bench.plan import shared_machine

    assert cores_of("2 CPU cores (AMD EPYC), 24 GiB, Linux") == 2 and cores_of("?") is None
    cal = Calibration(hop_s=1e-3, seconds_per_byte=2e-9, compressor_ms_per_mb={"fp16": 0.5},
                      processes=2)
    assert shared_machine(cal, 2, 2) is cal and shared_machine(cal, 8, None) is cal
    four = shared_machine(cal, 4, 2)
    assert (four.hop_s, four.seconds_per_byte) == pytest.approx((2e-3, 4e-9))
    assert four.compressor_ms_per_mb == {"fp16": 1.0}
    measured_at_four = shared_machine(dataclasses.replace(cal, processes=4), 4, 2)
    assert (measured_at_four.hop_s, measured_at_four.seconds_per_byte) == (1e-3, 2e-9)
    assert measured_at_four.compressor_ms_per_mb == {"fp16": 1.0}
    assert shared_machine(cal, 8, 4).seconds_per_byte == pytest.approx(4e-9)  # 2 per core
    # the compressors measured in 4 processes at once: scaled from there, not from one
    both_at_four = dataclasses.replace(cal, processes=4, compressor_processes=4)
    assert shared_machine(both_at_four, 4, 2) is both_at_four
    assert shared_machine(both_at_four, 8, 2).compressor_ms_per_mb == {"fp16": 1.0}


def test_bad_plans_are_refused_by_name():
    work = Workload.from_parameters(1000, 0.01)
    with pytest.raises(ValueError, match="Unknown algorithm 'zip'.*powersgd:RANK"):
        predict(work, Cluster(2, Link(1.0)), ["zip"])
    with pytest.raises(ValueError, match="pipeline: give STAGESxMICROBATCHES"):
        predict(work, Cluster(2, Link(1.0)), ["pipeline:4"])
    with pytest.raises(ValueError, match="gbit_per_s"):
        Link(0)
    with pytest.raises(ValueError, match="engine"):
        Cluster(2, Link(1.0), engine="mpi")
    with pytest.raises(ValueError, match="shapes"):
        Workload(((3, 0),), 0.1)
    with pytest.raises(ValueError, match=r"`precision` must be one of \('float32', 'mixed'\)\. "
                                         r"Received: precision='bf16'"):
        Workload.from_parameters(1000, 0.01, precision="bf16")
    plan = predict(work, Cluster(6, Link(1.0)), ["dense", "pipeline:4x8", "powersgd:2"])
    assert [e.algorithm for e in plan.estimates] == ["dense"]
    assert "4 stages do not divide 6 workers" in plan.left_out["pipeline:4x8"]
    assert "parameter count" in plan.left_out["powersgd:2"]


def test_mixed_precision_halves_the_bytes_sent_and_keeps_a_master_copy():
    """`precision="mixed"`: float16 parameters and gradients, so every exchange sends half the
    bytes of float32's, and a float32 master copy beside Adam's two slots (12 bytes of state
    per parameter); ZeRO shards that state as it does float32's."""
    shapes = ((64, 32), (32,), (32, 10), (10,))
    full, mixed = (Workload(shapes, 0.01, precision=p) for p in ("float32", "mixed"))
    specs = ["dense", "local_sgd:4", "zero1", "zero2", "zero3", "ps:1"]
    cluster = Cluster(4, Link(1.0))
    plans = [dict(zip(specs, predict(w, cluster, specs).estimates, strict=True))
             for w in (full, mixed)]
    for spec in specs:
        assert plans[1][spec].wire_bytes == pytest.approx(plans[0][spec].wire_bytes / 2, rel=1e-3)
    p, shard = full.parameters, -(-full.parameters // 4)
    assert dict(plans[1]["dense"].memory) == {"parameters": 2 * p, "gradients": 2 * p,
                                               "optimizer_state": 12 * p,
                                               "algorithm_state": 0, "activations": 0}
    zero2 = plans[1]["zero2"].memory
    assert (zero2["parameters"], zero2["gradients"], zero2["optimizer_state"],
            zero2["algorithm_state"]) == (2 * p, 2 * shard, 12 * shard, 0)
    assert plans[0]["zero2"].memory["algorithm_state"] == 4 * shard  # float32's updated shard
    # a compressor's work goes with the elements it compresses, whatever their width
    calibration = Calibration(compressor_ms_per_mb={"topk": 2.0})
    topk = [predict(w, cluster, ["topk:0.01"], calibration=calibration).estimates[0]
            for w in (full, mixed)]
    assert topk[0].compressor_s == topk[1].compressor_s == pytest.approx(2e-3 * 4 * p / 1e6)


def test_the_command_plans_mixed_precision(tmp_path, capsys):
    from tfdist.tools.cli import main

    assert main(["plan", "--parameters", "1000000", "--compute-ms", "10", "--workers", "8",
                 "--algorithms", "dense", "--precision", "mixed",
                 "--json", str(tmp_path / "plan.json")]) == 0
    assert "mixed precision (float32 master copy)" in capsys.readouterr().out
    (plan,) = json.loads((tmp_path / "plan.json").read_text())["plans"]
    assert plan["workload"]["precision"] == "mixed"
    assert plan["estimates"][0]["memory_bytes"] == 16 * 1_000_000  # 2 + 2 + 12 bytes
    assert plan["estimates"][0]["wire_bytes"] == 2 * 7 / 8 * 2 * 1_000_000  # float16 ring


def test_the_fused_updates_saving_shortens_the_exchanges_of_the_distributed_optimizer(
        tmp_path, capsys):
    """`update_saving_s` comes off the compute of dense, FP16, PowerSGD, top-k and local SGD,
    whose update is tfdist.DistributedOptimizer's; ZeRO, the pipeline and the servers keep the
    step as measured; a saving longer than the step is refused by name."""
    shapes = ((256, 128), (128,), (128, 10), (10,))
    specs = ["dense", "dense_overlap", "fp16", "powersgd:2", "topk:0.01", "local_sgd:4",
             "zero1", "zero3", "pipeline:2x4", "ps:1"]
    cluster = Cluster(4, Link(1.0))
    plain, fused = (dict(zip(specs, predict(Workload(shapes, 0.05, update_saving_s=saving),
                                            cluster, specs).estimates, strict=True))
                    for saving in (0.0, 0.01))
    for spec in specs:
        shorter = 0.01 if spec.split(":")[0] in ("dense", "dense_overlap", "fp16", "powersgd",
                                                 "topk", "local_sgd") else 0.0
        assert fused[spec].compute_s == pytest.approx(0.05 - shorter), spec
        assert fused[spec].step_s == pytest.approx(plain[spec].step_s - shorter), spec
    with pytest.raises(ValueError, match=r"`update_saving_s` \(0.2 s\) cannot exceed "
                                         r"`compute_s` \(0.1 s\)"):
        Workload(shapes, 0.1, update_saving_s=0.2)
    from tfdist.tools.cli import main

    assert main(["plan", "--parameters", "1000000", "--compute-ms", "10", "--workers", "8",
                 "--algorithms", "dense", "--update-saving-ms", "4",
                 "--json", str(tmp_path / "plan.json")]) == 0
    assert "tfdist's fused update saves 4.0 ms of it" in capsys.readouterr().out
    (plan,) = json.loads((tmp_path / "plan.json").read_text())["plans"]
    assert plan["workload"]["update_saving_s"] == 0.004
    assert plan["estimates"][0]["compute_s"] == pytest.approx(0.006)


def test_the_command_plans_1024_workers_without_tensorflow(tmp_path):
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tfdist.tools.cli", "plan",
         "--parameters", "25000000", "--compute-ms", "300", "--workers", "8,1024",
         "--per-host", "8", "--link", "25gbit", "--intra", "300gbit", "--latency-us", "10",
         "--device-memory", "24GB", "--stragglers", "1:3", "--json", str(tmp_path / "plan.json")],
        capture_output=True, text=True, env=worker_env(), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")]
    assert "tfdist.plan.planner" in imported and "tensorflow" not in imported
    assert "1,024 workers (8 per host, 128 hosts)" in out.stdout
    plans = json.loads((tmp_path / "plan.json").read_text())["plans"]
    assert [p["cluster"]["workers"] for p in plans] == [8, 1024]
    for p in plans:
        assert p["recommended"] in {e["algorithm"] for e in p["estimates"]}
        assert "recommended: " in out.stdout
        # one worker 3x slower: every synchronous step is its compute, then the dense exchange
        dense = next(e for e in p["estimates"] if e["algorithm"] == "dense")
        simulated = {run["algorithm"]: run for run in p["simulated"]}
        assert list(simulated) == ["sync", "local_sgd:8", "ssp:4", "async"]
        assert simulated["sync"]["step_s"] == pytest.approx(3 * 0.3 + dense["exchange_s"])
        assert simulated["async"]["staleness_max"] > 0 == simulated["sync"]["staleness_max"]
    assert out.stdout.count("simulated, 100 steps per worker, 1 worker(s) 3x slower") == 2
    for args, message in ((["--algorithms", "dense,zip"], "Unknown algorithm 'zip'"),
                          (["--stragglers", "0.1"], "the form is SLOW:SLOWDOWN"),
                          (["--batch", "0"], "--batch 0: give the examples of one worker's")):
        bad = subprocess.run([sys.executable, "-m", "tfdist.tools.cli", "plan", "--parameters",
                              "10", "--compute-ms", "1", *args],
                             capture_output=True, text=True, env=worker_env(), timeout=120)
        assert bad.returncode == 2 and message in bad.stderr


def test_the_planner_page_is_reproduced_from_its_kept_calibration(tmp_path):
    """The planner page's 2-host table (data/plan.json) is what `tfdist bench --suite plan`
    gives again from the measured run and the calibration directory the page names."""
    from tfdist.tools.cli import main

    docs = Path(ROOT) / "docs" / "benchmarks"
    assert main(["bench", "--suite", "plan", "--results", str(docs / "data" / "comm.json"),
                 "--calibrate", str(docs / "calibration" / "2026-11-29"),
                 "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "plan.json").read_text())["rows"]
    kept = json.loads((docs / "data" / "plan.json").read_text())["rows"]
    assert [(r["algorithm"], r["bandwidth"]) for r in again] == \
        [(r["algorithm"], r["bandwidth"]) for r in kept]
    for a, b in zip(again, kept):
        assert a["predicted_ms"] == pytest.approx(b["predicted_ms"], rel=1e-9)
        assert a["predicted_bytes"] == b["predicted_bytes"]


def test_the_bench_sets_the_prediction_beside_a_measured_comm_run(tmp_path):
    """`tfdist bench --suite plan` on the comm suite's quick run kept in the docs (2 emulated
    hosts, 100 Mbit/s): the bytes predicted for the dense and PowerSGD exchanges are the bytes
    the workers counted there, and every measured step is that run's own."""
    from tfdist.tools.cli import main

    data = f"{ROOT}/docs/benchmarks/data"
    assert main(["bench", "--suite", "plan", "--results", f"{data}/comm.quick.json",
                 "--calibrate", data, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    measured = {r["algorithm"]: r for r in json.loads(
        Path(f"{data}/comm.quick.json").read_text())["rows"]}
    assert {r["algorithm"] for r in rows} == {"dense_keras", "dense", "dense_horovod",
                                              "powersgd", "local_sgd"}
    for r in rows:
        run = measured[r["algorithm"]]
        assert r["measured_ms"] == pytest.approx(run["train_seconds"] / (run["steps"] - 1) * 1e3)
        if r["spec"] in ("dense", "powersgd:2"):
            assert r["predicted_bytes"] == run["bytes_per_step"], r["algorithm"]
    # post-local SGD: its config's 22 synchronous steps, then one round after every 8 local
    # steps (3 epochs of 22 steps here: a third of the run is synchronous), as it counted
    local = next(r for r in rows if r["algorithm"] == "local_sgd")
    assert local["spec"] == "local_sgd:8 after 22 dense steps"
    dense = next(r for r in rows if r["algorithm"] == "dense")["predicted_bytes"]
    steps = measured["local_sgd"]["steps"]
    assert local["predicted_bytes"] == pytest.approx((22 + (steps - 22) // 8) * dense / steps)
    assert local["predicted_bytes"] == pytest.approx(measured["local_sgd"]["bytes_per_step"])
    assert "median error" in (tmp_path / "plan.md").read_text()
    # The limit updates as tfdist does; Keras' own exchange adds Keras' update beyond the
    # fused one, as the overhead suite's run in the calibration directory measured it
    update = {u["variant"]: u["update_ms"] for u in json.loads(
        Path(f"{data}/overhead.json").read_text())["update_rows"]
        if u["model"] == "mlp" and u["optimizer"] == "adam"}
    compute = {r["algorithm"]: r["compute_ms"] for r in rows}
    limit = measured["limit"]["train_seconds"] / (measured["limit"]["steps"] - 1) * 1e3
    assert compute["dense"] == compute["dense_horovod"] == pytest.approx(limit)
    assert compute["dense_keras"] == pytest.approx(limit + update["keras"] - update["fused"])


def test_the_compute_step_of_a_host_count_is_its_limit_runs_over_every_link():
    from tfdist.tools.bench.plan import link_independent

    limits = {(4, "1gbit"): 0.050, (4, "10gbit"): 0.034, (8, "1gbit"): 0.088}
    assert link_independent(limits) == pytest.approx(
        {(4, "1gbit"): 0.042, (4, "10gbit"): 0.042, (8, "1gbit"): 0.088})


def test_a_models_sweeps_compute_step_is_its_hosts_in_step_run_where_it_has_one():
    from tfdist.tools.bench.plan import compute_steps

    def row(hosts, link, algorithm, step_ms, limit_ms):
        return {"hosts": hosts, "bandwidth": link, "algorithm": algorithm, "step_ms": step_ms,
                "limit_step_ms": limit_ms}

    rows = [row(2, "1gbit", "dense", 900, 500), row(2, "10gbit", "dense", 700, 520),
            row(2, "1gbit", "limit_in_phase", 590, 500), row(2, "10gbit", "limit_in_phase", 610,
                                                               520),
            row(4, "1gbit", "dense", 1500, 1000), row(4, "10gbit", "dense", 1300, 1200)]
    steps, source = compute_steps(rows)
    # 2 hosts: the runs in step, over both links; 4 hosts ran none: their limit, over both
    assert steps == pytest.approx({(2, "1gbit"): 0.600, (2, "10gbit"): 0.600,
                                   (4, "1gbit"): 1.100, (4, "10gbit"): 1.100})
    assert source == {2: "limit_in_phase", 4: "limit"}


def test_the_bench_sets_the_prediction_beside_a_measured_models_run(tmp_path):
    """`tfdist bench --suite plan` on the models suite's run kept in the docs (ResNet-50 and
    the encoder, 2 emulated hosts): each model's own shapes give the bytes its dense and
    PowerSGD runs counted, its runs' zero-communication limit is the compute step, and local
    SGD has no synchronous warm-up there (configs/bench/models.yaml sets it to 0)."""
    from tfdist.tools.cli import main

    data = f"{ROOT}/docs/benchmarks/data"
    assert main(["bench", "--suite", "plan", "--results", f"{data}/models.json",
                 "--calibrate", data, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    measured = {(r["model"], r["bandwidth"], r["algorithm"]): r for r in json.loads(
        Path(f"{data}/models.json").read_text())["rows"]}
    assert {r["model"] for r in rows} == {"resnet50", "transformer"}
    assert {r["algorithm"] for r in rows} == {"dense_keras", "dense", "dense_horovod", "fp16",
                                              "powersgd", "ef_topk", "local_sgd"}
    # a run without exchange does not depend on the link: each model's compute step is its
    # limit runs' mean over both links
    limit = {model: statistics.fmean({r["bandwidth"]: r["limit_step_ms"] for r in measured.values()
                                      if r["model"] == model}.values())
             for model in ("resnet50", "transformer")}
    for r in rows:
        run = measured[r["model"], r["bandwidth"], r["algorithm"]]
        assert r["measured_ms"] == pytest.approx(run["train_seconds"] / (run["steps"] - 1) * 1e3)
        # the limit updates as tfdist does: Keras' own exchange adds Keras' update of
        # ResNet-50 beyond it (the overhead suite has no update of the encoder)
        keras = r["algorithm"] == "dense_keras" and r["model"] == "resnet50"
        assert (r["compute_ms"] > limit[r["model"]] + 1) == keras
        assert r["compute_ms"] == pytest.approx(limit[r["model"]]) or keras
        # every exchange tfdist counts, the encoder's embedding included: its gradient goes
        # as the rows a worker's 16 x 64 tokens look up, all-gathered with their indices
        if r["algorithm"] in ("dense", "dense_horovod", "fp16", "powersgd", "ef_topk"):
            assert r["predicted_bytes"] == run["bytes_per_step"], (r["model"], r["algorithm"])
        if r["algorithm"] == "dense_keras":  # Keras' formula adds each table's row count
            tables = 1 if r["model"] == "transformer" else 0
            assert r["predicted_bytes"] == run["bytes_per_step"] - 4 * tables
        if r["algorithm"] == "local_sgd":  # 12 steps: one round, after the 8th, of every weight
            assert r["spec"] == "local_sgd:8"
            assert r["predicted_bytes"] == pytest.approx(4 * run["parameters"] / 12)
    assert "| model | hosts |" in (tmp_path / "plan.md").read_text()


def test_the_bench_feeds_a_published_set_up_to_the_planner(tmp_path):
    """`tfdist bench --suite plan --published`: Horovod's 512 GPUs over 25 Gbit/s, each model's
    efficiency is the compute step over the ring's bytes at the link's rate added (after the
    backward pass) or hidden behind 2/3 of the step but for the last 25 MiB bucket."""
    import math

    from tfdist.tools.cli import main

    assert main(["bench", "--suite", "plan", "--published", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "plan.json").read_text())
    assert "measured" not in result and result["command"].endswith("--published")
    scaling = [r for r in result["rows"] if "published" in r]
    for r in scaling:
        compute = r["compute_ms"] / 1e3
        ring = 2 * 511 / 512 * 4 * r["parameters"] * 8 / 25e9
        buckets = math.ceil(4 * r["parameters"] / (25 * 2**20))
        assert r["planned_dense"] == pytest.approx(compute / (compute + ring))
        hidden = max(ring - 2 / 3 * compute, ring / buckets)
        assert r["planned_dense_overlap"] == pytest.approx(compute / (compute + hidden))
    assert [r["published"] for r in scaling] == [0.90, 0.68]
    assert "2 of 2 published figures between" in (tmp_path / "plan.md").read_text()
    # the ZeRO paper's Figure 1, in GB per device as the paper gives it
    memory = {r["stage"].split()[0]: r["planned_bytes"] / 1e9 for r in result["rows"]
              if "published_bytes" in r}
    assert memory == pytest.approx({"baseline": 120, "P_os": 31.4, "P_os+g": 16.6,
                                    "P_os+g+p": 1.9}, rel=0.015)
    assert main(["bench", "--suite", "plan", "--published", "--results", "x.json",
                 "--out", str(tmp_path)]) == 2


def test_the_bench_sets_the_planned_memory_beside_the_memory_suite(tmp_path):
    """`tfdist bench --suite plan` on the memory suite's run kept in the docs: per replica
    count (1-8) and algorithm (dense, ZeRO 1-3), the bytes the optimizer held there, read from
    where each variable was placed, are the planned bytes."""
    from tfdist.tools.cli import main

    data = f"{ROOT}/docs/benchmarks/data/memory.json"
    assert main(["bench", "--suite", "plan", "--results", data, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    measured = json.loads(Path(data).read_text())["rows"]
    assert [(r["replicas"], r["stage"]) for r in rows] == [
        (m["replicas"], stage) for m in measured for stage in ("baseline", "zero1", "zero2",
                                                                "zero3")]
    by = {(m["replicas"], stage): m[stage] for m in measured for stage in ("baseline", "zero1",
                                                                            "zero2", "zero3")}
    for r in rows:
        assert r["measured_bytes"] == by[r["replicas"], r["stage"]]
        assert r["predicted_bytes"] == r["measured_bytes"], r
    assert "16 of 16 within 5%" in (tmp_path / "plan.md").read_text()


# The simulation (`tfdist.plan.simulate`): each case below is worked out by hand.
C, E, T = 0.1, 0.02, 0.01  # compute, all-reduce, parameter-server transfer (s)


def test_synchronous_rounds_wait_for_the_slowest_worker():
    slow = Stragglers(slow=1, slowdown=4)
    run = simulate("sync", 8, C, 50, stragglers=slow, exchange_s=E)
    assert run.seconds == pytest.approx(50 * (4 * C + E)) and run.updates == 50
    # waiting: the 7 fast workers' (4 - 1) C of every step, over all workers' time
    assert run.waiting_share == pytest.approx(7 * 3 * C / (8 * (4 * C + E)))
    local = simulate("local_sgd:5", 8, C, 50, stragglers=slow, exchange_s=E, warmup_steps=10)
    assert local.seconds == pytest.approx(10 * (4 * C + E) + 8 * (5 * 4 * C + E))
    assert local.updates == 10 + 8 and len(local.chief_clock) == 50
    # the chief's steps inside a local round are its own; the round's last waits for the slowest
    assert local.chief_clock[10] - local.chief_clock[9] == pytest.approx(C)
    assert local.chief_clock[14] == pytest.approx(local.chief_clock[9] + 5 * 4 * C + E)
    ps = simulate("ssp:0", 8, C, 50, stragglers=slow, transfer_s=T, apply_s=0.001)
    assert ps.seconds == pytest.approx(50 * (4 * C + T + 0.001)) and ps.staleness == {}


def test_asynchronous_servers_apply_each_push_and_count_its_staleness():
    run = simulate("async", 4, C, 30, transfer_s=T)
    # 4 equal workers push together: the pushes of a round are 0, 1, 2 and 3 updates stale
    assert run.staleness == {0: 30, 1: 30, 2: 30, 3: 30} and run.updates == 120
    assert run.seconds == pytest.approx(30 * (C + T))
    assert run.throughput == pytest.approx(4 / (C + T))
    # servers slower than the workers: they set the pace, one update per apply_s
    busy = simulate("async", 10, 0.01, 40, apply_s=0.01)
    assert busy.job_seconds == pytest.approx(0.01 + 10 * 40 * 0.01)
    # a 4x slower worker: the others never wait for it without a bound
    slow = Stragglers(slow=1, slowdown=4)
    free = simulate("async", 4, C, 40, stragglers=slow)
    assert free.seconds == pytest.approx(40 * C) and free.job_seconds == pytest.approx(160 * C)


def test_bounded_staleness_holds_the_fast_workers_to_the_slowest():
    slow = Stragglers(slow=1, slowdown=4)
    for bound in (1, 3):
        run = simulate(f"ssp:{bound}", 4, C, 40, stragglers=slow)
        # the chief ends at most bound + 1 of the slow worker's steps before it
        assert 40 * 4 * C - (bound + 1) * 4 * C <= run.seconds + 1e-9 <= 40 * 4 * C + 1e-9
        assert run.job_seconds == pytest.approx(40 * 4 * C)
    # a late start: the chief runs until it is 2 pushes ahead (more than 1), then waits for the
    # slow worker's first
    late = simulate("ssp:1", 4, C, 40, stragglers=Stragglers(slow=1, slowdown=4, late_s=5))
    assert late.chief_clock[1] == pytest.approx(2 * C) and late.chief_clock[2] >= 5 + 4 * C
    assert late.job_seconds == pytest.approx(5 + 40 * 4 * C)
    # its first push is computed on the weights pulled at the join (version 0): the 3 others'
    # 2 pushes each came before it
    assert late.staleness_max == 6 and late.staleness[6] == 1
    free = simulate("async", 4, C, 40, stragglers=Stragglers(1, 4, late_s=5))
    assert free.seconds == pytest.approx(40 * C)
    # unbounded: the others' 120 pushes came first; the servers count it "63 or more"
    assert free.staleness_max == 120 and free.staleness[120] == 1
    counted = free.counted_staleness()
    assert max(counted) == STALENESS_BUCKETS - 1 == BUCKETS - 1 and counted[63] == 1
    assert sum(counted.values()) == sum(free.staleness.values()) == 160
    # the one push past the last count is what the folded mean leaves out
    folded_mean = sum(k * n for k, n in counted.items()) / 160
    assert free.staleness_mean - folded_mean == pytest.approx((120 - 63) / 160)


def test_a_slow_first_update_holds_the_next_synchronous_exchange():
    slow = Stragglers(slow=1, slowdown=4, first_update_s=2)
    run = simulate("sync", 8, C, 50, stragglers=slow, exchange_s=E)
    # the first step ends with its exchange; the second also waits for the slow worker's update
    assert run.chief_clock[0] == pytest.approx(4 * C + E)
    assert run.chief_clock[1] - run.chief_clock[0] == pytest.approx(2 + 4 * C + E)
    assert run.seconds == pytest.approx(50 * (4 * C + E) + 2)
    # post-local SGD: the same wait, at the first averaging after its synchronous step
    post = simulate("local_sgd:5", 8, C, 11, stragglers=slow, exchange_s=E, warmup_steps=1)
    assert post.seconds == pytest.approx(4 * C + E + 2 + 2 * (5 * 4 * C + E))
    # local SGD from the first step: no exchange before its update, waited for at the first
    # averaging
    local = simulate("local_sgd:5", 8, C, 10, stragglers=slow, exchange_s=E)
    assert local.seconds == pytest.approx(2 + 2 * (5 * 4 * C + E))
    # the parameter servers update on the servers: nothing to wait for
    ps = simulate("ssp:0", 8, C, 50, stragglers=slow, transfer_s=T)
    assert ps.seconds == pytest.approx(50 * (4 * C + T))
    with pytest.raises(ValueError, match="first_update_s"):
        Stragglers(slow=1, slowdown=2, first_update_s=-1)


def test_the_all_reduces_first_epoch_stall_is_what_the_later_epochs_pace_leaves():
    from tfdist.tools.bench.plan import first_epoch_stall_s

    # epochs 2 and 3 at 0.1 s a step; the first's 10 timed steps (its first left out) 1.5 s more
    curve = [(2.5, 0.5, 11), (3.6, 0.9, 22), (4.7, 0.95, 33)]
    assert first_epoch_stall_s({"curve": curve}) == pytest.approx(1.5)
    assert first_epoch_stall_s({"curve": curve[:1]}) == 0  # one epoch: no pace to compare with
    assert first_epoch_stall_s({"curve": [(0.5, 0.5, 11), (1.6, 0.9, 22)]}) == 0


def test_the_eight_host_stragglers_bench_is_simulated_with_the_first_update(tmp_path):
    """The 8-host stragglers run kept in the docs: its synchronous all-reduce stalled in its
    first epoch (the slow worker's first, XLA-compiled, update). Fitted with that stall, the
    simulated all-reduce reaches the target when the measured did; the order of the seven
    runs is the measured one; the planner's page shows this table."""
    from tfdist.tools.bench.plan import run_plan, stragglers_table

    rows = run_plan(False, str(tmp_path),
                    results=f"{ROOT}/docs/benchmarks/data/stragglers.8hosts.json")
    reached = [r for r in rows if r["measured_target_s"] is not None]
    assert len(reached) == 4 and all(r["predicted_target_s"] for r in reached)
    assert sorted(reached, key=lambda r: r["predicted_target_s"]) == \
        sorted(reached, key=lambda r: r["measured_target_s"])
    sync = next(r for r in rows if r["algorithm"] == "sync")
    assert sync["predicted_target_s"] == pytest.approx(sync["measured_target_s"], rel=0.05)
    ssp1 = next(r for r in rows if r["algorithm"] == "ssp1")
    assert abs(ssp1["ratio_error"]) <= 0.25
    assert stragglers_table(rows) in Path(ROOT, "docs/benchmarks/planner.md").read_text()


def test_spread_step_times_are_seeded_and_have_mean_one():
    spread = Stragglers(sigma=0.5)
    one = simulate("sync", 1, C, 20000, stragglers=spread, seed=3)
    assert one.seconds / 20000 == pytest.approx(C, rel=0.02)
    assert simulate("sync", 1, C, 200, stragglers=spread, seed=3).seconds == \
        simulate("sync", 1, C, 200, stragglers=spread, seed=3).seconds
    # heavy tails: the slowest of 64 workers sets every synchronous step
    assert simulate("sync", 64, C, 200, stragglers=spread).step_s > 1.5 * C
    assert Stragglers(slow=0.25, slowdown=2).slowed(64) == 16


def test_bad_simulations_are_refused_by_name():
    for spec in ("ssp", "local_sgd:0", "ring", "async:2"):
        with pytest.raises(ValueError, match="algorithm .*the forms are"):
            simulate(spec, 4, C, 10)
    with pytest.raises(ValueError, match="slow"):
        Stragglers(slow=1.5)
    with pytest.raises(ValueError, match="slowdown"):
        Stragglers(slow=1, slowdown=0.5)
    with pytest.raises(ValueError, match="workers"):
        simulate("sync", 0, C, 10)


def test_the_simulated_stragglers_bench_keeps_the_measured_order(tmp_path):
    """The stragglers suite's run kept in the docs (4 emulated hosts, one 3x slower), simulated
    from three of its runs: the other runs' times to target keep the measured order, each ratio
    to the synchronous all-reduce's within 25%; the planning guide shows this table."""
    from tfdist.tools.bench.plan import run_plan, stragglers_table

    rows = run_plan(False, str(tmp_path),
                    results=f"{ROOT}/docs/benchmarks/data/stragglers.json")
    order = [r["algorithm"] for r in sorted(rows, key=lambda r: r["measured_target_s"])]
    assert [r["algorithm"] for r in sorted(rows, key=lambda r: r["predicted_target_s"])] == order
    predicted = [r for r in rows if not r["fitted"]]
    assert len(predicted) == 4 and all(abs(r["ratio_error"]) <= 0.25 for r in predicted), rows
    # The slow worker's first push, computed on the weights pulled at the join: as stale as
    # every other worker's pushes until then (3 x (bound + 1); all of them, "63 or more", when
    # nothing holds the others back).
    servers = [r for r in rows if r["measured_staleness"]]
    assert [r["predicted_staleness_max"] for r in servers] == \
        [r["measured_staleness_max"] for r in servers] and len(servers) == 4
    assert all(abs(r["predicted_staleness"] - r["measured_staleness"]) <= 0.05 for r in servers)
    assert stragglers_table(rows) in Path(ROOT, "docs/guides/planning.md").read_text()


def test_the_report_goes_to_stdout_as_it_is_when_called():
    """`report` reads `sys.stdout` when called, not when its module was imported: a
    redirection made later (here, and pytest's `capsys` in the test above) gets the text."""
    import contextlib
    import io

    from tfdist.tools import cli, planning

    args = cli.build_parser().parse_args(["plan", "--parameters", "1000", "--compute-ms", "10",
                                          "--workers", "8", "--algorithms", "dense"])
    results, how = planning.plans(args, None)
    with contextlib.redirect_stdout(io.StringIO()) as text:
        planning.report(results, how)
    assert text.getvalue().startswith("model: 1,000 parameters")
    assert "| dense all-reduce **(recommended)** |" in text.getvalue()


def test_a_recommendation_says_how_to_run_it_and_when_its_margin_is_thin(capsys):
    """After `recommended:`, the config settings that turn the algorithm on, what its steps
    factor means, and, when the next algorithm is within 1.1x, that the margin is within the
    planner's error."""
    from tfdist.tools.cli import main

    assert main(["plan", "--parameters", "25557032", "--compute-ms", "200", "--workers", "8",
                 "--link", "10gbit"]) == 0
    out = capsys.readouterr().out
    after = out.split("recommended: local SGD, H=8", 1)[1].splitlines()
    assert after[1] == "  to run it: --set averaging.period=8"
    assert after[2].startswith("  steps factor 1: the steps it needs for one dense step's")
    assert "(1.08x) is within the planner's error" in after[3]
    from types import SimpleNamespace

    from tfdist.tools.planning import how_to_run

    def best(algorithm, label):
        estimate = SimpleNamespace(algorithm=algorithm, label=label, steps_factor=None,
                                   dense_step_equivalent_s=None)
        return how_to_run(SimpleNamespace(best=estimate, estimates=[estimate]))

    assert best("powersgd", "PowerSGD rank 4") == [
        "to run it: --set compression.name=powersgd --set compression.options={rank: 4}"]
    assert best("topk", "EF-TopK 0.01")[0].endswith(
        "--set compression.options={ratio: 0.01} --set compression.error_feedback=true")
    assert best("zero3", "ZeRO-3") == ["to run it: --set optimizer.zero_stage=3"]


def test_an_input_slower_than_the_step_bounds_every_algorithm_and_is_said(capsys):
    """A decode cost per example: where the input pipeline needs longer than an algorithm's
    step, that step is the input's time; where it needs longer than the best one, the
    recommendation says the input, not the exchange, bounds the step. A cheap input changes
    nothing."""
    from tfdist.tools.cli import main

    work = Workload.from_parameters(25_000_000, 0.030)
    cluster = Cluster(8, Link(10))
    alone = predict(work, cluster)
    for input_s in (0.010, 0.1024):
        fed = predict(dataclasses.replace(work, input_s=input_s), cluster)
        for a, b in zip(alone.estimates, fed.estimates, strict=True):
            assert b.step_s == max(a.step_s, input_s), b.label
            assert ("input bound" in b.note) == (input_s > a.step_s), b.note
        bound = input_s > alone.best.step_s
        assert fed.reason.startswith("input, not the exchange, bounds the step") == bound
        if not bound:
            assert fed.best == alone.best and fed.reason == alone.reason
    assert main(["plan", "--parameters", "25000000", "--compute-ms", "30", "--workers", "8",
                 "--decode-ms", "0.4", "--batch", "256"]) == 0
    out = capsys.readouterr().out
    assert "input 102.4 ms per step" in out
    assert "recommended: FP16 all-reduce: input, not the exchange, bounds the step: the input " \
        "pipeline needs 102.4 ms per step" in out
    assert main(["plan", "--parameters", "25000000", "--compute-ms", "30", "--workers", "8",
                 "--decode-ms", "0.4", "--batch", "256", "--decode-cores", "4"]) == 0
    assert "input 25.6 ms per step" in capsys.readouterr().out
    for args, said in ((["--decode-ms", "0.4"], "--decode-ms with --parameters needs --batch"),
                       (["--decode-ms", "-1", "--batch", "8"], "--decode-ms -1.0: must be >= 0"),
                       (["--decode-ms", "1", "--batch", "8", "--decode-cores", "0"],
                        "--decode-cores 0: give the cores")):
        assert main(["plan", "--parameters", "1000", "--compute-ms", "1", *args]) == 2
        assert said in capsys.readouterr().err
