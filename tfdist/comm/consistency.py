"""Checks that every worker trains the same model, before any gradient is exchanged.

Workers whose models differ would otherwise feed collectives of different shapes: at best an
obscure error, at worst a hang. A fixed-size fingerprint is all-gathered instead (same shape on
every worker by construction), and every worker raises the same clear error.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfdist.comm.base import Communicator


def model_fingerprint(variables: Sequence) -> np.ndarray:
    """[number of variables, number of elements, CRC32 of the ordered shapes and dtypes].

    Example:
        ```python
        fingerprint = tfdist.comm.model_fingerprint(build_model().trainable_variables)
        print(fingerprint)  # [2 variables, 650 elements, CRC32 of their shapes and dtypes]
        ```
    """
    spec = ";".join(f"{tuple(v.shape)}:{tf.as_dtype(v.dtype).name}" for v in variables)
    n_elements = sum(int(np.prod(v.shape)) for v in variables)
    return np.array([len(variables), n_elements, zlib.crc32(spec.encode())], dtype=np.int64)


def verify_same_model(
    variables: Sequence,
    communicator: Communicator,
    run: Callable[[Callable[[], tf.Tensor]], tf.Tensor] | None = None,
) -> None:
    """Raises ValueError on every worker if any worker's variables differ in shape or dtype.

    Args:
        variables: The trainable variables this worker is about to train.
        communicator: Where to all-gather the fingerprints.
        run: Runs a collective function in the right context (e.g. inside `strategy.run`) and
            returns one local result. Defaults to calling it directly.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
        engine = tfdist.comm.resolve(strategy)  # engines call it with their own communicator
        engine.verify_same_model(model.trainable_variables)  # else the same ValueError everywhere
        ```
    """
    if communicator.world_size == 1:
        return
    mine = model_fingerprint(variables)
    gathered = (run or (lambda f: f()))(
        lambda: communicator.all_gather(tf.constant(mine[None, :]))
    )
    table = np.asarray(gathered).reshape(communicator.world_size, -1)
    bad = [r for r in range(table.shape[0]) if not np.array_equal(table[r], table[0])]
    if bad:
        rows = "\n".join(
            f"  rank {r}: {table[r][0]} variables, {table[r][1]} parameters, "
            f"shape digest {table[r][2]:#010x}" for r in range(table.shape[0])
        )
        raise ValueError(
            f"The workers' models differ (ranks {bad} differ from rank 0):\n{rows}\n"
            "Every worker must build the same model (same layers, shapes and dtypes) before "
            "training. Check that all workers run the same script and config."
        )


def _number(value: int | str) -> int:
    return int(value) if isinstance(value, (int, np.integer)) else zlib.crc32(str(value).encode())


def verify_same_setup(
    setup: dict[str, int | str],
    communicator: Communicator,
    run: Callable[[Callable[[], tf.Tensor]], tf.Tensor] | None = None,
) -> None:
    """Raises ValueError on every worker if any worker's `setup` differs (steps per epoch,
    epochs, the optimizer's configuration...): ints are compared as they are, strings by their
    CRC32. Workers that disagree would otherwise wait for each other in different collectives.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        engine = tfdist.comm.resolve(strategy)
        engine.verify_same_setup({"steps_per_epoch": 22, "optimizer": "adam"})
        ```
    """
    if communicator.world_size == 1 or not setup:
        return
    keys = sorted(setup)
    mine = np.array([[_number(setup[k]) for k in keys]], dtype=np.int64)
    gathered = (run or (lambda f: f()))(lambda: communicator.all_gather(tf.constant(mine)))
    table = np.asarray(gathered).reshape(communicator.world_size, -1)
    lines = []
    for j, key in enumerate(keys):
        column = table[:, j]
        if not (column == column[0]).all():
            shown = [f"{v:#010x}" if isinstance(setup[key], str) else str(v) for v in column]
            lines.append(f"  {key}{' (digest)' if isinstance(setup[key], str) else ''}: "
                         + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
    if lines:
        raise ValueError(
            "The workers' training setups differ:\n" + "\n".join(lines) + "\nEvery worker "
            "must run the same job (the same steps per epoch, epochs, batch size and optimizer "
            "configuration); they would otherwise wait for each other forever.")
