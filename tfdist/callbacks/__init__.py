"""Keras callbacks that tune distributed training during `fit`."""

from tfdist.callbacks.accordion import Accordion, critical_regimes
from tfdist.callbacks.averaging_period import AveragingPeriodSchedule, adacomm_period
from tfdist.callbacks.backup import (
    PREEMPTED_EXIT,
    BackupAndRestore,
    BackupError,
    BackupMismatch,
)
from tfdist.callbacks.checkpoint import ModelCheckpoint
from tfdist.callbacks.comm_stats import CommunicationStats, StepTimer
from tfdist.callbacks.lr_warmup import LearningRateWarmup, warmup_learning_rate
from tfdist.callbacks.resize import RESIZE_EXIT, ElasticJoin, ElasticResize, throughput_policy
from tfdist.callbacks.scalars import ScalarLog, ScalarWriter
from tfdist.callbacks.start import StartAt
from tfdist.callbacks.timeline import StepTimeline
from tfdist.callbacks.watchdog import WATCHDOG_EXIT, Watchdog

__all__ = [
    "Accordion",
    "AveragingPeriodSchedule",
    "BackupAndRestore",
    "BackupError",
    "BackupMismatch",
    "CommunicationStats",
    "ElasticJoin",
    "ElasticResize",
    "LearningRateWarmup",
    "RESIZE_EXIT",
    "ModelCheckpoint",
    "PREEMPTED_EXIT",
    "ScalarLog",
    "ScalarWriter",
    "StartAt",
    "StepTimeline",
    "StepTimer",
    "WATCHDOG_EXIT",
    "Watchdog",
    "adacomm_period",
    "critical_regimes",
    "throughput_policy",
    "warmup_learning_rate",
]
