"""Typed configuration: one dataclass per core ``run.yaml`` section plus the ``SpeedtronicConfig``
root.

Plugins own their 2.0 keys (``Callback.legacy_schema``): keys a plugin adds to a core section
are kept beside the section's fields (``section.extensions``; ``logging`` and ``distributed``
also read them as attributes, ``cfg.logging.console``), and top-level keys only plugins
declare are kept on the root (``cfg.plugin_keys``; read as attributes too,
``cfg.checkpoint.every_steps``, through ``SectionView``). These views are plain data: new code
reads a plugin's options instead.

Every way in -- ``SpeedtronicConfig.load``/``from_dict``/``from_yaml``, direct construction,
``validate()`` after mutation -- goes through the same JSON Schema and cross-field rules
(``speedtronic.config.schema``), so a config object that exists is a valid one. Errors are
collected and raised together as ``ConfigError``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, TypeAlias, cast

import yaml
from typing_extensions import Self

from speedtronic.config.loading import (
    CASE_FOLDS,
    REDACTED,
    apply_overrides,
    looks_like_text,
    normalise,
    read_file,
    read_source,
)
from speedtronic.config.schema import (
    ConfigError,
    config_errors,
    plugin_root_keys,
    plugin_section_keys,
    root_default,
    schema_defaults,
)
from speedtronic.plugins import configurable_plugins
from speedtronic.state.atomic_io import atomic_write_text

JSONValue: TypeAlias = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]
"""A value that JSON (and YAML) can represent."""

SECRET_KEYS = frozenset({"token", "secret", "password", "hmac_key", "api_key"})
"""Keys whose values are secrets wherever they appear (case-insensitive)."""


def redact_secrets(value: JSONValue) -> JSONValue:
    """A copy of ``value`` with every non-empty secret (``SECRET_KEYS``) replaced by
    ``"<redacted>"``, at any depth (distributed.token, callback options, ...)."""
    if isinstance(value, dict):
        return {
            key: (
                REDACTED
                if key.lower() in SECRET_KEYS and item not in (None, "")
                else redact_secrets(item)
            )
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact_secrets(item) for item in value]
    return value


def _jsonable(value: object) -> JSONValue:
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        return _jsonable(to_dict())
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, os.PathLike):
        return str(os.fspath(value))
    # Scalars pass through; anything else is left for validation to report by path.
    return cast(JSONValue, value)


# -- coercion of directly constructed sections ---------------------------------------------


_HINTS: dict[type, dict[str, object]] = {}


def _field_hints(cls: type) -> dict[str, object]:
    """Resolved field annotations of a section class (computed once per class)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _coerce(hint: object, value: object) -> object:
    """Lossless conversions a caller reasonably expects (``lr=1`` -> ``1.0``, a list of two
    betas -> a tuple, a path -> a string, a rule mapping -> ``RoutingRule``). Anything else is
    returned unchanged so that validation reports it."""
    if value is None or isinstance(value, bool):
        return value
    origin = typing.get_origin(hint)
    choices = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    if float in choices and isinstance(value, int):
        return float(value)
    if int in choices and float not in choices and isinstance(value, float):
        return int(value) if value.is_integer() else value
    if str in choices and isinstance(value, os.PathLike):
        return os.fspath(value)
    for choice in choices:
        choice_origin, args = typing.get_origin(choice), typing.get_args(choice)
        if choice_origin is tuple and isinstance(value, (list, tuple)):
            if len(args) == len(value):
                return tuple(_coerce(arg, item) for arg, item in zip(args, value, strict=True))
            return tuple(value)
        if choice_origin is list and isinstance(value, (list, tuple)):
            return [_coerce(args[0], item) for item in value]
        if choice_origin is dict and isinstance(value, Mapping):
            return dict(value)
        if choice is RoutingRule and isinstance(value, Mapping):
            return RoutingRule.from_mapping(value)
        if choice is MixtureSource and isinstance(value, Mapping):
            return MixtureSource.from_mapping(value)
    return value


# -- sections -----------------------------------------------------------------------------


@dataclass
class _Section:
    """Shared behaviour of the section dataclasses: coercion, case folding, validation."""

    section_name: ClassVar[str] = ""

    @property
    def extensions(self) -> dict[str, JSONValue]:
        """Keys that installed plugins add to this section (``Callback.legacy_schema``)."""
        extensions = self.__dict__.get("_extensions")
        if extensions is None:
            extensions = {
                key: cast(JSONValue, schema_defaults(self.section_name).get(key))
                for key in plugin_section_keys(self.section_name)
            }
            self.__dict__["_extensions"] = extensions
        return cast("dict[str, JSONValue]", extensions)

    def __post_init__(self) -> None:
        hints = _field_hints(type(self))
        for item in dataclasses.fields(self):
            value = _coerce(hints[item.name], getattr(self, item.name))
            fold = CASE_FOLDS.get((self.section_name, item.name))
            if fold is not None and isinstance(value, str):
                value = fold(value)
            setattr(self, item.name, value)
        self._fill_defaults()
        errors = config_errors({self.section_name: self.to_dict()})
        if errors:
            raise ConfigError(errors)

    def _fill_defaults(self) -> None:
        """Derive defaults that depend on other keys of the section."""

    def to_dict(self) -> dict[str, JSONValue]:
        """The section as JSON-compatible data, keys in declaration order (the fields, then
        the keys plugins add)."""
        values = {
            item.name: _jsonable(getattr(self, item.name)) for item in dataclasses.fields(self)
        }
        values.update((key, _jsonable(value)) for key, value in self.extensions.items())
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, object] | None = None) -> Self:
        """Validate ``values`` as this section (shorthands and case folding included)."""
        data, errors = normalise({cls.section_name: {} if values is None else values})
        errors.extend(config_errors(data))
        if errors:
            raise ConfigError(errors)
        return cls._from_valid(_as_mapping(data.get(cls.section_name)))

    @classmethod
    def _from_valid(cls, values: Mapping[str, object]) -> Self:
        names = {item.name for item in dataclasses.fields(cls)}
        factory = cast("Callable[..., Self]", cls)
        section = factory(**{key: value for key, value in values.items() if key in names})
        section.extensions.update(
            (key, cast(JSONValue, value)) for key, value in values.items() if key not in names
        )
        return section


class _PluginKeysAsAttributes:
    """Read (and set) the keys plugins add to a section as attributes: ``logging.console``.
    Typed as plain JSON values; a plugin's own options are the typed way in."""

    extensions: dict[str, JSONValue]
    if TYPE_CHECKING:  # provided by _Section, which comes after this mixin

        def to_dict(self) -> dict[str, JSONValue]: ...

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _PluginKeysAsAttributes)
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, like the other sections

    def __getattr__(self, name: str) -> JSONValue:
        extensions = self.__dict__.get("_extensions")
        if extensions is None and not name.startswith("_"):
            extensions = self.extensions
        if isinstance(extensions, dict) and name in extensions:
            return cast(JSONValue, extensions[name])
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        if name in _field_names(type(self)) or name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in self.extensions:
            self.extensions[name] = cast(JSONValue, value)
        else:
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}")


def _field_names(cls: type) -> frozenset[str]:
    return frozenset(item.name for item in dataclasses.fields(cls))


def _as_mapping(value: object) -> Mapping[str, object]:
    return cast("Mapping[str, object]", value) if isinstance(value, Mapping) else {}


@dataclass
class RunConfig(_Section):
    """``run:`` -- identity, seed, device and the training target."""

    section_name: ClassVar[str] = "run"

    name: str = "speedtronic-run"
    seed: int = 1234
    device: str = "auto"
    max_steps: int = 1000
    max_epochs: int | None = None
    output_dir: str = "runs"
    log_every: int | None = None
    threads: int | Literal["auto"] = "auto"
    stop_grace_s: float | None = None


@dataclass(eq=False)  # equality includes the plugin keys (the mixin's)
class ModelConfig(_PluginKeysAsAttributes, _Section):
    """``model:`` -- the registered model name, reference-transformer dimensions and free-form
    ``options`` for the factory (plugins may add 2.0 keys, readable as attributes:
    ``model.gradient_checkpointing``)."""

    section_name: ClassVar[str] = "model"

    name: str = "reference_transformer"
    vocab_size: int = 512
    max_seq_len: int = 128
    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int | None = None
    d_model: int = 256
    d_ff: int | None = None
    dropout: float = 0.0
    tie_weights: bool = True
    rope_base: float = 10000.0
    options: dict[str, JSONValue] = field(default_factory=dict)

    def _fill_defaults(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None and _is_int(self.d_model):
            self.d_ff = 4 * self.d_model


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class MixtureSource:
    """``data.mixture[i]`` -- a token-shard directory and its relative weight."""

    tokens: str
    weight: float = 1.0

    def to_dict(self) -> dict[str, JSONValue]:
        return {"tokens": self.tokens, "weight": self.weight}

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> MixtureSource | Mapping[str, object]:
        """The source, or ``values`` unchanged when they do not fit (validation reports it)."""
        factory = cast("Callable[..., MixtureSource]", cls)
        try:
            source = factory(**values)
        except TypeError:
            return values
        weight = source.weight
        if isinstance(weight, int) and not isinstance(weight, bool):
            return dataclasses.replace(source, weight=float(weight))
        return source


@dataclass(repr=False)
class DataConfig(_Section):
    """``data:`` -- the data source and batching (``target = K * micro``)."""

    section_name: ClassVar[str] = "data"

    text_path: str | None = None
    tokens: str | None = None
    mixture: list[MixtureSource] = field(default_factory=list)
    tokenizer: str | None = None
    verify_shards: bool = True
    dataset: str | None = None
    dataset_options: dict[str, JSONValue] = field(default_factory=dict)
    collate: str = "auto"
    synthetic: bool = True
    synthetic_kind: Literal["uniform", "learnable"] = "uniform"
    num_tokens: int = 100000
    vocab_size: int | None = None
    block_size: int | None = None
    micro_batch_size: int = 1
    target_batch_size: int | None = None
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool | None = None
    shuffle: bool | None = None
    """``null``: on for ``tokens`` and ``mixture``, off for the other sources."""
    drop_last: bool = True
    seed: int | None = None
    max_steps: int | None = None

    @property
    def accumulation_steps(self) -> int:
        """Microbatches per optimizer step (1 while ``target_batch_size`` is unset)."""
        if self.target_batch_size is None:
            return 1
        return self.target_batch_size // self.micro_batch_size

    def __repr__(self) -> str:
        # dataset_options is free-form and may hold credentials: never print them.
        values = ", ".join(
            f"{item.name}={_redacted(getattr(self, item.name))!r}"
            for item in dataclasses.fields(self)
        )
        return f"DataConfig({values})"


@dataclass(repr=False)
class EvalConfig(_Section):
    """``eval:`` -- evaluation on a held-out set: how often, how much, and from where (no
    data option: the training source's held-out split, see ``docs/evaluation.md``)."""

    section_name: ClassVar[str] = "eval"

    every_steps: int | None = None
    max_batches: int | None = None
    fraction: float = 0.05
    text_path: str | None = None
    dataset: str | None = None
    dataset_options: dict[str, JSONValue] = field(default_factory=dict)

    def __repr__(self) -> str:
        # dataset_options is free-form and may hold credentials: never print them.
        values = ", ".join(
            f"{item.name}={_redacted(getattr(self, item.name))!r}"
            for item in dataclasses.fields(self)
        )
        return f"EvalConfig({values})"


def _redacted(value: object) -> object:
    return redact_secrets(cast(JSONValue, value)) if isinstance(value, dict) else value


@dataclass(frozen=True)
class RoutingRule:
    """``optimizer.routing[i]`` -- send matching parameters to Muon or AdamW.

    Every given criterion must match; a rule with none matches everything. This is the
    config record only: ``speedtronic.optimizers.RoutingRule`` does the matching.
    """

    to: Literal["muon", "adamw"]
    name: str | None = None
    module: str | None = None
    ndim: int | None = None

    def to_dict(self) -> dict[str, JSONValue]:
        """The rule as config data (unset criteria omitted)."""
        values: dict[str, JSONValue] = {"to": self.to}
        for key in ("name", "module", "ndim"):
            value = getattr(self, key)
            if value is not None:
                values[key] = value
        return values

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> RoutingRule | Mapping[str, object]:
        """The rule, or ``values`` unchanged when they do not fit (validation reports it)."""
        factory = cast("Callable[..., RoutingRule]", cls)
        try:
            return factory(**values)
        except TypeError:
            return values


@dataclass
class OptimizerConfig(_Section):
    """``optimizer:`` -- AdamW, or hybrid Muon (matrices) + AdamW (the rest); optionally
    cautious. ``muon_lr``/``muon_weight_decay`` default to ``lr``/``weight_decay``."""

    section_name: ClassVar[str] = "optimizer"

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    fused: bool | None = None
    grad_clip: float | None = None
    muon_plus: bool = False
    muon_plus_mode: Literal["row_col", "col_row"] = "row_col"
    cautious: bool = False
    cautious_rescale: bool = False
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
    muon_norm_eps: float = 1e-8
    muon_lr: float | None = None
    muon_lr_scale: Literal["original", "rms"] = "rms"
    muon_weight_decay: float | None = None
    decay_norms_and_biases: bool | None = None
    """``null``: ``true`` unless a callback of the run proposes otherwise
    (``Callback.optimizer_decay_norms_and_biases``)."""
    routing: list[RoutingRule] = field(default_factory=list)

    @property
    def resolved_muon_lr(self) -> float:
        """The Muon group's learning rate (``muon_lr``, else ``lr``)."""
        return self.lr if self.muon_lr is None else self.muon_lr

    @property
    def resolved_muon_weight_decay(self) -> float:
        """The Muon group's weight decay (``muon_weight_decay``, else ``weight_decay``)."""
        return self.weight_decay if self.muon_weight_decay is None else self.muon_weight_decay


@dataclass
class SchedulerConfig(_Section):
    """``scheduler:`` -- warmup then cosine or constant. ``max_steps: None`` follows the
    training target; read the resolved horizon from ``SpeedtronicConfig.scheduler_steps``."""

    section_name: ClassVar[str] = "scheduler"

    name: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 100
    max_steps: int | None = None
    min_lr_ratio: float = 0.1


@dataclass
class PrecisionConfig(_Section):
    """``precision:`` -- ``auto`` or a forced bf16/fp16/fp32 mode."""

    section_name: ClassVar[str] = "precision"

    mode: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    dtype: Literal["bf16", "fp16", "fp32"] | None = None


@dataclass(eq=False)  # equality includes the plugin keys (the mixin's)
class LoggingConfig(_PluginKeysAsAttributes, _Section):
    """``logging:`` -- log level and file, and the metric cadence. Sink plugins add their
    2.0 switches (``console``, ``jsonl``, ``json_file``), readable as attributes."""

    section_name: ClassVar[str] = "logging"

    level: str = "INFO"
    file: str | None = None
    every_steps: int = 1


@dataclass(eq=False)  # equality includes the plugin keys (the mixin's)
class DistributedConfig(_PluginKeysAsAttributes, _Section):
    """``distributed:`` -- settings of torch.distributed runs (``timeout_s``, the per-step
    collective timeout). Plugins add their 2.0 keys, readable as attributes."""

    section_name: ClassVar[str] = "distributed"

    timeout_s: float = 1800.0


@dataclass
class ParallelConfig(_Section):
    """``parallel:`` -- how a multi-rank run splits the model: ``ddp`` (every rank holds
    the whole model and optimizer state) or ``fsdp`` (FSDP2: parameters, gradients and
    optimizer state sharded across the ranks; see docs/scale-out.md)."""

    section_name: ClassVar[str] = "parallel"

    strategy: Literal["ddp", "fsdp"] = "ddp"
    reshard_after_forward: bool = True


@dataclass
class ShapeValidationConfig(_Section):
    """``shape_validation:`` -- startup warnings about unaligned shapes (never errors)."""

    section_name: ClassVar[str] = "shape_validation"

    enabled: bool = True
    alignment: int | Literal["auto", "none"] = "auto"
    check_batch: bool = True
    check_sequence: bool = True
    check_model: bool = True
    check_vocab: bool = False
    warn_on_cpu: bool = False

    def _fill_defaults(self) -> None:
        if self.alignment is None:  # the original treated null as auto
            self.alignment = "auto"


@dataclass
class CallbackSpec:
    """One ``callbacks:`` entry: the plugin name and its (validated) options."""

    name: str
    options: dict[str, JSONValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "name" in self.options:
            raise ConfigError(
                f"callbacks: option 'name' of {self.name!r} clashes with the plugin name"
            )

    def to_dict(self) -> dict[str, JSONValue]:
        """The entry as written in config: ``{name: ..., **options}``."""
        return {"name": self.name, **self.options}

    @classmethod
    def from_dict(cls, entry: Mapping[str, object]) -> CallbackSpec:
        """An entry ``{name: ..., **options}`` (already validated)."""
        options = {key: value for key, value in entry.items() if key != "name"}
        return cls(name=str(entry["name"]), options=cast("dict[str, JSONValue]", options))

    def __repr__(self) -> str:
        return f"CallbackSpec(name={self.name!r}, options={redact_secrets(self.options)!r})"


_SECTION_TYPES: dict[str, type[_Section]] = {
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


# -- the root -----------------------------------------------------------------------------


@dataclass
class SpeedtronicConfig:
    """A complete, validated run configuration.

    Build it with ``SpeedtronicConfig.load(source, overrides)`` (mapping, YAML/JSON file or
    text, or another config), ``from_dict``/``from_yaml``, or directly. Construction fills
    derived defaults (``data.block_size``/``vocab_size``/``seed``, ``logging.every_steps`` from
    ``run.log_every``, and what plugins derive from their 2.0 keys) and then
    validates everything; after mutating fields call ``validate()`` again.
    """

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    shape_validation: ShapeValidationConfig = field(default_factory=ShapeValidationConfig)
    compile: bool = False
    ooo_backprop: bool = False
    ooo_streams: int = 4
    callbacks: list[CallbackSpec] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, section_type in _SECTION_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a plain mapping is accepted for a section
                setattr(self, name, section_type.from_dict(value))
            elif not isinstance(value, section_type):
                raise ConfigError(
                    f"{name}: expected a {section_type.__name__} or a mapping, "
                    f"got {type(value).__name__}"
                )
        self._derive_defaults()
        self._normalise_plugin_keys()
        self.validate()

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
        if name in _field_names(type(self)) or name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in self.plugin_keys:
            self.plugin_keys[name] = _jsonable(value)
        else:
            raise AttributeError(f"SpeedtronicConfig has no section {name!r}")

    def __eq__(self, other: object) -> bool:
        """Equal when every setting is, the keys plugins declare included."""
        if not isinstance(other, SpeedtronicConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def _normalise_plugin_keys(self) -> None:
        """Let every installed plugin rewrite its 2.0 keys (``Callback.normalise_legacy``)
        and take back what changed, core sections included."""
        data: dict[str, object] = dict(self.to_dict())
        for _, plugin in configurable_plugins():
            plugin.normalise_legacy(data)
        for key in self.plugin_keys:
            if key in data:
                self.plugin_keys[key] = _jsonable(data[key])
        for name in _SECTION_TYPES:
            section = getattr(self, name)
            values = data.get(name)
            if not isinstance(values, dict):
                continue
            for key, value in values.items():
                if key in section.extensions:
                    section.extensions[key] = _jsonable(value)
                elif value != _jsonable(getattr(section, key)):
                    object.__setattr__(section, key, value)

    def _derive_defaults(self) -> None:
        if self.data.block_size is None:
            self.data.block_size = self.model.max_seq_len
        if self.data.target_batch_size is None:
            self.data.target_batch_size = self.data.micro_batch_size
        if self.data.vocab_size is None:
            self.data.vocab_size = self.model.vocab_size
        if self.data.seed is None:
            self.data.seed = self.run.seed
        if self.run.log_every is not None and self.logging.every_steps == 1:
            self.logging.every_steps = self.run.log_every

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
        errors = config_errors(self.to_dict())
        if errors:
            raise ConfigError(errors)
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
        data, errors = normalise(values)
        errors.extend(config_errors(data))
        if errors:
            raise ConfigError(errors)
        return cls._from_valid(data)

    @classmethod
    def _from_valid(cls, data: Mapping[str, object]) -> SpeedtronicConfig:
        sections = {
            name: section_type._from_valid(_as_mapping(data.get(name)))
            for name, section_type in _SECTION_TYPES.items()
        }
        compile_value = data.get("compile", False)
        if isinstance(compile_value, Mapping):
            compile_value = compile_value.get("enabled", False)
        callbacks = data.get("callbacks", [])
        imports = data.get("imports", [])
        factory = cast("Callable[..., SpeedtronicConfig]", cls)
        config = factory(
            **sections,
            compile=compile_value is True,
            ooo_backprop=data.get("ooo_backprop", False) is True,
            ooo_streams=data.get("ooo_streams", 4),
            callbacks=[CallbackSpec.from_dict(_as_mapping(entry)) for entry in _as_list(callbacks)],
            imports=[str(module) for module in _as_list(imports)],
        )
        given = {key: data[key] for key in config.plugin_keys if key in data}
        if given:
            config.plugin_keys.update((key, _jsonable(value)) for key, value in given.items())
            config.validate()
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
                return source.validate()
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
        values[key] = _jsonable(value)

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
