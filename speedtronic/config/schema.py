"""The run.yaml JSON Schema: loading, composition with plugin schemas, publishing.

The core schema is derived from the declarations of the core's keys
(``speedtronic.config.sections``: one typed field per key), so it is part of the code an
installed wheel runs; ``speedtronic/schemas/run.schema.json`` is a generated copy of it for
other tools, kept current by a test. Each ``callbacks:`` entry is checked by its plugin's own
options schema, composed into the core schema as ``if name == X then <X's schema>`` so that
one ``jsonschema`` pass reports every error.

Plugins own their configuration: the top-level keys a plugin reads (``checkpoint:``, the sink
switches of ``logging:``, ...) are declared by the plugin (``PluginSpec.sections``) and
composed into the run schema here, generically, for every installed plugin; the plugin's own
cross-field rules (``Sections.errors``, ``PluginSpec.options_errors``) run with the core's.
Nothing in this module knows a plugin by name, and nothing here imports the engine.

Validating a configuration against it is ``speedtronic.config.validation``.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import TypeGuard
from urllib.parse import quote

from jsonschema import Draft202012Validator, ValidationError, validators

from speedtronic import plugins
from speedtronic.config import core
from speedtronic.errors import ConfigError as ConfigError
from speedtronic.state.atomic_io import atomic_write_text

SchemaDict = dict[str, object]
"""A JSON Schema document as a plain (JSON-compatible) dict."""

_CORE_SCHEMA_FILE = "run.schema.json"
_CALLBACK_SCHEMA_DIR = "callbacks"
CORE_SCHEMA_ID = "urn:speedtronic:schemas:run"
_DIALECT = "https://json-schema.org/draft/2020-12/schema"

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle")

INT64_MAX = 2**63 - 1
"""The largest integer any ``integer`` key accepts, whatever its schema says: every core key
has a much smaller ``maximum`` (docs/configuration.md, "Bounds"); this also bounds the
integer options of plugins that declare none (``checkpoint.every_steps: 1e41``)."""


MAX_NUMBER_CHARS = 80
"""The longest number a configuration may spell out (any base: ``0x...``, ``0b...``, decimal,
YAML 1.1's sexagesimal ``1:2:3``). 2**63 - 1, the largest integer any key accepts, takes 19
decimal digits; a longer literal is out of range wherever it is, and building or printing it
could take quadratic time or fail (Python's 4,300-digit limit on int/str conversion)."""
MAX_INTEGER_BITS = 256
"""An integer given from Python (a mapping source) wider than this is reported like a number
literal longer than ``MAX_NUMBER_CHARS``, without ever printing its digits."""


class OversizedNumber:
    """A number too long to build or to show, read from configuration text (or a Python int
    wider than ``MAX_INTEGER_BITS``). It stands in the raw configuration only: ``config_errors``
    reports it at its path, so it never reaches a typed config. Its ``repr`` is a short
    preview (``0xffffffff...ffffff``), safe in any message."""

    __slots__ = ("length", "preview")

    def __init__(self, literal: str, length: int | None = None) -> None:
        self.length = len(literal) if length is None else length
        self.preview = literal if len(literal) <= 24 else f"{literal[:12]}...{literal[-6:]}"

    @classmethod
    def of_int(cls, value: int) -> OversizedNumber:
        """A preview of a huge Python int, from its hex digits (linear, never decimal)."""
        digits = round(value.bit_length() * math.log10(2)) + 1  # about that many decimals
        return cls(hex(value), length=digits)

    def describe(self) -> str:
        return (
            f"{self.preview} is a number of {self.length:,} characters, out of range "
            f"(a number in a configuration has at most {MAX_NUMBER_CHARS} characters; "
            f"no integer key accepts more than 2**63 - 1)"
        )

    def __repr__(self) -> str:
        return self.preview

    __str__ = __repr__


def oversized_integer(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a Python int too wide to validate or print (``MAX_INTEGER_BITS``)."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value.bit_length() > MAX_INTEGER_BITS
    )


# -- paths ------------------------------------------------------------------------------


def format_path(parts: Iterable[str | int]) -> str:
    """``["callbacks", 0, "every_steps"]`` -> ``callbacks[0].every_steps``."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "<root>"


# -- the core schema --------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _core() -> SchemaDict:
    """The core schema, derived once from the declarations; shared: never mutate it
    (``core_schema`` returns a copy). The declarations build on this module (they are
    validated with it), so the package hands them down (``speedtronic.config.core``)."""
    return core.declarations().schema_document(dialect=_DIALECT, schema_id=CORE_SCHEMA_ID)


def packaged_core_schema() -> SchemaDict:
    """A fresh copy of the core schema: the core's keys only (what
    ``speedtronic/schemas/run.schema.json`` holds)."""
    return copy.deepcopy(_core())


def _merge_plugin_keys(schema: SchemaDict, key: str, declared: Mapping[str, object]) -> None:
    """Add what a plugin declares for the top-level ``key`` to ``schema``: properties of a
    section the core (or an earlier plugin) already has, else the whole key. Keys that are
    already declared keep their first declaration."""
    root = schema["properties"]
    assert isinstance(root, dict)
    existing = root.get(key)
    if not isinstance(existing, dict):
        root[key] = json.loads(json.dumps(declared))
        return
    properties = existing.setdefault("properties", {})
    assert isinstance(properties, dict)
    for name, spec in mapping_or_empty(declared.get("properties")).items():
        properties.setdefault(name, json.loads(json.dumps(spec)))


@functools.lru_cache(maxsize=4)
def _base(version: int) -> SchemaDict:
    """The core schema plus every installed plugin's 2.0 keys (shared: never mutate)."""
    del version  # the cache key: registering a plugin may declare more keys
    schema = copy.deepcopy(_core())
    for spec in plugins.configurable_specs():
        for key, declared in spec.sections.schema.items():
            _merge_plugin_keys(schema, key, declared)
    return schema


def base() -> SchemaDict:
    """The run schema without the per-callback options (shared: never mutate)."""
    return _base(plugins.callback_registry.version)


def core_schema() -> SchemaDict:
    """A fresh copy of the run schema without the per-callback options: the core plus the
    top-level keys that installed plugins declare (``Sections.schema``)."""
    return copy.deepcopy(base())


def mapping_or_empty(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def section_schema(schema: Mapping[str, object], section: str) -> Mapping[str, object]:
    """The ``properties`` of one section of ``schema`` (``{}`` when absent)."""
    root = mapping_or_empty(schema.get("properties"))
    return mapping_or_empty(mapping_or_empty(root.get(section)).get("properties"))


@functools.lru_cache(maxsize=64)
def section_defaults(section: str, version: int) -> Mapping[str, object]:
    del version
    props = section_schema(base(), section)
    return {key: mapping_or_empty(spec).get("default") for key, spec in props.items()}


def schema_defaults(section: str) -> dict[str, object]:
    """The documented default of every key of ``section`` in the run schema."""
    return copy.deepcopy(dict(section_defaults(section, plugins.callback_registry.version)))


def root_default(key: str) -> object:
    """The documented default of a top-level key of the run schema (of a section: the
    mapping of its keys' defaults)."""
    spec = mapping_or_empty(mapping_or_empty(base().get("properties")).get(key))
    if "properties" in spec:
        return schema_defaults(key)
    return copy.deepcopy(spec.get("default"))


def plugin_root_keys() -> tuple[str, ...]:
    """Top-level keys that only plugins declare (not in the packaged core)."""
    core = mapping_or_empty(_core().get("properties"))
    return tuple(key for key in mapping_or_empty(base().get("properties")) if key not in core)


def plugin_section_keys(section: str) -> tuple[str, ...]:
    """Keys that plugins add to a core section."""
    core = section_schema(_core(), section)
    return tuple(key for key in section_schema(base(), section) if key not in core)


def section_names() -> tuple[str, ...]:
    """Top-level keys of the run schema that are sections (mappings of settings)."""
    root = mapping_or_empty(base().get("properties"))
    return tuple(key for key, spec in root.items() if "properties" in mapping_or_empty(spec))


def section_aliases() -> dict[str, str]:
    """Other top-level spellings of sections, as plugins declare them (alias -> key)."""
    aliases: dict[str, str] = {}
    for spec in plugins.configurable_specs():
        for alias, key in spec.sections.aliases.items():
            aliases.setdefault(alias, key)
    return aliases


# -- composition with plugin schemas ----------------------------------------------------


def callback_schema_id(name: str) -> str:
    """The ``$id`` a callback plugin's options schema gets once composed or published."""
    return f"urn:speedtronic:schemas:callbacks:{quote(name, safe='')}"


def callback_entry_schema(name: str, options_schema: Mapping[str, object]) -> SchemaDict:
    """A plugin's options schema turned into the schema of a whole ``callbacks:`` entry.

    The entry also holds ``name``, so it is added as a property (a plugin schema that
    forbids additional properties would otherwise reject it). An ``$id`` makes the schema
    its own resource, so its internal ``#/$defs/...`` references keep working when it is
    embedded in the run schema.
    """
    entry: SchemaDict = json.loads(json.dumps(options_schema))
    entry.pop("$schema", None)
    entry.setdefault("$id", callback_schema_id(name))
    properties = dict(mapping_or_empty(entry.get("properties")))
    properties["name"] = {"const": name, "description": "Callback plugin name."}
    entry["properties"] = properties
    return entry


def _model_option_schemas(names: Iterable[str] | None = None) -> dict[str, Mapping[str, object]]:
    """The ``model.options`` schema of each named model that declares one (default: every
    model the registry knows); models that fail to load are left out."""
    from speedtronic.models.registry import registry

    found: dict[str, Mapping[str, object]] = {}
    for name in registry.names() if names is None else names:
        try:
            declared = registry.options_schema(name)
        except plugins.PluginError:
            continue
        if declared is not None:
            found[name] = declared
    return found


def _add_model_options(
    schema: SchemaDict, model_schemas: Mapping[str, Mapping[str, object]]
) -> None:
    """``if model.name == X then model.options: <X's schema>`` for editors (validation
    checks ``model.options`` in ``_model_rules``)."""
    model = mapping_or_empty(mapping_or_empty(schema["properties"]).get("model"))
    if not model_schemas or not isinstance(model, dict):
        return
    model["allOf"] = [
        {
            "if": {"properties": {"name": {"const": name}}, "required": ["name"]},
            "then": {"properties": {"options": json.loads(json.dumps(model_schemas[name]))}},
        }
        for name in sorted(model_schemas)
    ]


def _compose(
    plugin_schemas: Mapping[str, Mapping[str, object]],
    model_schemas: Mapping[str, Mapping[str, object]] | None = None,
) -> SchemaDict:
    schema = core_schema()
    _add_model_options(schema, model_schemas or {})
    if not plugin_schemas:
        return schema
    callbacks = mapping_or_empty(mapping_or_empty(schema["properties"]).get("callbacks"))
    items = callbacks.get("items")
    assert isinstance(items, dict), "core schema: callbacks.items must be an object"
    items["allOf"] = [
        {
            "if": {"properties": {"name": {"const": name}}, "required": ["name"]},
            "then": callback_entry_schema(name, plugin_schemas[name]),
        }
        for name in sorted(plugin_schemas)
    ]
    return schema


def composed_schema(
    plugin_names: Iterable[str] | None = None, *, model_options: bool = False
) -> SchemaDict:
    """The core schema plus the options schema of each named callback plugin (default:
    every plugin the registry knows, registered or declared by an entry point); with
    ``model_options``, also the ``model.options`` schema of every model that declares one."""
    names = plugins.callback_registry.names() if plugin_names is None else tuple(plugin_names)
    option_schemas = {name: plugins.callback_options_schema(name) for name in names}
    return _compose(option_schemas, _model_option_schemas() if model_options else None)


_DRAFT_TYPE = Draft202012Validator.VALIDATORS["type"]


def _type_within_int64(
    validator: Draft202012Validator, types: object, instance: object, schema: Mapping[str, object]
) -> Iterator[ValidationError]:
    """The draft's ``type`` check, plus: a value for an ``integer`` key lies in 64 bits when
    its schema sets no bound on that side (a whole float like ``1e41`` counts as an integer)."""
    yield from _DRAFT_TYPE(validator, types, instance, schema)
    wanted = types if isinstance(types, list) else [types]
    if "integer" not in wanted or not validator.is_type(instance, "integer"):
        return
    assert isinstance(instance, (int, float))
    if instance > INT64_MAX and "maximum" not in schema and "exclusiveMaximum" not in schema:
        yield ValidationError(f"{instance!r} is greater than the maximum of {INT64_MAX}")
    if -instance > INT64_MAX + 1 and "minimum" not in schema and "exclusiveMinimum" not in schema:
        yield ValidationError(f"{instance!r} is less than the minimum of {-INT64_MAX - 1}")


_Validator: type[Draft202012Validator] = validators.extend(  # type: ignore[no-untyped-call]  # jsonschema leaves extend unannotated
    Draft202012Validator, {"type": _type_within_int64}
)


@functools.lru_cache(maxsize=4)
def _base_validator(version: int) -> Draft202012Validator:
    del version
    return _Validator(base())


def composed_validator(plugin_schemas: Mapping[str, Mapping[str, object]]) -> Draft202012Validator:
    if not plugin_schemas:
        return _base_validator(plugins.callback_registry.version)
    return _Validator(_compose(plugin_schemas))


def core_maximum(section: str, key: str) -> int | float:
    """The ``maximum`` of a core key (``core_maximum("run", "max_steps")``)."""
    bound = mapping_or_empty(section_schema(_core(), section).get(key)).get("maximum")
    assert isinstance(bound, (int, float)), f"{section}.{key} has no maximum"
    return bound


# -- published schema files -------------------------------------------------------------


def builtin_callback_names() -> tuple[str, ...]:
    """Callback plugins that speedtronic itself declares as entry points (the ones whose
    schemas are published in the repository's ``schemas/`` folder)."""
    names = {
        entry.name
        for entry in metadata.entry_points(group=plugins.CALLBACK_GROUP)
        if entry.dist is not None and entry.dist.name == "speedtronic"
    }
    return tuple(sorted(names))


def _dump(schema: Mapping[str, object]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def rendered_schemas(plugin_names: Iterable[str] | None = None) -> dict[str, str]:
    """Relative path -> file text of every published schema document."""
    names = builtin_callback_names() if plugin_names is None else tuple(sorted(plugin_names))
    option_schemas = {name: plugins.callback_options_schema(name) for name in names}
    files = {_CORE_SCHEMA_FILE: _dump(_compose(option_schemas))}
    for name, options in option_schemas.items():
        document: SchemaDict = {
            "$schema": _DIALECT,
            "$id": callback_schema_id(name),
            "title": f"speedtronic callback {name!r} options",
        }
        plugin_document: SchemaDict = json.loads(json.dumps(options))
        plugin_document.pop("$schema", None)
        document.update(plugin_document)
        files[f"{_CALLBACK_SCHEMA_DIR}/{name}.schema.json"] = _dump(document)
    return files


def write_packaged_core_schema() -> Path:
    """Rewrite the package's copy of the core schema (``speedtronic/schemas/run.schema.json``,
    for tools that read a file) from the declarations; returns its path."""
    path = Path(__file__).resolve().parent.parent / "schemas" / _CORE_SCHEMA_FILE
    atomic_write_text(path, _dump(_core()))
    return path


def write_schemas(directory: Path, plugin_names: Iterable[str] | None = None) -> list[Path]:
    """Write ``run.schema.json`` (core + plugin schemas) and ``callbacks/<name>.schema.json``
    per plugin into ``directory``; stale ``callbacks/*.schema.json`` files are removed so the
    folder mirrors the code. ``plugin_names`` defaults to speedtronic's own callback plugins
    (pass ``callback_registry.names()`` to include every installed and registered one)."""
    directory = Path(directory)
    files = rendered_schemas(plugin_names)
    written: list[Path] = []
    for relative, text in files.items():
        path = directory / relative
        atomic_write_text(path, text)  # an editor reading it never sees half a schema
        written.append(path)
    callback_dir = directory / _CALLBACK_SCHEMA_DIR
    if callback_dir.is_dir():
        for stale in callback_dir.glob("*.schema.json"):
            if f"{_CALLBACK_SCHEMA_DIR}/{stale.name}" not in files:
                stale.unlink()
    return written
