"""tf.distribute.Strategy subclasses (the tf.distribute engine)."""

from tfdist._hooks.distribute import new_mirrored_strategy
from tfdist.strategies.compressed import CompressedStrategy, MultiWorkerCompressedStrategy
from tfdist.strategies.local_sgd import LocalSGDStrategy, MultiWorkerLocalSGDStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy

__all__ = [
    "CompressedStrategy",
    "LocalSGDStrategy",
    "MultiWorkerLocalSGDStrategy",
    "MultiWorkerCompressedStrategy",
    "MultiWorkerMirroredStrategy",
    "new_mirrored_strategy",
]
