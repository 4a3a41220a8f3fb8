"""speedtronic: an event-driven PyTorch training framework with typed callbacks.

Public names are imported lazily so that ``import speedtronic`` stays cheap for tools
(``speedtronic validate`` / ``schema``) that do not train.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "3.0.0"

_EXPORTS: dict[str, str] = {
    # events and callbacks
    "Event": "speedtronic.events",
    "Callback": "speedtronic.callback",
    "CallbackPlan": "speedtronic.dispatch",
    "CallbackWarning": "speedtronic.dispatch",
    "MetricRecord": "speedtronic.metrics",
    "TrainResult": "speedtronic.result",
    "SyncCoordinator": "speedtronic.coordinator",
    # trainer and runtime
    "Trainer": "speedtronic.trainer",
    "TrainingEngine": "speedtronic.trainer",
    "SpeedtronicTrainer": "speedtronic.trainer",
    "TrainingStateError": "speedtronic.trainer",
    "build_runtime": "speedtronic.runtime",
    "train_from_config": "speedtronic.runtime",
    "build_callbacks": "speedtronic.runtime",
    # config
    "SpeedtronicConfig": "speedtronic.config",
    "Config": "speedtronic.config",
    "ConfigError": "speedtronic.config",
    "load_config": "speedtronic.config",
    "load_yaml_config": "speedtronic.config",
    # plugins and registries
    "PluginContext": "speedtronic.plugins",
    "PluginError": "speedtronic.plugins",
    "register_callback": "speedtronic.plugins",
    "callback_registry": "speedtronic.plugins",
    "ModelRegistry": "speedtronic.registry",
    "register_model": "speedtronic.registry",
    "build_model": "speedtronic.registry",
    "registry": "speedtronic.registry",
    "register_dataset": "speedtronic.data",
    "build_dataloader": "speedtronic.data",
    # model
    "GPT": "speedtronic.model",
    "GPTConfig": "speedtronic.model",
    "ReferenceTransformer": "speedtronic.model",
    # precision
    "PrecisionPlan": "speedtronic.precision",
    # utilities of the original API
    "set_gradient_checkpointing": "speedtronic.module_utils",
    "CheckpointManager": "speedtronic.checkpoint",
    "MetricLogger": "speedtronic.profiling",
    "WandbHook": "speedtronic.integrations",
    "TensorboardHook": "speedtronic.integrations",
    "HubClient": "speedtronic.hub",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'speedtronic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from speedtronic.callback import Callback as Callback
    from speedtronic.config import ConfigError as ConfigError
    from speedtronic.config import SpeedtronicConfig as SpeedtronicConfig
    from speedtronic.events import Event as Event
    from speedtronic.metrics import MetricRecord as MetricRecord
    from speedtronic.plugins import PluginContext as PluginContext
    from speedtronic.plugins import register_callback as register_callback
    from speedtronic.registry import register_model as register_model
    from speedtronic.result import TrainResult as TrainResult
    from speedtronic.runtime import build_runtime as build_runtime
    from speedtronic.runtime import train_from_config as train_from_config
    from speedtronic.trainer import Trainer as Trainer
