"""tf.distribute.Strategy subclasses (the tf.distribute engine)."""

from tfdist.strategies.compressed import CompressedStrategy, MultiWorkerCompressedStrategy
from tfdist.strategies.local_sgd import LocalSGDStrategy, MultiWorkerLocalSGDStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy

__all__ = [
    "CompressedStrategy",
    "LocalSGDStrategy",
    "MultiWorkerLocalSGDStrategy",
    "MultiWorkerCompressedStrategy",
    "MultiWorkerMirroredStrategy",
]
