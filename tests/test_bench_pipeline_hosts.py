"""`tfdist bench --suite pipeline_hosts`: stages on emulated hosts send only the activations and
their gradients (the bytes on the links, measured), and its outputs are written."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tfdist.tools.bench.pipeline import BATCH, WIDTH
from tfdist.tools.bench.pipeline_hosts import payload_bytes, run_pipeline_hosts


def test_payload_is_the_activations_and_gradients_that_cross():
    assert payload_bytes(2) == 2 * BATCH * WIDTH * 4 + BATCH * 8
    assert payload_bytes(4) == 3 * 2 * BATCH * WIDTH * 4 + BATCH * 8
    per_stage = 4 * (3 * (WIDTH * WIDTH + WIDTH) + WIDTH * 10 + 10) + 4 * 4 * (WIDTH * WIDTH + WIDTH)
    assert payload_bytes(2, replicas=2) == (2 * 2 * (BATCH // 2) * WIDTH * 4 + 2 * (BATCH // 2) * 8
                                            + (BATCH // 2) * WIDTH * 4 + 2 * per_stage)


def test_bad_hosts_are_refused_first(tmp_path):
    with pytest.raises(ValueError, match=r"--hosts 3: .* 2, 4 or 8 hosts"):
        run_pipeline_hosts(True, str(tmp_path), hosts=[3])


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="needs root and iproute2 (ip, tc) for the emulated hosts")
def test_stages_on_two_hosts_send_only_their_payload(tmp_path):
    rows = run_pipeline_hosts(True, str(tmp_path), hosts=[2])
    assert [(r["layout"], r["m"]) for r in rows] == [
        ("one device", 1), ("gpipe 2 stages", 4), ("1f1b 2 stages", 4)]
    assert rows[0]["bytes_per_step"] < 10_000  # the whole model on host 0: nothing crosses
    for r in rows[1:]:
        assert 1.0 <= r["bytes_per_step"] / r["payload_per_step"] < 1.05, r
        assert r["step_ms"] > 0
    saved = json.loads((tmp_path / "pipeline_hosts.json").read_text())
    assert saved["rows"] == rows
    assert saved["date"] and "TensorFlow" in saved["machine"]  # what its page names
    assert "| 2 | 1gbit | gpipe 2 stages | 4 |" in (tmp_path / "pipeline_hosts.md").read_text()
