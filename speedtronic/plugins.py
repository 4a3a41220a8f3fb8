"""Named plugins: callbacks, models and datasets, found by registration or entry points; and
what a callback plugin declares (``PluginSpec``).

A plugin is visible to ``speedtronic fit`` when it is registered in a module listed under
``imports:`` in the config, or when an installed distribution declares it under one of the
entry-point groups below -- exactly how the built-in callbacks in ``callbacks/`` are found
(the engine never imports that package directly).

A callback plugin is two things apart: its ``Callback`` class (hooks and state, the engine's
business) and its ``PluginSpec`` -- the name, the options type and schema, the 2.0 section
it reads (``Sections``), where it goes in a run (order) and how it is built. Config
validation and the composition root read the spec only, so this module, and
``speedtronic.config``, import nothing of the engine. A built-in declares its spec from an
options dataclass with ``speedtronic.config.declare.plugin``; a class written against the
class-attribute API (``plugin_name``, ``options_schema``, ``from_options``,
``legacy_sections``, ...) is adapted into one (``spec_of_class``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Literal, TypeVar, cast, overload

import torch

# ``speedtronic.util.options`` (options dataclasses -> schemas) and ``speedtronic.user_imports``
# are imported by the functions that read declarations or user modules: a Trainer built in
# Python imports this module for the hook API's names and uses neither.
if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.engine.callback import Callback

T = TypeVar("T")

CALLBACK_GROUP = "speedtronic.callbacks"
MODEL_GROUP = "speedtronic.models"
DATASET_GROUP = "speedtronic.datasets"


_NAME_HINT_CUTOFF = 0.7
"""How close (``difflib`` ratio) a known name must be to a mistyped one to be suggested:
``jsonn`` -> ``jsonl`` is 0.8, ``consol`` -> ``console`` 0.92."""


def closest_name(name: str, names: Sequence[str]) -> str | None:
    """The known name to suggest for a mistyped ``name``: the closest by ``difflib``, else the
    only known name in the same family (the same first ``_`` part: ``hf_lama`` ->
    ``hf_causal_lm``, whose ratio is too low), else none."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=_NAME_HINT_CUTOFF)
    if close:
        return close[0]
    family, underscore, _ = name.partition("_")
    if not underscore:
        return None
    kin = [known for known in names if known.startswith(family + "_")]
    return kin[0] if len(kin) == 1 else None


class PluginError(KeyError):
    """An unknown plugin name, or an entry point that fails to load."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class PluginContext:
    """What a plugin gets when it is built from config."""

    config: SpeedtronicConfig
    output_dir: Path
    device: torch.device


class PluginRegistry(Generic[T]):
    """Name -> plugin, filled by ``register`` and, lazily, by an entry-point group.

    Registration wins over an entry point of the same name (and silently replaces an
    earlier registration, as the original model registry did).
    """

    def __init__(self, kind: str, group: str | None) -> None:
        self.kind = kind
        self.group = group
        self._items: dict[str, T] = {}
        self._origins: dict[str, str] = {}
        self._lock = threading.Lock()
        self._declared: dict[str, metadata.EntryPoint] | None = None
        self.version = 0
        """Bumped by every registration (lets callers cache what they derive)."""

    @overload
    def register(self, name: str, obj: None = None) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T) -> T: ...

    def register(self, name: str, obj: T | None = None) -> T | Callable[[T], T]:
        """Register ``obj`` under ``name``; without ``obj`` returns a decorator."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorate(item: T) -> T:
            with self._lock:
                self._items[name] = item
                module = getattr(item, "__module__", None) or "<unknown>"
                self._origins[name] = f"registered in {module}"
                self.version += 1
            return item

        return decorate if obj is None else decorate(obj)

    def unregister(self, name: str) -> None:
        """Forget a registration (tests, examples); an entry point of that name stays."""
        with self._lock:
            self._items.pop(name, None)
            self._origins.pop(name, None)
            self.version += 1

    def _entry_points(self) -> dict[str, metadata.EntryPoint]:
        """The group's entry points, read once per process (installing a distribution
        while a process runs is not supported)."""
        if self.group is None:
            return {}
        if self._declared is None:
            self._declared = {ep.name: ep for ep in metadata.entry_points(group=self.group)}
        return self._declared

    def names(self) -> tuple[str, ...]:
        """Every known name, registered or declared by an entry point, sorted."""
        return tuple(sorted(set(self._items) | set(self._entry_points())))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def get(self, name: str) -> T:
        """The plugin called ``name``; ``PluginError`` (a ``KeyError``) names the known ones."""
        with self._lock:
            if name in self._items:
                return self._items[name]
        entry = self._entry_points().get(name)
        if entry is None:
            raise PluginError(self.unknown(name))
        try:
            loaded: T = entry.load()
        except Exception as exc:  # a broken third-party plugin must name itself
            raise PluginError(
                f"{self.kind} {name!r} from entry point {entry.value!r} failed to load: {exc}"
            ) from exc
        with self._lock:
            self._items.setdefault(name, loaded)
            dist = entry.dist.name if entry.dist is not None else "?"
            self._origins.setdefault(name, f"entry point {entry.value} ({dist})")
            return self._items[name]

    def unknown(self, name: str) -> str:
        """What is wrong with a name nothing registered: ``unknown model 'referance_model'
        (did you mean 'reference_model'? known: ...)`` -- the closest known name, when one is
        close, then every known name."""
        names = self.names()
        close = closest_name(name, names)
        hint = f"did you mean {close!r}? " if close else ""
        return f"unknown {self.kind} {name!r} ({hint}known: {', '.join(names) or 'none'})"

    def origin(self, name: str) -> str:
        """Where ``name`` comes from (for ``speedtronic plugins``)."""
        if name not in self._origins:
            entry = self._entry_points().get(name)
            if entry is not None:
                dist = entry.dist.name if entry.dist is not None else "?"
                return f"entry point {entry.value} ({dist})"
            self.get(name)
        return self._origins[name]


# == callback plugins: what they declare ===============================================

JSONSchema = Mapping[str, object]
"""A JSON Schema document (draft 2020-12) as a mapping."""

EMPTY_OPTIONS_SCHEMA: JSONSchema = {"type": "object", "additionalProperties": False}

SectionData = Mapping[str, object]
"""The top-level keys a plugin reads (``Sections.keys``), as validated plain data
(``{"checkpoint": {"every_steps": 500, ...}}``); a key the config leaves out holds its schema
defaults."""

PluginOptions = dict[str, object]
"""Options of one ``callbacks:`` entry (``name`` excluded), as plain data."""

RankPolicy = Literal["all", "main", "local_main"]
"""Which ranks of a distributed run call a callback's hooks (``Callback.rank_policy``)."""


def section_of(sections: SectionData, key: str) -> Mapping[str, object]:
    """The mapping under ``key`` of ``sections`` (``{}`` when absent or not a mapping)."""
    value = sections.get(key)
    return cast("Mapping[str, object]", value) if isinstance(value, Mapping) else {}


def keys_of(sections: SectionData, key: str, declaring: type[T]) -> T:
    """The keys the dataclass ``declaring`` declares under the top-level ``key``, typed
    (``keys_of(sections, "logging", ConsoleLoggingKeys).console``): built from the validated
    sections without checking them again; a key left out takes its declared default."""
    from speedtronic.util import options as declaration

    section = section_of(sections, key)
    names = {item.name for item in declaration.declared(declaring)}
    return declaration.build(
        declaring, {name: value for name, value in section.items() if name in names}
    )


def _no_rewrite(data: dict[str, object]) -> None:
    del data


def _no_section_errors(sections: SectionData) -> Iterator[str]:
    del sections
    return iter(())


OptionRules = Callable[[str, Mapping[str, object], SectionData], Iterator[str]]
"""Cross-field rules of one ``callbacks:`` entry: ``(path, options, sections) -> messages``."""


def _no_option_errors(
    entry: str, options: Mapping[str, object], sections: SectionData
) -> Iterator[str]:
    del entry, options, sections
    return iter(())


@dataclass(frozen=True)
class Sections:
    """The top-level config keys a plugin reads besides its ``callbacks:`` entry: the
    ``checkpoint:`` section, the sink switches of ``logging:``, DiLoCo's ``distributed:`` keys.
    The core composes them into the run schema and knows none of them by name."""

    keys: tuple[str, ...] = ()
    """The top-level keys read (``("checkpoint",)``)."""
    schema: Mapping[str, JSONSchema] = field(default_factory=dict)
    """JSON Schema of what the plugin adds under those keys, by key. An object schema whose
    key the core also declares (``logging``) contributes its ``properties`` to it; any other
    becomes the key's whole schema."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Other top-level spellings of a section (``{"hub": "distributed"}``), used when the
    canonical key is absent."""
    to_options: (
        Callable[[SectionData, Mapping[str, object] | None], PluginOptions | None] | None
    ) = None
    """The one place the sections become options: given the sections and the options of
    the plugin's ``callbacks:`` entry (``None`` when the config does not name it), the
    options to build with, or ``None`` to leave an unnamed plugin out. Without it a named
    plugin gets its own options and an unnamed one is added (with none) only when it is on
    by default."""
    normalise: Callable[[dict[str, object]], None] = _no_rewrite
    """Rewrite the keys in a raw config mapping, in place, before validation (case folding,
    derived values). Idempotent; leaves values of a wrong type alone; never raises."""
    errors: Callable[[SectionData], Iterator[str]] = _no_section_errors
    """Cross-field rules of the sections (defaults filled in), run after the schema pass of
    every config; each message starts with its path (``distributed.hub_dir: ...``)."""
    declared: Mapping[str, type] = field(default_factory=dict)
    """The options dataclass that declares what the plugin adds under a key, by key: each
    field one key with its type, default and ``Opt`` (``speedtronic.util.options``), the
    only declaration of that key. The key's ``schema`` is derived from it (where ``schema``
    does not give one), and the plugin reads the keys typed: ``keys_of(sections, key,
    declaring)`` from validated data, ``section.keys_of(declaring)`` on a built config."""

    def __post_init__(self) -> None:
        from speedtronic.util import options as declaration

        derived = {
            key: declaration.object_schema(declaring)
            for key, declaring in self.declared.items()
            if key not in self.schema
        }
        if derived:
            object.__setattr__(self, "schema", {**self.schema, **derived})


@dataclass(frozen=True)
class PluginSpec:
    """What a callback plugin declares, apart from its hooks: its name and options, the
    sections it reads, its place in a run, and how it is built from validated options.

    ``create(options, context)`` is what the runtime calls: the options are plain data the
    composed schema has accepted; ``parse`` makes them the typed options object (without
    checking them again) and ``build`` the callback.
    """

    name: str
    callback: type[Callback]
    """The class the plugin builds (for the per-event plan, its rank policy, ...)."""
    options_schema: JSONSchema = field(default_factory=lambda: EMPTY_OPTIONS_SCHEMA)
    """The JSON Schema of a ``callbacks:`` entry's options (``name`` excluded)."""
    options_type: type | None = None
    """The options dataclass the schema is derived from (``None``: a hand-written schema)."""
    parse: Callable[[Mapping[str, object]], object] = dict
    build: Callable[[object, PluginContext], Callback] | None = None
    sections: Sections = field(default_factory=Sections)
    options_errors: OptionRules = _no_option_errors
    """Cross-field rules of one ``callbacks:`` entry naming this plugin, after the schema
    pass; the first argument is its path (``callbacks[2]``), to start each message with."""
    enabled_by_default: bool = False
    """Add the plugin to every run whose config does not name it (unless its sections turn
    it off)."""
    default_replaced_by: tuple[str, ...] = ()
    """Plugins that, when named in ``callbacks:``, stand in for this default one."""
    implied_order: int = 0
    """Where the plugin goes when the config turns it on without naming it: a negative value
    before the ``callbacks:`` list, otherwise after it; ascending, ties by name."""

    @property
    def rank_policy(self) -> RankPolicy:
        """Where its callbacks run in a distributed run (``Callback.rank_policy``)."""
        return self.callback.rank_policy

    @property
    def composed(self) -> bool:
        """Whether the core composes something of this plugin into every config: it is on
        by default, or reads top-level sections."""
        return self.enabled_by_default or bool(self.sections.keys)

    def create(self, options: Mapping[str, object], context: PluginContext) -> Callback:
        """The callback of one ``callbacks:`` entry, from its validated options."""
        assert self.build is not None, f"plugin {self.name!r} declares no builder"
        return self.build(self.parse(options), context)

    def options_for(
        self, sections: SectionData, options: Mapping[str, object] | None
    ) -> PluginOptions | None:
        """The options this plugin is built with (``Sections.to_options``), or ``None`` when
        an unnamed plugin stays out."""
        if self.sections.to_options is not None:
            return self.sections.to_options(sections, options)
        if options is not None:
            return dict(options)
        return {} if self.enabled_by_default else None


def spec_of_class(name: str, cls: type[Callback]) -> PluginSpec:
    """The spec of a callback class registered as ``name``: the one it declares (``plugin``),
    else one adapted from its class attributes -- ``options_schema``, ``from_options`` (default:
    the options as keyword arguments), ``build``, ``enabled_by_default``,
    ``default_replaced_by``, ``implied_order``, ``legacy_sections``, ``legacy_schema``,
    ``legacy_aliases`` and the classmethods ``options_from_legacy``, ``normalise_legacy``,
    ``legacy_errors``, ``options_errors`` -- so plugins written against that API keep working."""
    declared = cls.__dict__.get("__plugin_spec__")
    if isinstance(declared, PluginSpec):
        return declared if declared.name == name else dataclasses.replace(declared, name=name)
    get = functools.partial(getattr, cls)
    enabled = bool(get("enabled_by_default", False))

    def to_options(
        sections: SectionData, options: Mapping[str, object] | None
    ) -> PluginOptions | None:
        legacy = get("options_from_legacy", None)
        if callable(legacy):
            return cast("PluginOptions | None", legacy(sections, options))
        if options is not None:
            return dict(options)
        return {} if enabled else None

    def build(options: object, context: PluginContext) -> Callback:
        builder = get("build", None) or get("from_options", None)
        if callable(builder):
            return cast("Callback", builder(options, context))
        factory = cast("Callable[..., Callback]", cls)
        return factory(**cast("Mapping[str, object]", options))

    schema = get("options_schema", EMPTY_OPTIONS_SCHEMA)
    return PluginSpec(
        name=name,
        callback=cls,
        options_schema=cast(JSONSchema, schema),
        build=build,
        sections=Sections(
            keys=tuple(get("legacy_sections", ())),
            schema=get("legacy_schema", {}),
            aliases=get("legacy_aliases", {}),
            to_options=to_options,
            normalise=get("normalise_legacy", _no_rewrite),
            errors=get("legacy_errors", _no_section_errors),
        ),
        options_errors=get("options_errors", _no_option_errors),
        enabled_by_default=enabled,
        default_replaced_by=tuple(get("default_replaced_by", ())),
        implied_order=int(get("implied_order", 0)),
    )


# == the callback registry ===============================================================


def _is_callback_class(item: object) -> bool:
    """Whether ``item`` is a ``Callback`` subclass. This module sits below the engine and
    never imports it: a subclass can only exist once ``speedtronic.engine.callback`` is."""
    module = sys.modules.get("speedtronic.engine.callback")
    base = getattr(module, "Callback", None)
    return isinstance(item, type) and isinstance(base, type) and issubclass(item, base)


callback_registry: PluginRegistry[type[Callback]] = PluginRegistry("callback", CALLBACK_GROUP)
"""Callback classes by the name used in ``callbacks:`` (each with its ``PluginSpec``)."""


_CallbackClass = TypeVar("_CallbackClass", bound="type[Callback]")


def register_callback(name: str) -> Callable[[_CallbackClass], _CallbackClass]:
    """Class decorator: make a ``Callback`` subclass usable as ``{name: <name>}`` in config."""

    def decorate(cls: _CallbackClass) -> _CallbackClass:
        if not _is_callback_class(cls):
            raise TypeError(f"register_callback({name!r}) needs a Callback subclass, got {cls!r}")
        callback_registry.register(name, cls)
        return cls

    return decorate


def register_plugin(spec: PluginSpec) -> PluginSpec:
    """Make a callback plugin usable as ``{name: <spec.name>}`` in config from its spec (a
    plugin built without ``declare.plugin``); ``spec.callback`` is what the registry holds
    and ``plugin_spec(spec.name)`` then answers ``spec``. Returns the spec."""
    if not _is_callback_class(spec.callback):
        raise TypeError(f"register_plugin({spec.name!r}) needs a Callback subclass")
    # The registry holds classes (as entry points name them); the spec travels on its class.
    spec.callback.__plugin_spec__ = spec  # type: ignore[attr-defined]  # read by spec_of_class
    callback_registry.register(spec.name, spec.callback)
    return spec


def import_modules(modules: Iterable[str]) -> None:
    """Import user modules (the config's ``imports:``) so their registrations run; the CLI
    also looks for them in the working and config directories (``speedtronic.user_imports``)."""
    from speedtronic.user_imports import import_user_module

    for module in modules:
        try:
            import_user_module(module)
        except ImportError as exc:
            raise PluginError(f"imports: cannot import {module!r}: {exc}") from exc


def plugin_spec(name: str) -> PluginSpec:
    """The ``PluginSpec`` of the callback plugin ``name`` (``PluginError`` when unknown)."""
    return _spec(name, callback_registry.version)


@functools.lru_cache(maxsize=256)
def _spec(name: str, version: int) -> PluginSpec:
    del version  # the cache key: a registration may replace a plugin
    return spec_of_class(name, callback_registry.get(name))


def callback_options_schema(name: str) -> Mapping[str, object]:
    """The JSON Schema of a callback plugin's options (``name`` excluded)."""
    return plugin_spec(name).options_schema


def build_callback(name: str, options: Mapping[str, object], context: PluginContext) -> Callback:
    """Instantiate the callback plugin ``name`` from already-validated options."""
    return plugin_spec(name).create(options, context)


def configurable_specs() -> tuple[PluginSpec, ...]:
    """The spec of every known callback plugin whose configuration the core composes (on by
    default, or reading top-level sections: ``PluginSpec.composed``). Plugins that fail to
    load are left out here (naming one in ``callbacks:`` reports its error)."""
    return _configurable_specs(callback_registry.version)


@functools.lru_cache(maxsize=4)
def _configurable_specs(version: int) -> tuple[PluginSpec, ...]:
    del version  # the cache key: a registration may add or replace a plugin
    found: list[PluginSpec] = []
    for name in callback_registry.names():
        try:
            plugin_class = callback_registry.get(name)
        except PluginError:
            continue
        if not _is_callback_class(plugin_class):
            continue
        spec = plugin_spec(name)
        if spec.composed:
            found.append(spec)
    return tuple(found)


def sections_of(spec: PluginSpec, data: Mapping[str, object]) -> dict[str, object]:
    """The top-level sections ``spec`` reads, taken from a normalised config mapping."""
    return {key: data[key] for key in spec.sections.keys if key in data}
