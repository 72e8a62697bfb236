"""`tfdist bench --suite comm`: the sweep of algorithm x link on the emulated cluster."""

import json
import os

import pytest

from tests.conftest import horovod_available
from tests.test_emulated import needs_netns, own_namespaces
from tfdist.tools.bench.comm import (
    LIMIT,
    auto_check,
    breakdown,
    breakdown_table,
    compressor_ms,
    concurrent_step_ms,
    load_plan,
    page_table,
    run_comm,
)
from tfdist.tools.config import ConfigError

SPEC = """
job: [model.name=mlp, "model.hidden=[64]", data.global_batch_size=64, train.epochs=2]
target_accuracy: 0.5
hosts: [2]
bandwidths: [1gbit]
run_timeout_seconds: {timeout}
algorithms:
  dense_keras:
    {{label: dense Keras, config: default.yaml,
      set: [engine.name=tfdist.tools.bench.baselines:KerasMultiWorker]}}
  dense_horovod: {{label: dense Horovod, config: default.yaml, set: [engine.name=horovod]}}
  powersgd: {{label: PowerSGD, config: powersgd.yaml}}
  local_sgd: {{label: local SGD, config: local_sgd.yaml,
              set: [averaging.warmup_steps=0, averaging.period=4]}}
"""


def _spec(tmp_path, timeout=300):
    path = tmp_path / "comm.yaml"
    path.write_text(SPEC.format(timeout=timeout))
    return path


def test_the_shipped_spec_is_valid_and_its_model_has_5m_parameters():
    plan = load_plan()
    assert [a.key for a in plan.algorithms][0] == "dense_keras"
    assert plan.configs[(2, "dense_keras")]["engine"]["name"] == \
        "tfdist.tools.bench.baselines:KerasMultiWorker"
    assert plan.configs[(2, "powersgd")]["engine"]["name"] == "multi_worker"
    hidden = plan.configs[(2, "dense")]["model"]["hidden"]
    params = 64 * hidden[0] + hidden[0] + hidden[0] * hidden[1] + hidden[1] + 10 * hidden[1] + 10
    assert params >= 5_000_000
    quick = load_plan(quick=True)
    assert quick.hosts == [2] and quick.bandwidths == ["100mbit"]
    assert quick.configs[(2, "dense")]["train"]["epochs"] == 3
    # The per-variable rows are selectable, not in the default sweep.
    assert "dense_per_variable" not in [a.key for a in plan.algorithms]
    chosen = load_plan(algorithms=["dense", "dense_per_variable"],
                       job=["model.hidden=[256, 256]"])
    assert chosen.configs[(2, "dense_per_variable")]["optimizer"]["fused_update"] is False
    assert chosen.configs[(2, "dense_keras")]["model"]["hidden"] == [256, 256]  # --set
    assert chosen.configs[(2, "dense")]["optimizer"]["fused_update"] is True


def test_a_malformed_spec_is_a_config_error(tmp_path):
    path = tmp_path / "comm.yaml"
    path.write_text("job: [model.name=mlp\nhosts: 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_plan(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_plan(path)


@pytest.mark.parametrize("kwargs, message", [
    ({"algorithms": ["powersgd", "zip"]}, "--algorithms: unknown 'zip'; choose from"),
    ({"bandwidths": ["100"]}, "bandwidth '100': give a number and a unit"),
    ({"hosts": ["1"]}, "hosts: got '1'; must be integers >= 2"),
    ({"hosts": ["400"]}, "hosts=400"),
])
def test_bad_input_is_refused_before_anything_is_created(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        load_plan(**kwargs)
    assert not own_namespaces()


def test_the_baseline_always_runs_and_the_limit_has_no_exchange(tmp_path):
    plan = load_plan(_spec(tmp_path), algorithms=["powersgd"])
    assert [a.key for a in plan.algorithms] == ["dense_keras", "powersgd"]
    limit = plan.configs[(2, LIMIT)]
    assert limit["engine"]["name"] == "single"
    assert limit["data"]["global_batch_size"] == 32  # one worker's share of the batch


def _spans(begin: float, steps: list[float]) -> list[list[float]]:
    spans, t = [], begin
    for s in steps:
        spans.append([t, t + s])
        t += s
    return spans


def test_the_limit_counts_the_steps_every_host_ran_at_once():
    # Host 0 starts first and runs alone at 10 ms a step, then at 40 ms with the other host
    # (which starts 1.5 s later, its tracing step of 1 s left out), then alone again at 10 ms.
    first = _spans(0.0, [1.0] + [0.01] * 150 + [0.04] * 40 + [0.01] * 50)
    second = _spans(1.5, [1.0] + [0.04] * 40)
    ms, fewest = concurrent_step_ms([first, second])
    assert ms == pytest.approx(40.0) and fewest >= 5
    # Worker 0's median over its own timed steps would have been the idle machine's 10 ms.
    # Hosts that never overlapped: every timed step counts, and the count says so.
    late = _spans(10.0, [1.0] + [0.03] * 20)
    ms, fewest = concurrent_step_ms([first, late])
    assert fewest == 0
    assert ms == pytest.approx((10.0 + 30.0) / 2)  # the median of the hosts' medians


@needs_netns
@pytest.mark.slow
def test_small_sweep_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "out"
    rows = run_comm(False, str(out), spec=str(_spec(tmp_path)))
    by = {r["algorithm"]: r for r in rows}
    horovod = ["dense_horovod"] if horovod_available() else []
    assert list(by) == ["dense_keras", *horovod, "powersgd", "local_sgd", LIMIT]
    dense = by["dense_keras"]
    params = 64 * 64 + 64 + 64 * 10 + 10
    assert dense["bytes_per_step"] == 4 * params  # ring all-reduce, 2 workers: 2(N-1)/N = 1
    if horovod:  # Gloo across the emulated hosts, counted by the tfdist optimizer
        assert by["dense_horovod"]["bytes_per_step"] == 4 * params
        assert by["dense_horovod"]["wire_bytes_per_step"] >= 4 * params
    # On the wire: the payload plus framing (and the set-up traffic), not less.
    assert dense["wire_bytes_per_step"] >= dense["bytes_per_step"]
    assert by["powersgd"]["bytes_per_step"] < 0.5 * dense["bytes_per_step"]
    assert by["local_sgd"]["bytes_per_step"] == pytest.approx(dense["bytes_per_step"] / 4)
    assert by[LIMIT]["wire_bytes_per_step"] < 0.01 * dense["wire_bytes_per_step"]
    for r in rows:
        times = [t for t, _, _ in r["curve"]]
        assert len(times) == 2 and 0 < times[0] < times[1]
        # the machine's cores (every emulated host shares them) busy during the timed steps:
        # counted in 10 ms ticks per core, over epochs of a fraction of a second here
        assert r["cores"] == os.cpu_count() and 0 < r["busy_cores"] <= 1.2 * r["cores"]
        assert r["limit_busy_cores" if r["algorithm"] != LIMIT else "busy_cores"] == \
            by[LIMIT]["busy_cores"]
    # The limit's step: both hosts' steps while both ran (each a chief, its own summary).
    spans = [json.loads((out / "comm" / "2hosts-1gbit" / LIMIT / f"host{h}" / "run" /
                         "summary.json").read_text())["step_spans"] for h in (0, 1)]
    assert (by[LIMIT]["step_ms"], by[LIMIT]["concurrent_steps"]) == concurrent_step_ms(spans)
    # The limit: the baseline's accuracy at the compute-only step time.
    assert [a for _, a, _ in by[LIMIT]["curve"]] == [a for _, a, _ in dense["curve"]]
    saved = json.loads((out / "comm.json").read_text())
    assert saved["failures"] == [] and len(saved["rows"]) == len(by)
    assert saved["date"] and "TensorFlow" in saved["machine"]  # what a benchmark page names
    assert "| 2 | 1gbit | PowerSGD |" in (out / "comm.md").read_text()
    # A benchmark page shows the same tables, read back from the JSON alone.
    assert page_table(saved) in (out / "comm.md").read_text()
    # Every run's step against the limit's: compute is the limit's step, wire the counted bytes
    # at 1 Gbit/s, the compressor's own work timed for PowerSGD alone
    for r in rows:
        if r["algorithm"] != LIMIT:
            assert r["compute_ms"] == by[LIMIT]["step_ms"]
            assert r["wire_ms"] == pytest.approx(8 * r["bytes_per_step"] / 1e6)
            assert (r["compressor_ms"] > 0) == (r["algorithm"] == "powersgd")
            assert r["mean_step_ms"] == pytest.approx(1000 * r["train_seconds"] / (r["steps"] - 1))
            assert r["rest_ms"] == pytest.approx(r["mean_step_ms"] - r["compute_ms"] -
                                                 r["wire_ms"] - r["compressor_ms"])
    assert "Per-step breakdown (ms)" in page_table(saved)
    assert by["powersgd"]["collectives_per_step"] == 3.0  # P's, Q's, the dense rest
    assert by["dense_keras"]["collectives_per_step"] == 1.0
    picks = (out / "decisions.md").read_text()
    assert f"| 2 | 1gbit | {params:,} |" in picks  # one decision for the one setting
    for png in ("comm_accuracy_2hosts.png", "comm_bytes.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not own_namespaces()


@needs_netns
def test_a_failed_run_is_reported_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="3 of 3 runs failed"):
        run_comm(False, str(out), spec=str(_spec(tmp_path, timeout=2)),
                 algorithms=["powersgd"])
    saved = json.loads((out / "comm.json").read_text())
    assert len(saved["failures"]) == 3 and "exited with [None, None]" in saved["failures"][0]
    assert not own_namespaces()


def test_auto_is_judged_against_the_fixed_algorithms_of_its_run():
    plan = load_plan(quick=True)

    def row(algorithm, seconds, link="100mbit", choice=None):
        return {"hosts": 2, "bandwidth": link, "algorithm": algorithm,
                "time_to_target_s": seconds, "auto_choice": choice}

    rows = [row("dense_keras", 45.0), row("powersgd", 8.0), row("auto", 8.8, choice="powersgd"),
            row(LIMIT, 1.0), row("dense_keras", 3.0, "10gbit"), row("fp16", 2.5, "10gbit"),
            row("auto", None, "10gbit", "fp16")]
    lines = auto_check(plan, rows).splitlines()
    assert lines[2] == "| 2 | 100mbit | powersgd | 8.8 | 1.10x (powersgd) | 0.20x |"
    assert lines[3] == "| 2 | 10gbit | fp16 | not reached | n/a (fp16) | n/a |"
    assert auto_check(plan, rows[:2]) == ""  # no auto row, no table


def test_the_step_breaks_down_into_compute_wire_compressor_and_the_rest(tmp_path):
    """Compute is the limit's step, wire the counted bytes at the link rate, the compressor its
    own work on the run's model (PowerSGD > 0, dense 0, timed on the config's model), the rest
    what remains (negative where communication overlapped)."""
    import yaml

    from tfdist.tools.config import load_config

    # 11 steps, the first left out: 10 timed steps in 2 s, a mean step of 200 ms (the median,
    # 150 ms, leaves out the steps that carried the bytes, as local SGD's averaging rounds)
    row = {"model": "m", "hosts": 2, "bandwidth": "100mbit", "label": "x", "step_ms": 150.0,
           "train_seconds": 2.0, "steps": 11, "bytes_per_step": 1_250_000.0}
    parts = breakdown(row, 50.0, 20.0)
    assert parts == {"mean_step_ms": pytest.approx(200.0), "compute_ms": 50.0,
                     "wire_ms": pytest.approx(100.0), "compressor_ms": 20.0,
                     "rest_ms": pytest.approx(30.0)}
    assert breakdown(row, None, 0.0) == {}
    assert breakdown({**row, "train_seconds": 1.2}, 50.0, 20.0)["rest_ms"] < 0
    lines = breakdown_table([{**row, **parts}]).splitlines()
    assert lines[2] == "| m | 2 | 100mbit | x | 200 | 50 | 100 | 20 | 30 | n/a | n/a |"
    # the comm suite's rows name no model: no model column
    unnamed = {k: v for k, v in row.items() if k != "model"}
    assert breakdown_table([{**unnamed, **parts}]).splitlines()[2] == \
        "| 2 | 100mbit | x | 200 | 50 | 100 | 20 | 30 | n/a | n/a |"
    timed = {**row, **parts, "startup_s": 21.46, "first_step_s": 13.62}
    assert breakdown_table([timed]).splitlines()[2].endswith("| 30 | 21.5 | 13.6 |")
    # a run with a profiled step (train.profile_step) adds its span, exposed communication and
    # update; a table with such rows says n/a for the others
    seen = {"span_ms": 181.4, "exposed_communication_ms": 42.6, "communication_ms": 50.0,
            "busy_ms": {"update": 7.5}}
    profiled = {**timed, "collectives_per_step": 1.0, "timeline": seen}
    # a profile that saw no collective in a run that made one every step cannot say what was
    # exposed; a local SGD step between averaging rounds has none to see
    unseen = {**seen, "exposed_communication_ms": 0.0, "communication_ms": 0.0}
    lines = breakdown_table([profiled, timed, {**profiled, "timeline": unseen},
                             {**profiled, "collectives_per_step": 0.2, "timeline": unseen}]
                            ).splitlines()
    assert "exposed communication" in lines[0] and lines[1].count("|") == lines[0].count("|")
    assert lines[2].endswith("| 30 | 181, 43, 8 | 21.5 | 13.6 |")
    assert lines[3].endswith("| 30 | n/a | 21.5 | 13.6 |")
    assert lines[4].endswith("| 30 | 181, n/a, 8 | 21.5 | 13.6 |")
    assert lines[5].endswith("| 30 | 181, 0, 8 | 21.5 | 13.6 |")
    for name, picked, positive in (("powersgd.yaml", None, True), ("default.yaml", None, False),
                                   ("auto.yaml", "powersgd", True), ("auto.yaml", "dense", False)):
        run_dir = tmp_path / f"{name}-{picked}"
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(yaml.safe_dump(load_config(f"configs/{name}")))
        # an `auto` run's compressor is the candidate it picked
        assert (compressor_ms(run_dir, repeats=2, picked=picked) > 0) == positive
