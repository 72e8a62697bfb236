"""The Horovod engine: callbacks under horovodrun, and import without Horovod."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.conftest import ROOT, horovod_available, worker_env
from tests.workers import common
from tfdist.tools.launch import run_horovod

needs_horovod = pytest.mark.skipif(
    not horovod_available(),
    reason="Horovod is not installed: run launch/build_horovod.sh (see BUILD.md)",
)


def test_import_tfdist_works_without_horovod():
    code = (
        "import sys; sys.modules['horovod'] = None\n"
        "import tfdist, tfdist.horovod as thvd\n"
        "assert not thvd.is_available()\n"
        "try:\n    thvd.init()\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=worker_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERR The Horovod engine needs Horovod" in out.stdout
    assert "build_horovod.sh" in out.stdout


@needs_horovod
def test_horovod_optimizers_are_the_engine_neutral_classes():
    """One class per algorithm whatever the engine: a Horovod-saved optimizer's config names
    tfdist.DistributedOptimizer (so it loads anywhere)."""
    import tfdist
    import tfdist.horovod as thvd

    assert thvd.ZeroOptimizer is tfdist.ZeroOptimizer
    opt = thvd.DistributedOptimizer(keras.optimizers.SGD(0.1), accumulation_steps=2)
    assert type(opt) is tfdist.DistributedOptimizer  # Horovod's spelling builds tfdist's class
    config = keras.saving.serialize_keras_object(opt)
    assert config["registered_name"] == "tfdist>DistributedOptimizer"
    again = keras.saving.deserialize_keras_object(config)
    assert type(again) is tfdist.DistributedOptimizer and again.accumulation_steps == 2


@needs_horovod
@pytest.mark.multiprocess
@pytest.mark.horovod
def test_callbacks_broadcast_average_and_warm_up(tmp_path):
    result = run_horovod([sys.executable, f"{ROOT}/tests/workers/horovod_callbacks_worker.py",
                          str(tmp_path)], 2, 240, env=worker_env())
    assert result.returncode == 0, result.output[-5000:]
    w = [common.load_weights(str(tmp_path / f"rank{r}.npz")) for r in (0, 1)]
    common.assert_weights_close(w[0], w[1], rtol=0, atol=0)  # broadcast made them one model
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # MetricAverage: both ranks report the same (averaged) epoch metrics.
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(logs[0]["history"][key], logs[1]["history"][key], rtol=1e-6)
    # Warm-up from 0.01 to 0.01 * 2 ranks over 2 epochs of 4 steps, then flat.
    expected = [0.01 * (1 + t / 8) for t in range(8)] + [0.02] * 4
    np.testing.assert_allclose(logs[0]["lrs"], expected, rtol=1e-6)
    assert logs[0]["lrs"] == logs[1]["lrs"]


FINISHES_FIRST = """
import sys, time
import tensorflow as tf
import horovod.tensorflow as horovod
import tfdist.horovod as thvd

alone = horovod.ProcessSet([0])
thvd.init(process_sets=[alone])
if thvd.rank() == 0:  # still busy, in a collective of its own, when rank 1 has finished
    time.sleep(3)
    print("SUM", float(horovod.allreduce(tf.ones([]), op=horovod.Sum, process_set=alone)))
import os
print("EXIT", thvd.rank(), "THREADS", os.environ.get("TF_NUM_INTRAOP_THREADS"), flush=True)
"""


@needs_horovod
@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_rank_that_finishes_first_waits_for_the_others_before_horovod_shuts_down(tmp_path):
    """Horovod shuts down for every rank when one exits: a rank that finished first ended the
    collectives still running on the others (a host's last averaging round within its process
    set). tfdist's ranks wait for each other at exit. (The same run checks that the 2 local
    ranks each get half of this machine's cores as TensorFlow's threads.)"""
    script = tmp_path / "finishes_first.py"
    script.write_text(FINISHES_FIRST)
    env = worker_env()
    env.pop("TF_NUM_INTRAOP_THREADS", None)
    result = run_horovod([sys.executable, str(script)], 2, 120, env=env)
    assert result.returncode == 0, result.output[-3000:]
    assert "SUM 1.0" in result.output
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"EXIT 1 THREADS {half}" in result.output and f"EXIT 0 THREADS {half}" in result.output


def test_the_cycle_time_is_set_for_hvd_init_and_refused_where_it_would_not_apply(monkeypatch):
    from tfdist.horovod import _set_cycle_time

    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    _set_cycle_time(10, initialized=False)
    assert os.environ["HOROVOD_CYCLE_TIME"] == "10"
    _set_cycle_time(10.0, initialized=True)  # the value Horovod read: nothing to change
    with pytest.raises(ValueError, match=r"got 5 ms, but HOROVOD_CYCLE_TIME=10 is set"):
        _set_cycle_time(5, initialized=False)
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    with pytest.raises(ValueError, match="after Horovod was initialised"):
        _set_cycle_time(2.5, initialized=True)
    for bad in (0, -1, True, "10"):
        with pytest.raises(ValueError, match="must be a number of milliseconds > 0"):
            _set_cycle_time(bad, initialized=False)
    assert "HOROVOD_CYCLE_TIME" not in os.environ


def test_an_all_reduce_of_several_tensors_reaches_horovod_as_one_buffer_per_dtype():
    """A bucket of gradients is one Horovod tensor per dtype, so Horovod's every-cycle
    negotiation tracks a tensor per bucket, not per gradient; each tensor's sum comes back in
    its shape and dtype (a fake Horovod of 2 equal ranks); one tensor goes as it is."""
    import tensorflow as tf

    from tfdist.comm import horovod as engine

    calls = []

    class TwoEqualRanks:
        Sum, Average = "sum", "average"

        def grouped_allreduce(self, tensors, op, process_set=None):
            calls.append([(t.dtype.name, t.shape.as_list()) for t in tensors])
            return [t * 2 for t in tensors]

    comm = object.__new__(engine.HorovodCommunicator)  # its collectives, without Horovod
    comm._hvd = TwoEqualRanks()
    tensors = [tf.ones([2, 3]), tf.range(4, dtype=tf.float32), tf.ones([5], tf.float16),
               tf.fill([2, 2], 3.0)]
    out = comm._all_reduce(tensors, "sum")
    assert calls == [[("float32", [14]), ("float16", [5])]]
    for t, o in zip(tensors, out, strict=True):
        assert o.shape == t.shape and o.dtype == t.dtype
        np.testing.assert_array_equal(o.numpy(), 2 * t.numpy())
    calls.clear()
    (alone,) = comm._all_reduce([tf.ones([3, 2])], "sum")  # one tensor goes as it is
    assert calls == [[("float32", [3, 2])]] and alone.shape == [3, 2]
