"""The names ``speedtronic`` exported before its front door was the modern API alone.

``speedtronic.__all__`` lists the modern API; each name below still imports from
``speedtronic`` (``from speedtronic import RunConfig, Muon, MetricLogger``) with the object it
always had, resolved here at first use, so ``import speedtronic`` loads none of it.
``speedtronic/__init__.py`` declares each for type checkers, and
``tests/test_static_types.py`` checks that declaration against the object.
"""

from __future__ import annotations

import importlib

from speedtronic.compat.plugin_exports import plugin_attribute

__all__ = ["kept_attribute", "kept_names"]

_KEPT_EXPORTS: dict[str, str] = {
    "CallbackWarning": "speedtronic.engine.dispatch",
    "SyncCoordinator": "speedtronic.compat.coordinator",
    "TrainingEngine": "speedtronic.compat.trainer",
    "SpeedtronicTrainer": "speedtronic.compat.trainer",
    "build_callbacks": "speedtronic.runtime",
    "Config": "speedtronic.config",
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
    "callback_registry": "speedtronic.plugins",
    "ModelRegistry": "speedtronic.models.registry",
    "registry": "speedtronic.models.registry",
    "GPT": "speedtronic.models.transformer",
    "GPTConfig": "speedtronic.models.transformer",
    "ReferenceTransformer": "speedtronic.models.transformer",
    "PrecisionPlan": "speedtronic.systems.precision",
    "set_gradient_checkpointing": "speedtronic.module_utils",
    "CheckpointManager": "speedtronic.state.checkpoint",
    "MetricLogger": "speedtronic.profiling",
    "WandbHook": "speedtronic.integrations",
    "TensorboardHook": "speedtronic.integrations",
    "CautiousOptimizer": "speedtronic.optimizers",
    "HybridOptimizer": "speedtronic.optimizers",
    "Muon": "speedtronic.optimizers",
    "ParameterRouting": "speedtronic.optimizers",
    "newton_schulz": "speedtronic.optimizers",
    "post_polar_normalize": "speedtronic.optimizers",
    "route_parameters": "speedtronic.optimizers",
    "StageInfo": "speedtronic.systems.stage_streams",
    "StageStreamScheduler": "speedtronic.systems.stage_streams",
    "ShapeProfile": "speedtronic.systems.shapes",
    "ShapeReport": "speedtronic.systems.shapes",
    "ShapeWarning": "speedtronic.systems.shapes",
    "resolve_shape_profile": "speedtronic.systems.shapes",
    "validate_startup_shapes": "speedtronic.systems.shapes",
}
"""Name -> the module that defines it."""

_PLUGIN_EXPORTS: dict[str, str] = {"HubClient": "diloco", "DumbDiLoCoCoordinator": "diloco"}
"""2.0 names whose implementation is a plugin: found through the plugin's entry point, so the
package never imports ``speedtronic_callbacks`` itself."""


def kept_names() -> list[str]:
    """Every name ``speedtronic`` gives beyond its ``__all__``."""
    return [*_KEPT_EXPORTS, *_PLUGIN_EXPORTS]


def kept_attribute(name: str, owner: str) -> object:
    """The object a kept name stands for; ``AttributeError`` for any other name (for
    ``owner``'s ``__getattr__``)."""
    module = _KEPT_EXPORTS.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    if name in _PLUGIN_EXPORTS:
        return plugin_attribute(_PLUGIN_EXPORTS[name], name, owner)
    raise AttributeError(f"module {owner!r} has no attribute {name!r}")
