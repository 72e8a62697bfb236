"""Every built-in compressor, by name: importing a compressor's module registers it (its class
carries `@register(name)`), so a new compressor is one module plus one import line here.

    get("topk", ratio=0.01); get({"name": "powersgd", "rank": 2})
    get({"name": "topk", "ratio": 0.01, "error_feedback": True})
"""

from tfdist.compression import (  # noqa: F401 (imported to register them)
    adaptive,
    dgc,
    error_feedback,
    fp16,
    powersgd,
    qsgd,
    randomk,
    sign,
    terngrad,
    threshold,
    topk,
)
from tfdist.compression.base import COMPRESSORS, get, register, serialize

__all__ = ["COMPRESSORS", "get", "register", "serialize"]
