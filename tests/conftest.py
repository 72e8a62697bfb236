"""Test rig: logical CPU devices (created once, before TensorFlow initialises), strategy fixtures,
and helpers that launch local worker processes with a hard timeout."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_LOGICAL_CPUS = 4
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
)

# A test process builds many MirroredStrategies, plain Keras reference runs among them: each
# numbers its collectives from a base of its own from the start (tfdist itself installs this
# when it first builds a strategy or a communicator; tests/test_hooks.py checks both).
from tfdist._hooks.distribute import fresh_collective_keys  # noqa: E402

fresh_collective_keys()

# TensorFlow's and Keras' modules are millions of objects that never die: kept out of every
# later garbage collection (measured: test_faults + test_zero 205 s -> 197 s, test_local_sgd
# 110 s -> 100 s).
gc.freeze()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "train_worker.py")


# A parallel run (`pytest -n 2`, the README's test command; `--dist loadfile` in pyproject.toml)
# keeps each module in one process, so its module-scoped multi-process runs are built once (the
# session-scoped runs below are each used by one module). The longest modules start first, so
# that no process is left with a long one at the end (the order of their times in a `-n 2` run):
# the xdist workers collect, and their order is the order the modules are handed out in.
_LONGEST_FIRST = ("test_hosts", "test_records", "test_multiprocess", "test_cli", "test_readme",
                  "test_ps", "test_zero", "test_safe_resume", "test_data_service", "test_zero3",
                  "test_resume", "test_local_sgd", "test_horovod_migration", "test_slurm",
                  "test_compressed_training", "test_pipeline", "test_optimizer", "test_faults",
                  "test_horovod_elastic", "test_docstrings")


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker: the files' own order
        return
    rank = {module: i for i, module in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


@pytest.fixture
def mirrored():
    """Factory: a MirroredStrategy over the first n logical CPU devices."""
    from tests.workers.common import cpu_devices

    def make(n: int = 2):
        return tf.distribute.MirroredStrategy(cpu_devices(n))

    return make


def worker_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                CUDA_VISIBLE_DEVICES="")


def horovod_available() -> bool:
    from tfdist.horovod import is_available

    return is_available()


@pytest.fixture
def worker_cmd():
    """argv prefix for tests/workers/train_worker.py."""
    return [sys.executable, WORKER]


@pytest.fixture
def small_filesystem(tmp_path):
    """A 64 KiB tmpfs, mounted for the test (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    path = tmp_path / "small"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tfdist-test", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.fixture(autouse=True, scope="module")
def _fresh_keras_per_module():
    """Drop each test module's Keras graphs and traced functions when the module ends, the custom
    gradients TensorFlow registered for them included (it keeps them, and so every graph traced
    with an all-reduce, for the life of the process). Without this the suite's process grows to
    millions of objects, and later modules trace and collect garbage next to every earlier model."""
    import keras

    from tfdist._hooks.graphs import custom_gradients_released

    with custom_gradients_released():
        yield
    keras.backend.clear_session()  # and a garbage collection


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory):
    """test_resume's elastic job on 3 workers, never stopped: (summary, weights). Shared by the
    elastic tests on this machine and on share-nothing hosts (the same computation)."""
    import tests.workers.slow_model  # noqa: F401 (registers the layer for loading)
    from tests.jobs import final_weights
    from tests.test_resume import _elastic_command

    out = tmp_path_factory.mktemp("straight")
    straight = subprocess.run(_elastic_command(out), capture_output=True, text=True,
                              cwd=ROOT, env=worker_env(), timeout=450)
    assert straight.returncode == 0, straight.stderr[-3000:]
    return final_weights(out)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """name -> (summary, weights) of tests/jobs.py's job with ALGORITHMS[name] on 2 local workers,
    never stopped: each algorithm's run once per session, when a test first asks for it."""
    import tests.workers.slow_model  # noqa: F401 (registers the layer for loading)
    from tests.jobs import final_weights, launcher_command

    runs: dict[str, tuple] = {}

    def run(name: str) -> tuple:
        if name not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            done = subprocess.run(launcher_command(out, name), capture_output=True, text=True,
                                  cwd=ROOT, env=worker_env(), timeout=450)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[name] = final_weights(out)
        return runs[name]

    return run
