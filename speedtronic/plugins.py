"""Named plugins: callbacks, models and datasets, found by registration or entry points.

A plugin is visible to ``speedtronic fit`` when it is registered in a module listed under
``imports:`` in the config, or when an installed distribution declares it under one of the
entry-point groups below -- exactly how the built-in callbacks in ``callbacks/`` are found
(the engine never imports that package directly).
"""

from __future__ import annotations

import difflib
import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar, overload

import torch

from speedtronic.engine.callback import Callback
from speedtronic.user_imports import import_user_module

if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig

T = TypeVar("T")

CALLBACK_GROUP = "speedtronic.callbacks"
MODEL_GROUP = "speedtronic.models"
DATASET_GROUP = "speedtronic.datasets"


NAME_HINT_CUTOFF = 0.7
"""How close (``difflib`` ratio) a known name must be to a mistyped one to be suggested:
``jsonn`` -> ``jsonl`` is 0.8, ``consol`` -> ``console`` 0.92."""


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
        close = difflib.get_close_matches(name, names, n=1, cutoff=NAME_HINT_CUTOFF)
        hint = f"did you mean {close[0]!r}? " if close else ""
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


callback_registry: PluginRegistry[type[Callback]] = PluginRegistry("callback", CALLBACK_GROUP)
"""Callbacks by the name used in ``callbacks:``."""


CallbackClass = TypeVar("CallbackClass", bound=type[Callback])


def register_callback(name: str) -> Callable[[CallbackClass], CallbackClass]:
    """Class decorator: make a ``Callback`` subclass usable as ``{name: <name>}`` in config."""

    def decorate(cls: CallbackClass) -> CallbackClass:
        if not (isinstance(cls, type) and issubclass(cls, Callback)):
            raise TypeError(f"register_callback({name!r}) needs a Callback subclass, got {cls!r}")
        callback_registry.register(name, cls)
        return cls

    return decorate


def import_modules(modules: Iterable[str]) -> None:
    """Import user modules (the config's ``imports:``) so their registrations run; the CLI
    also looks for them in the working and config directories (``speedtronic.user_imports``)."""
    for module in modules:
        try:
            import_user_module(module)
        except ImportError as exc:
            raise PluginError(f"imports: cannot import {module!r}: {exc}") from exc


def callback_options_schema(name: str) -> Mapping[str, object]:
    """The JSON Schema of a callback plugin's options (``name`` excluded)."""
    return callback_registry.get(name).options_schema


def build_callback(name: str, options: Mapping[str, object], context: PluginContext) -> Callback:
    """Instantiate the callback plugin ``name`` from already-validated options."""
    return callback_registry.get(name).build(options, context)


def configurable_plugins() -> tuple[tuple[str, type[Callback]], ...]:
    """``(name, class)`` of every known callback plugin that declares configuration the
    core composes: on by default, or reading 2.0 sections. Plugins that fail to load are
    left out here (naming one in ``callbacks:`` reports its error)."""
    return _configurable_plugins(callback_registry.version)


@functools.lru_cache(maxsize=4)
def _configurable_plugins(version: int) -> tuple[tuple[str, type[Callback]], ...]:
    del version  # the cache key: a registration may add or replace a plugin
    found: list[tuple[str, type[Callback]]] = []
    for name in callback_registry.names():
        try:
            plugin = callback_registry.get(name)
        except PluginError:
            continue
        if not (isinstance(plugin, type) and issubclass(plugin, Callback)):
            continue
        if plugin.enabled_by_default or plugin.legacy_sections:
            found.append((name, plugin))
    return tuple(found)


def legacy_sections_of(plugin: type[Callback], data: Mapping[str, object]) -> dict[str, object]:
    """The 2.0 sections ``plugin`` declared, taken from a normalised config mapping."""
    return {key: data[key] for key in plugin.legacy_sections if key in data}
