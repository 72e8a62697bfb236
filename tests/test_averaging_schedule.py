import pytest
import tensorflow as tf

from tfdist.averaging import HierarchicalSchedule, PeriodicSchedule


def test_post_local_schedule_table():
    s = PeriodicSchedule(period=4, warmup_steps=3)
    table = [(step, s.is_synchronous(step), s.is_averaging(step)) for step in range(12)]
    assert [t[1] for t in table] == [True] * 3 + [False] * 9
    assert [t[0] for t in table if t[2]] == [6, 10]
    assert s.rounds(12) == 3 + 2


def test_tensor_and_python_steps_agree():
    s = PeriodicSchedule(period=3, warmup_steps=2)
    for step in range(20):
        assert bool(s.is_averaging(tf.constant(step))) == s.is_averaging(step)
        assert bool(s.is_synchronous(tf.constant(step))) == s.is_synchronous(step)


def test_period_one_averages_every_local_step():
    s = PeriodicSchedule(period=1)
    assert all(s.is_averaging(i) for i in range(5)) and s.rounds(5) == 5


@pytest.mark.parametrize("kwargs, match", [
    (dict(period=0), "period=0"),
    (dict(period=2, warmup_steps=-1), "warmup_steps=-1"),
    (dict(period=2.5), "period=2.5"),
])
def test_periodic_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PeriodicSchedule(**kwargs)


def test_hierarchical_levels_and_validation():
    intra, inter = HierarchicalSchedule(2, 8, warmup_steps=1).levels()
    assert [i for i in range(20) if intra.is_averaging(i)] == [2, 4, 6, 8, 10, 12, 14, 16, 18]
    assert [i for i in range(20) if inter.is_averaging(i)] == [8, 16]
    with pytest.raises(ValueError, match="multiple of `intra_period` \\(3\\)"):
        HierarchicalSchedule(3, 8)
