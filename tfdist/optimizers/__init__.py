"""Keras 3 optimizer wrappers: the one place tfdist meets Keras' optimizer internals."""

from tfdist.optimizers.distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
