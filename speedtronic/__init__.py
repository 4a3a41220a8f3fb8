"""speedtronic: an event-driven PyTorch training framework with typed callbacks.

Public names are imported lazily so that ``import speedtronic`` stays cheap for tools
(``speedtronic validate`` / ``schema``) that do not train. Every name in ``__all__`` is
declared for type checkers under ``TYPE_CHECKING`` with the same type it has at run time, in
any import order: no public name is also the name of a submodule (a submodule, once imported,
would replace the package attribute -- hence ``speedtronic.model_registry`` holds the
``registry`` instance). ``tests/test_static_types.py`` checks this.
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
    "TrainerView": "speedtronic.view",
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
    "RunConfig": "speedtronic.config",
    "ModelConfig": "speedtronic.config",
    "DataConfig": "speedtronic.config",
    "OptimizerConfig": "speedtronic.config",
    "SchedulerConfig": "speedtronic.config",
    "PrecisionConfig": "speedtronic.config",
    "CheckpointConfig": "speedtronic.compat.checkpoint_config",
    "LoggingConfig": "speedtronic.config",
    "DistributedConfig": "speedtronic.config",
    "ParallelConfig": "speedtronic.config",
    "ShapeValidationConfig": "speedtronic.config",
    # plugins and registries
    "PluginContext": "speedtronic.plugins",
    "PluginError": "speedtronic.plugins",
    "register_callback": "speedtronic.plugins",
    "callback_registry": "speedtronic.plugins",
    "ModelRegistry": "speedtronic.model_registry",
    "register_model": "speedtronic.model_registry",
    "build_model": "speedtronic.model_registry",
    "registry": "speedtronic.model_registry",
    "register_dataset": "speedtronic.data",
    "build_dataloader": "speedtronic.data",
    # model
    "GPT": "speedtronic.model",
    "GPTConfig": "speedtronic.model",
    "ReferenceTransformer": "speedtronic.model",
    # precision
    "PrecisionPlan": "speedtronic.precision",
    # reproducibility
    "seed_everything": "speedtronic.rng",
    # utilities of the original API
    "set_gradient_checkpointing": "speedtronic.module_utils",
    "CheckpointManager": "speedtronic.checkpoint",
    "MetricLogger": "speedtronic.profiling",
    "WandbHook": "speedtronic.integrations",
    "TensorboardHook": "speedtronic.integrations",
    # 2.0's optimizers, out-of-order backprop and shape checks
    "CautiousOptimizer": "speedtronic.optimizers",
    "HybridOptimizer": "speedtronic.optimizers",
    "Muon": "speedtronic.optimizers",
    "ParameterRouting": "speedtronic.optimizers",
    "newton_schulz": "speedtronic.optimizers",
    "post_polar_normalize": "speedtronic.optimizers",
    "route_parameters": "speedtronic.optimizers",
    "StageInfo": "speedtronic.stage_streams",
    "StageStreamScheduler": "speedtronic.stage_streams",
    "ShapeProfile": "speedtronic.shapes",
    "ShapeReport": "speedtronic.shapes",
    "ShapeWarning": "speedtronic.shapes",
    "resolve_shape_profile": "speedtronic.shapes",
    "validate_startup_shapes": "speedtronic.shapes",
}

# Original names whose implementation is a plugin: resolved through the plugin's entry point
# at first use, so the engine never imports ``speedtronic_callbacks`` itself at run time
# (the static declaration below names the class, for type checkers only).
_PLUGIN_EXPORTS: dict[str, str] = {"HubClient": "diloco", "DumbDiLoCoCoordinator": "diloco"}

__all__ = ["__version__", *_EXPORTS, *_PLUGIN_EXPORTS]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _PLUGIN_EXPORTS:
        from speedtronic.compat.plugin_exports import plugin_attribute

        value = plugin_attribute(_PLUGIN_EXPORTS[name], name, "speedtronic")
    else:
        raise AttributeError(f"module 'speedtronic' has no attribute {name!r}")
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from speedtronic.callback import Callback as Callback
    from speedtronic.checkpoint import CheckpointManager as CheckpointManager
    from speedtronic.compat.checkpoint_config import CheckpointConfig as CheckpointConfig
    from speedtronic.config import Config as Config
    from speedtronic.config import ConfigError as ConfigError
    from speedtronic.config import DataConfig as DataConfig
    from speedtronic.config import DistributedConfig as DistributedConfig
    from speedtronic.config import LoggingConfig as LoggingConfig
    from speedtronic.config import ModelConfig as ModelConfig
    from speedtronic.config import OptimizerConfig as OptimizerConfig
    from speedtronic.config import ParallelConfig as ParallelConfig
    from speedtronic.config import PrecisionConfig as PrecisionConfig
    from speedtronic.config import RunConfig as RunConfig
    from speedtronic.config import SchedulerConfig as SchedulerConfig
    from speedtronic.config import ShapeValidationConfig as ShapeValidationConfig
    from speedtronic.config import SpeedtronicConfig as SpeedtronicConfig
    from speedtronic.config import load_config as load_config
    from speedtronic.config import load_yaml_config as load_yaml_config
    from speedtronic.coordinator import SyncCoordinator as SyncCoordinator
    from speedtronic.data import build_dataloader as build_dataloader
    from speedtronic.data import register_dataset as register_dataset
    from speedtronic.dispatch import CallbackPlan as CallbackPlan
    from speedtronic.dispatch import CallbackWarning as CallbackWarning
    from speedtronic.events import Event as Event
    from speedtronic.integrations import TensorboardHook as TensorboardHook
    from speedtronic.integrations import WandbHook as WandbHook
    from speedtronic.metrics import MetricRecord as MetricRecord
    from speedtronic.model import GPT as GPT
    from speedtronic.model import GPTConfig as GPTConfig
    from speedtronic.model import ReferenceTransformer as ReferenceTransformer
    from speedtronic.model_registry import ModelRegistry as ModelRegistry
    from speedtronic.model_registry import build_model as build_model
    from speedtronic.model_registry import register_model as register_model
    from speedtronic.model_registry import registry as registry
    from speedtronic.module_utils import set_gradient_checkpointing as set_gradient_checkpointing
    from speedtronic.optimizers import CautiousOptimizer as CautiousOptimizer
    from speedtronic.optimizers import HybridOptimizer as HybridOptimizer
    from speedtronic.optimizers import Muon as Muon
    from speedtronic.optimizers import ParameterRouting as ParameterRouting
    from speedtronic.optimizers import newton_schulz as newton_schulz
    from speedtronic.optimizers import post_polar_normalize as post_polar_normalize
    from speedtronic.optimizers import route_parameters as route_parameters
    from speedtronic.plugins import PluginContext as PluginContext
    from speedtronic.plugins import PluginError as PluginError
    from speedtronic.plugins import callback_registry as callback_registry
    from speedtronic.plugins import register_callback as register_callback
    from speedtronic.precision import PrecisionPlan as PrecisionPlan
    from speedtronic.profiling import MetricLogger as MetricLogger
    from speedtronic.result import TrainResult as TrainResult
    from speedtronic.rng import seed_everything as seed_everything
    from speedtronic.runtime import build_callbacks as build_callbacks
    from speedtronic.runtime import build_runtime as build_runtime
    from speedtronic.runtime import train_from_config as train_from_config
    from speedtronic.shapes import ShapeProfile as ShapeProfile
    from speedtronic.shapes import ShapeReport as ShapeReport
    from speedtronic.shapes import ShapeWarning as ShapeWarning
    from speedtronic.shapes import resolve_shape_profile as resolve_shape_profile
    from speedtronic.shapes import validate_startup_shapes as validate_startup_shapes
    from speedtronic.stage_streams import StageInfo as StageInfo
    from speedtronic.stage_streams import StageStreamScheduler as StageStreamScheduler
    from speedtronic.trainer import SpeedtronicTrainer as SpeedtronicTrainer
    from speedtronic.trainer import Trainer as Trainer
    from speedtronic.trainer import TrainingEngine as TrainingEngine
    from speedtronic.trainer import TrainingStateError as TrainingStateError
    from speedtronic.view import TrainerView as TrainerView
    from speedtronic_callbacks.diloco import DumbDiLoCoCoordinator as DumbDiLoCoCoordinator
    from speedtronic_callbacks.diloco import HubClient as HubClient
