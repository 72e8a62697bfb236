"""One small training run, shared by in-process references and multi-process workers.

Every engine trains the same MLP from the same seed on the same sequence of global batches of the
embedded digits set; only how the batch is split over replicas differs. So the final weights must
agree across engines up to floating-point summation order.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.data import distribute, global_batches, load_digits, shard_batches
from tfdist.models import build_model  # noqa: F401 (re-exported for workers)

SEED = 3
HIDDEN = (16,)


def make_model(hidden=HIDDEN) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    return build_model("mlp", (8, 8, 1), 10, hidden)


def make_inner_optimizer(name: str = "sgd") -> keras.optimizers.Optimizer:
    if name == "adam":
        return keras.optimizers.Adam(1e-2)
    return keras.optimizers.SGD(0.05, momentum=0.9)


def train(engine: str, steps: int, global_batch: int, *, strategy=None, wrap: bool = True,
          accumulation_steps: int = 1, optimizer: str = "sgd", hidden=HIDDEN,
          callbacks=(), **wrapper_kwargs) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    """Trains for `steps` micro-steps; `engine` in {"strategy", "horovod"}."""
    x, y = load_digits()
    if engine == "horovod":
        import tfdist.horovod as thvd

        thvd.init()
        model = make_model(hidden)
        zero_stage = wrapper_kwargs.pop("zero_stage", 0)
        offload = wrapper_kwargs.pop("offload", None)
        if zero_stage:
            opt = thvd.ZeroOptimizer(make_inner_optimizer(optimizer), stage=zero_stage,
                                     accumulation_steps=accumulation_steps, offload=offload)
        else:
            opt = thvd.DistributedOptimizer(make_inner_optimizer(optimizer),
                                            accumulation_steps=accumulation_steps,
                                            **wrapper_kwargs)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        per_rank = global_batch // accumulation_steps
        data = shard_batches(global_batches(x, y, per_rank, shuffle=False),
                             thvd.rank(), thvd.size())
        callbacks = [thvd.callbacks.BroadcastGlobalVariables(0), *callbacks]
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
        return model, opt

    assert engine == "strategy" and strategy is not None
    with strategy.scope():
        model = make_model(hidden)
        opt = make_inner_optimizer(optimizer)
        if wrap:
            opt = tfdist.DistributedOptimizer(opt, accumulation_steps=accumulation_steps,
                                              **wrapper_kwargs)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    data = distribute(strategy, x, y, global_batch // accumulation_steps, shuffle=False)
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=list(callbacks))
    return model, opt


def weights(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(w) for w in model.get_weights()]


def save_weights(model: keras.Model, path: str) -> None:
    np.savez(path, *weights(model))


def load_weights(path: str) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def assert_weights_close(a, b, rtol=1e-5, atol=1e-6) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol, err_msg=f"weight {i}")


def cpu_devices(n: int) -> list[str]:
    return [d.name for d in tf.config.list_logical_devices("CPU")[:n]]
