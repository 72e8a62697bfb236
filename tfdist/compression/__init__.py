"""Gradient compressors: pure tensor maths with explicit state, one per module.

Use one with `tfdist.DistributedOptimizer(inner, compressor=...)` (any engine) or
`tfdist.CompressedStrategy(compressor=...)`. A compressor of your own: subclass `Compressor`,
decorate it with `@register("name")` to name it in configs.
"""

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

__all__ = [
    "Adaptive", "BF16", "COMPRESSORS", "Compressor", "DGC", "ErrorFeedback", "FP16", "Identity", "NUQSGD",
    "OneBit", "PowerSGD", "QSGD", "RandomK", "SignSGD", "TernGrad", "Threshold", "TopK", "get",
    "register", "serialize",
]
