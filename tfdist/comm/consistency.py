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


SHOWN = 64  # bytes of a value's text a message shows; a longer value is shown by its digest


def _number(value: int | str) -> int:
    return int(value) if isinstance(value, (int, np.integer)) else zlib.crc32(str(value).encode())


def _shown(value: int | str) -> str:
    text = str(value)
    return text if len(text.encode()) <= SHOWN else f"{_number(value):#010x}"


def setup_differences(
    setup: dict[str, int | str],
    communicator: Communicator,
    run: Callable[[Callable[[], tf.Tensor]], tf.Tensor] | None = None,
    process: int | None = None,
) -> dict[str, dict[int, str]]:
    """The keys of `setup` whose values differ between the workers, each with every worker's
    value as text ({key: {worker: text}}; a text over 64 bytes as its CRC32 digest); empty
    when every worker has the same values. Every worker gets the same answer: one all-gather
    of a number per key (ints as they are, strings by their CRC32), and a second of the
    differing keys' texts only where there are some.

    Args:
        setup: This worker's values.
        communicator: Where to all-gather them.
        run: Runs a collective function in the right context (see `verify_same_model`).
        process: This process's index, which names it in the answer (its replicas give one
            entry); None names each replica by its rank.
    """
    if communicator.world_size == 1 or not setup:
        return {}
    run = run or (lambda f: f())
    keys = sorted(setup)
    mine = np.array([[-1 if process is None else process]
                     + [_number(setup[k]) for k in keys]], dtype=np.int64)
    table = np.asarray(run(lambda: communicator.all_gather(tf.constant(mine))))
    table = table.reshape(communicator.world_size, -1)
    names = [int(p) if p >= 0 else r for r, p in enumerate(table[:, 0])]
    differ = [j for j in range(len(keys)) if not (table[:, j + 1] == table[0, j + 1]).all()]
    if not differ:
        return {}
    texts = np.zeros((1, len(differ) * SHOWN), np.int64)
    for i, j in enumerate(differ):
        encoded = _shown(setup[keys[j]]).encode()
        texts[0, i * SHOWN:i * SHOWN + len(encoded)] = np.frombuffer(encoded, np.uint8)
    gathered = np.asarray(run(lambda: communicator.all_gather(tf.constant(texts))))
    gathered = gathered.reshape(communicator.world_size, len(differ), SHOWN)
    return {keys[j]: {name: bytes(gathered[r, i].astype(np.uint8)).rstrip(b"\0").decode(
        errors="replace") for r, name in enumerate(names)} for i, j in enumerate(differ)}


def verify_same_setup(
    setup: dict[str, int | str],
    communicator: Communicator,
    run: Callable[[Callable[[], tf.Tensor]], tf.Tensor] | None = None,
) -> None:
    """Raises ValueError on every worker if any worker's `setup` differs (steps per epoch,
    epochs, the optimizer's configuration...), naming each worker's value (a long text by its
    CRC32 digest). Workers that disagree would otherwise wait for each other in different
    collectives.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        engine = tfdist.comm.resolve(strategy)
        engine.verify_same_setup({"steps_per_epoch": 22, "optimizer": "adam"})
        ```
    """
    differences = setup_differences(setup, communicator, run)
    lines = []
    for key, values in differences.items():
        digest = " (digest)" if _shown(setup[key]) != str(setup[key]) else ""
        lines.append(f"  {key}{digest}: "
                     + ", ".join(f"rank {r}: {v}" for r, v in values.items()))
    if lines:
        raise ValueError(
            "The workers' training setups differ:\n" + "\n".join(lines) + "\nEvery worker "
            "must run the same job (the same steps per epoch, epochs, batch size and optimizer "
            "configuration); they would otherwise wait for each other forever.")
