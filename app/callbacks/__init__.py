"""Callbacks that observe training: throughput, AMP health, stop-at-accuracy, each rank's epoch loss
(:class:`RankEpochLoss`) and the final summary; the random generator states of checkpoints (:class:`RNGState`). The
fault handling (SIGTERM, SLURM preemption, a lost rank) is :mod:`app.resilience`'s, its callbacks listed here with the
others (and importable from here, as configs name them: ``app.callbacks.LostRank``).

Checkpoints are :mod:`app.checkpoint`'s; when the run saves is the ``--checkpoint`` group's :class:`SaveSchedule`
(:mod:`app.callbacks.save_schedule`), the weights' moving average the ``--ema`` group's :class:`EMA` (when a decay is
given). :data:`DEFAULTS` are the callbacks every run gets (the CLI's ``--callbacks.NAME`` switches, configs/base.yaml).
"""

from lightning.pytorch import Callback

from app.callbacks.amp import AMPHealth, NonFiniteLossError
from app.callbacks.ema import EMA
from app.callbacks.lr_monitor import LearningRateMonitor
from app.callbacks.rank_loss import RankEpochLoss
from app.callbacks.rng import RNGState
from app.callbacks.save_schedule import SaveSchedule
from app.callbacks.stop_at_accuracy import StopAtAccuracy
from app.callbacks.stragglers import Stragglers
from app.callbacks.summary import TrainingSummary
from app.callbacks.throughput import Throughput
from app.resilience.lost_rank import LostRank
from app.resilience.preemption import SLURMRequeue
from app.resilience.sigterm import SIGTERMCheckpoint

# name of the --callbacks.NAME switch -> the callback, in the order the Trainer calls them
DEFAULTS: dict[str, type[Callback]] = {
    "lr_monitor": LearningRateMonitor,
    "amp_health": AMPHealth,
    "throughput": Throughput,
    "summary": TrainingSummary,
    "stragglers": Stragglers,
    "slurm_requeue": SLURMRequeue,
    "rng_state": RNGState,
    "sigterm": SIGTERMCheckpoint,
    "lost_rank": LostRank,
}

__all__ = [
    "DEFAULTS",
    "AMPHealth",
    "EMA",
    "LearningRateMonitor",
    "LostRank",
    "NonFiniteLossError",
    "RankEpochLoss",
    "RNGState",
    "SIGTERMCheckpoint",
    "SLURMRequeue",
    "SaveSchedule",
    "StopAtAccuracy",
    "Stragglers",
    "Throughput",
    "TrainingSummary",
]
