"""Every private Keras hook tfdist relies on, in one place (TF's: tfdist/strategies/_tf_hooks.py;
the merge-call query of tfdist/comm/control.py uses TF's semi-private `tf.__internal__`).

Each hook names the private attribute it touches and is covered by tests/test_keras_hooks.py,
which fails loudly if a TensorFlow or Keras upgrade moves it. Pinned: tensorflow 2.21.x,
keras 3.15.x.
"""

from __future__ import annotations

import types
from typing import Any

import tensorflow as tf

# Keras' TF backend all-reduces gradients in TFOptimizer._all_reduce_sum_gradients, called from
# _backend_update_step (keras/src/backend/tensorflow/optimizer.py).
ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"


def disable_gradient_all_reduce(optimizer) -> None:
    """Makes a Keras optimizer apply the gradients it is given without all-reducing them.

    tfdist wrappers reduce gradients themselves (through a Communicator); the inner optimizer
    must not reduce them a second time.
    """
    if not hasattr(type(optimizer), ALL_REDUCE_HOOK):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no `{ALL_REDUCE_HOOK}`: this Keras version is not "
            "supported by tfdist (pin keras 3.15.x)."
        )

    def _identity(self, grads_and_vars):
        return list(grads_and_vars)

    object.__setattr__(optimizer, ALL_REDUCE_HOOK, types.MethodType(_identity, optimizer))
    object.__setattr__(optimizer, SKIP_ATTRIBUTE, True)


# -- strategy-driven exchange -------------------------------------------------------------------
# A tfdist strategy (e.g. CompressedStrategy) exchanges the gradients of the user's own Keras
# optimizer. Keras' TF optimizer gains, once, a `build` that attaches the strategy's
# GradientExchange (its state becomes the optimizer's variables) and an `_backend_update_step`
# that uses it instead of `_all_reduce_sum_gradients`. Optimizers under any other strategy take
# the original code path unchanged.
UPDATE_HOOK = "_backend_update_step"
EXCHANGE_ATTRIBUTE = "_tfdist_exchange"
AVERAGING_ATTRIBUTE = "_tfdist_averaging"  # LocalSGDStrategy's ModelAveraging
SKIP_ATTRIBUTE = "_tfdist_no_exchange"  # set on tfdist wrappers and their inner optimizers
_installed: dict[str, Any] = {}


def _tf_optimizer_class():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def original_update_step():
    """Keras' own `_backend_update_step` (also after `install_strategy_hooks`)."""
    return _installed.get("original_update") or getattr(_tf_optimizer_class(), UPDATE_HOOK)


def install_strategy_hooks() -> None:
    """Idempotently installs the two hooks described above."""
    if _installed:
        return
    import keras

    cls = _tf_optimizer_class()
    if not hasattr(cls, UPDATE_HOOK) or "build" in vars(cls):
        raise RuntimeError(
            "Keras' TF optimizer no longer matches what tfdist hooks (pin keras 3.15.x).")
    original_update = getattr(cls, UPDATE_HOOK)

    def build(self, variables):
        super(cls, self).build(variables)
        make = getattr(self._distribution_strategy, "make_gradient_exchange", None)
        skip = getattr(self, SKIP_ATTRIBUTE, False) or isinstance(
            self, keras.optimizers.LossScaleOptimizer)
        if make is not None and not skip and getattr(self, EXCHANGE_ATTRIBUTE, None) is None:
            exchange = make()
            exchange.build(self, variables)
            object.__setattr__(self, EXCHANGE_ATTRIBUTE, exchange)
            make_averaging = getattr(self._distribution_strategy, "make_model_averaging", None)
            if make_averaging is not None:
                averaging = make_averaging(self)
                averaging.build(self, variables)
                object.__setattr__(self, AVERAGING_ATTRIBUTE, averaging)

    def update_step(self, grads, trainable_variables, learning_rate):
        exchange = getattr(self, EXCHANGE_ATTRIBUTE, None)
        if exchange is None:
            return original_update(self, grads, trainable_variables, learning_rate)
        from tfdist.comm import ReplicaCommunicator

        strategy = self._distribution_strategy
        variables = [v.value if isinstance(v, keras.Variable) else v for v in trainable_variables]

        def apply(reduced):
            tf.__internal__.distribute.interim.maybe_merge_call(
                self._distributed_tf_update_step, strategy,
                [(g, v) for g, v in zip(reduced, variables) if g is not None], learning_rate)

        comm = ReplicaCommunicator(strategy, exchange.counter())
        averaging = getattr(self, AVERAGING_ATTRIBUTE, None)
        if averaging is None:
            exchange.exchange(comm, list(grads), variables, apply, reduce_op="sum")
            return
        averaging.step(
            exchange, comm, list(grads), variables,
            synchronous=lambda full: exchange.exchange(comm, full, variables, apply, "sum"),
            apply_local=apply, local_scale=comm.world_size)

    cls.build = build
    setattr(cls, UPDATE_HOOK, update_step)
    _installed.update(original_update=original_update)
