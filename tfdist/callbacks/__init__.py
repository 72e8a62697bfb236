"""Keras callbacks that tune distributed training during `fit`."""

from tfdist.callbacks.comm_stats import CommunicationStats, StepTimer
from tfdist.callbacks.lr_warmup import LearningRateWarmup, warmup_learning_rate

__all__ = ["CommunicationStats", "LearningRateWarmup", "StepTimer", "warmup_learning_rate"]
