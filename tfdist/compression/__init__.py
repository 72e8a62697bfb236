"""Gradient compressors: pure tensor maths with explicit state, one per module.

Use one with `tfdist.DistributedOptimizer(inner, compressor=...)` (any engine) or
`tfdist.CompressedStrategy(compressor=...)`. A compressor of your own: subclass `Compressor`,
decorate it with `@register("name")` to name it in configs.

The names below load their module on first use, so that `BUILT_IN` (what configs may name) is
known without importing TensorFlow: the `tfdist` command checks a config in well under a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tfdist.compression.names import BUILT_IN

# Public name -> the module that defines it.
_EXPORTS = {
    "Adaptive": "adaptive", "BF16": "fp16", "Compressor": "base", "DGC": "dgc",
    "ErrorFeedback": "error_feedback", "FP16": "fp16", "Identity": "base", "NUQSGD": "qsgd",
    "OneBit": "sign", "PowerSGD": "powersgd", "QSGD": "qsgd", "RandomK": "randomk",
    "SignSGD": "sign", "TernGrad": "terngrad", "Threshold": "threshold", "TopK": "topk",
    "COMPRESSORS": "registry", "get": "registry", "register": "registry",
    "serialize": "registry",
}

__all__ = [
    "Adaptive", "BF16", "BUILT_IN", "COMPRESSORS", "Compressor", "DGC", "ErrorFeedback", "FP16",
    "Identity", "NUQSGD", "OneBit", "PowerSGD", "QSGD", "RandomK", "SignSGD", "TernGrad",
    "Threshold", "TopK", "get", "register", "serialize",
]

if TYPE_CHECKING:
    from tfdist.compression.adaptive import Adaptive
    from tfdist.compression.base import Compressor, Identity
    from tfdist.compression.dgc import DGC
    from tfdist.compression.error_feedback import ErrorFeedback
    from tfdist.compression.fp16 import BF16, FP16
    from tfdist.compression.powersgd import PowerSGD
    from tfdist.compression.qsgd import NUQSGD, QSGD
    from tfdist.compression.randomk import RandomK
    from tfdist.compression.registry import COMPRESSORS, get, register, serialize
    from tfdist.compression.sign import OneBit, SignSGD
    from tfdist.compression.terngrad import TernGrad
    from tfdist.compression.threshold import Threshold
    from tfdist.compression.topk import TopK


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfdist.compression' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tfdist.compression.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
