"""`tfdist bench --suite collectives`: one all-reduce over tf.distribute's collectives and
Horovod's Gloo, 2 processes on 127.0.0.1, every result checked by the workers."""

import json
import os

import pytest

from tests.conftest import horovod_available
from tfdist.tools.bench import collectives


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One small sweep, shared: 0.4 MB whole and in 2 calls, 3 timed calls each."""
    out = tmp_path_factory.mktemp("collectives")
    rows = collectives.run_collectives(False, str(out), sizes_mb=["0.4"], splits=["1", "2"],
                                       repeats=3)
    return out, rows


@pytest.mark.multiprocess
def test_every_transport_size_and_split_has_a_measured_row(sweep):
    out, rows = sweep
    transports = ["tf.distribute"] + (["horovod"] if horovod_available() else [])
    assert [(r["transport"], r["size_mb"], r["splits"]) for r in rows] == [
        (t, 0.4, k) for t in transports for k in (1, 2)]
    for r in rows:
        assert r["processes"] == 2 and r["samples"] == 3
        assert 0 < r["min_ms"] <= r["median_ms"]
        assert r["bus_gbs"] == pytest.approx(0.4e6 / (r["median_ms"] / 1e3) / 1e9)
        # the machine's busy core-ms per call: at most all its cores for as long as the calls
        # took, with a 10 ms clock tick of /proc/stat's resolution (3 calls of a few ms may
        # read 0)
        assert 0 <= r["busy_core_ms"] <= os.cpu_count() * (3 * r["median_ms"] + 10)
    saved = json.loads((out / "collectives.json").read_text())
    assert saved["rows"] == rows and saved["failures"] == []
    assert saved["command"] == "tfdist bench --suite collectives --sizes 0.4 --splits 1,2"
    assert saved["date"] and "TensorFlow" in saved["machine"]  # what its page names
    table = (out / "collectives.md").read_text()
    assert table.count("\n| ") == len(rows) + 1 and "| 1.00x |" in table


def test_a_wrong_sum_is_reported_not_timed():
    collectives._check([3.0, 3.0], 2, "ok")  # workers send 1 and 2
    with pytest.raises(RuntimeError, match="must be 3.0"):
        collectives._check([3.0, 2.0], 2, "1 MB in 1 parts")


@pytest.mark.parametrize("kwargs, message", [
    ({"processes": ["1"]}, "at least 2 processes"),
    ({"processes": ["two"]}, "hosts: got 'two'"),
    ({"sizes_mb": ["-1"]}, "sizes: got '-1'"),
    ({"splits": ["0"]}, "splits: got '0'"),
    ({"sizes_mb": ["0.000012"], "splits": ["2"]}, "does not split into 2 equal parts"),
    ({"repeats": -1}, "--repeats must be >= 1"),
    ({"repeats": 0}, "--repeats must be >= 1. Received: 0"),
])
def test_bad_input_is_refused_before_any_process_starts(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        collectives.run_collectives(False, str(tmp_path / "out"), **kwargs)
    assert not (tmp_path / "out").exists()


def test_table_compares_each_row_with_tf_distribute_at_the_same_size_and_split():
    def row(transport, ms):
        return {"transport": transport, "label": transport, "processes": 2, "size_mb": 22.0,
                "splits": 1, "median_ms": ms, "min_ms": ms,
                "bus_gbs": collectives.bus_bandwidth_gbs(22.0, ms, 2)}

    text = collectives.table([row("tf.distribute", 40.0), row("horovod", 16.0)])
    assert "| horovod | 2 | 22 | 1 | 16.0 | 16.0 | 1.38 | 2.50x |" in text
    assert collectives.bus_bandwidth_gbs(94.0, 100.0, 4) == pytest.approx(1.41)


def test_the_page_shows_each_size_and_split_with_one_column_per_transport_and_processes():
    def row(transport, processes, splits, ms):
        return {"transport": transport, "label": transport, "processes": processes,
                "size_mb": 22.0, "splits": splits, "median_ms": ms, "min_ms": ms,
                "bus_gbs": collectives.bus_bandwidth_gbs(22.0, ms, processes)}

    rows = [row(t, n, k, ms) for t, n, k, ms in (
        ("tf.distribute", 2, 1, 40.0), ("horovod", 2, 1, 16.0), ("tf.distribute", 4, 1, 100.0),
        ("horovod", 4, 1, 37.0), ("tf.distribute", 2, 2, 30.0))]
    lines = collectives.page_table(rows).splitlines()
    assert lines[0] == ("| size (MB) | all-reduce calls | tf.distribute, 2 processes | "
                        "Horovod, 2 processes | tf.distribute, 4 processes | "
                        "Horovod, 4 processes |")
    assert lines[2] == "| 22 | 1 | 40.0 (0.55) | 16.0 (1.38) | 100.0 (0.33) | 37.0 (0.89) |"
    assert lines[3] == "| 22 | 2 | 30.0 (0.73) | - | - | - |"  # not measured: a dash
    # a run that measured the machine's busy cores shows its core-ms per call after the bus
    lines = collectives.page_table([{**rows[0], "busy_core_ms": 61.4}]).splitlines()
    assert lines[2] == "| 22 | 1 | 40.0 (0.55; 61 core-ms) |"
    text = collectives.table([{**rows[0], "busy_core_ms": 61.4}, rows[1]])
    assert "| machine's busy core-ms per call |" in text.splitlines()[0]
    assert text.splitlines()[2].endswith("| 1.00x | 61 |")
    assert text.splitlines()[3].endswith("| 2.50x | n/a |")
    assert "busy" not in collectives.table(rows)  # a run saved before: as it was


def test_the_command_names_the_bad_value_and_exits_2(tmp_path, capsys):
    from tfdist.tools.cli import main

    assert main(["bench", "--suite", "collectives", "--splits", "3", "--sizes", "1",
                 "--out", str(tmp_path)]) == 2
    assert "does not split into 3 equal parts" in capsys.readouterr().err
