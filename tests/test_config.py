from pathlib import Path

import pytest

from tfdist.tools.config import ConfigError, defaults, load_config, parse_override, validate

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    config = load_config(path)
    assert set(config) == {"model", "data", "engine", "optimizer", "compression", "averaging",
                           "train"}


def test_the_built_in_defaults_are_the_main_job():
    """`tfdist train` without configs/ (an installed package) trains configs/default.yaml's job."""
    assert validate({}) == load_config(Path(__file__).parents[1] / "configs" / "default.yaml")


def test_defaults_fill_missing_keys():
    config = validate({"train": {"epochs": 3}})
    assert config["train"]["epochs"] == 3
    # weight_decay null: the optimizer's own, recorded as used
    assert config["optimizer"] == {**defaults()["optimizer"], "weight_decay": 0.0}


@pytest.mark.parametrize("raw, message", [
    ({"train": {"epochs": 0}}, "train.epochs: got 0; must be an integer >= 1"),
    ({"train": {"epochs": "3"}}, "train.epochs: got '3'"),
    ({"train": {"epochs": True}}, "train.epochs: got True"),
    ({"optimizer": {"name": "adagrad"}}, "optimizer.name: got 'adagrad'; must be one of"),
    ({"optimizer": {"learning_rate": -1}}, "optimizer.learning_rate: got -1; must be a number > 0"),
    ({"engine": {"name": "mpi"}}, "engine.name: got 'mpi'"),
    ({"engine": {"name": "horovod", "horovod_cycle_ms": 0}},
     "engine.horovod_cycle_ms: got 0; must be a number > 0 (ms), or null"),
    ({"engine": {"name": "multi_worker", "horovod_cycle_ms": 10}},
     "engine.horovod_cycle_ms: sets Horovod's cycle time; engine.name 'multi_worker' does not "
     "run Horovod"),
    ({"engine": {"name": "horovod", "horovod_pack": False}},
     "engine: unknown key 'horovod_pack'"),
    ({"engine": {"name": "tfdist.tools.bench.baselines:KerasMultiWorker"},
      "compression": {"name": "fp16"}},
     "compression.name need(s) a tfdist engine: use 'multi_worker'"),
    ({"model": {"hidden": [64, 0]}}, "model.hidden: got [64, 0]"),
    ({"train": {"epoch": 3}}, "unknown key 'epoch' (did you mean 'epochs'?)"),
    ({"trian": {}}, "unknown key 'trian' (did you mean 'train'?)"),
    ({"compression": {"name": "powersdg"}}, "got 'powersdg'; must be one of"),
    ({"compression": {"name": "powersdg"}}, "(did you mean 'powersgd'?)"),
    ({"optimizer": {"name": "adamm"}}, "(did you mean 'adam'?)"),
    ({"engine": {"devices": 3}, "data": {"global_batch_size": 64}},
     "must divide by engine.devices (3): use a multiple of 3"),
    ({"optimizer": {"accumulation_steps": 3}}, "must divide by optimizer.accumulation_steps (3)"),
    ({"compression": {"name": "zip"}}, "compression.name: got 'zip'; must be one of"),
    ({"compression": {"name": "topk", "options": {"ratio": 1.5}}}, "ratio=1.5"),
    ({"compression": {"name": "powersgd", "options": {"rank": 0}}}, "rank=0"),
    ({"compression": {"name": "topk", "options": {"rate": 0.1}}}, "Bad arguments for compressor"),
    ({"averaging": {"period": 0}}, "averaging.period: got 0; must be an integer >= 1"),
    ({"averaging": {"period": 4, "warmup_steps": -1}}, "averaging.warmup_steps: got -1"),
    ({"averaging": {"outer": {"name": "slowmo"}}}, "averaging.outer: needs averaging.period"),
    ({"averaging": {"period": 6, "intra_period": 4}},
     "averaging: `inter_period` must be a multiple of `intra_period` (4)"),
    ({"averaging": {"period": 4, "host_size": 2}}, "host_size: needs averaging.intra_period"),
    ({"averaging": {"period": 4, "outer": {"name": "nesterov"}}},
     "averaging: Unknown outer rule 'nesterov'"),
    ({"averaging": {"period": 4, "outer": {"name": "sma", "alpha": 1.5}}},
     "averaging: `alpha` must be a number in (0, 1]. Received: alpha=1.5"),
    ({"averaging": {"period": 4, "outer": {"name": "slowmo", "beta": 0.5}}},
     "Bad options for outer rule 'slowmo'"),
    ({"averaging": {"period": 1, "topology": "ring", "outer": {"name": "sma"}}},
     "averaging: Ring gossip averages with neighbours only"),
    ({"averaging": {"period": 2, "topology": "star"}}, "averaging.topology: got 'star'"),
    ({"optimizer": {"zero_stage": 4}}, "optimizer.zero_stage: got 4; must be one of"),
    ({"optimizer": {"offload": "disk"}}, "optimizer.offload: needs optimizer.zero_stage"),
    ({"optimizer": {"zero_stage": 1, "offload": "gpu"}}, "optimizer.offload: got 'gpu'"),
    ({"optimizer": {"zero_stage": 1, "offload_dir": "/tmp"}}, "only for optimizer.offload: disk"),
    ({"optimizer": {"zero_stage": 2}, "compression": {"name": "topk"}},
     "it does not combine with compression or local SGD"),
    # ZeroOptimizer's and Offload's own rules, as their constructors state them
    ({"optimizer": {"zero_stage": 2}, "train": {"precision": "mixed_float16"}},
     "train.precision: ZeroOptimizer does no loss scaling"),
    ({"optimizer": {"zero_stage": 1, "offload": "disk", "offload_budget_mb": 0.0001}},
     "optimizer.offload_budget_mb: `budget_bytes` must be an integer >= 1024. Received: "
     "budget_bytes=104"),
])
def test_errors_name_key_value_and_rule(raw, message):
    with pytest.raises(ConfigError) as e:
        validate(raw)
    assert message in str(e.value)


def test_parts_compose_local_sgd_with_compression_and_accumulation():
    from tfdist.tools.config import make_parts

    config = validate({"averaging": {"period": 4, "warmup_steps": 8,
                                     "outer": {"name": "slowmo", "momentum": 0.5}},
                       "compression": {"name": "fp16"}, "optimizer": {"accumulation_steps": 2}})
    kinds = [type(p).__name__ for p in make_parts(config)]
    assert kinds == ["Accumulation", "LocalSGD", "GradientExchange"]  # the order they run


def test_all_errors_are_reported_at_once():
    with pytest.raises(ConfigError) as e:
        validate({"train": {"epochs": 0, "verbose": 5}, "optimizer": {"name": "x"}})
    text = str(e.value)
    assert "train.epochs" in text and "train.verbose" in text and "optimizer.name" in text


def test_overrides_are_yaml_values_and_validated(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  epochs: 5\n")
    config = load_config(cfg, ["train.epochs=2", "model.hidden=[8, 4]", "optimizer.loss_scale=null"])
    assert config["train"]["epochs"] == 2
    assert config["model"]["hidden"] == [8, 4]
    assert config["optimizer"]["loss_scale"] is None
    with pytest.raises(ConfigError, match="train.epochs: got -2"):
        load_config(cfg, ["train.epochs=-2"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("epochs=2")


@pytest.mark.parametrize("text, message", [
    ("optimizer: {learning_rate: .inf}", "optimizer.learning_rate: got inf; must be a number > 0"),
    ("optimizer: {learning_rate: .nan}", "optimizer.learning_rate: got nan"),
    ("train: {seed: -1}", "train.seed: got -1; must be an integer >= 0"),
    ("data: {seed: 99999999999999}", "data.seed: got 99999999999999"),
    ("train: {epochs: 1000000000000}", "train.epochs: got 1000000000000; must be an integer >= 1 "
                                       "(at most 1,000,000)"),
    ("engine: {devices: 100000}", "engine.devices: got 100000"),
    ("model: {hidden: [64, 100000000]}", "model.hidden: got [64, 100000000]"),
    ("a: &a [1, 2]\nb: *a", "YAML aliases (*name) are not allowed in a config (line 2)"),
    ("train: {run_name: '../x'}", "train.run_name: got '../x'"),
    # values that would fail later (a traceback, out of memory) or be ignored
    ("train:\n  epochs: 2\n  epochs: 3\n", "Key 'epochs' is given twice (lines 2 and 3); keep one"),
    ("model: {hidden: " + "[" * 5000 + "]" * 5000 + "}", "nested more than 32 deep"),
    ("optimizer: {name: adam, momentum: 0.5}", "optimizer.momentum: optimizer.name 'adam' takes "
                                               "no momentum"),
    ("model: {name: cnn, options: {width: 3}}", "model.options: the built-in model 'cnn' takes "
                                                "none"),
    ("data: {name: digits, num_examples: 100}", "data.num_examples: only for data.name synthetic"),
    ("optimizer: {zero_stage: 1, offload: disk, offload_dir: /nonexistent/state}",
     "optimizer.offload_dir: Offload directory '/nonexistent/state' does not exist: create it"),
    ("data: {name: synthetic, input_shape: [10000, 10000]}",
     "data.num_examples: 4,096 examples of shape [10000, 10000] take 1,525.9 GiB"),
    ("model: {name: mlp, hidden: [1048576, 1048576]}", "use narrower layers"),
    ("engine: {devices: 1024}", "engine.devices: got 1024"),
])
def test_malformed_configs_are_refused_at_load(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value)
    assert len(str(e.value)) < 600


def test_refusals_stay_short_and_ints_become_floats(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]"
        for i in range(8)]
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(bomb)
    assert len(str(e.value)) < 200  # the alias bomb (9**9 nodes) is not expanded
    binary = tmp_path / "model.h5"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="is not a text file"):
        load_config(binary)
    huge = {"train": {f"key{i}": "x" * 10_000 for i in range(100)}}
    with pytest.raises(ConfigError) as e:
        validate(huge)
    assert len(str(e.value)) < 12_000 and "and 80 more" in str(e.value)
    config = validate({"optimizer": {"name": "sgd", "momentum": 0, "learning_rate": 1}})
    assert isinstance(config["optimizer"]["momentum"], float)
    assert isinstance(config["optimizer"]["learning_rate"], float)


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)



def test_numbers_written_as_python_reads_them_and_the_weight_decay_used_is_recorded():
    # YAML 1.1 reads 1e-6 and 1.0e6 as text; they are numbers to every user
    config = load_config(None, ["data.test_fraction=1e-1", "optimizer.learning_rate=1.0e-2"])
    assert config["data"]["test_fraction"] == 0.1
    assert config["optimizer"]["learning_rate"] == 0.01
    with pytest.raises(ConfigError, match="optimizer.learning_rate: got 'fast'"):
        load_config(None, ["optimizer.learning_rate=fast"])
    assert load_config(None, ["optimizer.name=adamw"])["optimizer"]["weight_decay"] == 0.004
    assert load_config(None, ["optimizer.name=adamw", "optimizer.weight_decay=0"])[
        "optimizer"]["weight_decay"] == 0.0
    assert load_config(None, ["optimizer.name=adam"])["optimizer"]["weight_decay"] == 0.0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_runs_config_yaml_loads_back_to_the_same_config(path, tmp_path):
    """config.yaml in a run directory lists every key, defaults included: given back with
    --config (a bench does this for every run), it is the same config, refused nowhere."""
    import yaml

    config = load_config(path)
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(config, sort_keys=False))
    assert load_config(saved) == config


def test_the_names_a_config_may_take_are_the_registries():
    """The config knows the built-in compressors and models without importing them (no
    TensorFlow): its names must be the registries' own."""
    from tfdist import compression
    from tfdist.tools import config, models

    assert set(config.MODELS) == set(models.MODELS)
    registered = {name: cls.__module__ for name, cls in compression.COMPRESSORS.items()
                  if cls.__module__.startswith("tfdist.")}  # not the tests' own
    assert registered == {name: f"tfdist.compression.{module}"
                          for name, module in compression.BUILT_IN.items()}
    assert set(compression.__all__) == {"BUILT_IN", *compression._EXPORTS}
    assert all(getattr(compression, name) for name in compression.__all__)


def test_the_config_and_its_engines_load_without_tensorflow():
    """The command reads a config and looks its engine up before TensorFlow loads (it loads
    only past the schema, to build what the config describes, or in a `check` that asks a rule
    of the library): a mistake is said in a second, and TensorFlow's load-time lines stay
    silenced (`tfdist.logs.loading_quietly`)."""
    import subprocess
    import sys

    check = ("import sys; sys.argv = ['tfdist']; from tfdist.tools import config; "
             "c = config.defaults(); "
             "[config.ENGINES.lookup(n)().check(c) for n in config.ENGINES "
             "if n != 'parameter_server']")
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", check],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "tfdist.tools.engines.parameter_server" in imported
    assert "tensorflow" not in imported and "keras" not in imported


def test_an_invalid_config_names_its_file_and_overrides(tmp_path):
    """A key misspelt in a YAML file, or in an override, is said with where it was written."""
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError, match=rf"Invalid config \({path}\):\n  train: unknown key "
                                          "'epoch' \\(did you mean 'epochs'\\?\\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"Invalid config \(--set train.epoch=2\):"):
        load_config(None, ["train.epoch=2"])
