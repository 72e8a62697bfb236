"""One small training run, shared by in-process references and multi-process workers.

Every engine trains the same MLP from the same seed on the same sequence of global batches of the
embedded digits set; only how the batch is split over replicas differs. So the final weights must
agree across engines up to floating-point summation order.
"""

from __future__ import annotations  # noqa: I001 (tfdist first, as the docs advise)

import tfdist  # TensorFlow then loads without matplotlib (tfdist._hooks.imports)
import keras
import numpy as np
import tensorflow as tf

from tfdist.data import distribute, global_batches, load_digits, shard_batches
from tfdist.tools.models import build_model  # noqa: F401 (re-exported for workers)

SEED = 3
HIDDEN = (16,)


def make_model(hidden=HIDDEN) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    return build_model("mlp", (8, 8, 1), 10, hidden)


def make_inner_optimizer(name: str = "sgd") -> keras.optimizers.Optimizer:
    if name == "adam":
        return keras.optimizers.Adam(1e-2)
    if name == "rmsprop":  # no fused kernel
        return keras.optimizers.RMSprop(1e-3, momentum=0.5)
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
        if zero_stage == 3:
            model = tfdist.zero.ShardedModel(model)
        offload = wrapper_kwargs.pop("offload", None)
        if zero_stage:
            opt = tfdist.ZeroOptimizer(make_inner_optimizer(optimizer), stage=zero_stage,
                                     accumulation_steps=accumulation_steps, offload=offload,
                                     **wrapper_kwargs)
        else:
            opt = tfdist.DistributedOptimizer(make_inner_optimizer(optimizer),
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
    zero_stage = wrapper_kwargs.pop("zero_stage", 0)
    offload = wrapper_kwargs.pop("offload", None)
    with strategy.scope():
        model = make_model(hidden)
        if zero_stage == 3:
            model = tfdist.zero.ShardedModel(model)
        opt = make_inner_optimizer(optimizer)
        if zero_stage:
            opt = tfdist.ZeroOptimizer(opt, stage=zero_stage, offload=offload,
                                       accumulation_steps=accumulation_steps, **wrapper_kwargs)
        elif wrap:
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


def make_pipelined_model(kind: str, devices: list[str], schedule: str = "gpipe") -> keras.Model:
    """The digits MLP cut into two stages: as a `Pipeline` layer in a Sequential ("layer") or as
    a `PipelineModel` with the loss on the last stage ("model")."""
    from tfdist.pipeline import Pipeline, PipelineModel

    keras.utils.set_random_seed(SEED)
    stages = [[keras.layers.Flatten(), keras.layers.Dense(64, activation="relu")],
              [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]]
    pipe = Pipeline(stages, devices=devices, num_microbatches=4, schedule=schedule)
    if kind == "model":
        return PipelineModel(pipe, input_shape=(8, 8, 1))
    return keras.Sequential([keras.Input((8, 8, 1)), pipe])


def train_pipelined(engine: str, kind: str, steps: int, global_batch: int,
                    schedule: str = "gpipe") -> keras.Model:
    """Trains the pipelined digits MLP over 2 devices: on one process with the global batch
    ("local"), or one pipeline per Horovod rank, each on its slice of the global batch."""
    from tfdist.devices import place_slots

    x, y = load_digits()
    model = make_pipelined_model(kind, cpu_devices(2), schedule)
    optimizer = place_slots(make_inner_optimizer("sgd"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    callbacks = []
    data = global_batches(x, y, global_batch, shuffle=False)
    if engine == "horovod":
        import tfdist.horovod as thvd

        thvd.init()
        optimizer = thvd.DistributedOptimizer(optimizer)
        data = shard_batches(data, thvd.rank(), thvd.size())
        callbacks = [thvd.callbacks.BroadcastGlobalVariables(0)]
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
    return model
