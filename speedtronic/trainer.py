"""The 2.0 import path; the code lives in ``speedtronic.engine.trainer``."""

from speedtronic.compat.coordinator import SyncCoordinator as SyncCoordinator
from speedtronic.engine.result import TrainResult as TrainResult
from speedtronic.engine.trainer import LRScheduler as LRScheduler
from speedtronic.engine.trainer import SpeedtronicTrainer as SpeedtronicTrainer
from speedtronic.engine.trainer import Trainer as Trainer
from speedtronic.engine.trainer import TrainingEngine as TrainingEngine
from speedtronic.state.training_state import TrainingStateError as TrainingStateError

__all__ = [
    "LRScheduler",
    "SpeedtronicTrainer",
    "SyncCoordinator",
    "TrainResult",
    "Trainer",
    "TrainingEngine",
    "TrainingStateError",
]
