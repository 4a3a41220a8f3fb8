"""Run configuration: typed sections, JSON Schema validation, loading, overrides, schemas.

The core's sections are typed here; the 2.0 keys a plugin reads (``checkpoint:``, the
default sinks' switches, the synchronisation keys of ``distributed:``) are declared by that plugin
and composed in (see ``speedtronic.config.schema``).

``load_config("run.yaml", overrides=["optimizer.lr=1e-3"])`` returns a validated
``SpeedtronicConfig`` or raises ``ConfigError`` listing every problem with its path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from speedtronic.config import core, loading
from speedtronic.config.loading import (
    RawConfig,
    apply_overrides,
    normalise,
    parse_override,
    read_source,
)
from speedtronic.config.schema import (
    ConfigError,
    builtin_callback_names,
    composed_schema,
    core_schema,
    format_path,
    packaged_core_schema,
    section_aliases,
    write_schemas,
)
from speedtronic.config.sections import (
    SECRET_KEYS,
    CallbackSpec,
    Config,
    ConfigSource,
    DataConfig,
    DistributedConfig,
    JSONValue,
    LoggingConfig,
    MixtureSource,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RoutingRule,
    RunConfig,
    SchedulerConfig,
    SectionView,
    ShapeValidationConfig,
    SpeedtronicConfig,
    core_declarations,
    load_config,
    load_yaml_config,
    redact_secrets,
)
from speedtronic.config.validation import config_errors

if TYPE_CHECKING:
    from speedtronic.compat.checkpoint_config import CheckpointConfig
    from speedtronic.config.loading import OPTIMIZER_ALIASES, RUN_ALIASES

# The machinery (schema, validation, loading) reads the core's declarations through
# ``core``; they are handed down here, once, before anything can ask for them.
core.bind(core_declarations())

__all__ = [
    "OPTIMIZER_ALIASES",
    "RUN_ALIASES",
    "SECRET_KEYS",
    "CallbackSpec",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigSource",
    "DataConfig",
    "DistributedConfig",
    "ParallelConfig",
    "JSONValue",
    "LoggingConfig",
    "MixtureSource",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RawConfig",
    "RoutingRule",
    "RunConfig",
    "SchedulerConfig",
    "SectionView",
    "ShapeValidationConfig",
    "SpeedtronicConfig",
    "apply_overrides",
    "builtin_callback_names",
    "composed_schema",
    "config_errors",
    "core_schema",
    "format_path",
    "load_config",
    "load_yaml_config",
    "normalise",
    "packaged_core_schema",
    "parse_override",
    "read_source",
    "redact_secrets",
    "section_aliases",
    "write_schemas",
]


def __getattr__(name: str) -> object:
    """Names looked up at first use. The root shorthands (``RUN_ALIASES``,
    ``OPTIMIZER_ALIASES``) are read from the declarations, which exist once this module has
    bound them. 2.0's ``CheckpointConfig`` is a 2.0 shim (``speedtronic.compat``), looked up
    by name as the package root does for its kept names, so that the config layer imports
    nothing of the 2.0 layer."""
    if name in ("RUN_ALIASES", "OPTIMIZER_ALIASES"):
        return getattr(loading, name)
    if name == "CheckpointConfig":
        module = importlib.import_module("speedtronic.compat.checkpoint_config")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
