"""Every built-in compressor, by name: importing a compressor's module registers it (its class
carries `@register(name)`); this module imports each one `tfdist.compression.BUILT_IN` lists.

    get("topk", ratio=0.01); get({"name": "powersgd", "rank": 2})
    get({"name": "topk", "ratio": 0.01, "error_feedback": True})
"""

import importlib

from tfdist.compression.base import COMPRESSORS, get, register, serialize
from tfdist.compression.names import BUILT_IN

for _module in sorted(set(BUILT_IN.values())):
    importlib.import_module(f"tfdist.compression.{_module}")

__all__ = ["COMPRESSORS", "get", "register", "serialize"]
