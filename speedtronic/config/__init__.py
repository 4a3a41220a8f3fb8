"""Run configuration: typed sections, JSON Schema validation, loading, overrides, schemas.

``load_config("run.yaml", overrides=["optimizer.lr=1e-3"])`` returns a validated
``SpeedtronicConfig`` or raises ``ConfigError`` listing every problem with its path.
"""

from __future__ import annotations

from speedtronic.config.loading import (
    OPTIMIZER_ALIASES,
    RUN_ALIASES,
    SECTION_ALIASES,
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
    config_errors,
    core_schema,
    format_path,
    write_schemas,
)
from speedtronic.config.sections import (
    SECRET_KEYS,
    CallbackSpec,
    CheckpointConfig,
    Config,
    ConfigSource,
    DataConfig,
    DistributedConfig,
    JSONValue,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RoutingRule,
    RunConfig,
    SchedulerConfig,
    ShapeValidationConfig,
    SpeedtronicConfig,
    load_config,
    load_yaml_config,
    redact_secrets,
)

__all__ = [
    "OPTIMIZER_ALIASES",
    "RUN_ALIASES",
    "SECRET_KEYS",
    "SECTION_ALIASES",
    "CallbackSpec",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigSource",
    "DataConfig",
    "DistributedConfig",
    "JSONValue",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RawConfig",
    "RoutingRule",
    "RunConfig",
    "SchedulerConfig",
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
    "parse_override",
    "read_source",
    "redact_secrets",
    "write_schemas",
]
