"""tfdist: distributed training for Keras 3 `model.fit` on TensorFlow 2.21.

Two engines share one algorithm core: the tf.distribute engine (strategies, and the
`DistributedOptimizer` wrapper under any strategy) and the Horovod engine
(`tfdist.horovod`, imported on demand so `import tfdist` works without Horovod).
"""

from tfdist import averaging, callbacks, comm, compression, data, pipeline, zero
from tfdist.optimizers import DistributedOptimizer
from tfdist.optimizers.exchange import GradientExchange
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
    "pipeline",
    "zero",
]
