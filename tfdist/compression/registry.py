"""Compressors by name, for configs: `get("topk", ratio=0.01)`, `get({"name": "powersgd",
"rank": 2})`, `get({"name": "topk", "ratio": 0.01, "error_feedback": true})`."""

from __future__ import annotations

from typing import Any

from tfdist.compression.adaptive import Adaptive
from tfdist.compression.base import Compressor, Identity
from tfdist.compression.dgc import DGC
from tfdist.compression.error_feedback import ErrorFeedback
from tfdist.compression.fp16 import BF16, FP16
from tfdist.compression.powersgd import PowerSGD
from tfdist.compression.qsgd import NUQSGD, QSGD
from tfdist.compression.randomk import RandomK
from tfdist.compression.sign import OneBit, SignSGD
from tfdist.compression.terngrad import TernGrad
from tfdist.compression.threshold import Threshold
from tfdist.compression.topk import TopK

COMPRESSORS: dict[str, type[Compressor]] = {
    "none": Identity, "fp16": FP16, "bf16": BF16, "topk": TopK, "randomk": RandomK,
    "threshold": Threshold, "dgc": DGC, "qsgd": QSGD, "nuqsgd": NUQSGD, "terngrad": TernGrad,
    "signsgd": SignSGD, "onebit": OneBit, "powersgd": PowerSGD,
}
_NAMES = {cls: name for name, cls in COMPRESSORS.items()}


def get(spec: str | dict[str, Any] | Compressor | None, **kwargs) -> Compressor | None:
    """A compressor from a name (+ keyword arguments), a config dict, or an instance."""
    if spec is None or isinstance(spec, Compressor):
        return spec
    if isinstance(spec, dict):
        spec = dict(spec)
        name = spec.pop("name", None)
        if name == "error_feedback":
            return ErrorFeedback(_required(get(spec.pop("inner"))))
        if name == "adaptive":
            return Adaptive(_required(get(spec.pop("low"))), _required(get(spec.pop("high"))))
        ef = spec.pop("error_feedback", False)
        compressor = get(name, **spec, **kwargs)
        return ErrorFeedback(_required(compressor)) if ef else compressor
    if not isinstance(spec, str) or spec.lower() not in COMPRESSORS:
        raise ValueError(f"Unknown compressor {spec!r}; choose one of {sorted(COMPRESSORS)} "
                         "(or 'error_feedback' with 'inner', or 'adaptive' with 'low' and 'high').")
    try:
        return COMPRESSORS[spec.lower()](**kwargs)
    except TypeError as e:
        raise ValueError(f"Bad arguments for compressor {spec!r}: {e}") from e


def _required(compressor: Compressor | None) -> Compressor:
    if compressor is None:
        raise ValueError("Error feedback needs an inner compressor; received none.")
    return compressor


def serialize(compressor: Compressor | None) -> dict[str, Any] | None:
    if compressor is None:
        return None
    if isinstance(compressor, ErrorFeedback):
        return {"name": "error_feedback", **compressor.get_config()}
    if isinstance(compressor, Adaptive):
        return {"name": "adaptive", **compressor.get_config()}
    return {"name": _NAMES[type(compressor)], **compressor.get_config()}
