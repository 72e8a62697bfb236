"""tf.distribute.Strategy subclasses (the tf.distribute engine)."""

from tfdist.strategies._tf_hooks import new_mirrored_strategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy

__all__ = ["MultiWorkerMirroredStrategy", "new_mirrored_strategy"]
