"""`tfdist bench --suite stragglers`: the spec, the straggler's quota, the table and the check.

The runs themselves are the comm suite's on an emulated cluster whose straggler is tested in
tests/test_emulated.py; here what is built before a run and judged after it."""

import json
import os
import re

import pytest

from tests.test_emulated import needs_cgroup, needs_netns, own_namespaces
from tfdist.tools import emulated
from tfdist.tools.bench import stragglers
from tfdist.tools.config import ConfigError


def test_the_shipped_spec_builds_every_run_and_the_parameter_server_ones():
    plan, straggler = stragglers.load()
    assert straggler == {"host": 1, "slowdown": 3.0}
    keys = [a.key for a in plan.algorithms]
    assert keys == ["sync", "local_sgd", "ps_sync", "ssp1", "ssp4", "async", "async_scaled"]
    engines = {k: plan.configs[(4, k)]["engine"] for k in keys}
    assert engines["sync"]["name"] == "multi_worker"
    assert [engines[k]["staleness"] for k in ("ps_sync", "ssp1", "ssp4", "async")] == \
        [0, 1, 4, None]
    assert all(engines[k]["name"] == "parameter_server" for k in ("ssp1", "async"))
    quick, _ = stragglers.load(quick=True)
    assert [a.key for a in quick.algorithms] == ["sync", "ssp4", "async", "async_scaled"]
    assert plan.configs[(4, "async_scaled")]["engine"]["scale_lr_by_staleness"] is True


def test_the_straggler_gets_a_third_of_an_equal_share(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert stragglers.cpu_share(4, 3.0) == pytest.approx(2 / 4 / 3)
    assert "a CPU quota of 0.167 cores" in stragglers.describe({"host": 1, "slowdown": 3.0}, 4)


@pytest.mark.parametrize("straggler, message", [
    ("null", "straggler: give {host: INDEX, slowdown: FACTOR}"),
    ("{host: 1, slowdown: 0.5}", "straggler.slowdown: got 0.5"),
    ("{host: 0, slowdown: 3}", "straggler.host: got 0; must be a worker host in [1, 2)"),
    ("{host: 1}", "straggler: give"),
])
def test_a_bad_straggler_is_refused_before_anything_runs(tmp_path, straggler, message):
    path = tmp_path / "s.yaml"
    path.write_text(f"hosts: [2]\nstraggler: {straggler}\nalgorithms:\n"
                    "  sync: {config: default.yaml}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        stragglers.load(path)


def _row(algorithm, t, accuracy, ps=True, staleness=None):
    """A result row; `ps`: a parameter-server run (with its staleness bound)."""
    return {"hosts": 4, "bandwidth": "1gbit", "algorithm": algorithm, "label": algorithm,
            "time_to_target_s": t, "final_accuracy": accuracy, "step_ms": 10.0,
            "bytes_per_step": 100.0, "staleness": staleness,
            "staleness_mean": 1.5 if ps else None, "staleness_max": 3 if ps else None,
            "curve": [(1.0, 0.5, 10), (t or 9.0, accuracy, 20)]}


def test_the_check_needs_1_5x_sooner_within_a_point():
    plan, _ = stragglers.load()
    rows = [_row("sync", 30.0, 0.96, ps=False), _row("ssp4", 25.0, 0.96, staleness=4),
            _row("async", 18.0, 0.955), _row("ps_sync", 10.0, 0.96, staleness=0)]
    text = stragglers.check(rows)  # staleness 0 is synchronous: not a candidate
    assert "async reached the target 1.67x sooner than sync, final accuracy -0.5 pt: passes" \
        in text
    rows.append(_row("async_scaled", 15.0, 0.93))  # faster, but 3 points lower: not judged
    assert "async reached the target 1.67x sooner" in stragglers.check(rows)
    rows[2]["final_accuracy"] = 0.94
    assert "ssp4 reached the target 1.20x sooner" in stragglers.check(rows[:2])
    assert "async_scaled reached the target 2.00x sooner than sync, final accuracy -3.0 pt: " \
        "FAILS" in stragglers.check([r for r in rows if r["algorithm"] != "ssp4"])
    # what keeps a sweep from being judged, said
    assert "not judged (no bounded-staleness or asynchronous run)" in stragglers.check(
        [rows[0], _row("sync_keras_update", 12.0, 0.96, ps=False)])
    assert "not judged (sync missed the target)" in stragglers.check(
        [_row("sync", None, 0.9, ps=False), rows[2]])
    assert "not judged (every bounded-staleness or asynchronous run missed the target)" in \
        stragglers.check([rows[0], _row("ssp4", None, 0.9, staleness=4)])
    table = stragglers.table(plan.target_accuracy, rows)
    assert "| 4 | 1gbit | async | 18.0 | 1.67x | 0.9400 | -2.0 | 1.50 / 3 | 10 | 100 |" in table
    assert "| 4 | 1gbit | sync | 30.0 | 1.00x | 0.9600 | +0.0 | - |" in table


def test_outputs_are_written(tmp_path):
    plan, straggler = stragglers.load()
    rows = [_row("sync", 30.0, 0.96, ps=False), _row("async", 15.0, 0.96)]
    stragglers.write(plan, straggler, rows, [], tmp_path, "tfdist bench --suite stragglers")
    saved = json.loads((tmp_path / "stragglers.json").read_text())
    assert [(r["algorithm"], r["time_to_target_s"]) for r in saved["rows"]] == \
        [("sync", 30.0), ("async", 15.0)]
    assert saved["date"] and "TensorFlow" in saved["machine"]  # what a benchmark page names
    assert stragglers.page_table(saved) in (tmp_path / "stragglers.md").read_text()  # its page
    assert "passes" in (tmp_path / "stragglers.md").read_text()
    assert (tmp_path / "stragglers_accuracy.png").stat().st_size > 10_000


SPEC = """
job: [model.name=mlp, "model.hidden=[64]", data.global_batch_size=64, train.epochs=2]
target_accuracy: 0.5
hosts: [2]
bandwidths: [1gbit]
straggler: {host: 1, slowdown: 1}
run_timeout_seconds: 300
algorithms:
  sync: {label: sync, config: default.yaml}
  async: {label: async, config: default.yaml,
          set: [engine.name=parameter_server, engine.staleness=null]}
"""


@needs_netns
@needs_cgroup
@pytest.mark.slow
def test_a_small_sweep_runs_parameter_servers_beside_a_straggler(tmp_path):
    """2 hosts, host 1 under a quota of one core: the all-reduce baseline and asynchronous
    parameter servers (on host 0) both train; rows, JSON and plot written; nothing left."""
    spec = tmp_path / "stragglers.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    rows = stragglers.run_stragglers(False, str(out), spec=str(spec))
    by = {r["algorithm"]: r for r in rows}
    assert list(by) == ["sync", "async"]
    params = 64 * 64 + 64 + 64 * 10 + 10
    assert by["async"]["bytes_per_step"] == 4 * params  # one push of the gradients
    assert by["async"]["updates"] == 2 * by["async"]["steps"]  # both workers' pushes applied
    assert by["sync"]["staleness_mean"] is None and by["async"]["staleness_mean"] is not None
    assert by["async"]["straggler"] == {"host": 1, "slowdown": 1.0, "cpu_share": 1.0}
    assert all(r["final_accuracy"] > 0.5 for r in rows)
    assert (out / "stragglers_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "stragglers.json").read_text())["failures"] == []
    assert not own_namespaces()
    assert not [c for c in os.listdir(emulated.CGROUP_CPU) if c.startswith(f"tfd-{os.getpid()}-")]
