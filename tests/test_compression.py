"""The compressors as pure tensor maths (no training)."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist import compression as C
from tfdist.comm import (
    ByteCounter,
    Gather,
    LocalCommunicator,
    ReplicaCommunicator,
    Sum,
    reduce_encoded,
    run_rounds,
    static_nbytes,
)
from tfdist.compression import packing

ALL = [C.Identity(), C.FP16(), C.BF16(), C.TopK(0.1), C.RandomK(0.1), C.Threshold(0.5, 0.2),
       C.DGC(0.1), C.QSGD(4, 64), C.NUQSGD(4, 64), C.TernGrad(), C.SignSGD(), C.OneBit(),
       C.PowerSGD(2)]


def _x(shape=(24, 10), seed=0):
    return tf.constant(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _roundtrip(c, x, step=0, rank=0, state=None):
    state = c.init_state(x.shape, x.dtype, seed=7) if state is None else state
    payload, ctx, state = c.compress(x, state, tf.constant(step, tf.int64), rank)
    return c.decompress(payload, ctx), payload, state


@pytest.mark.parametrize("c", ALL, ids=lambda c: type(c).__name__)
def test_decompress_restores_shape_and_dtype(c):
    x = _x()
    y, _, _ = _roundtrip(c, x)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_lossless_and_half_precision():
    x = _x()
    np.testing.assert_array_equal(_roundtrip(C.Identity(), x)[0], x)
    np.testing.assert_allclose(_roundtrip(C.FP16(), x)[0], x, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(_roundtrip(C.BF16(), x)[0], x, rtol=1e-2, atol=1e-2)
    assert static_nbytes(_roundtrip(C.FP16(), x)[1]) == x.shape.num_elements() * 2


def test_topk_keeps_exactly_the_largest():
    x = _x((100,))
    y, payload, _ = _roundtrip(C.TopK(0.05), x)
    kept = np.flatnonzero(y.numpy())
    assert len(kept) == 5
    assert set(kept) == set(np.argsort(-np.abs(x.numpy()))[:5])
    np.testing.assert_array_equal(y.numpy()[kept], x.numpy()[kept])


@pytest.mark.parametrize("data", ["normal", "heavy_tailed", "rows", "ties", "zeros"])
def test_sampled_selection_finds_exactly_the_k_largest(data):
    """`largest` (top-k, DGC, threshold) on tensors big enough for its sampled threshold: the
    same set as a full top-k, whatever the distribution; with a threshold set too high on
    purpose it falls back to the full selection, still exact."""
    from tfdist.compression.topk import largest

    rng = np.random.RandomState(0)
    n, k = 300_000, 3_000
    values = {"normal": rng.randn(n), "heavy_tailed": rng.standard_cauchy(n),
              "rows": (rng.randn(600, 500) * np.arange(1, 501)).reshape(-1),  # columns differ
              "ties": np.round(rng.randn(n), 1), "zeros": np.zeros(n)}[data]
    magnitudes = tf.constant(np.abs(values).astype("float32"))
    expected = np.sort(magnitudes.numpy())[-k:]
    for sigmas in (5.0, -1e6):
        got = largest(magnitudes, k, margin_sigmas=sigmas).numpy()
        assert got.shape == (k,) and len(set(got)) == k
        np.testing.assert_array_equal(np.sort(magnitudes.numpy()[got]), expected)


def test_randomk_draws_distinct_indices_uniformly():
    n, k = 100_000, 1_000
    c = C.RandomK(k / n, seed=1)
    counts = np.zeros(n)
    for step in range(200):
        idx = c._indices(n, k, step, tf.constant(0, tf.int64)).numpy()
        assert idx.shape == (k,) and len(set(idx)) == k and idx.min() >= 0 and idx.max() < n
        counts[idx] += 1
    # each index is drawn with probability k / n per step: 2 in 200 steps, Poisson-like
    assert abs(counts.mean() - 2.0) < 1e-9 and 1.6 < counts.var() < 2.4
    dense = C.RandomK(0.9)._indices(1000, 900, 3, tf.constant(0, tf.int64)).numpy()
    assert len(set(dense)) == 900  # few distinct draws: the permutation path


def test_qsgd_levels_round_to_neighbours_without_bias():
    """The arithmetic rounding (no search): each value rounds between the two levels around it,
    up with the probability that keeps its expectation."""
    rng = np.random.RandomState(0)
    for cls in (C.QSGD, C.NUQSGD):
        for levels in (1, 2, 4, 8):
            c = cls(levels=levels, bucket_size=64)
            points = c.level_values()
            r = np.concatenate([rng.rand(5000), points, [0.0, 1.0]]).astype("float32")
            lower, up = (t.numpy() for t in c._round_down(tf.constant(r)))
            assert (lower >= 0).all() and (lower <= len(points) - 2).all()
            lo, hi = points[lower], points[lower + 1]
            assert (lo <= r + 1e-7).all() and (r <= hi + 1e-7).all()
            np.testing.assert_allclose(lo + up * (hi - lo), r, atol=1e-6)
            np.testing.assert_allclose(c._level(tf.range(len(points))).numpy(), points)


def test_threshold_sends_only_values_above_it():
    x = tf.constant([0.1, -2.0, 0.3, 1.5, -0.2, 0.05, 3.0, 0.0, 0.0, 0.0])
    y, _, _ = _roundtrip(C.Threshold(1.0, max_ratio=0.5), x)
    np.testing.assert_array_equal(y, [0, -2.0, 0, 1.5, 0, 0, 3.0, 0, 0, 0])


def test_randomk_indices_are_shared_across_workers_and_change_per_step():
    c, x = C.RandomK(0.1, seed=3), _x((200,))
    support = [tuple(np.flatnonzero(_roundtrip(c, x, step=s, rank=r)[0].numpy()))
               for s, r in ((5, 0), (5, 1), (6, 0))]
    assert support[0] == support[1] and support[0] != support[2]


@pytest.mark.parametrize("c", [C.RandomK(0.25), C.QSGD(2, 16), C.NUQSGD(3, 16), C.TernGrad()],
                         ids=lambda c: type(c).__name__)
def test_unbiased_compressors_are_unbiased(c):
    """Mean of T independent draws is within 5 standard errors of x, element-wise."""
    x = _x((64,), seed=1)
    draws = np.stack([_roundtrip(c, x, step=s)[0].numpy() for s in range(1000)])
    se = draws.std(axis=0) / np.sqrt(len(draws)) + 1e-6
    assert np.all(np.abs(draws.mean(axis=0) - x.numpy()) < 5 * se + 1e-4)
    assert c.unbiased


def test_biased_topk_is_not_unbiased():
    x = _x((64,), seed=1)
    y = _roundtrip(C.TopK(0.25), x)[0].numpy()
    assert not np.allclose(y, x.numpy()) and not C.TopK(0.25).unbiased


@pytest.mark.parametrize("inner", [C.TopK(0.1), C.SignSGD(), C.QSGD(2, 16), C.RandomK(0.2),
                                   C.OneBit(), C.TernGrad()], ids=lambda c: type(c).__name__)
def test_error_feedback_residual_is_what_compression_dropped(inner):
    ef = C.ErrorFeedback(inner)
    x = _x()
    state = ef.init_state(x.shape, x.dtype, seed=1)
    payload, ctx, state = ef.compress(x, state, tf.constant(0, tf.int64))
    np.testing.assert_allclose(state["residual"], x - ef.decompress(payload, ctx), atol=1e-6)
    # Next step compresses x2 + residual.
    x2 = _x(seed=5)
    payload2, ctx2, state2 = ef.compress(x2, state, tf.constant(1, tf.int64))
    np.testing.assert_allclose(state2["residual"],
                               x2 + state["residual"] - ef.decompress(payload2, ctx2), atol=1e-5)


def test_error_feedback_is_not_poisoned_by_nan():
    ef = C.ErrorFeedback(C.TopK(0.1))
    x = _x()
    state = ef.init_state(x.shape, x.dtype)
    _, _, state = ef.compress(x, state, tf.constant(0, tf.int64))
    bad = tf.tensor_scatter_nd_update(x, [[0, 0]], [np.nan])
    _, _, after = ef.compress(bad, state, tf.constant(1, tf.int64))
    np.testing.assert_array_equal(after["residual"], state["residual"])
    assert np.isfinite(after["residual"].numpy()).all()


def test_dgc_keeps_nan_out_of_its_state():
    c = C.DGC(0.1)
    x = _x()
    state = c.init_state(x.shape, x.dtype)
    _, _, state = c.compress(x, state, tf.constant(0, tf.int64))
    _, _, after = c.compress(x * np.inf, state, tf.constant(1, tf.int64))
    for k in state:
        np.testing.assert_array_equal(after[k], state[k])


@pytest.mark.parametrize("c", [C.SignSGD(), C.OneBit()], ids=lambda c: type(c).__name__)
def test_sign_payloads_are_packed_to_one_bit(c):
    x = _x((1024, 32))
    _, payload, _ = _roundtrip(c, x)
    n = x.shape.num_elements()
    scales = 4 if isinstance(c, C.SignSGD) else 8
    assert static_nbytes(payload) == n * 4 // 32 + scales  # 1/32 of float32, plus the scale(s)
    y = _roundtrip(c, x)[0].numpy()
    np.testing.assert_array_equal(y > 0, x.numpy() > 0)


def test_bit_packing_round_trips_every_width():
    rng = np.random.default_rng(0)
    for bits in (1, 2, 4, 8, 16):
        codes = rng.integers(0, 2**bits, size=101)
        words = packing.pack(tf.constant(codes), bits)
        assert words.dtype == tf.int32 and words.shape[0] == packing.packed_words(101, bits)
        np.testing.assert_array_equal(packing.unpack(words, bits, 101), codes)


def test_dgc_masks_sent_coordinates_and_warms_up():
    c = C.DGC(0.05, momentum=0.9, warmup_steps=40, warmup_ratios=(0.5, 0.2))
    assert [(s, p.ratio) for s, p in c.phases()] == [(0, 0.5), (20, 0.2), (40, 0.05)]
    x = _x((100,))
    y, _, state = _roundtrip(C.DGC(0.05), x)
    sent = np.flatnonzero(y.numpy())
    assert len(sent) == 5
    assert np.all(state["velocity"].numpy()[sent] == 0) and np.all(state["momentum"].numpy()[sent] == 0)
    rest = np.setdiff1d(np.arange(100), sent)
    np.testing.assert_allclose(state["velocity"].numpy()[rest], x.numpy()[rest])


def test_powersgd_warm_start_approaches_the_best_rank_r_error():
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.standard_normal((60, 60)))
    v, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    s = np.array([10.0, 6.0, 3.0, 1.0] + [0.1] * 36)
    m = tf.constant((u[:, :40] * s) @ v.T, tf.float32)
    c = C.PowerSGD(rank=2)
    state = c.init_state(m.shape, m.dtype)
    for step in range(8):
        approx, _, state = _roundtrip(c, m, step=step, state=state)
    best = np.linalg.norm(s[2:])  # Eckart-Young
    err = np.linalg.norm(m.numpy() - approx.numpy())
    assert err <= 1.01 * best, (err, best)


def test_powersgd_skips_tensors_where_it_does_not_pay():
    c = C.PowerSGD(rank=4)
    assert not c.applies_to(tf.TensorShape([100]))
    assert not c.applies_to(tf.TensorShape([8, 8]))       # 64 <= 2 * 16 * 4
    assert c.applies_to(tf.TensorShape([3, 3, 32, 64]))  # a conv kernel: [288, 64]
    assert not c.applies_to(tf.TensorShape([3, 3, 1, 32]))  # [9, 32]: 288 <= 2 * 41 * 4
    from tfdist.compression.powersgd import orthogonalize

    q = orthogonalize(tf.constant([[1.0, 0.0], [0.0, 0.0]]))  # a zero column: no NaN
    assert np.isfinite(q.numpy()).all()


@pytest.mark.parametrize("c", [C.TopK(0.25), C.SignSGD(), C.FP16(), C.RandomK(0.5)],
                         ids=lambda c: type(c).__name__)
def test_reduce_over_replicas_sums_each_replicas_decompressed_tensor(mirrored, c):
    strategy = mirrored(2)
    xs = [_x((16, 4), seed=s) for s in (1, 2)]
    with strategy.scope():
        sent = tf.Variable(0.0, dtype=tf.float64, aggregation=tf.VariableAggregation.NONE)

    @tf.function
    def run():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            x = tf.where(tf.equal(rid, 0), xs[0], xs[1])
            comm = ReplicaCommunicator(strategy, ByteCounter(sent))
            state = c.init_state(x.shape, x.dtype, seed=1)
            (out,), _ = reduce_encoded(c, [x], [state], tf.constant(3, tf.int64), comm, op="mean")
            return out
        return strategy.run(fn)

    outs = [o.numpy() for o in strategy.experimental_local_results(run())]
    np.testing.assert_allclose(outs[0], outs[1])
    expected = np.mean([_roundtrip(c, x, step=3, rank=r, state=c.init_state(x.shape, x.dtype, 1))[0]
                        for r, x in enumerate(xs)], axis=0)
    tol = 2e-3 if isinstance(c, C.FP16) else 1e-6  # FP16 payloads are summed in half precision
    np.testing.assert_allclose(outs[0], expected, rtol=1e-5, atol=tol)
    # N = 2: an all-reduce sends 2(N-1)/N = 1 payload, an all-gather N-1 = 1 payload.
    payload = _roundtrip(c, xs[0])[1]
    assert strategy.experimental_local_results(sent)[0].numpy() == \
        pytest.approx(static_nbytes(payload))


class _ScaledSum(C.Compressor):
    """A codec of two rounds of its own: every worker's largest magnitude gathered, then each
    tensor divided by the largest of them, summed, and scaled back; its state counts exchanges."""

    summable = True

    def init_state(self, shape, dtype, seed=0):
        return {"exchanges": tf.constant(0, tf.int64)}

    def compress(self, x, state, step, rank=0):
        return (x,), None, state

    def decompress(self, payload, ctx):
        return payload[0]

    def encode(self, xs, states, step, rank=0):
        copies = yield Gather([tf.reduce_max(tf.abs(x))[None] for x in xs])
        scales = [tf.reduce_max(c) for c in copies]
        sums = yield Sum([x / scale for x, scale in zip(xs, scales)])
        return ([total * scale for total, scale in zip(sums, scales)],
                [{"exchanges": s["exchanges"] + 1} for s in states])


@pytest.mark.parametrize("per_tensor, calls", [(False, 2), (True, 4)])
def test_the_transport_carries_a_codecs_own_rounds_over_replicas(mirrored, per_tensor, calls):
    """The transport runs any codec's rounds (a gather, then a sum) over the replicas: every
    replica gets the sum of both replicas' tensors and the codec's new state; each round is one
    collective call for both tensors, where reducing one tensor at a time (the transport
    called per tensor) takes one per tensor for the same sums."""
    strategy = mirrored(2)
    xs = [[_x((6, 4), seed=s), _x((5,), seed=s + 10)] for s in (1, 2)]
    codec = _ScaledSum()
    with strategy.scope():
        sent = tf.Variable(0.0, dtype=tf.float64, aggregation=tf.VariableAggregation.NONE)
        made = tf.Variable(0, dtype=tf.int64, aggregation=tf.VariableAggregation.NONE)

    @tf.function
    def run():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            mine = [tf.where(tf.equal(rid, 0), a, b) for a, b in zip(*xs)]
            comm = ReplicaCommunicator(strategy, ByteCounter(sent, made))
            states = [codec.init_state(x.shape, x.dtype) for x in mine]
            step = tf.constant(0, tf.int64)
            if not per_tensor:
                return reduce_encoded(codec, mine, states, step, comm)
            pairs = [reduce_encoded(codec, [x], [s], step, comm) for x, s in zip(mine, states)]
            return [t for (t,), _ in pairs], [s for _, (s,) in pairs]
        return strategy.run(fn)

    totals, states = run()
    for replica in range(2):
        for j in range(2):
            got = strategy.experimental_local_results(totals[j])[replica]
            np.testing.assert_allclose(got, xs[0][j] + xs[1][j], rtol=1e-6, atol=1e-6)
            assert strategy.experimental_local_results(states[j]["exchanges"])[replica] == 1
    assert strategy.experimental_local_results(made)[0] == calls


def test_the_transport_refuses_what_is_not_a_round():
    def rounds():
        yield [tf.ones(2)]  # a list, not tfdist.comm.Sum([...])

    with pytest.raises(TypeError, match="Sum, Gather or Choice"):
        run_rounds(rounds(), LocalCommunicator())


def test_reduce_with_a_world_of_one_is_the_local_round_trip():
    c, x = C.TopK(0.2), _x()
    (out,), _ = reduce_encoded(c, [x], [c.init_state(x.shape, x.dtype)],
                               tf.constant(0, tf.int64), LocalCommunicator(), op="sum")
    np.testing.assert_array_equal(out, _roundtrip(c, x)[0])


@pytest.mark.parametrize("call, match", [
    (lambda: C.TopK(1.5), "ratio=1.5"),
    (lambda: C.TopK(0), "ratio=0"),
    (lambda: C.RandomK(-0.1), "ratio=-0.1"),
    (lambda: C.PowerSGD(rank=0), "rank=0"),
    (lambda: C.QSGD(levels=0), "levels=0"),
    (lambda: C.DGC(momentum=1.0), "momentum=1.0"),
    (lambda: C.Threshold(0.0), "threshold=0.0"),
    (lambda: C.get("top_k"), "Unknown compressor 'top_k'"),
    (lambda: C.get("topk", ratio=2), "ratio=2"),
    (lambda: C.get("topk", rate=0.1), "Bad arguments for compressor 'topk'"),
    (lambda: C.ErrorFeedback(C.PowerSGD()), "already keeps its own error feedback"),
])
def test_bad_arguments_raise_value_error_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_registry_round_trips_configs():
    for c in [C.TopK(0.01), C.ErrorFeedback(C.SignSGD()), C.PowerSGD(rank=3, seed=2),
              C.DGC(0.01, warmup_steps=8)]:
        again = C.get(C.serialize(c))
        assert type(again) is type(c) and C.serialize(again) == C.serialize(c)
    ef = C.get({"name": "topk", "ratio": 0.01, "error_feedback": True})
    assert isinstance(ef, C.ErrorFeedback) and isinstance(ef.inner, C.TopK)


class _Unregistered(C.Compressor):
    """A compressor of one's own module, never registered."""

    summable = True

    def compress(self, x, state, step, rank=0):
        return (x,), None, state

    def decompress(self, payload, ctx):
        return payload[0]


def test_an_unregistered_compressor_is_saved_under_its_import_path():
    config = C.serialize(_Unregistered())
    assert config == {"name": "tests.test_compression:_Unregistered"}
    assert type(C.get(config)) is _Unregistered

    def local():
        class Local(_Unregistered):
            pass
        return Local()

    with pytest.raises(ValueError, match="Local is defined inside a function"):
        C.serialize(local())
