"""Typed configuration: one dataclass per core ``run.yaml`` section plus the ``SpeedtronicConfig``
root -- and the declaration of every core key.

Each field is the one declaration of its key (``speedtronic.config.declare``): its type,
default, bounds and doc. The core part of the run schema (``core_declarations``), the
defaults, the case-insensitive keys and the root shorthands the loader rewrites, and the
tables of ``docs/configuration.md`` are all derived from these fields.

Plugins own their 2.0 keys (``PluginSpec.sections``): keys a plugin adds to a core section are
kept beside the section's fields (``section.extensions``; ``logging`` and ``distributed`` also
read them as attributes, ``cfg.logging.console``), and top-level keys only plugins declare are
kept on the root (``cfg.plugin_keys``; read as attributes too, ``cfg.checkpoint.every_steps``,
through ``SectionView``). These views are plain data: new code reads a plugin's options
instead.

One pass each: a mapping, file or text is normalised once (``loading.normalise``), validated
once against the composed schema and the cross-field rules (``validation.config_errors``), and
then built into these objects without being checked again (``declare.build``). A section or
root built directly from Python goes through the same pipeline, once, on construction; after
mutating fields call ``validate()``. Errors are collected and raised together as
``ConfigError``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, TypeAlias, TypeVar, cast

import yaml

from speedtronic.config import declare
from speedtronic.config.core import CoreDeclarations, CoreKeys
from speedtronic.config.data_section import DataConfig, MixtureSource
from speedtronic.config.declare import Opt
from speedtronic.config.eval_section import EvalConfig, EvalTaskSource
from speedtronic.config.loading import (
    apply_overrides,
    looks_like_text,
    normalise,
    read_file,
    read_source,
)
from speedtronic.config.model_section import AdaptersConfig, LoraAdapterConfig, ModelConfig
from speedtronic.config.optimizer_section import OptimizerConfig, RoutingRule, SchedulerConfig
from speedtronic.config.run_section import RunConfig
from speedtronic.config.schema import plugin_root_keys, root_default
from speedtronic.config.section_base import (
    SECRET_KEYS,
    JSONValue,
    Section,
    as_mapping,
    field_names,
    jsonable,
    redact_secrets,
)
from speedtronic.config.system_sections import (
    CallbackSpec,
    DistributedConfig,
    LoggingConfig,
    ParallelConfig,
    PrecisionConfig,
    ShapeValidationConfig,
)
from speedtronic.config.validation import config_errors, import_errors
from speedtronic.errors import ConfigError
from speedtronic.state.atomic_io import atomic_write_text

__all__ = [
    "AdaptersConfig",
    "CallbackSpec",
    "Config",
    "ConfigSource",
    "core_declarations",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "EvalTaskSource",
    "JSONValue",
    "load_config",
    "load_yaml_config",
    "LoggingConfig",
    "LoraAdapterConfig",
    "MixtureSource",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "redact_secrets",
    "RoutingRule",
    "RunConfig",
    "SchedulerConfig",
    "SECRET_KEYS",
    "SectionView",
    "ShapeValidationConfig",
    "SpeedtronicConfig",
]

_SECTION_TYPES: dict[str, type[Section]] = {
    "run": RunConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "eval": EvalConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "precision": PrecisionConfig,
    "logging": LoggingConfig,
    "distributed": DistributedConfig,
    "parallel": ParallelConfig,
    "shape_validation": ShapeValidationConfig,
}


_SectionType = TypeVar("_SectionType", bound=Section)


def _defaults_of(section_type: type[_SectionType]) -> Callable[[], _SectionType]:
    """A default factory building the section's defaults as validated data (the declared
    defaults are valid: nothing to check)."""
    return lambda: section_type._from_valid({})


_CALLBACKS_SCHEMA: Mapping[str, object] = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name"],
        "description": "A callback plugin: its registered name plus its options. A bare "
        "string is a shorthand for {name: <string>}.",
        "properties": {
            "name": {
                "type": "string",
                "minLength": 1,
                "description": "Registered callback plugin name.",
            }
        },
    },
}
"""Each entry is checked by its plugin's own options schema, composed in by
``schema.composed_schema``."""


# -- the root -----------------------------------------------------------------------------


@dataclass
class SpeedtronicConfig:
    """A complete, validated run configuration.

    Build it with ``SpeedtronicConfig.load(source, overrides)`` (mapping, YAML/JSON file or
    text, or another config), ``from_dict``/``from_yaml``, or directly. Construction fills
    derived defaults (``data.block_size``/``vocab_size``/``seed``/``target_batch_size``,
    ``logging.every_steps`` from ``run.log_every``, and what plugins derive from their 2.0
    keys) and validates everything once; after mutating fields call ``validate()`` again.
    """

    run: RunConfig = field(default_factory=_defaults_of(RunConfig))
    model: ModelConfig = field(default_factory=_defaults_of(ModelConfig))
    data: DataConfig = field(default_factory=_defaults_of(DataConfig))
    eval: EvalConfig = field(default_factory=_defaults_of(EvalConfig))
    optimizer: OptimizerConfig = field(default_factory=_defaults_of(OptimizerConfig))
    scheduler: SchedulerConfig = field(default_factory=_defaults_of(SchedulerConfig))
    precision: PrecisionConfig = field(default_factory=_defaults_of(PrecisionConfig))
    logging: LoggingConfig = field(default_factory=_defaults_of(LoggingConfig))
    distributed: DistributedConfig = field(default_factory=_defaults_of(DistributedConfig))
    parallel: ParallelConfig = field(default_factory=_defaults_of(ParallelConfig))
    shape_validation: ShapeValidationConfig = field(
        default_factory=_defaults_of(ShapeValidationConfig)
    )
    compile: Annotated[
        bool,
        Opt(
            "`torch.compile` the model; a compiler failure warns and the run continues eagerly",
            schema={
                "type": ["boolean", "object"],
                "properties": {"enabled": {"type": "boolean", "default": False}},
                "additionalProperties": False,
            },
            type_text="bool or `{enabled: bool}`",
        ),
    ] = False
    ooo_backprop: Annotated[
        bool,
        Opt(
            "out-of-order backprop on CUDA stage streams (a no-op on CPU/MPS); see "
            "[systems](systems.md)"
        ),
    ] = False
    ooo_streams: Annotated[
        int, Opt("streams for `ooo_backprop`", minimum=1, maximum=8, type_text="int 1 … 8")
    ] = 4
    callbacks: Annotated[
        list[CallbackSpec],
        Opt("Callback plugins, run in this order.", schema=_CALLBACKS_SCHEMA),
    ] = field(default_factory=list)
    imports: Annotated[
        list[str],
        Opt(
            "Python modules imported before plugins are looked up (they may register models, "
            "datasets, callbacks).",
            items={"minLength": 1},
        ),
    ] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Built from Python: what the objects state goes through the loader's one pass
        (normalised, validated, built) and the result is taken back into them."""
        stated: dict[str, object] = {}
        for name, section_type in _SECTION_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a plain mapping is accepted for a section
                stated[name] = value
            elif isinstance(value, section_type):
                stated[name] = value._stated()
            else:
                raise ConfigError(
                    f"{name}: expected a {section_type.__name__} or a mapping, "
                    f"got {type(value).__name__}"
                )
        stated.update(self.plugin_keys)
        for item in declare.declared(type(self)):
            if item.name not in _SECTION_TYPES:
                stated[item.name] = jsonable(getattr(self, item.name))
        self._adopt(type(self)._resolve(stated))

    def _adopt(self, resolved: SpeedtronicConfig) -> None:
        """Take the values of ``resolved`` (built from what this config states); sections
        given as objects stay those objects."""
        for name in _SECTION_TYPES:
            section, built = getattr(self, name), getattr(resolved, name)
            if isinstance(section, Section):
                section.__dict__.update(built.__dict__)
            else:
                object.__setattr__(self, name, built)
        for item in declare.declared(type(self)):
            if item.name not in _SECTION_TYPES:
                object.__setattr__(self, item.name, getattr(resolved, item.name))
        self.__dict__["_plugin_keys"] = resolved.plugin_keys
        self.__dict__["_validated"] = resolved.__dict__.get("_validated")

    # -- keys plugins declare ---------------------------------------------------------

    @property
    def plugin_keys(self) -> dict[str, JSONValue]:
        """Top-level keys only plugins declare (``checkpoint``, ...), as plain data."""
        keys = self.__dict__.get("_plugin_keys")
        if keys is None:
            keys = {key: cast(JSONValue, root_default(key)) for key in plugin_root_keys()}
            self.__dict__["_plugin_keys"] = keys
        return cast("dict[str, JSONValue]", keys)

    def __getattr__(self, name: str) -> SectionView | JSONValue:
        """A top-level key a plugin declares: a ``SectionView`` of a section, else the
        value (``cfg.checkpoint.every_steps``, ``cfg.gradient_checkpointing``)."""
        if name.startswith("_"):
            raise AttributeError(name)
        keys = self.plugin_keys
        if name not in keys:
            raise AttributeError(f"SpeedtronicConfig has no section {name!r}")
        value = keys[name]
        return SectionView(name, value) if isinstance(value, dict) else value

    def __setattr__(self, name: str, value: object) -> None:
        if name in field_names(type(self)) or name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in self.plugin_keys:
            self.plugin_keys[name] = jsonable(value)
        else:
            raise AttributeError(f"SpeedtronicConfig has no section {name!r}")

    def __eq__(self, other: object) -> bool:
        """Equal when every setting is, the keys plugins declare included."""
        if not isinstance(other, SpeedtronicConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __getstate__(self) -> dict[str, object]:
        """A copy (or another process) validates again: ``ensure_valid`` trusts only what
        was validated here, where the config's ``imports:`` were imported."""
        state = dict(self.__dict__)
        state.pop("_validated", None)
        return state

    def _derive_defaults(self) -> None:
        """The defaults that follow other sections (after validation: the values they
        follow have the same bounds)."""
        if self.data.block_size is None:
            self.data.block_size = self.model.max_seq_len
        if self.data.target_batch_size is None:
            self.data.target_batch_size = self.data.micro_batch
        if self.data.vocab_size is None:
            self.data.vocab_size = self.model.vocab_size
        if self.data.seed is None:
            self.data.seed = self.run.seed

    # -- derived values ---------------------------------------------------------------

    @property
    def accumulation_steps(self) -> int:
        """Microbatches per optimizer step (``data.target_batch_size // micro_batch_size``)."""
        return self.data.accumulation_steps

    @property
    def target_steps(self) -> int:
        """The absolute global-step target: ``data.max_steps`` when set, else ``run.max_steps``."""
        return self.run.max_steps if self.data.max_steps is None else self.data.max_steps

    @property
    def scheduler_steps(self) -> int:
        """The LR-schedule horizon: an explicit ``scheduler.max_steps``, else the target."""
        explicit = self.scheduler.max_steps
        return self.target_steps if explicit is None else explicit

    # -- validation and serialisation -------------------------------------------------

    def validate(self) -> SpeedtronicConfig:
        """Check the whole configuration (imports, plugins, schema, cross-field rules);
        raise ``ConfigError`` with every problem. Returns ``self``."""
        data = self.to_dict()
        errors = config_errors(data)
        if errors:
            raise ConfigError(errors)
        self.__dict__["_validated"] = data
        return self

    def ensure_valid(self) -> SpeedtronicConfig:
        """``validate()``, unless nothing changed since this config was last validated
        (built, loaded or ``validate()``d): what the composition root calls, so a config is
        checked once however many builders it passes through. Returns ``self``."""
        if self.__dict__.get("_validated") != self.to_dict():
            self.validate()
        return self

    def to_dict(self, *, redact_secrets: bool = False) -> dict[str, JSONValue]:
        """JSON-compatible data in canonical layout (loads back to an equal config)."""
        values: dict[str, JSONValue] = {
            name: getattr(self, name).to_dict() for name in _SECTION_TYPES
        }
        values.update(copy.deepcopy(self.plugin_keys))
        values["compile"] = self.compile
        values["ooo_backprop"] = self.ooo_backprop
        values["ooo_streams"] = self.ooo_streams
        values["callbacks"] = [spec.to_dict() for spec in self.callbacks]
        values["imports"] = list(self.imports)
        if redact_secrets:
            redacted = _redact(values)
            assert isinstance(redacted, dict)
            return redacted
        return values

    def to_yaml(self, *, redact_secrets: bool = False) -> str:
        """The configuration as YAML (sections in canonical order)."""
        return yaml.safe_dump(
            self.to_dict(redact_secrets=redact_secrets), sort_keys=False, allow_unicode=True
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the configuration, secrets always redacted, atomically: YAML for
        ``.yaml``/``.yml``, JSON otherwise. Returns the path."""
        path = Path(path)
        if path.suffix.lower() in (".yaml", ".yml"):
            text = self.to_yaml(redact_secrets=True)
        else:
            text = json.dumps(self.to_dict(redact_secrets=True), indent=2) + "\n"
        atomic_write_text(path, text)
        return path

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, object] | None = None) -> SpeedtronicConfig:
        """Validate a mapping (shorthands allowed) and build the typed configuration."""
        return cls._resolve(values)

    @classmethod
    def _resolve(cls, raw: object) -> SpeedtronicConfig:
        """The one pass: import the ``imports:`` (a plugin they register rewrites its own
        keys too), normalise (``loading.normalise``), validate once, build."""
        errors = import_errors(raw.get("imports") if isinstance(raw, Mapping) else None)
        data, conflicts = normalise(raw)
        errors.extend(conflicts)
        errors.extend(config_errors(data, imported=True))
        if errors:
            raise ConfigError(errors)
        return cls._build(data)

    @classmethod
    def _build(cls, data: Mapping[str, object]) -> SpeedtronicConfig:
        """The typed configuration of validated, normalised data (nothing is checked)."""
        config = cls.__new__(cls)
        for name, section_type in _SECTION_TYPES.items():
            object.__setattr__(config, name, section_type._from_valid(as_mapping(data.get(name))))
        compile_value = data.get("compile", False)
        if isinstance(compile_value, Mapping):
            compile_value = compile_value.get("enabled", False)
        object.__setattr__(config, "compile", compile_value is True)
        object.__setattr__(config, "ooo_backprop", data.get("ooo_backprop", False) is True)
        object.__setattr__(config, "ooo_streams", data.get("ooo_streams", 4))
        callbacks = [
            CallbackSpec.from_dict(as_mapping(entry)) for entry in _as_list(data.get("callbacks"))
        ]
        object.__setattr__(config, "callbacks", callbacks)
        object.__setattr__(
            config, "imports", [str(module) for module in _as_list(data.get("imports"))]
        )
        config.plugin_keys.update(
            (key, jsonable(data[key])) for key in list(config.plugin_keys) if key in data
        )
        config._derive_defaults()
        config.__dict__["_validated"] = config.to_dict()
        return config

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SpeedtronicConfig:
        """Load a YAML file (an empty file means all defaults)."""
        raw = read_file(path, yaml_only=True)
        return _with_source(lambda: cls.from_dict(raw), str(path))

    @classmethod
    def load(cls, source: ConfigSource = None, overrides: Sequence[str] = ()) -> SpeedtronicConfig:
        """Load from a mapping, a YAML/JSON file path, YAML/JSON text or a config object,
        then apply ``key.path=value`` overrides (before validation)."""
        if isinstance(overrides, str):
            overrides = [overrides]
        if isinstance(source, SpeedtronicConfig):
            if not overrides:
                return source.ensure_valid()
            data = apply_overrides(source.to_dict(), overrides)
            return cls.from_dict(data)
        origin: str | None = None
        if isinstance(source, os.PathLike) or (
            isinstance(source, str) and not looks_like_text(source)
        ):
            origin = str(os.fspath(source))
        data = apply_overrides(read_source(source), overrides)
        return _with_source(lambda: cls.from_dict(data), origin)


class SectionView:
    """Attribute access to a section only plugins declare (``cfg.checkpoint.every_steps``):
    a live view of the plain data in ``SpeedtronicConfig.plugin_keys``. Setting a key
    changes the config; call ``validate()`` afterwards, as for any change."""

    def __init__(self, name: str, values: dict[str, JSONValue]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, key: str) -> JSONValue:
        values: dict[str, JSONValue] = self.__dict__["_values"]
        if key not in values:
            raise AttributeError(f"{self.__dict__['_name']} has no setting {key!r}")
        return values[key]

    def __setattr__(self, key: str, value: object) -> None:
        values: dict[str, JSONValue] = self.__dict__["_values"]
        if key not in values:
            raise AttributeError(f"{self.__dict__['_name']} has no setting {key!r}")
        values[key] = jsonable(value)

    def to_dict(self) -> dict[str, JSONValue]:
        """The section as plain data (a copy)."""
        return copy.deepcopy(self.__dict__["_values"])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SectionView):
            return self.to_dict() == other.to_dict()
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass sections

    def __repr__(self) -> str:
        values = redact_secrets(self.__dict__["_values"])
        return f"SectionView({self.__dict__['_name']!r}, {values!r})"


ConfigSource: TypeAlias = Mapping[str, object] | str | os.PathLike[str] | SpeedtronicConfig | None
"""What ``load_config`` accepts."""

Config = SpeedtronicConfig
"""Alias kept from the original API."""


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def _redact(values: dict[str, JSONValue]) -> JSONValue:
    return redact_secrets(values)


def _with_source(build: Callable[[], SpeedtronicConfig], origin: str | None) -> SpeedtronicConfig:
    """Run ``build``; a ``ConfigError`` names the file it came from."""
    try:
        return build()
    except ConfigError as exc:
        if origin is None or exc.source is not None:
            raise
        raise ConfigError(exc.errors, source=origin) from None


def load_config(source: ConfigSource = None, overrides: Sequence[str] = ()) -> SpeedtronicConfig:
    """``SpeedtronicConfig.load``: a mapping, YAML/JSON file or text, or a config object,
    with ``key.path=value`` overrides applied before validation."""
    return SpeedtronicConfig.load(source, overrides)


def load_yaml_config(path: str | os.PathLike[str]) -> SpeedtronicConfig:
    """``SpeedtronicConfig.from_yaml``."""
    return SpeedtronicConfig.from_yaml(path)


# -- what the declarations give the loader and the schema ---------------------------------


def _core_keys() -> CoreKeys:
    shorthands: dict[str, str] = {}
    folds: dict[tuple[str, str], declare.Fold] = {}
    fills: dict[tuple[str, str], tuple[str, str]] = {}
    for name, section_type in _SECTION_TYPES.items():
        for item in declare.documented(section_type):
            if item.opt.shorthand:
                shorthands[item.name] = name
            if item.opt.fold is not None:
                folds[(name, item.name)] = item.opt.fold
            if item.opt.fills is not None:
                section, _, key = item.opt.fills.partition(".")
                fills[(name, item.name)] = (section, key)
    bare_values = {
        name: section_type.bare_value
        for name, section_type in _SECTION_TYPES.items()
        if section_type.bare_value is not None
    }
    return CoreKeys(shorthands, folds, fills, bare_values)


_CORE_KEYS = _core_keys()


def _core_schema_document(*, dialect: str, schema_id: str) -> dict[str, object]:
    """The core's part of the run schema, from the declarations: each section a closed
    object of its declared keys, then the root flags, ``callbacks`` and ``imports``."""
    properties: dict[str, object] = {
        "$schema": {"type": "string", "description": "Schema reference for editors; ignored."}
    }
    for name, section_type in _SECTION_TYPES.items():
        properties[name] = {
            "title": name,
            "description": section_type.section_doc,
            **declare.object_schema(section_type),
        }
    for item in declare.declared(SpeedtronicConfig):
        if item.name not in _SECTION_TYPES:
            properties[item.name] = declare.property_schema(item)
    shorthands = ", ".join(_CORE_KEYS.shorthands)
    return {
        "$schema": dialect,
        "$id": schema_id,
        "title": "speedtronic run configuration",
        "description": f"A speedtronic run.yaml. Root shorthands ({shorthands}, and section "
        "aliases that plugins declare) are accepted by the loader and rewritten before "
        "validation.",
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }


def core_declarations() -> CoreDeclarations:
    """What the declarations give the machinery (``speedtronic.config.core``)."""
    return CoreDeclarations(keys=_CORE_KEYS, schema_document=_core_schema_document)
