"""Exact resume from any step (`tfdist.callbacks.BackupAndRestore`): a run stopped after any step
and started again ends with the weights, every replica's state and the data position of a run
never stopped; the data sequence is the same on every engine."""

from __future__ import annotations

import json
import os
import signal
import sys

import keras
import numpy as np
import pytest

import tfdist
from tests.jobs import final_weights
from tests.workers import common
from tfdist.tools import launch

BATCH, STEPS, EPOCHS = 32, 6, 3


class Crash(Exception):
    pass


class CrashAfter(keras.callbacks.Callback):
    """Stops the process's training as a kill would: after global step `step`, by raising."""

    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            raise Crash


def every_copy(model):
    variables = [*model.variables, *model.optimizer.variables]
    return [c.numpy() for v in variables for c in tfdist.comm.replica_copies(v)]


OPTIMIZERS = {
    "dense": lambda: tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
    "ef_topk": lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), compressor={
            "name": "topk", "ratio": 0.05, "error_feedback": True}, min_compress_size=64),
    "powersgd": lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), compressor={"name": "powersgd", "rank": 2}),
    "local_sgd": lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), local_sgd=tfdist.averaging.PeriodicSchedule(4)),
    "zero2": lambda: tfdist.ZeroOptimizer(keras.optimizers.Adam(1e-2), stage=2,
                                          accumulation_steps=2),
    "zero3": lambda: tfdist.ZeroOptimizer(keras.optimizers.Adam(1e-2), stage=3,
                                          accumulation_steps=2),  # on a ShardedModel
}


class SignalDuring(keras.callbacks.Callback):
    """Sends this process `number` while global step `step` is in flight (a preemption notice)."""

    def __init__(self, step, number):
        super().__init__()
        self.step, self.number, self.seen = step, number, 0

    def on_train_batch_begin(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            os.kill(os.getpid(), self.number)


def _run(strategy, optimizer, directory=None, crash=None, save_freq=4, hidden=(32,),
         **backup_options):
    x, y = common.load_digits()
    with strategy.scope():
        model, optimizer = common.make_model(hidden=hidden), optimizer()
        if getattr(optimizer, "stage", None) == 3:
            model = tfdist.zero.ShardedModel(model)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    callbacks, start = [], 0
    if directory is not None:
        backup = tfdist.callbacks.BackupAndRestore(directory, save_freq=save_freq,
                                                   **backup_options)
        callbacks.append(backup)
        start = backup.data_start
    if isinstance(crash, keras.callbacks.Callback):
        callbacks.append(crash)
    elif crash is not None:
        callbacks.append(CrashAfter(crash))
    # Prefetched: the start is read when the iterator is made, not at the first batch read.
    data = tfdist.data.distribute_batches(strategy, lambda: tfdist.data.global_batches(
        x, y, BATCH, seed=3, start=start).prefetch(2))
    try:
        history = model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
                            callbacks=callbacks)
    except Crash:
        return model, None
    return model, history


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_stopped_run_resumes_to_the_weights_of_one_never_stopped(mirrored, tmp_path, name):
    """Stopped mid-epoch (after step 9 of 18; last backup at step 8), run again: every replica's
    copy of every variable equals the uninterrupted run's, and so do the epochs' losses."""
    straight, history = _run(mirrored(2), OPTIMIZERS[name])
    _, crashed = _run(mirrored(2), OPTIMIZERS[name], tmp_path / "backup", crash=9)
    assert crashed is None
    resumed, rest = _run(mirrored(2), OPTIMIZERS[name], tmp_path / "backup")
    for a, b in zip(every_copy(straight), every_copy(resumed), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The resumed run did epochs 1 and 2 (epoch 1 from its 3rd step, metrics restored).
    np.testing.assert_allclose(rest.history["loss"], history.history["loss"][1:], rtol=1e-5)
    assert not (tmp_path / "backup").exists()  # removed after a normal end



@pytest.mark.parametrize("name", ["local_sgd", "powersgd", "zero2"])
def test_a_preemption_signal_backs_up_the_step_in_flight_and_the_rerun_is_exact(mirrored,
                                                                               tmp_path, name):
    """SIGUSR1 arrives while step 11 of 18 runs; no periodic backup is due (save_freq 100): the
    step ends, the backup of step 11 is written, fit ends with SystemExit(PREEMPTED_EXIT) and
    the previous handler is back; the same run again resumes there and ends equal to a run never
    stopped (every replica's state: local models, residuals and Q, shards)."""
    straight, history = _run(mirrored(2), OPTIMIZERS[name])
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit) as ended:
        _run(mirrored(2), OPTIMIZERS[name], tmp_path / "backup",
             crash=SignalDuring(11, signal.SIGUSR1), save_freq=100,
             preemption_signals=["SIGUSR1", "SIGTERM"])
    assert ended.value.code == tfdist.callbacks.PREEMPTED_EXIT == launch.PREEMPTED_EXIT == 76
    assert signal.getsignal(signal.SIGUSR1) is before
    assert sorted(p.name for p in (tmp_path / "backup" / "process-0").iterdir()) == ["step-11"]
    resumed, rest = _run(mirrored(2), OPTIMIZERS[name], tmp_path / "backup",
                         save_freq=100, preemption_signals=["SIGUSR1"])
    for a, b in zip(every_copy(straight), every_copy(resumed), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rest.history["loss"], history.history["loss"][1:], rtol=1e-5)


def test_a_notice_during_a_backup_leaves_it_and_the_one_before_usable(mirrored, tmp_path,
                                                                      monkeypatch):
    """SIGTERM arrives while the periodic backup of step 8 is being written: the handler only
    notes it, the backup completes, no second backup of the same step is made, and the run
    exits with 76 holding the backups of steps 4 and 8; the rerun resumes at 8, exactly."""
    straight, _ = _run(mirrored(2), OPTIMIZERS["dense"])
    savez, sent = np.savez, []

    def savez_then_notice(path, **arrays):  # the notice lands in the middle of the write
        if "step-8" in str(path) and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        savez(path, **arrays)

    monkeypatch.setattr(np, "savez", savez_then_notice)
    with pytest.raises(SystemExit) as ended:
        _run(mirrored(2), OPTIMIZERS["dense"], tmp_path / "backup", save_freq=4,
             preemption_signals=["SIGTERM"])
    monkeypatch.setattr(np, "savez", savez)
    assert sent and ended.value.code == 76
    assert sorted(p.name for p in (tmp_path / "backup" / "process-0").iterdir()) == \
        ["step-4", "step-8"]
    resumed, _ = _run(mirrored(2), OPTIMIZERS["dense"], tmp_path / "backup", save_freq=4)
    for a, b in zip(every_copy(straight), every_copy(resumed), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_preemption_signals_are_checked(tmp_path):
    backup = tfdist.callbacks.BackupAndRestore(tmp_path, preemption_signals=("TERM", 10))
    assert backup.preemption_signals == (signal.SIGTERM, signal.SIGUSR1)
    for bad, message in (("SIGKILL", "SIGKILL cannot be caught"),
                         (["SIGFOO"], "'SIGFOO' is not a signal"), (1.5, "must be a list")):
        with pytest.raises(ValueError, match=message):
            tfdist.callbacks.BackupAndRestore(tmp_path, preemption_signals=bad)
    with pytest.raises(ValueError, match="`on_preempted` must be callable"):
        tfdist.callbacks.BackupAndRestore(tmp_path, on_preempted="scontrol requeue")


def test_the_batch_sequence_is_a_pure_function_of_seed_and_epoch(mirrored):
    """Eager, in a strategy's input pipeline, from any start: the same global batches."""
    x, y = common.load_digits()
    first = [b[1].numpy() for b in tfdist.data.global_batches(x, y, 64, seed=5).take(50)]
    assert len({tuple(b) for b in first}) == 50  # epochs differ (44 batches per epoch here)
    assert not np.array_equal(first[0], first[44])
    resumed = [b[1].numpy() for b in tfdist.data.global_batches(x, y, 64, seed=5,
                                                                start=lambda: 30).take(20)]
    assert all(np.array_equal(a, b) for a, b in zip(first[30:], resumed, strict=True))
    strategy = mirrored(2)
    data = iter(tfdist.data.distribute(strategy, x, y, 64, seed=5, start=7))
    for expected in first[7:10]:
        halves = strategy.experimental_local_results(next(data)[1])
        np.testing.assert_array_equal(np.concatenate([h.numpy() for h in halves]), expected)
    with pytest.raises(ValueError, match=r"`start` must be an int >= 0.*start=-1"):
        tfdist.data.global_batches(x, y, 64, start=-1)
    with pytest.raises(ValueError, match=r"`seed` must be an int >= 0"):
        tfdist.data.global_batches(x, y, 64, seed=1.5)


def test_backups_refuse_another_model_and_bad_arguments(mirrored, tmp_path):
    _run(mirrored(2), OPTIMIZERS["dense"], tmp_path / "backup", crash=5)
    with pytest.raises(ValueError, match=r"does not fit this optimizer: it holds \d+ optimizer "
                                         r"variables, this optimizer has \d+"):
        _run(mirrored(2), OPTIMIZERS["ef_topk"], tmp_path / "backup")
    with pytest.raises(ValueError, match=r"variable .* was saved as float32\[64, 32\] on 2 "
                                         r"replica\(s\); here .* on 1"):
        _run(mirrored(1), OPTIMIZERS["dense"], tmp_path / "backup")
    for bad in ({"save_freq": 0}, {"save_freq": "step"}, {"keep": 1}):
        with pytest.raises(ValueError, match=f"`{next(iter(bad))}` must be"):
            tfdist.callbacks.BackupAndRestore(tmp_path, **bad)


def test_a_full_disk_stops_training_with_the_last_backup_intact(mirrored, small_filesystem):
    """The second backup does not fit: training stops with an error naming the step and the
    intact backup, which resumes."""
    directory = small_filesystem / "backup"
    with pytest.raises(OSError, match=r"could not write the backup of step 8 .* The last "
                                      r"complete backup, step 4, is intact"):
        _run(mirrored(2), lambda: tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
             directory, save_freq=4, hidden=(16,))
    assert sorted(p.name for p in (directory / "process-0").iterdir()) == ["step-4"]

# -- elastic: the resize policy on 3 local workers (shrinking and growing: tests/test_hosts.py) ---
def _pid_of_worker(marker: str, index: int) -> int | None:
    """The pid of the TF_CONFIG worker `index` whose command line holds `marker`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        config = env.get(b"TF_CONFIG")
        if config and json.loads(config)["task"]["index"] == index:
            return int(entry)
    return None


ELASTIC_JOB = ["--set", "engine.name=multi_worker",
               "--set", "model.name=tests.workers.slow_model:build",
               "--set", "train.epochs=3", "--set", "train.steps_per_epoch=12",
               "--set", "train.checkpoint_steps=4", "--set", "data.global_batch_size=48"]


def _elastic_command(out, *extra):
    return [sys.executable, "-m", "tfdist.launch", "--elastic", "--workers", "3",
            "--min-workers", "2", "--timeout", "400", *extra, "--", sys.executable, "-m",
            "tfdist.tools.cli", "train", *ELASTIC_JOB, "--set", f"train.output_dir={out}"]


def _assert_same_training(out, reference):
    summary, weights = final_weights(out)
    reference_summary, reference_weights = reference
    assert reference_summary["world_size"] == 3
    assert summary["examples_per_epoch"] == reference_summary["examples_per_epoch"] == [576] * 3
    for a, b in zip(reference_weights, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    assert not (out / "backup").exists()
    return summary


def test_an_elastic_hostfile_sets_the_size_and_bad_combinations_are_refused(tmp_path, capsys):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.1 slots=1\n")
    code = "import json, os; print(json.loads(os.environ['TF_CONFIG'])['cluster'])"
    assert launch.main(["--elastic", "--hostfile", str(hostfile), "--max-workers", "2",
                        "--timeout", "60", "--", sys.executable, "-c", code]) == 0
    assert capsys.readouterr().out.count("127.0.0.1:") == 2 * 2  # 2 workers (of 3 slots)
    with pytest.raises(SystemExit):
        launch.main(["--elastic", "--hosts", "a:2", "--", "true"])
    assert "--elastic takes --workers N (local workers) or --hostfile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(["--elastic", "--", "true"])
    assert "--elastic needs --workers N (local workers) or --hostfile" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="must be a tfdist.callbacks.BackupAndRestore"):
        tfdist.callbacks.ElasticJoin(keras.callbacks.BackupAndRestore(str(tmp_path)))


def test_the_launcher_names_a_missing_command_and_a_signal(capsys):
    assert launch.main(["--workers", "1", "--", "/nonexistent/command"]) == 127
    assert "[launch] cannot run '/nonexistent/command': No such file or directory" in \
        capsys.readouterr().err
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert launch.main(["--workers", "1", "--", sys.executable, "-c", code]) == 128 + 9
    assert "worker 0 was killed by SIGKILL (signal 9)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(["--elastic", "--workers", "2", "--min-workers", "3", "--", "true"])
    assert "--min-workers must be in [1, --workers=2]" in capsys.readouterr().err


def test_the_throughput_policy_settles_on_the_fewest_workers_that_do_as_well():
    decide = tfdist.callbacks.throughput_policy(tolerance=0.05)
    assert decide({3: 300.0}, 3, 2, 4)[0] == 2  # first: does the last worker help?
    assert decide({3: 300.0, 2: 290.0}, 2, 2, 4) == (
        2, "2 workers run at 290 examples/s, the best measured: staying")
    size, reason = decide({3: 300.0, 2: 200.0}, 2, 2, 4)
    assert size == 3 and "more workers pay" in reason
    assert decide({3: 300.0, 2: 200.0}, 3, 2, 4)[0] == 4  # adding paid off: try one more
    assert decide({3: 300.0, 2: 200.0, 4: 305.0}, 4, 2, 4)[0] == 3  # 4 within 5% of 3
    assert decide({1: 100.0}, 1, 1, 1)[0] == 1
    assert tfdist.callbacks.RESIZE_EXIT == launch.RESIZE_EXIT
    from tfdist.callbacks.channel import NOTICES_ENV, REQUEST_TAG
    assert REQUEST_TAG == launch.REQUEST_TAG  # the launcher reads what the chief writes
    assert NOTICES_ENV == launch.NOTICES_ENV  # and the job reads the notices it sends
