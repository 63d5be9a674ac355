"""Callbacks that observe training: throughput, AMP health, stop-at-accuracy, each rank's epoch loss
(:class:`RankEpochLoss`) and the final summary; the random generator states of checkpoints (:class:`RNGState`); the
ranks' agreements (SIGTERM, requeue, lost rank).

Checkpoint I/O lives in :mod:`app.checkpoint`.
"""

from app.callbacks.amp import AMPHealth, NonFiniteLossError
from app.callbacks.lost_rank import LostRank, LostRankError
from app.callbacks.lr_monitor import LearningRateMonitor
from app.callbacks.rank_loss import RankEpochLoss
from app.callbacks.requeue import SLURMRequeue
from app.callbacks.rng import RNGState
from app.callbacks.sigterm import SIGTERMCheckpoint
from app.callbacks.stop_at_accuracy import StopAtAccuracy
from app.callbacks.stragglers import Stragglers
from app.callbacks.summary import TrainingSummary
from app.callbacks.throughput import Throughput

__all__ = [
    "AMPHealth",
    "LearningRateMonitor",
    "LostRank",
    "LostRankError",
    "NonFiniteLossError",
    "RankEpochLoss",
    "RNGState",
    "SIGTERMCheckpoint",
    "SLURMRequeue",
    "StopAtAccuracy",
    "Stragglers",
    "Throughput",
    "TrainingSummary",
]
