"""The 2.0 import path; the code lives in ``speedtronic.engine.trainer`` (``Trainer``, which is
``speedtronic.Trainer``) and ``speedtronic.compat.trainer`` (2.0's other names for it, and the
2.0 trainer it builds when given 2.0's arguments)."""

from speedtronic.compat.coordinator import SyncCoordinator as SyncCoordinator
from speedtronic.compat.trainer import SpeedtronicTrainer as SpeedtronicTrainer
from speedtronic.compat.trainer import TrainingEngine as TrainingEngine
from speedtronic.engine.result import TrainResult as TrainResult
from speedtronic.engine.trainer import LRScheduler as LRScheduler
from speedtronic.engine.trainer import Trainer as Trainer
from speedtronic.engine.trainer import TrainingStateError as TrainingStateError

__all__ = [
    "LRScheduler",
    "SpeedtronicTrainer",
    "SyncCoordinator",
    "TrainResult",
    "Trainer",
    "TrainingEngine",
    "TrainingStateError",
]
