"""speedtronic: an event-driven PyTorch training framework with typed callbacks.

``__all__`` is the modern API (docs/architecture.md); the names the package gave before
(2.0's) still resolve, from ``speedtronic.compat.exports``, loaded only when one is asked for.
Public names are imported lazily so that ``import speedtronic`` stays cheap for tools
(``speedtronic validate`` / ``schema``) that do not train. Every name in ``__all__`` and
every kept name is declared for type checkers under ``TYPE_CHECKING`` with the same type it
has at run time, in any import order: no public name is also the name of a submodule (a
submodule, once imported, would replace the package attribute -- hence
``speedtronic.models.registry`` holds the ``registry`` instance).
``tests/test_static_types.py`` checks this. ``speedtronic.Trainer`` is the engine's Trainer;
the root installs the loader through which it reaches 2.0's constructor arguments and members
(``speedtronic.engine.compat_route``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from speedtronic._version import __version__ as __version__
from speedtronic.engine import compat_route

_EXPORTS: dict[str, str] = {
    # events and callbacks
    "Event": "speedtronic.engine.events",
    "Callback": "speedtronic.engine.callback",
    "CallbackPlan": "speedtronic.engine.dispatch",
    "TrainerView": "speedtronic.engine.view",
    "MetricRecord": "speedtronic.engine.metrics",
    "TrainResult": "speedtronic.engine.result",
    # training
    "Trainer": "speedtronic.engine.trainer",
    "TrainingStateError": "speedtronic.engine.trainer",
    "build_runtime": "speedtronic.runtime",
    "train_from_config": "speedtronic.runtime",
    "seed_everything": "speedtronic.state.rng",
    # config
    "SpeedtronicConfig": "speedtronic.config",
    "ConfigError": "speedtronic.config",
    "load_config": "speedtronic.config",
    # plugins and registries
    "PluginContext": "speedtronic.plugins",
    "PluginError": "speedtronic.plugins",
    "register_callback": "speedtronic.plugins",
    "register_model": "speedtronic.models.registry",
    "build_model": "speedtronic.models.registry",
    "register_dataset": "speedtronic.data",
    "build_dataloader": "speedtronic.data",
}
"""The front door: the modern API. Every other name ``speedtronic`` gave before (2.0's config
classes, optimizers, hooks, ...) still resolves, through ``speedtronic.compat.exports``."""

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    else:
        # The 2.0 facade beside the front door: loaded only when such a name is asked for.
        exports = importlib.import_module("speedtronic.compat.exports")
        value = exports.kept_attribute(name, "speedtronic")
    globals()[name] = value
    return value


def _v2_layer() -> compat_route.V2Layer:
    """The 2.0 layer's part the Trainer asks for (2.0's arguments and members), loaded now."""
    layer: compat_route.V2Layer = importlib.import_module("speedtronic.compat.trainer").V2_LAYER
    return layer


# The engine's Trainer reaches 2.0's arguments and members only through this loader: the
# engine never imports the 2.0 layer, and a run that uses none of 2.0 never loads it.
compat_route.install(_v2_layer)


if TYPE_CHECKING:
    from speedtronic.compat.checkpoint_config import CheckpointConfig as CheckpointConfig
    from speedtronic.compat.coordinator import SyncCoordinator as SyncCoordinator
    from speedtronic.compat.trainer import SpeedtronicTrainer as SpeedtronicTrainer
    from speedtronic.compat.trainer import TrainingEngine as TrainingEngine
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
    from speedtronic.data import build_dataloader as build_dataloader
    from speedtronic.data import register_dataset as register_dataset
    from speedtronic.engine.callback import Callback as Callback
    from speedtronic.engine.dispatch import CallbackPlan as CallbackPlan
    from speedtronic.engine.dispatch import CallbackWarning as CallbackWarning
    from speedtronic.engine.events import Event as Event
    from speedtronic.engine.metrics import MetricRecord as MetricRecord
    from speedtronic.engine.result import TrainResult as TrainResult
    from speedtronic.engine.trainer import Trainer as Trainer
    from speedtronic.engine.trainer import TrainingStateError as TrainingStateError
    from speedtronic.engine.view import TrainerView as TrainerView
    from speedtronic.integrations import TensorboardHook as TensorboardHook
    from speedtronic.integrations import WandbHook as WandbHook
    from speedtronic.models.registry import ModelRegistry as ModelRegistry
    from speedtronic.models.registry import build_model as build_model
    from speedtronic.models.registry import register_model as register_model
    from speedtronic.models.registry import registry as registry
    from speedtronic.models.transformer import GPT as GPT
    from speedtronic.models.transformer import GPTConfig as GPTConfig
    from speedtronic.models.transformer import ReferenceTransformer as ReferenceTransformer
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
    from speedtronic.profiling import MetricLogger as MetricLogger
    from speedtronic.runtime import build_callbacks as build_callbacks
    from speedtronic.runtime import build_runtime as build_runtime
    from speedtronic.runtime import train_from_config as train_from_config
    from speedtronic.state.checkpoint import CheckpointManager as CheckpointManager
    from speedtronic.state.rng import seed_everything as seed_everything
    from speedtronic.systems.precision import PrecisionPlan as PrecisionPlan
    from speedtronic.systems.shapes import ShapeProfile as ShapeProfile
    from speedtronic.systems.shapes import ShapeReport as ShapeReport
    from speedtronic.systems.shapes import ShapeWarning as ShapeWarning
    from speedtronic.systems.shapes import resolve_shape_profile as resolve_shape_profile
    from speedtronic.systems.shapes import validate_startup_shapes as validate_startup_shapes
    from speedtronic.systems.stage_streams import StageInfo as StageInfo
    from speedtronic.systems.stage_streams import StageStreamScheduler as StageStreamScheduler
    from speedtronic_callbacks.diloco import DumbDiLoCoCoordinator as DumbDiLoCoCoordinator
    from speedtronic_callbacks.diloco import HubClient as HubClient
