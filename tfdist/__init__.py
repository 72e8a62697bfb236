"""tfdist: distributed training for Keras 3 `model.fit` on TensorFlow 2.21.

One algorithm core, handed an engine: the tf.distribute engine (strategies, and the wrappers
under any strategy), the Horovod engine (`tfdist.horovod`, imported on demand so `import tfdist`
works without Horovod), and a world of one. The tools around the library (the `tfdist` command,
configs, benchmarks, the emulated cluster, launchers) live in `tfdist.tools`, which the library
never imports.
"""

from tfdist import averaging, callbacks, comm, compression, data, optimizers, pipeline, tensor_parallel, zero
from tfdist.optimizers import DistributedOptimizer, GradientExchange
from tfdist.strategies import (
    CompressedStrategy,
    LocalSGDStrategy,
    MultiWorkerCompressedStrategy,
    MultiWorkerLocalSGDStrategy,
    MultiWorkerMirroredStrategy,
)
from tfdist.zero import ZeroOptimizer

__version__ = "0.1.0"

__all__ = [
    "CompressedStrategy",
    "DistributedOptimizer",
    "GradientExchange",
    "LocalSGDStrategy",
    "MultiWorkerCompressedStrategy",
    "MultiWorkerLocalSGDStrategy",
    "MultiWorkerMirroredStrategy",
    "ZeroOptimizer",
    "__version__",
    "averaging",
    "callbacks",
    "comm",
    "compression",
    "data",
    "optimizers",
    "pipeline",
    "tensor_parallel",
    "zero",
]
