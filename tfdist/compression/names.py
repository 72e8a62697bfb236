"""The built-in compressors' names, known without importing them (or TensorFlow): what a
config may name (`tfdist.tools.config` checks a config in well under a second)."""

# Every built-in compressor: its name in configs -> the module that defines it (importing the
# module registers the class under that name). A new built-in compressor is its module plus one
# line here (and its class's line in `tfdist.compression._EXPORTS`).
BUILT_IN = {
    "adaptive": "adaptive", "bf16": "fp16", "dgc": "dgc", "error_feedback": "error_feedback",
    "fp16": "fp16", "none": "base", "nuqsgd": "qsgd", "onebit": "sign", "powersgd": "powersgd",
    "qsgd": "qsgd", "randomk": "randomk", "signsgd": "sign", "terngrad": "terngrad",
    "threshold": "threshold", "topk": "topk",
}
