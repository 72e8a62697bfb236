"""`tfdist.tools.cpu_load`: the machine's cores busy during each training step."""

import ctypes
import os
import threading
import time

import pytest

from tfdist.tools.bench.comm import breakdown_table, busy_cores, thread_split
from tfdist.tools.cpu_load import (
    COMPUTE,
    MAIN,
    MachineLoad,
    busy_core_seconds,
    parse_stat,
    parse_task_stat,
    thread_groups,
    thread_times,
)

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


def test_a_threads_stat_line_gives_its_name_and_its_user_plus_system_ticks():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    line = "4242 (tf) (x y)) S 1 4242 4242 0 -1 4194560 10 0 0 0 125 37 0 0 20 0 9 0\n"
    assert parse_task_stat(line) == ("tf) (x y)", 125 + 37)
    with pytest.raises(ValueError, match="not a thread's stat line"):
        parse_task_stat("4242 no name here")


class _NamedWorker:
    """A thread named `name` that, once `go` is set, keeps its core busy until its own CPU
    clock (`time.thread_time`, an account independent of /proc's) has advanced `cpu_s`, then
    sets `done` and waits for `release` (an ended thread leaves /proc/self/task). Counting its
    own CPU time, not the wall time, makes the work the same however loaded the machine is."""

    def __init__(self, name: bytes, cpu_s: float):
        self.ready, self.go, self.done, self.release = (threading.Event() for _ in range(4))
        self.thread = threading.Thread(target=self._run, args=(name, cpu_s))
        self.thread.start()
        self.ready.wait()

    def _run(self, name: bytes, cpu_s: float) -> None:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
        self.ready.set()
        self.go.wait(10)
        start = time.thread_time()
        while time.thread_time() - start < cpu_s:
            pass
        self.done.set()
        self.release.wait(30)

    def end(self) -> None:
        self.release.set()
        self.thread.join()


TICKS = 3 * 1000 / os.sysconf("SC_CLK_TCK")  # ms: user and system ticks, each read twice


def test_this_process_threads_are_read_with_their_names_the_first_as_main():
    worker = _NamedWorker(b"spinner", 0.3)
    before = thread_times()
    worker.go.set()
    assert worker.done.wait(30)
    after = thread_times()
    worker.end()
    spun = [tid for tid, (group, _) in after.items() if group == "spinner"]
    assert len(spun) == 1
    assert 1000 * (after[spun[0]][1] - before[spun[0]][1]) == pytest.approx(300, abs=TICKS)
    assert after[str(os.getpid())][0] == MAIN
    assert thread_times("/nonexistent/task") is None


def test_the_summary_splits_this_process_cpu_per_step_by_thread():
    load = MachineLoad()
    load.on_epoch_begin(0)
    load.on_train_batch_end(0)  # the tracing step's end opens the window: a per-thread reading
    main_start = time.thread_time()
    transport = _NamedWorker(b"transport", 0.6)  # started in the window: all its work is in it
    transport.go.set()
    batches = 0
    while not transport.done.is_set():
        _batch(load, 0.2)
        batches += 1
    time.sleep(1.05)
    _batch(load, 0.0)  # over a second since any reading: this batch's end is the last one
    batches += 1
    main_cpu_ms = 1000 * (time.thread_time() - main_start)
    load.on_train_end()
    transport.end()
    split = load.summary()["thread_core_ms_per_step"]
    assert load.thread_steps == batches
    # Each thread's core-ms in the window, per step, as its own CPU clock counted them.
    assert split["transport"] * batches == pytest.approx(600, abs=TICKS)
    assert split[MAIN] * batches == pytest.approx(main_cpu_ms, abs=TICKS)
    assert thread_groups(split) == (0.0, pytest.approx(sum(split.values())))
    assert thread_groups({COMPUTE: 500.0, MAIN: 30.0, "x": 20.0}) == (500.0, 50.0)


def test_the_breakdown_shows_worker_0s_op_pools_and_other_threads_in_the_run_and_its_limit():
    row = {"hosts": 2, "bandwidth": "10gbit", "label": "x", "mean_step_ms": 610.0,
           "compute_ms": 500.0, "wire_ms": 80.0, "compressor_ms": 0.0, "rest_ms": 30.0}
    split = {**row, "thread_core_ms_per_step": {COMPUTE: 520.4, MAIN: 40.0, "unnamed": 230.2},
             "limit_thread_core_ms_per_step": {COMPUTE: 580.0, MAIN: 60.0}}
    assert thread_split(split) == "520 + 270; 580 + 60" and thread_split(row) == "n/a"
    lines = breakdown_table([split, row]).splitlines()
    assert "| worker 0's core-ms per step: op pools + other threads, run; limit |" in lines[0]
    assert lines[2] == "| 2 | 10gbit | x | 610 | 500 | 80 | 0 | 30 | 520 + 270; 580 + 60 | n/a | n/a |"
    assert "op pools" not in breakdown_table([row])
