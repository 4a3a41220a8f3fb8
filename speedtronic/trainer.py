"""The 2.0 import path; the code lives in ``speedtronic.compat.trainer`` (the public
``Trainer``) and ``speedtronic.engine.trainer`` (the engine's Trainer it builds)."""

from speedtronic.compat.coordinator import SyncCoordinator as SyncCoordinator
from speedtronic.compat.trainer import LRScheduler as LRScheduler
from speedtronic.compat.trainer import SpeedtronicTrainer as SpeedtronicTrainer
from speedtronic.compat.trainer import Trainer as Trainer
from speedtronic.compat.trainer import TrainingEngine as TrainingEngine
from speedtronic.engine.result import TrainResult as TrainResult
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
