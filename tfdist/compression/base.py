"""The compressor protocol: pure tensor maths with explicit state.

A compressor turns one gradient tensor into a payload of (small) tensors and back:

    state = compressor.init_state(shape, dtype)           # dict of initial tensors
    payload, ctx, state = compressor.compress(x, state, step)
    x_hat = compressor.decompress(payload, ctx)

`ctx` holds only what every worker computes alike (shape, dtype, k, shared random indices);
anything that depends on a worker's data travels in the payload. `step` (the exchange count) and
`rank` seed stochastic compressors statelessly, so a resumed run draws the same numbers.

A compressor is either *summable* (payloads of different workers may be added element-wise, so
they go through all-reduce: FP16, random-k with a shared seed, PowerSGD) or not (top-k, QSGD,
sign...: payloads are all-gathered and each worker's is decompressed). `encode` states that
routing for every compressed tensor of one exchange at once, as rounds of communication
(`tfdist.comm.Sum`, `Gather`) that the transport carries (`tfdist.comm.reduce_encoded`: all
payloads in one fused all-reduce, or one fused all-gather), so an exchange costs one collective
call rather than one per tensor. A compressor never sees a communicator. Multi-round schemes
(PowerSGD) override `encode`.
Keras-facing code turns the state into variables, so strategies place it and checkpoints carry it.

Names: each compressor class registers under a name (`@register("topk")`) for configs, or is
named by its import path (`"my_codecs:Mine"`, `tfdist.registry`);
`get({"name": "topk", "ratio": 0.01})` builds one and `serialize(c)` writes its config.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfdist.comm.transport import Gather, Rounds, Sum
from tfdist.registry import Registry

Payload = tuple[tf.Tensor, ...]
State = dict[str, tf.Tensor]


def xla(fn):
    """`fn` (tensors and Python constants in, tensors out) compiled by XLA, its element-wise ops
    fused into a few kernels: bit packing and stochastic rounding run 2-4x faster on CPU
    (`tfdist bench --suite compressors`). Python arguments are constants of the compilation."""
    return tf.function(fn, jit_compile=True, autograph=False, reduce_retracing=False)


def stateless_seed(*parts) -> tf.Tensor:
    """A [2] int64 seed for tf.random.stateless_* from integers / scalar tensors."""
    mixed = tf.constant(0, tf.int64)
    for p in parts:
        mixed = mixed * 1_000_003 + tf.cast(p, tf.int64)
    return tf.stack([mixed, tf.cast(parts[-1], tf.int64) if parts else mixed])


class Compressor(abc.ABC):
    """Base class; subclasses implement `compress` and `decompress` (and may override the rest).

    Class attributes:
        summable: payloads may be summed by an all-reduce.
        unbiased: E[decompress(compress(x))] == x.
        keeps_nonfinite: an inf or NaN anywhere in one worker's input always makes the reduced
            output non-finite (casts, products). False where selection may drop it (top-k,
            DGC, random-k...): the exchange then sends each worker's finiteness alongside.

    Example:
        ```python
        class Bfloat16(tfdist.compression.Compressor):
            summable = True  # payloads may be added: one all-reduce carries every worker's
            keeps_nonfinite = True

            def compress(self, x, state, step, rank=0):
                return (tf.cast(x, tf.bfloat16),), x.dtype, state

            def decompress(self, payload, ctx):
                return tf.cast(payload[0], ctx)


        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=tfdist.DistributedOptimizer(
                keras.optimizers.SGD(0.1), compressor=Bfloat16(), min_compress_size=256),
                loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1)
        ```
    """

    summable: bool = False
    unbiased: bool = False
    keeps_nonfinite: bool = False
    registry_name: str = ""  # set by @register

    def applies_to(self, shape: tf.TensorShape) -> bool:
        """Whether compressing a tensor of this shape pays off (else it is sent dense)."""
        return True

    def init_state(self, shape: tf.TensorShape, dtype: tf.DType, seed: int = 0) -> State:
        """Initial state for one tensor; `seed` differs per tensor, not per worker."""
        return {}

    @abc.abstractmethod
    def compress(self, x: tf.Tensor, state: State, step: tf.Tensor,
                 rank=0) -> tuple[Payload, Any, State]:
        """Returns (payload, ctx, new state)."""

    @abc.abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> tf.Tensor:
        """Rebuilds a tensor of the original shape and dtype from one worker's payload."""

    def decompress_sum(self, payloads: Sequence[Payload], ctx: Any) -> tf.Tensor:
        """The sum of every worker's decompressed payload (all-gathered compressors).
        Sparsifiers override it with one scatter of all workers' elements."""
        return tf.add_n([self.decompress(payload, ctx) for payload in payloads])

    def residual(self, x: tf.Tensor, payload: Payload, ctx: Any) -> tf.Tensor:
        """What of `x` its payload does not carry, `x - decompress(payload, ctx)` (error
        feedback's memory). Sparsifiers override it with an update of the few sent elements."""
        return x - self.decompress(payload, ctx)

    def encode(self, xs: Sequence[tf.Tensor], states: Sequence[State], step: tf.Tensor,
               rank=0) -> Rounds:
        """This worker's side of one exchange of the tensors `xs`: a generator that yields the
        rounds of communication it needs (`tfdist.comm.Sum`, `Gather`, `Choice`), receives each
        round's result from the transport (`tfdist.comm.run_rounds`), and returns (sums, new
        states): the sum over workers of each tensor, as decompressed, and its new state.

        By default, one round: summable payloads summed, the others gathered (each worker's
        payload decompressed and summed). Multi-round codecs (PowerSGD) override it.
        """
        compressed = [self.compress(x, s, step, rank) for x, s in zip(xs, states)]
        flat = [t for payload, _, _ in compressed for t in payload]
        if self.summable:
            reduced = iter((yield Sum(flat)))
            totals = [self.decompress(tuple(next(reduced) for _ in payload), ctx)
                      for payload, ctx, _ in compressed]
        else:
            gathered = iter((yield Gather(flat)))  # each: [n, *payload tensor shape]
            totals = []
            for payload, ctx, _ in compressed:
                mine = [next(gathered) for _ in payload]
                n = int(mine[0].shape[0]) if mine else 0
                totals.append(self.decompress_sum([tuple(g[w] for g in mine) for w in range(n)],
                                                  ctx))
        return totals, [new for _, _, new in compressed]

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Compressor:
        try:
            return cls(**config)
        except TypeError as e:
            raise ValueError(f"Bad arguments for compressor {cls.registry_name!r}: {e}") from None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


COMPRESSORS: Registry[Compressor] = Registry("compressor", Compressor)  # type: ignore[type-abstract]


def register(name: str):
    """Class decorator: makes a compressor known to configs under `name` (`tfdist.registry`;
    a compressor can also be named by its import path, `module.path:Class`).

    Example:
        ```python
        @tfdist.compression.register("half_mine")
        class Half(tfdist.compression.Compressor):
            summable = True

            def compress(self, x, state, step, rank=0):
                return (tf.cast(x, tf.float16),), x.dtype, state

            def decompress(self, payload, ctx):
                return tf.cast(payload[0], ctx)


        assert isinstance(tfdist.compression.get("half_mine"), Half)
        ```
    """
    return COMPRESSORS.register(name)


def get(spec: str | dict[str, Any] | Compressor | None, **kwargs) -> Compressor | None:
    """A compressor from a name (+ keyword arguments), a config dict, an instance, or None.

    A config is {"name": ..., **arguments}, optionally with "error_feedback": true, e.g.
    `get({"name": "topk", "ratio": 0.01, "error_feedback": True})`.

    Example:
        ```python
        codec = tfdist.compression.get({"name": "topk", "ratio": 0.01, "error_feedback": True})
        assert isinstance(codec, tfdist.compression.ErrorFeedback)
        assert tfdist.compression.get("powersgd", rank=2).rank == 2
        ```
    """
    if spec is None or isinstance(spec, Compressor):
        if kwargs:
            raise ValueError(f"Arguments {sorted(kwargs)} need a compressor name, not {spec!r}.")
        return spec
    if isinstance(spec, dict):
        spec = dict(spec)
        if "name" not in spec:
            raise ValueError(f"A compressor config needs a 'name', one of {sorted(COMPRESSORS)} "
                             f"or 'module.path:Class'. Received: {spec!r}")
        name = spec.pop("name")
        error_feedback = spec.pop("error_feedback", False)
        compressor = get(name, **spec, **kwargs)
        if not error_feedback:
            return compressor
        return COMPRESSORS["error_feedback"].from_config({"inner": serialize(compressor)})
    return COMPRESSORS.lookup(spec).from_config(kwargs)


def serialize(compressor: Compressor | None) -> dict[str, Any] | None:
    """The config `get` builds `compressor` from (None for None).

    Example:
        ```python
        config = tfdist.compression.serialize(tfdist.compression.TopK(0.01))
        assert config == {"name": "topk", "ratio": 0.01}
        assert tfdist.compression.get(config).ratio == 0.01
        ```
    """
    if compressor is None:
        return None
    name = COMPRESSORS.name_for(type(compressor))
    if name is None:
        raise ValueError(f"{type(compressor).__name__} is defined inside a function or a class: "
                         "define it at a module's top level, or decorate it with "
                         "@tfdist.compression.register(name), to save it in a config.")
    return {"name": name, **compressor.get_config()}


@register("none")
class Identity(Compressor):
    """No compression: the dense tensor is the payload (summable).

    Example:
        ```python
        codec = tfdist.compression.Identity()
        gradient = tf.random.normal([64, 100])
        payload, ctx, _ = codec.compress(gradient, codec.init_state(gradient.shape, gradient.dtype), step=0)
        approx = codec.decompress(payload, ctx)  # the dense tensor itself
        assert bool(tf.reduce_all(approx == gradient))
        ```
    """

    summable = True
    keeps_nonfinite = True
    unbiased = True

    def compress(self, x, state, step, rank=0):
        return (x,), None, state

    def decompress(self, payload, ctx):
        return payload[0]
