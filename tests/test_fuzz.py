"""Property-based fuzzing (hypothesis) of the config loader and the public constructors: any
input is accepted or refused with the project's own error (ConfigError / ValueError, of bounded
size), never a raw Python or TensorFlow exception."""

from __future__ import annotations

import contextlib

import keras
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfdist
from tfdist import compression
from tfdist.optimizers.distributed import SHORTCUTS
from tfdist.tools.config import SCHEMA, ConfigError, load_yaml, validate

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                   st.sampled_from([0, 1, 2, 0.5, 1e-3, "none", "topk", "sgd", "all", "ring"]))
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _section(name: str):
    keys = st.one_of(st.sampled_from(sorted(SCHEMA[name])), st.text(max_size=10))
    return st.dictionaries(keys, values, max_size=6)


configs = st.fixed_dictionaries({}, optional={name: _section(name) for name in SCHEMA}) | \
    st.dictionaries(st.text(max_size=10), values, max_size=3) | values


@FUZZ
@given(configs)
def test_any_config_is_accepted_or_refused_with_a_config_error(raw):
    try:
        config = validate(raw)
    except ConfigError as e:
        assert len(str(e)) < 12_000
        return
    assert set(config) == set(SCHEMA)


@FUZZ
@given(st.text(max_size=300))
def test_any_yaml_text_parses_or_is_refused(text):
    try:
        load_yaml(text, "the config")
    except ConfigError as e:
        assert "the config" in str(e) or "alias" in str(e)


optimizer_arguments = st.dictionaries(
    st.sampled_from([*SHORTCUTS, "loss_scale", "initial_scale", "dynamic_growth_steps",
                     "verify_model", "nan_policy"]), values, max_size=4)


@FUZZ
@given(optimizer_arguments)
def test_any_optimizer_arguments_construct_or_raise_a_value_error(kwargs):
    try:
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), **kwargs)
    except ValueError as e:
        assert any(f"`{k}`" in str(e) or k in str(e) for k in kwargs) or "compressor" in str(e)


@FUZZ
@given(st.sampled_from(sorted(compression.COMPRESSORS)), st.dictionaries(
    st.sampled_from(["ratio", "rank", "levels", "bucket_size", "seed", "scale", "momentum",
                     "clip_norm", "warmup_steps", "warmup_ratios", "threshold", "max_ratio",
                     "warm_start", "min_compression_rate", "eps", "inner", "low", "high"]),
    values, max_size=3))
def test_any_compressor_arguments_construct_or_raise_a_value_error(name, kwargs):
    with contextlib.suppress(ValueError):  # anything else (TypeError, ...) fails the test
        compression.get({"name": name, **kwargs})


@FUZZ
@given(st.dictionaries(st.sampled_from(["stage", "accumulation_steps", "offload",
                                        "verify_model", "nan_policy"]), values, max_size=3))
def test_any_zero_arguments_construct_or_raise_a_value_error(kwargs):
    with contextlib.suppress(ValueError):  # anything else fails the test
        tfdist.ZeroOptimizer(keras.optimizers.Adam(), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"initial_scale": 0}, "initial_scale=0"),
    ({"dynamic_growth_steps": 0}, "dynamic_growth_steps=0"),
    ({"verify_model": "yes"}, "verify_model='yes'"),
    ({"compress_1d": 1}, "compress_1d=1"),
    ({"track_norms": None}, "track_norms=None"),
])
def test_constructor_arguments_that_were_silently_accepted_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), **kwargs)
    with pytest.raises(ValueError, match="needs a 'name'"):
        compression.get({"ratio": 0.1})
