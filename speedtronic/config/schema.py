"""The run.yaml JSON Schema: loading, composition with plugin schemas, validation, publishing.

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

``config_errors`` is the single validation entry point: imports, plugin lookup, schema and
cross-field rules, every problem as one ``"<path>: <message>"`` string.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Protocol, TypeGuard, cast
from urllib.parse import quote

from jsonschema import Draft202012Validator, ValidationError, validators
from jsonschema.exceptions import SchemaError

from speedtronic import plugins
from speedtronic.errors import ConfigError as ConfigError
from speedtronic.state.atomic_io import atomic_write_text

SchemaDict = dict[str, object]
"""A JSON Schema document as a plain (JSON-compatible) dict."""

CORE_SCHEMA_FILE = "run.schema.json"
CALLBACK_SCHEMA_DIR = "callbacks"
CORE_SCHEMA_ID = "urn:speedtronic:schemas:run"
DIALECT = "https://json-schema.org/draft/2020-12/schema"

_PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle")

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
    validated with it), so they are read when first needed."""
    from speedtronic.config.sections import core_schema_document

    return core_schema_document(dialect=DIALECT, schema_id=CORE_SCHEMA_ID)


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
    for name, spec in _mapping(declared.get("properties")).items():
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


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def section_schema(schema: Mapping[str, object], section: str) -> Mapping[str, object]:
    """The ``properties`` of one section of ``schema`` (``{}`` when absent)."""
    root = _mapping(schema.get("properties"))
    return _mapping(_mapping(root.get(section)).get("properties"))


@functools.lru_cache(maxsize=64)
def _defaults(section: str, version: int) -> Mapping[str, object]:
    del version
    props = section_schema(base(), section)
    return {key: _mapping(spec).get("default") for key, spec in props.items()}


def schema_defaults(section: str) -> dict[str, object]:
    """The documented default of every key of ``section`` in the run schema."""
    return copy.deepcopy(dict(_defaults(section, plugins.callback_registry.version)))


def root_default(key: str) -> object:
    """The documented default of a top-level key of the run schema (of a section: the
    mapping of its keys' defaults)."""
    spec = _mapping(_mapping(base().get("properties")).get(key))
    if "properties" in spec:
        return schema_defaults(key)
    return copy.deepcopy(spec.get("default"))


def plugin_root_keys() -> tuple[str, ...]:
    """Top-level keys that only plugins declare (not in the packaged core)."""
    core = _mapping(_core().get("properties"))
    return tuple(key for key in _mapping(base().get("properties")) if key not in core)


def plugin_section_keys(section: str) -> tuple[str, ...]:
    """Keys that plugins add to a core section."""
    core = section_schema(_core(), section)
    return tuple(key for key in section_schema(base(), section) if key not in core)


def section_names() -> tuple[str, ...]:
    """Top-level keys of the run schema that are sections (mappings of settings)."""
    root = _mapping(base().get("properties"))
    return tuple(key for key, spec in root.items() if "properties" in _mapping(spec))


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
    properties = dict(_mapping(entry.get("properties")))
    properties["name"] = {"const": name, "description": "Callback plugin name."}
    entry["properties"] = properties
    return entry


def model_option_schemas(names: Iterable[str] | None = None) -> dict[str, Mapping[str, object]]:
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
    model = _mapping(_mapping(schema["properties"]).get("model"))
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
    callbacks = _mapping(_mapping(schema["properties"]).get("callbacks"))
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
    return _compose(option_schemas, model_option_schemas() if model_options else None)


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


def _validator(plugin_schemas: Mapping[str, Mapping[str, object]]) -> Draft202012Validator:
    if not plugin_schemas:
        return _base_validator(plugins.callback_registry.version)
    return _Validator(_compose(plugin_schemas))


def core_maximum(section: str, key: str) -> int | float:
    """The ``maximum`` of a core key (``core_maximum("run", "max_steps")``)."""
    bound = _mapping(section_schema(_core(), section).get(key)).get("maximum")
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
    files = {CORE_SCHEMA_FILE: _dump(_compose(option_schemas))}
    for name, options in option_schemas.items():
        document: SchemaDict = {
            "$schema": DIALECT,
            "$id": callback_schema_id(name),
            "title": f"speedtronic callback {name!r} options",
        }
        plugin_document: SchemaDict = json.loads(json.dumps(options))
        plugin_document.pop("$schema", None)
        document.update(plugin_document)
        files[f"{CALLBACK_SCHEMA_DIR}/{name}.schema.json"] = _dump(document)
    return files


def write_packaged_core_schema() -> Path:
    """Rewrite the package's copy of the core schema (``speedtronic/schemas/run.schema.json``,
    for tools that read a file) from the declarations; returns its path."""
    path = Path(__file__).resolve().parent.parent / "schemas" / CORE_SCHEMA_FILE
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
    callback_dir = directory / CALLBACK_SCHEMA_DIR
    if callback_dir.is_dir():
        for stale in callback_dir.glob("*.schema.json"):
            if f"{CALLBACK_SCHEMA_DIR}/{stale.name}" not in files:
                stale.unlink()
    return written


# -- validation -------------------------------------------------------------------------


def config_errors(data: Mapping[str, object], *, imported: bool = False) -> list[str]:
    """Every problem of a normalised configuration mapping (see ``loading.normalise``).

    Order: ``imports`` first (they may register the plugins that follow; ``imported``: the
    caller has imported them already, with ``import_errors``), then plugin names
    (callbacks, the model, datasets, the collate function: an unknown one with the closest
    known name), then the composed-schema pass, non-finite or non-JSON values, and the
    cross-field rules. Nothing is imported except the listed ``imports``.
    """
    data, oversized = _without_oversized_numbers(data)
    errors = [] if imported else import_errors(data.get("imports"))
    plugin_schemas, plugin_errors = _referenced_plugin_schemas(data.get("callbacks"))
    errors.extend(plugin_errors)
    errors.extend(_plugin_name_errors(_Values(data)))
    # A number too long to be anything is reported as that, not as a type mismatch.
    schema_errors = [
        (path, message)
        for path, message in _schema_errors(_validator(plugin_schemas), data)
        if path not in oversized
    ]
    errors.extend(message for _, message in schema_errors)
    errors.extend(oversized.values())
    reported = {path for path, _ in schema_errors} | set(oversized)
    errors.extend(
        message
        for path, message in _value_errors(data)
        if not any(path == seen or path.startswith(seen + ".") for seen in reported)
    )
    errors.extend(cross_field_errors(data))
    return errors


def _without_oversized_numbers(
    data: Mapping[str, object],
) -> tuple[Mapping[str, object], dict[str, str]]:
    """``data`` with every Python int wider than ``MAX_INTEGER_BITS`` replaced by an
    ``OversizedNumber`` (a copy, only when there is one: the schema's messages would print
    its digits), and the path -> message of every oversized number in it."""
    found: dict[str, str] = {}

    def walk(value: object, parts: tuple[str | int, ...]) -> object:
        number = OversizedNumber.of_int(value) if oversized_integer(value) else value
        if isinstance(number, OversizedNumber):
            path = format_path(parts)
            found[path] = f"{path}: {number.describe()}"
            return number
        if isinstance(value, Mapping):
            return {key: walk(item, (*parts, str(key))) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item, (*parts, index)) for index, item in enumerate(value)]
        return value

    cleaned = walk(data, ())
    if not found:
        return data, found
    return cast(Mapping[str, object], cleaned), found


def import_errors(imports: object) -> list[str]:
    """Import the modules of an ``imports:`` list; one message per module that fails
    (``imports[i]: cannot import ...``). A value that is no list is left to the schema."""
    if not isinstance(imports, list):
        return []  # a wrong type is reported by the schema
    errors: list[str] = []
    for index, module in enumerate(imports):
        if not isinstance(module, str) or not module:
            continue
        try:
            plugins.import_modules([module])
        except plugins.PluginError as exc:
            reason = exc.__cause__ if exc.__cause__ is not None else exc
            errors.append(f"imports[{index}]: cannot import {module!r}: {reason}")
    return errors


def _referenced_plugin_schemas(
    callbacks: object,
) -> tuple[dict[str, Mapping[str, object]], list[str]]:
    """Options schemas of the plugins named in ``callbacks:`` plus errors for unknown
    names and broken plugin schemas (each reported at ``callbacks[i].name``)."""
    if not isinstance(callbacks, list):
        return {}, []
    found: dict[str, Mapping[str, object]] = {}
    errors: list[str] = []
    for index, entry in enumerate(callbacks):
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or not name or name in found:
            continue  # missing or ill-typed names are reported by the schema
        try:
            options_schema = plugins.callback_options_schema(name)
        except plugins.PluginError as exc:
            errors.append(f"callbacks[{index}].name: {exc}")
            continue
        problem = _plugin_schema_problem(name, options_schema)
        if problem is not None:
            errors.append(f"callbacks[{index}].name: {problem}")
            continue
        found[name] = options_schema
    return found, errors


class _KnownNames(Protocol):
    """What the name check needs of a registry (``plugins.PluginRegistry``, any item type)."""

    def __contains__(self, name: object) -> bool: ...

    def unknown(self, name: str) -> str: ...


def _plugin_name_errors(values: _Values) -> Iterator[str]:
    """``model.name``, ``data.dataset``, ``eval.dataset`` and ``data.collate`` naming what
    no registry (nor entry point) knows. Ill-typed values are the schema's to report, a
    dataset name that looks like a file the data rules'."""
    from speedtronic.data.collate import collate_registry
    from speedtronic.data.loader import dataset_registry
    from speedtronic.models.registry import registry

    named: tuple[tuple[str, str, _KnownNames], ...] = (
        ("model", "name", registry),
        ("data", "dataset", dataset_registry),
        ("eval", "dataset", dataset_registry),
        ("data", "collate", collate_registry),
    )
    for section, key, registry_of_names in named:
        name = values.text(section, key)
        if name is None or name in registry_of_names or _looks_like_a_file(name):
            continue
        yield f"{section}.{key}: {registry_of_names.unknown(name)}"


def _looks_like_a_file(name: str) -> bool:
    return name.lower().endswith(_PICKLE_SUFFIXES) or "/" in name or "\\" in name


def _plugin_schema_problem(name: str, options_schema: object) -> str | None:
    if not isinstance(options_schema, Mapping):
        return f"callback {name!r} has an options schema that is not a mapping"
    try:
        Draft202012Validator.check_schema(callback_entry_schema(name, options_schema))
    except SchemaError as exc:
        return f"callback {name!r} has an invalid options schema: {exc.message}"
    except (TypeError, ValueError) as exc:  # not JSON-serialisable
        return f"callback {name!r} has an invalid options schema: {exc}"
    return None


def _schema_errors(validator: Draft202012Validator, data: object) -> list[tuple[str, str]]:
    """(path, message) for every schema violation, sorted by path."""
    found: list[tuple[str, str]] = []
    for error in validator.iter_errors(data):
        found.extend(_describe(error))
    return sorted(set(found), key=lambda item: item[0])


def _describe(error: ValidationError) -> Iterator[tuple[str, str]]:
    parts = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        allowed = tuple(_mapping(_mapping(error.schema).get("properties")))
        for key in error.instance:
            if key not in allowed:
                path = format_path([*parts, key]) if isinstance(key, str) else format_path(parts)
                yield path, f"{path}: unknown key{_suggestion(key, allowed, parts)}"
        return
    path = format_path(parts)
    yield path, f"{path}: {_shortened(error.message)}"


_MESSAGE_CHARS = 300


def _shortened(message: str) -> str:
    """A schema message cut in the middle when long: jsonschema quotes the whole value, and
    a value may be a string of a megabyte."""
    if len(message) <= _MESSAGE_CHARS:
        return message
    return f"{message[:160]} ... {message[-100:]} ({len(message):,} characters)"


def _suggestion(key: object, allowed: Sequence[str], parts: Sequence[str | int]) -> str:
    if not isinstance(key, str):
        return f" {key!r} (keys must be strings)"
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if not parts:  # a section key written at the root: point at its section
        sections = [name for name, spec in _mapping(base().get("properties")).items()]
        homes = [section for section in sections if key in section_schema(base(), section)]
        if homes:
            return f" (did you mean {homes[0]}.{key}?)"
    return ""


def _value_errors(data: object, parts: tuple[str | int, ...] = ()) -> Iterator[tuple[str, str]]:
    """Non-finite numbers anywhere and non-JSON values in free-form option mappings
    (``data.dataset_options`` and callback options), which the schema cannot see."""
    free_form = _is_free_form(parts)
    if isinstance(data, float) and not math.isfinite(data):
        path = format_path(parts)
        yield path, f"{path}: {data!r} is not a finite number"
    elif isinstance(data, Mapping):
        for key, value in data.items():
            if free_form and not isinstance(key, str):
                path = format_path(parts)
                yield path, f"{path}: key {key!r} is not a string"
                continue
            yield from _value_errors(value, (*parts, str(key)))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _value_errors(value, (*parts, index))
    elif free_form and not isinstance(data, (str, int, float, bool, type(None))):
        path = format_path(parts)
        yield path, f"{path}: {type(data).__name__} is not a JSON value"


def _is_free_form(parts: tuple[str | int, ...]) -> bool:
    free_form = (("data", "dataset_options"), ("eval", "dataset_options"), ("model", "options"))
    if parts[:2] in free_form:
        return True
    return len(parts) >= 2 and parts[0] == "callbacks"


# -- cross-field rules ------------------------------------------------------------------


class _Values:
    """Typed access to a (possibly ill-typed) normalised config with schema defaults.

    Each getter returns ``None`` when the value is absent-with-null-default or has the wrong
    type: the schema already reports wrong types, so a rule simply does not run on them.
    """

    def __init__(self, data: Mapping[str, object]) -> None:
        self._data = data

    def get(self, section: str, key: str) -> object:
        values = self._data.get(section, {})
        if not isinstance(values, Mapping):
            return None
        if key in values:
            return values[key]
        return _defaults(section, plugins.callback_registry.version).get(key)  # read-only

    def get_root(self, key: str) -> object:
        """A top-level value as given (``None`` when absent)."""
        return self._data.get(key)

    def integer(self, section: str, key: str) -> int | None:
        value = self.get(section, key)
        if isinstance(value, bool):
            return None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value if isinstance(value, int) else None

    def positive_int(self, section: str, key: str) -> int | None:
        value = self.integer(section, key)
        return value if value is not None and value > 0 else None

    def number(self, section: str, key: str) -> float | None:
        value = self.get(section, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value)

    def text(self, section: str, key: str) -> str | None:
        value = self.get(section, key)
        return value if isinstance(value, str) else None

    def flag(self, section: str, key: str) -> bool:
        return self.get(section, key) is True

    def plugin_sections(self, spec: plugins.PluginSpec) -> dict[str, object]:
        """The top-level keys a plugin reads, schema defaults filled in."""
        root = _mapping(base().get("properties"))
        found: dict[str, object] = {}
        for key in spec.sections.keys:
            if "properties" in _mapping(root.get(key)):  # a section: defaults under values
                defaults = _defaults(key, plugins.callback_registry.version)
                found[key] = {**defaults, **_mapping(self._data.get(key))}
            else:
                found[key] = self._data[key] if key in self._data else root_default(key)
        return found

    def callback_entries(self) -> list[tuple[int, Mapping[str, object]]]:
        """``(index, entry)`` of every well-formed ``callbacks:`` entry."""
        entries = self._data.get("callbacks")
        if not isinstance(entries, list):
            return []
        return [(i, entry) for i, entry in enumerate(entries) if isinstance(entry, Mapping)]


def cross_field_errors(data: Mapping[str, object]) -> list[str]:
    """Rules that relate several keys (or need more than a JSON Schema keyword)."""
    values = _Values(data)
    errors: list[str] = []
    for rule in (
        _batch_rules,
        _model_rules,
        _optimizer_rules,
        _data_rules,
        _eval_monitor_rules,
        _parallel_rules,
    ):
        errors.extend(rule(values))
    errors.extend(_plugin_rules(values))
    return errors


def _batch_rules(values: _Values) -> Iterator[str]:
    micro = values.positive_int("data", "micro_batch_size")
    target = values.positive_int("data", "target_batch_size")
    if micro is None or target is None:
        return
    if target < micro:
        yield f"data.target_batch_size: {target} is less than data.micro_batch_size ({micro})"
    elif target % micro:
        yield (
            f"data.target_batch_size: {target} is not divisible by data.micro_batch_size ({micro})"
        )


def _model_rules(values: _Values) -> Iterator[str]:
    """The model plugin's rules: ``model.options`` against the factory's ``options_schema``,
    and the reference transformer's dimension rules (for that model only). An unknown model
    name is reported with the other plugin names (``_plugin_name_errors``)."""
    from speedtronic.models.registry import registry

    name = values.text("model", "name")
    if name is None or name not in registry:
        return
    try:
        factory = registry.get(name)
    except plugins.PluginError as exc:
        yield f"model.name: {exc}"
        return
    options = values.get("model", "options")
    options_schema = registry.options_schema(name)
    if options_schema is not None and isinstance(options, Mapping):
        try:
            validator = Draft202012Validator(dict(options_schema))
            found = [
                message
                for error in validator.iter_errors(options)
                for _, message in _describe_under(error, ("model", "options"))
            ]
        except (SchemaError, TypeError, ValueError) as exc:
            found = [f"model.name: model {name!r} has an invalid options schema: {exc}"]
        yield from sorted(set(found))
    if _is_reference_transformer(factory):
        yield from _reference_transformer_rules(values)


def _is_reference_transformer(factory: object) -> bool:
    from speedtronic.models.transformer import ReferenceTransformer

    return isinstance(factory, type) and issubclass(factory, ReferenceTransformer)


def _describe_under(error: ValidationError, prefix: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """``_describe`` for an error found in a value that lives at ``prefix``."""
    error.path.extendleft(reversed(prefix))
    return _describe(error)


def _reference_transformer_rules(values: _Values) -> Iterator[str]:
    n_head = values.positive_int("model", "n_head")
    if n_head is None:
        return
    explicit_kv = values.get("model", "n_kv_head") is not None
    n_kv_head = values.positive_int("model", "n_kv_head") if explicit_kv else n_head
    if n_kv_head is not None and n_head % n_kv_head:
        yield f"model.n_head: {n_head} is not divisible by model.n_kv_head ({n_kv_head})"
    d_model = values.positive_int("model", "d_model")
    if d_model is not None and d_model % n_head:
        yield f"model.d_model: {d_model} is not divisible by model.n_head ({n_head})"


def _optimizer_rules(values: _Values) -> Iterator[str]:
    name = values.text("optimizer", "name")
    if values.flag("optimizer", "muon_plus") and name is not None and name != "muon":
        yield f"optimizer.muon_plus: requires optimizer.name 'muon' (got {name!r})"
    routing = values.get("optimizer", "routing")
    for index, rule in enumerate(routing if isinstance(routing, list) else []):
        if not isinstance(rule, Mapping) or rule.get("to") != "muon":
            continue
        ndim = rule.get("ndim")
        if isinstance(ndim, int) and not isinstance(ndim, bool) and ndim != 2:
            yield (
                f"optimizer.routing[{index}].ndim: Muon updates matrices only, "
                f"a rule sending ndim {ndim} to 'muon' can never apply"
            )


def _parallel_rules(values: _Values) -> Iterator[str]:
    """FSDP shards every parameter across the ranks; Muon's Newton-Schulz step needs each
    whole matrix, which this version does not gather (docs/scale-out.md)."""
    tensor = values.get("parallel", "tensor")
    if values.text("parallel", "strategy") != "fsdp":
        if isinstance(tensor, int) and tensor > 1:
            yield (
                f"parallel.tensor: {tensor} needs parallel.strategy 'fsdp' (tensor parallelism "
                "composes with FSDP2 over a data x tensor device mesh); set strategy: fsdp"
            )
        return
    if values.text("optimizer", "name") == "muon":
        yield (
            "parallel.strategy: 'fsdp' cannot be combined with optimizer.name 'muon': Muon's "
            "Newton-Schulz step needs each whole weight matrix and FSDP holds only a shard "
            "of it on each rank; use optimizer.name 'adamw' or parallel.strategy 'ddp'"
        )


def _data_rules(values: _Values) -> Iterator[str]:
    for section in ("data", "eval"):
        dataset = values.text(section, "dataset")
        if dataset is not None and dataset.lower().endswith(_PICKLE_SUFFIXES):
            yield (
                f"{section}.dataset: {dataset!r} looks like a pickled dataset file; name a "
                "registered dataset instead (pickle files are never loaded)"
            )
    if values.text("eval", "text_path") is not None and values.text("eval", "dataset"):
        yield "eval.dataset: give eval.text_path or eval.dataset, not both"
    yield from _token_source_rules(values)
    data_vocab = values.positive_int("data", "vocab_size")
    model_vocab = values.positive_int("model", "vocab_size")
    if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
        yield (
            f"data.vocab_size: {data_vocab} is larger than model.vocab_size ({model_vocab}); "
            "the model could not embed every token id"
        )


_SOURCE_KEYS = ("tokens", "mixture", "text_path", "dataset")


def _token_source_rules(values: _Values) -> Iterator[str]:
    """``data.tokens`` and ``data.mixture`` exclude the other sources; ``data.tokenizer``
    needs something to tokenize or check; a mixture is always shuffled."""
    given = [
        key
        for key in _SOURCE_KEYS
        if (values.get("data", key) if key == "mixture" else values.text("data", key))
    ]
    if {"tokens", "mixture"} & set(given) and len(given) > 1:
        named = " and ".join(f"data.{key}" for key in given)
        yield f"data.{given[1]}: give one training source, not {named}"
    text_sources = ("text_path", "tokens", "mixture")
    if values.text("data", "tokenizer") is not None and not (
        {*text_sources} & set(given) or values.text("eval", "text_path")
    ):
        yield (
            "data.tokenizer: nothing to tokenize or check (it applies to data.text_path, "
            "eval.text_path, data.tokens and data.mixture)"
        )
    if "mixture" in given and values.get("data", "shuffle") is False:
        yield "data.shuffle: false does not apply to data.mixture (a mixture is always shuffled)"


EVAL_METRIC_PREFIX = "eval/"


def _eval_monitor_rules(values: _Values) -> Iterator[str]:
    """A ``monitor`` option (of any plugin section or ``callbacks:`` entry) that names an
    evaluation metric needs evaluation on (``eval.every_steps``): it could never appear."""
    if values.positive_int("eval", "every_steps") is not None:
        return
    places: list[tuple[str, object]] = []
    for key in plugin_root_keys():
        section = values.get_root(key)
        if isinstance(section, Mapping):
            places.append((key, section.get("monitor")))
    for index, entry in values.callback_entries():
        places.append((f"callbacks[{index}]", entry.get("monitor")))
    for where, monitor in places:
        if isinstance(monitor, str) and monitor.startswith(EVAL_METRIC_PREFIX):
            yield (
                f"{where}.monitor: {monitor!r} is an evaluation metric, but evaluation is off "
                "(set eval.every_steps)"
            )


def _plugin_rules(values: _Values) -> Iterator[str]:
    """Each installed plugin's rules for its sections, then each ``callbacks:`` entry's
    rules, from the plugin it names."""
    for spec in plugins.configurable_specs():
        yield from spec.sections.errors(values.plugin_sections(spec))
    for index, entry in values.callback_entries():
        name = entry.get("name")
        if not isinstance(name, str) or name not in plugins.callback_registry:
            continue
        try:
            spec = plugins.plugin_spec(name)
        except plugins.PluginError:
            continue  # reported with the plugin names
        options = {key: value for key, value in entry.items() if key != "name"}
        yield from spec.options_errors(f"callbacks[{index}]", options, values.plugin_sections(spec))
