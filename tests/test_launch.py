import json
import sys
import time

import pytest

from tfdist.launch import free_ports, main, run_processes, run_tf_workers, tf_config


def test_tf_config_describes_a_loopback_cluster():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    cfg = json.loads(tf_config(1, ports))
    assert cfg["cluster"]["worker"] == [f"127.0.0.1:{p}" for p in ports]
    assert cfg["task"] == {"type": "worker", "index": 1}


def test_workers_see_their_own_index():
    code = "import json, os; print('INDEX', json.loads(os.environ['TF_CONFIG'])['task']['index'])"
    results = run_tf_workers([sys.executable, "-c", code], 2, timeout=60)
    assert [r.returncode for r in results] == [0, 0]
    assert ["INDEX 0" in results[0].output, "INDEX 1" in results[1].output] == [True, True]


def test_timeout_kills_the_whole_process_group():
    start = time.monotonic()
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
           "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"
    (result,) = run_processes([([sys.executable, "-c", code], {})], timeout=2)
    assert time.monotonic() - start < 20
    assert result.returncode is None and "started" in result.output


def test_one_failure_stops_the_others_and_sets_the_exit_code(capsys):
    code = ("import json, os, sys, time\n"
            "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
            "sys.exit(3) if i == 1 else time.sleep(120)\n")
    start = time.monotonic()
    assert main(["--workers", "2", "--timeout", "100", "--", sys.executable, "-c", code]) == 3
    assert time.monotonic() - start < 60
    assert "worker 1 exited with 3" in capsys.readouterr().err


def test_bad_worker_count():
    with pytest.raises(ValueError, match="num_workers"):
        run_tf_workers(["true"], 0, timeout=1)
