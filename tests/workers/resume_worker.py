"""Save/resume in separate processes (MirroredStrategy over 2 logical CPUs).

    resume_worker.py first    CKPT COMPRESSOR_JSON      # train S steps, model.save(CKPT)
    resume_worker.py second   CKPT COMPRESSOR_JSON OUT  # load CKPT, train S steps, save weights
    resume_worker.py straight -    COMPRESSOR_JSON OUT  # train S, then S more; save weights
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import tfdist  # noqa: E402
from tests.workers import common  # noqa: E402

STEPS = 5


def fit(model, strategy):
    x, y = common.load_digits()
    model.fit(common.distribute(strategy, x, y, 32, shuffle=False), epochs=1,
              steps_per_epoch=STEPS, verbose=0)


def main() -> None:
    phase, ckpt, compressor = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    strategy = tf.distribute.MirroredStrategy(common.cpu_devices(2))
    with strategy.scope():
        if phase == "second":
            model = keras.saving.load_model(ckpt)
        else:
            model = common.make_model(hidden=(32,))
            model.compile(optimizer=tfdist.DistributedOptimizer(
                keras.optimizers.Adam(1e-2), compressor=compressor),
                loss="sparse_categorical_crossentropy")
    fit(model, strategy)
    if phase == "first":
        model.save(ckpt)
        return
    if phase == "straight":
        fit(model, strategy)
    common.save_weights(model, sys.argv[4])


if __name__ == "__main__":
    main()
