"""A Horovod rank running a 2-stage pipeline over 2 logical CPU devices of its own.

    horovodrun --gloo -np 2 python tests/workers/pipeline_worker.py --out DIR --kind layer|model

Writes DIR/rank{R}.npz (the trained weights) and prints DONE.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kind", choices=["layer", "model"], required=True)
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=32)
    args = p.parse_args()

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    import tfdist.horovod as thvd
    from tests.workers import common

    model = common.train_pipelined("horovod", args.kind, args.steps, args.global_batch,
                                   args.schedule)
    common.save_weights(model, os.path.join(args.out, f"rank{thvd.rank()}.npz"))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
