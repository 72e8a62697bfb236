"""Loads checkpoints saved under MirroredStrategy on Horovod ranks and trains on (horovodrun).

    cross_engine_worker.py OUT POWERSGD_KERAS ZERO_KERAS

For each file: load it (after tfdist.horovod.init(), so the optimizer builds on the Horovod
engine), train STEPS more steps on this rank's share of the global batches that follow, save
the weights to OUT/<kind>_rank<R>.npz. Then save both models again: the PowerSGD one from rank 0
alone (Horovod's usual way), the ZeRO one from every rank (its save gathers the shards; rank 0
writes OUT/zero_horovod.keras).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

STEPS = 5


def main() -> None:
    import keras

    import tfdist.horovod as thvd
    from tests.workers import common

    out, powersgd_path, zero_path = sys.argv[1:4]
    thvd.init()
    rank, size = thvd.rank(), thvd.size()
    x, y = common.load_digits()
    for kind, path in (("powersgd", powersgd_path), ("zero", zero_path)):
        model = keras.saving.load_model(path)
        data = common.shard_batches(common.global_batches(x, y, 32, shuffle=False).skip(STEPS),
                                    rank, size)
        model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0)
        common.save_weights(model, os.path.join(out, f"{kind}_rank{rank}.npz"))
        if kind == "powersgd" and rank == 0:
            model.save(os.path.join(out, "powersgd_horovod.keras"))
        if kind == "zero":
            model.save(os.path.join(out, "zero_horovod.keras" if rank == 0
                                    else f"scratch_rank{rank}.keras"))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
