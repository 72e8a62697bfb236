"""`tfdist bench --suite models`: the spec, the plans it builds and the table it writes.

The runs themselves are the comm suite's (tests/test_bench_comm.py runs a small sweep); here the
plan per model and host count, the fixed per-worker batch and the throughput arithmetic."""

import pytest

from tfdist.tools.bench import models
from tfdist.tools.bench.comm import LIMIT
from tfdist.tools.config import ConfigError


def test_the_shipped_spec_builds_every_plan_and_keeps_the_per_worker_batch():
    spec, plans = models.load()
    assert {m for m, _, _ in plans} == {"resnet50", "transformer"}
    for model, hosts, plan in plans:
        per_worker = spec["models"][model]["per_worker_batch"]
        for algo in plan.algorithms:
            config = plan.configs[(hosts, algo.key)]
            assert config["data"]["global_batch_size"] == per_worker * hosts
            assert config["model"]["name"] == model
        assert plan.configs[(hosts, "dense_4mib")]["compression"]["bucket_mb"] == 4
        assert plan.configs[(hosts, "dense_one_call")]["compression"]["bucket_mb"] is None
        assert plan.configs[(hosts, LIMIT)]["data"]["global_batch_size"] == per_worker
    _, horovod = models.load(algorithms=["dense_horovod_4mib", "dense_horovod_one_call"])
    for _, hosts, plan in horovod:
        for key, bucket_mb in (("dense_horovod_4mib", 4), ("dense_horovod_one_call", None)):
            config = plan.configs[(hosts, key)]
            assert config["engine"]["name"] == "horovod"
            assert config["compression"]["bucket_mb"] == bucket_mb
    # the compute step with the hosts in step: nothing exchanged (never averaged in the run),
    # the dense runs' optimizer, the multi-worker engine
    _, in_phase = models.load(algorithms=["dense", "limit_in_phase"])
    for _, hosts, plan in in_phase:
        config, dense = plan.configs[(hosts, "limit_in_phase")], plan.configs[(hosts, "dense")]
        assert config["averaging"]["period"] > config["train"]["steps_per_epoch"]
        assert config["averaging"]["warmup_steps"] == 0
        assert config["optimizer"]["name"] == dense["optimizer"]["name"] == "adam"
        assert config["optimizer"]["learning_rate"] == dense["optimizer"]["learning_rate"]
        assert config["engine"]["name"] == dense["engine"]["name"]
    _, quick = models.load(quick=True)
    assert [(m, h) for m, h, _ in quick] == [("resnet50", 2), ("transformer", 2)]


@pytest.mark.parametrize("kwargs, message", [
    ({"algorithms": ["zip"]}, "unknown 'zip'"),
    ({"hosts": ["two"]}, "hosts: got 'two'"),
    ({"bandwidths": ["fast"]}, "bandwidths"),
])
def test_bad_selections_are_refused_before_anything_runs(kwargs, message):
    with pytest.raises(ConfigError, match=message) as e:
        models.load(**kwargs)
    # the file named is the spec the user can open, not one made for the run
    assert "tfdist-models-" not in str(e.value)
    if "algorithms" in kwargs:
        assert "(defined in " in str(e.value) and "models.yaml)" in str(e.value)


def test_a_malformed_model_entry_names_the_key(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  m: {job: [], per_worker_batch: 0, colour: red}\n")
    with pytest.raises(ConfigError) as e:
        models.load(path)
    assert "models.m: unknown keys ['colour']" in str(e.value)
    assert "models.m.per_worker_batch: got 0" in str(e.value)


def test_throughput_and_scaling_efficiency():
    info = {"per_worker_batch": 16, "per_example": 64, "unit": "tokens"}

    def row(algorithm, step_ms):
        return {"hosts": 2, "bandwidth": "1gbit", "algorithm": algorithm, "label": algorithm,
                "step_ms": step_ms, "collectives_per_step": 1.0, "bytes_per_step": 8.0,
                "bytes_counted": True, "wire_bytes_per_step": 10.0, "curve": []}

    rows = models.rows_with_throughput("transformer", info,
                                       [row("dense", 400.0), row("fp16", 250.0),
                                        row(LIMIT, 200.0)])
    assert [r["algorithm"] for r in rows] == ["dense", "fp16"]
    assert rows[0]["throughput"] == pytest.approx(2 * 16 * 64 / 0.4)
    assert rows[1]["scaling_efficiency"] == pytest.approx(0.8)
    lines = models.table(rows).splitlines()
    assert lines[2] == "| transformer | 2 | 1gbit | dense | 400 | 5,120 tokens/s | 1.00x | 50% | 1 | 8 | 10 |"
    assert lines[3].endswith("| 8,192 tokens/s | 1.60x | 80% | 1 | 8 | 10 |")


def test_the_encoders_position_table_is_trained_and_saved(tmp_path):
    """The encoder's learned positions are a weight of the model: one SGD step moves them, and
    a saved model loads with the same table and the same predictions."""
    import keras
    import numpy as np

    from tfdist.tools.models import build_model

    keras.utils.set_random_seed(0)
    model = build_model("transformer", (8,), 10, (16,), layers=1, heads=2, vocab=32)
    table = next(v for v in model.trainable_weights if v.path == "positions/embeddings")
    assert tuple(table.shape) == (8, 16)
    before = table.numpy().copy()
    x = np.random.default_rng(0).standard_normal((16, 8)).astype("float32")
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    model.fit(x, np.arange(16) % 10, batch_size=16, epochs=1, verbose=0)
    assert np.abs(table.numpy() - before).max() > 0

    model.save(tmp_path / "encoder.keras")
    loaded = keras.saving.load_model(tmp_path / "encoder.keras")
    np.testing.assert_array_equal(loaded.get_layer("positions").embeddings.numpy(), table.numpy())
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=0, atol=1e-6)


def test_keras_exchange_formula_gathers_embedding_rows_and_reduces_the_rest():
    """Keras' own exchange is not counted as it runs: its formula all-reduces the dense
    gradients in one call and all-gathers each embedding's looked-up rows with their int32
    indices in three (row counts, rows, indices), as TF's CollectiveAllReduce does."""
    from tfdist.tools.bench.baselines import keras_exchange
    from tfdist.tools.models import build_model

    model = build_model("transformer", (8,), 10, (16,), layers=1, heads=2, vocab=32)
    table = 32 * 16
    dense = model.count_params() - table
    rows = 3 * 8  # replica batch 3, 8 ids per example
    sent, calls = keras_exchange(model, 3, 4)
    assert calls == 4
    assert sent == 2 * 3 / 4 * 4 * dense + 3 * (rows * (16 * 4 + 4) + 4)
    assert keras_exchange(model, 3, 1) == (0.0, 0)
    mlp = build_model("mlp", (8,), 10, (16,))
    assert keras_exchange(mlp, 3, 2) == (4.0 * mlp.count_params(), 1)


def test_a_result_names_the_thread_setting_it_ran_with(monkeypatch):
    """A page's command must reproduce its run: TF_NUM_INTRAOP_THREADS, when set here (the
    emulated hosts' default share otherwise), heads the command as a shell would set it."""
    from tfdist.tools.bench.machine import stamp

    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    assert stamp("tfdist bench --suite models")["command"] == "tfdist bench --suite models"
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "2")
    assert stamp("tfdist bench --suite models")["command"] == \
        "TF_NUM_INTRAOP_THREADS=2 tfdist bench --suite models"
