"""Keras variable and layer internals for ZeRO stage 3 (`tfdist.zero.ShardedModel`).

A Keras 3 variable keeps its backend variable in `_value`; with `_value` None it is an
*uninitialized* variable (what Keras makes inside a `StatelessScope`) and reads outside a
stateless mapping call `_initializer(shape, dtype)`. Stage 3 drops each parameter's storage
that way once its values live in the shards. Which variables a layer owns itself (not through
sublayers) is `_trainable_variables`; a model's layers, nested ones included, come from
`_flatten_layers`. Keras' symbolic shape inference (`compute_output_spec`) runs in a
`SymbolicScope`. A layer runs in the `AutocastScope` its `__call__` opened (mixed precision:
float32 variables read in the compute dtype); a recomputation must run in the same one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import tensorflow as tf
from keras.src.backend import get_autocast_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope


def release_storage(variable, read: Callable) -> None:
    """Drops `variable`'s backend storage: later reads outside a `keras.StatelessScope` that
    maps it return `read(shape, dtype)` (which may raise)."""
    if variable._value is None:
        raise RuntimeError(f"Variable {variable.path} holds no storage already (is the model "
                           "sharded twice?).")
    variable._value = None
    variable._initializer = read


def holds_storage(variable) -> bool:
    return getattr(variable, "_value", None) is not None


def own_trainable_variables(layer) -> list:
    """The trainable variables `layer` created itself (not its sublayers')."""
    return [v for v in layer._trainable_variables if v.trainable]


def nested_layers(model) -> list:
    """Every layer inside `model`, nested ones included, each once, in Keras' order."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def in_shape_inference() -> bool:
    """Whether Keras is inferring output shapes symbolically (no real values flow)."""
    return bool(in_symbolic_scope())


def current_autocast():
    """A context manager that re-enters the autocast scope active now (or does nothing)."""
    scope = get_autocast_scope()
    return contextlib.nullcontext() if scope is None else _Reenter(scope)


class _Reenter:
    def __init__(self, scope):
        self.scope = scope

    def __enter__(self):
        self.scope.__enter__()

    def __exit__(self, *exc):
        return self.scope.__exit__(*exc)


def read_uncast(variable):
    """`variable`'s value in its own dtype, whatever autocast scope is active."""
    return tf.convert_to_tensor(variable._value)
