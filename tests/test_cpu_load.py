"""`tfdist.tools.cpu_load`: the machine's cores busy during each training step."""

import os
import time

import pytest

from tfdist.tools.bench.comm import breakdown_table, busy_cores
from tfdist.tools.cpu_load import MachineLoad, busy_core_seconds, parse_stat

STAT = """cpu  1000 50 500 9000 200 30 70 150 40 0
cpu0 500 25 250 4500 100 15 35 75 20 0
cpu1 500 25 250 4500 100 15 35 75 20 0
intr 288455 0 0
ctxt 123
btime 1796155000
"""


def test_busy_time_is_every_field_but_idle_and_iowait_in_ticks_and_cores_are_cpu_lines():
    busy, cores = parse_stat(STAT)
    # user + nice + system + irq + softirq + steal; guest (40) is already in user
    assert busy == pytest.approx((1000 + 50 + 500 + 30 + 70 + 150) / os.sysconf("SC_CLK_TCK"))
    assert cores == 2
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        parse_stat("cpu0 1 2 3 4\n")


def test_this_machine_reports_its_cores_and_a_busy_time_that_grows():
    before, cores = busy_core_seconds()
    assert cores == os.cpu_count()
    deadline = time.perf_counter() + 0.2
    while time.perf_counter() < deadline:
        pass
    after, _ = busy_core_seconds()
    assert after - before >= 0.1  # this process alone kept one core busy for 0.2 s


def _batch(load, spin_s):
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        pass
    load.on_train_batch_end(0)


def test_steps_that_keep_a_core_busy_count_one_core_at_least_and_each_epochs_first_opens_it():
    load = MachineLoad()
    assert load.summary() is None  # no step yet
    load.on_epoch_begin(0)
    _batch(load, 0.0)  # the tracing step: its end opens the epoch's window
    _batch(load, 0.3)
    _batch(load, 0.3)
    load.on_epoch_begin(1)
    _batch(load, 0.3)  # the next epoch's first batch opens its window: not counted
    time.sleep(0.3)  # between its batches: counted as wall time, not busy
    _batch(load, 0.0)
    load.on_train_end()
    summary = load.summary()
    assert summary["cores"] == os.cpu_count() and load.steps == 3
    assert load.seconds == pytest.approx(0.9, abs=0.05)
    # this process spun on one core for 0.6 of the 0.9 s; other processes may have kept the
    # other cores busy
    assert 0.55 <= summary["busy_cores"] <= summary["cores"] + 0.05
    assert summary["busy_core_ms_per_step"] >= 0.55 * 600 / 3


def test_the_breakdown_shows_the_cores_busy_in_the_run_and_its_limit_only_when_measured():
    row = {"hosts": 2, "bandwidth": "10gbit", "label": "x", "mean_step_ms": 610.0,
           "compute_ms": 500.0, "wire_ms": 80.0, "compressor_ms": 0.0, "rest_ms": 30.0}
    loaded = {**row, "cores": 2, "busy_cores": 1.966, "limit_busy_cores": 1.999}
    assert busy_cores(loaded) == "1.97, 2.00 of 2" and busy_cores(row) == "n/a"
    assert busy_cores({k: v for k, v in loaded.items() if k != "limit_busy_cores"}) == \
        "1.97, n/a of 2"
    lines = breakdown_table([loaded, row]).splitlines()
    assert "| cores busy: run, limit |" in lines[0]
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[2] == "| 2 | 10gbit | x | 610 | 500 | 80 | 0 | 30 | 1.97, 2.00 of 2 | n/a | n/a |"
    assert lines[3] == "| 2 | 10gbit | x | 610 | 500 | 80 | 0 | 30 | n/a | n/a | n/a |"
    assert "cores busy" not in breakdown_table([row])  # a result saved before: as it was
