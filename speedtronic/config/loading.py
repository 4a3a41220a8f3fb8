"""Reading configuration sources, rewriting shorthands, and applying ``a.b=c`` overrides.

Everything here works on plain mappings *before* validation. Rewriting never raises for a
wrong type: it leaves the value where it is so the schema reports it with its path.
Conflicting spellings of one setting (``muon_plus`` at the root and in ``optimizer``) are
returned as errors, so they are reported together with everything else.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from speedtronic import plugins
from speedtronic.config import core
from speedtronic.config.core import CoreKeys
from speedtronic.config.declare import Fold
from speedtronic.config.schema import (
    MAX_NUMBER_CHARS,
    ConfigError,
    OversizedNumber,
    format_path,
    section_aliases,
    section_names,
)

RawConfig = dict[str, object]
"""A configuration as plain data, before validation."""

REDACTED = "<redacted>"

if TYPE_CHECKING:
    RUN_ALIASES: tuple[str, ...]
    """Root keys that are shorthands for ``run.<key>`` (declared ``Opt(shorthand=True)``)."""
    OPTIMIZER_ALIASES: tuple[str, ...]
    """Root keys that are shorthands for ``optimizer.<key>``."""


def __getattr__(name: str) -> tuple[str, ...]:
    """``RUN_ALIASES`` and ``OPTIMIZER_ALIASES``, read from the declarations."""
    section = {"RUN_ALIASES": "run", "OPTIMIZER_ALIASES": "optimizer"}.get(name)
    if section is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return tuple(key for key, home in _core().shorthands.items() if home == section)


def _core() -> CoreKeys:
    """What the core's declarations tell the loader (shorthands, case folds, keys that fill
    others). The declarations (``speedtronic.config.sections``) build on this module, so the
    package hands them down (``speedtronic.config.core``)."""
    return core.declarations().keys


def fold_value(fold: Fold, value: str) -> str:
    """An enumerated string as the config means it: stripped, then lower- or upper-cased."""
    return value.strip().lower() if fold == "lower" else value.strip().upper()


# -- YAML -------------------------------------------------------------------------------


MAX_TEXT_BYTES = 1_048_576
"""The longest configuration text read at all (a file, a string source, a ``--set`` value),
checked before any parsing: a run configuration is a few kilobytes, and PyYAML parses about
2 MB a second, so this bounds the time a file can take (about half a second)."""
MAX_NODES = 20_000
"""Most values (scalars, lists, mappings, keys) a configuration document may spell out,
counted while composing, before aliases are expanded: a bound on the parser's work that
refuses a 150,000-key file after 20,000 of them instead of after all."""
MAX_NESTING = 64
"""Deepest nesting of mappings/lists a configuration may have (aliases expanded)."""
MAX_VALUES = 100_000
"""Most values (scalars, lists, mappings) a configuration may expand to: a bound on the work
that an alias bomb (``&a [*b, *b, ...]`` nested a few times) can cause."""


def _check_text_size(size: int, unit: str = "bytes") -> None:
    """``ConfigError`` for configuration text longer than ``MAX_TEXT_BYTES``."""
    if size > MAX_TEXT_BYTES:
        raise ConfigError(
            f"the configuration text is {size:,} {unit} long, more than the limit of "
            f"{MAX_TEXT_BYTES:,} (1 MiB); a run configuration is a few kilobytes: is this "
            "the right file?"
        )


def _too_many_values(where: str) -> ConfigError:
    return ConfigError(
        f"{where} holds more than {MAX_NODES:,} values (keys, scalars, lists, mappings); a "
        "run configuration needs far fewer: refusing to read further"
    )


class _YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``3e-4`` as a float (YAML 1.2; PyYAML's 1.1 resolver
    makes it a string), rejects duplicate keys instead of keeping the last one, refuses
    nesting deeper than ``MAX_NESTING`` and documents of more than ``MAX_NODES`` values
    while composing (before any recursion runs deep, or the rest of the text is parsed),
    and reads an integer longer than ``MAX_NUMBER_CHARS`` as an ``OversizedNumber``."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.nesting = 0
        self.nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self.nesting += 1
        self.nodes += 1
        try:
            if self.nesting > MAX_NESTING or self.nodes > MAX_NODES:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]  # untyped in types-PyYAML
                where = f"line {mark.line + 1}, column {mark.column + 1}"
                if self.nodes > MAX_NODES:
                    raise _too_many_values(f"the YAML document (up to {where})")
                raise ConfigError(f"YAML nested more than {MAX_NESTING} levels deep (at {where})")
            return super().compose_node(parent, index)
        finally:
            self.nesting -= 1


def _construct_int(loader: _YamlLoader, node: yaml.ScalarNode) -> int | OversizedNumber:
    """PyYAML's int (every base, ``1_000``, ``1:30``), or an ``OversizedNumber`` for a literal
    too long to be a setting: building it could fail (Python's limit on int/str conversion)
    or take quadratic time, and no message could print it."""
    literal = str(loader.construct_scalar(node))
    if len(literal) > MAX_NUMBER_CHARS:
        return OversizedNumber(literal)
    return loader.construct_yaml_int(node)


_YamlLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _construct_mapping(loader: _YamlLoader, node: yaml.MappingNode) -> dict[object, object]:
    loader.flatten_mapping(node)
    mapping: dict[object, object] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable):
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                "found an unhashable key",
                key_node.start_mark,
            )
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, name: str | None = None) -> object:
    """Parse YAML (or JSON) text; ``ConfigError`` on syntax errors, on values YAML cannot
    build (``2001-13-45`` as a date), on text longer than ``MAX_TEXT_BYTES`` characters
    (before parsing), documents of more than ``MAX_NODES`` values or nested deeper than
    ``MAX_NESTING`` (while composing), or expanding (through aliases) to more than
    ``MAX_VALUES`` values -- checked on the composed node graph, before anything is built, so
    the work stays bounded. An integer longer than ``MAX_NUMBER_CHARS`` is read as an
    ``OversizedNumber`` (validation reports it with its path). ``name`` (the file path) is
    what syntax errors point at instead of ``<unicode string>``."""
    _check_text_size(len(text), "characters")
    _check_flow_nesting(text)
    try:
        return _compose_and_build(text, name)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}") from None
    except ConfigError:
        raise
    except Exception as exc:  # PyYAML's constructors: ValueError, IndexError ("!!int" alone)
        raise ConfigError(f"invalid YAML value: {type(exc).__name__}: {exc}") from None


def _compose_and_build(text: str, name: str | None = None) -> object:
    loader = _YamlLoader(text)  # a SafeLoader subclass: data only
    if name is not None:
        loader.name = name  # error marks say 'in "<name>", line N'
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


_FLOW_OPENERS = re.compile(r"[\[\]{}]")
_FLOW_SCAN_LIMIT = 4 * MAX_NESTING


def _check_flow_nesting(text: str) -> None:
    """A fast guard in front of PyYAML, whose scanner slows down quadratically with the
    number of open ``[``/``{`` (100,000 of them take seconds before the composer can see
    the depth): refuse bracket nesting far beyond ``MAX_NESTING``. Brackets inside quoted
    strings count too, so the bound is generous; the composer enforces the exact limit."""
    if text.count("[") + text.count("{") <= _FLOW_SCAN_LIMIT:
        return
    depth = 0
    for match in _FLOW_OPENERS.finditer(text):
        depth += 1 if match.group() in "[{" else -1
        if depth > _FLOW_SCAN_LIMIT:
            line = text.count("\n", 0, match.start()) + 1
            raise ConfigError(f"YAML nested more than {MAX_NESTING} levels deep (at line {line})")


def _check_expansion(root: yaml.Node) -> None:
    """``ConfigError`` when ``root`` expands (aliases followed) to more than ``MAX_VALUES``
    values, deeper than ``MAX_NESTING``, or into a cycle. Each node is measured once."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height)
    in_progress: set[int] = set()

    def measure(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        known = measured.get(key)
        if known is None:
            if key in in_progress:
                raise ConfigError("YAML alias refers to its own ancestor (a cycle)")
            in_progress.add(key)
            known = measure_children(node, depth)
            in_progress.discard(key)
            measured[key] = known
        if depth + known[1] > MAX_NESTING:
            raise ConfigError(
                f"YAML nested more than {MAX_NESTING} levels deep once aliases are expanded"
            )
        return known

    def measure_children(node: yaml.Node, depth: int) -> tuple[int, int]:
        values, height = 1, 0
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        for child in children:
            child_values, child_height = measure(child, depth + 1)
            values += child_values
            height = max(height, child_height + 1)
            if values > MAX_VALUES:
                raise ConfigError(
                    f"YAML expands to more than {MAX_VALUES} values once aliases are "
                    "followed (an alias bomb?); refusing to build it"
                )
        return values, height

    measure(root, 0)


def _check_plain_nesting(value: object, origin: str) -> None:
    """``ConfigError`` when parsed JSON nests deeper than ``MAX_NESTING`` or holds more than
    ``MAX_NODES`` values (iterative)."""
    pending: list[tuple[object, int]] = [(value, 0)]
    values = 0
    while pending:
        item, depth = pending.pop()
        values += 1 + (len(item) if isinstance(item, dict) else 0)  # a key counts too
        if values > MAX_NODES:
            raise ConfigError(_too_many_values("the JSON document").errors, source=origin)
        if depth > MAX_NESTING:
            raise ConfigError(f"JSON nested more than {MAX_NESTING} levels deep", source=origin)
        if isinstance(item, dict):
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)


def _json_int(literal: str) -> int | OversizedNumber:
    """A JSON integer, or an ``OversizedNumber`` when it is too long to be a setting."""
    return OversizedNumber(literal) if len(literal) > MAX_NUMBER_CHARS else int(literal)


# -- sources ----------------------------------------------------------------------------


def looks_like_text(source: str) -> bool:
    """Whether a string source is configuration text rather than a file path."""
    if "\n" in source or source.lstrip().startswith(("{", "[")):
        return True
    return ":" in source and not Path(source).exists()


def _root_mapping(value: object, origin: str) -> RawConfig:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"<root>: configuration root must be a mapping, got {type(value).__name__}",
            source=origin,
        )
    return _plain_copy(value)


def read_text(text: str) -> RawConfig:
    """A configuration from YAML or JSON text; empty text is ``{}`` (all defaults)."""
    return _root_mapping(parse_yaml(text), "<text>")


def read_file(path: str | os.PathLike[str], *, yaml_only: bool = False) -> RawConfig:
    """A configuration file: ``.yaml``/``.yml`` (or ``yaml_only``) as YAML, anything else
    as JSON. A missing file raises ``FileNotFoundError``."""
    path = Path(path)
    with path.open("rb") as stream:
        raw = stream.read(MAX_TEXT_BYTES + 1)  # never more: a huge file is refused unread
    try:
        _check_text_size(max(len(raw), path.stat().st_size))
        text = raw.decode("utf-8")
    except ConfigError as exc:
        raise ConfigError(exc.errors, source=str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"<root>: not UTF-8 text ({exc.reason} at byte {exc.start})", source=str(path)
        ) from None
    if yaml_only or path.suffix.lower() in (".yaml", ".yml"):
        try:
            parsed = parse_yaml(text, str(path))
        except ConfigError as exc:
            raise ConfigError(exc.errors, source=str(path)) from None
    else:
        try:
            parsed = json.loads(text, parse_int=_json_int)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"invalid JSON: {exc}", source=str(path)) from None
        except RecursionError:
            raise ConfigError(
                f"JSON nested more than {MAX_NESTING} levels deep", source=str(path)
            ) from None
        _check_plain_nesting(parsed, str(path))
    return _root_mapping(parsed, str(path))


def read_source(source: Mapping[str, object] | str | os.PathLike[str] | None) -> RawConfig:
    """A mapping (copied), YAML/JSON text, or a YAML/JSON file path, as plain data."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return _root_mapping(source, "<mapping>")
    if isinstance(source, str) and looks_like_text(source):
        return read_text(source)
    if isinstance(source, (str, os.PathLike)):
        return read_file(source)
    raise ConfigError(
        f"<root>: cannot load a configuration from {type(source).__name__}; give a mapping, "
        "a YAML/JSON path or text, or a SpeedtronicConfig"
    )


def _plain_copy(value: Mapping[str, object]) -> RawConfig:
    """A deep copy as plain data: tuples become lists, paths become strings, typed config
    objects become their ``to_dict()``. Other values are kept (and validated later)."""
    copied = _plain(value)
    assert isinstance(copied, dict)
    return copied


def _plain(value: object) -> object:
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        value = to_dict()
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


# -- shorthands -------------------------------------------------------------------------


def normalise(raw: object) -> tuple[RawConfig, list[str]]:
    """Rewrite shorthands into the canonical layout; returns the copy and conflict errors.

    The one place a configuration is normalised, before its one validation pass:

    * a section alias that a plugin declares (``PluginSpec.sections.aliases``) -> its section
      (when that is absent); a section written as a bare value -> its declared key
      (``optimizer: muon`` -> ``{name: muon}``, ``precision: bf16`` -> ``{mode: bf16}``);
      empty sections -> ``{}``;
    * root shorthands of section keys (declared ``Opt(shorthand=True)``: ``max_steps`` ->
      ``run.max_steps``, ``muon_plus`` -> ``optimizer.muon_plus``, ...);
    * a ``callbacks`` entry ``"name"`` -> ``{name: name}``;
    * a key that fills another (``Opt(fills=...)``: ``run.log_every`` fills
      ``logging.every_steps``) when that one is absent;
    * enumerated strings are case-folded (``Opt(fold=...)``); ``shape_validation.alignment:
      null`` -> ``auto``;
    * then every installed plugin rewrites its own 2.0 keys (``Sections.normalise``).

    The same setting given twice with different values is a conflict error. Idempotent.
    """
    data = _root_mapping(raw, "<mapping>")
    data.pop("$schema", None)
    errors: list[str] = []
    core = _core()
    for section in (*section_names(), "callbacks", "imports"):
        if section in data and data[section] is None:
            data[section] = [] if section in ("callbacks", "imports") else {}
    _move_section_aliases(data, errors)
    for section, key in core.bare_values.items():
        if isinstance(data.get(section), str):
            data[section] = {key: data[section]}
    _move_shorthands(data, core.shorthands, errors)
    callbacks = data.get("callbacks")
    if isinstance(callbacks, list):
        data["callbacks"] = [{"name": e} if isinstance(e, str) else e for e in callbacks]
    _fill_linked(data, core, errors)
    _fold_values(data, core)
    for spec in plugins.configurable_specs():
        spec.sections.normalise(data)
    return data, errors


def _section(data: RawConfig, name: str) -> dict[str, object] | None:
    """The mutable mapping of section ``name`` (created when absent), or ``None`` when the
    section has a wrong type (the schema reports it)."""
    section = data.setdefault(name, {})
    return section if isinstance(section, dict) else None


def _move_shorthands(data: RawConfig, shorthands: Mapping[str, str], errors: list[str]) -> None:
    for alias, home in shorthands.items():
        if alias not in data:
            continue
        value = data.pop(alias)
        section = _section(data, home)
        if section is None:
            continue
        if alias in section and section[alias] != value:
            errors.append(
                f"{alias}: conflicts with {home}.{alias} ({value!r} vs {section[alias]!r})"
            )
        else:
            section[alias] = value


def _move_section_aliases(data: RawConfig, errors: list[str]) -> None:
    for alias, section in section_aliases().items():
        if alias not in data:
            continue
        if section in data:
            data.pop(alias)
            errors.append(f"{alias}: alias of {section}, which is also given")
        else:
            value = data.pop(alias)
            data[section] = {} if value is None else value


def _fill_linked(data: RawConfig, core: CoreKeys, errors: list[str]) -> None:
    """A key that fills another (``run.log_every`` -> ``logging.every_steps``) copies its
    value there when that is absent; a different value there is a conflict."""
    for (source, key), (target, target_key) in core.fills.items():
        values = data.get(source)
        value = values.get(key) if isinstance(values, dict) else None
        if not isinstance(value, int) or isinstance(value, bool):
            continue  # unset, or a wrong type the schema reports at its own path
        section = _section(data, target)
        if section is None:
            continue
        given = section.setdefault(target_key, value)
        if given != value:
            errors.append(
                f"{source}.{key}: conflicts with {target}.{target_key} ({value} vs {given!r})"
            )


def _fold_values(data: RawConfig, core: CoreKeys) -> None:
    for (section_name, key), fold in core.folds.items():
        section = data.get(section_name)
        if isinstance(section, dict) and isinstance(section.get(key), str):
            section[key] = fold_value(fold, section[key])
    shapes = data.get("shape_validation")
    if isinstance(shapes, dict) and "alignment" in shapes and shapes["alignment"] is None:
        shapes["alignment"] = "auto"


# -- overrides --------------------------------------------------------------------------

_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_SHOWN_CHARS = 120


def _shown(text: str) -> str:
    """``repr(text)``, shortened in the middle when long: an override is quoted in its
    errors, and a 1 MB ``--set`` value must not make a 1 MB message."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return repr(f"{text[:80]}...{text[-30:]}") + f" ({len(text):,} characters)"


def parse_override(text: str) -> tuple[list[str | int], object]:
    """``"optimizer.betas[1]=0.99"`` -> (``["optimizer", "betas", 1]``, ``0.99``).

    The value is YAML, so ``true``, ``3e-4``, ``null`` and ``[a, b]`` get their types.
    """
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {_shown(text)}: expected KEY=VALUE, e.g. optimizer.lr=0.001")
    parts: list[str | int] = []
    position = 0
    for match in _PATH_TOKEN.finditer(key):
        expected_dot = parts and match.group(1) is not None
        gap = key[position : match.start()]
        if gap != ("." if expected_dot else ""):
            raise ConfigError(f"override {_shown(text)}: malformed key {_shown(key)}")
        parts.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        position = match.end()
    if position != len(key) or not parts or isinstance(parts[0], int):
        raise ConfigError(f"override {_shown(text)}: malformed key {_shown(key)}")
    try:
        value = parse_yaml(value_text)
    except ConfigError as exc:
        raise ConfigError(f"override {_shown(text)}: {exc.errors[0]}") from None
    return parts, value


def apply_overrides(raw: Mapping[str, object] | None, overrides: Iterable[str] = ()) -> RawConfig:
    """A copy of ``raw`` with each ``key.path=value`` override applied, in order.

    Runs before validation, so overridden values are validated like any other. An
    override replaces everything at its path, including shorthand spellings of it
    (``max_steps=5`` and ``run.max_steps=5`` are the same override and both beat a root
    ``max_steps:`` in the file). Lists are indexed as ``callbacks[0].every_steps=10``.
    """
    data = _root_mapping(raw, "<mapping>")
    if isinstance(overrides, str):
        overrides = [overrides]
    for text in overrides:
        parts, value = parse_override(text)
        path = _canonical(parts)
        _drop_shadowed_aliases(data, path)
        _assign(data, path, value, text)
    return data


def _canonical(parts: list[str | int]) -> list[str | int]:
    head, rest = parts[0], parts[1:]
    shorthands = _core().shorthands
    if isinstance(head, str) and head in shorthands:
        return [shorthands[head], head, *rest]
    aliases = section_aliases()
    if isinstance(head, str) and head in aliases:
        return [aliases[head], *rest]
    return parts


def _drop_shadowed_aliases(data: RawConfig, path: list[str | int]) -> None:
    """Remove other spellings of the setting at ``path`` (or below it): its root shorthand,
    a plugin's alias of its section, and -- for a key another one fills -- that key, or for
    the key that fills, what it fills (so the override's value is what both end up with)."""
    head = path[0]
    key = path[1] if len(path) > 1 else None
    core = _core()
    for alias, home in core.shorthands.items():
        if home == head and key in (None, alias):
            data.pop(alias, None)
    if isinstance(head, str) and head not in data:
        for alias, section in section_aliases().items():
            if section == head and alias in data:
                data[head] = data.pop(alias)
                break
    for (source, source_key), (target, target_key) in core.fills.items():
        if head == target and key in (None, target_key):
            if core.shorthands.get(source_key) == source:
                data.pop(source_key, None)
            _pop_key(data, source, source_key)
        elif path == [source, source_key]:
            _pop_key(data, target, target_key)


def _pop_key(data: RawConfig, section: str, key: str) -> None:
    values = data.get(section)
    if isinstance(values, dict):
        values.pop(key, None)


def _expand_shorthand(path: list[str | int], value: object, next_part: str | int) -> object:
    """The container form of a shorthand (or missing) value about to be descended into."""
    if value is None:
        return [] if isinstance(next_part, int) else {}
    bare = _core().bare_values
    if len(path) == 1 and isinstance(value, str) and path[0] in bare:
        return {bare[str(path[0])]: value}
    if path == ["compile"] and isinstance(value, bool):
        return {"enabled": value}
    if len(path) == 2 and path[0] == "callbacks" and isinstance(value, str):
        return {"name": value}
    return value


def _assign(data: RawConfig, path: list[str | int], value: object, text: str) -> None:
    node: object = data
    for depth, part in enumerate(path[:-1]):
        here = path[: depth + 1]
        next_part = path[depth + 1]
        if isinstance(part, int):
            assert isinstance(node, list)
            child = node[part] = _expand_shorthand(here, node[part], next_part)
        else:
            assert isinstance(node, dict)
            child = node[part] = _expand_shorthand(here, node.get(part), next_part)
        wanted = list if isinstance(next_part, int) else dict
        if not isinstance(child, wanted):
            kind = "a list" if wanted is list else "a mapping"
            raise ConfigError(
                f"override {_shown(text)}: {format_path(here)} is {type(child).__name__}, "
                f"not {kind}"
            )
        if isinstance(next_part, int) and not 0 <= next_part < len(child):
            raise ConfigError(
                f"override {_shown(text)}: index {next_part} is out of range for "
                f"{format_path(here)} ({len(child)} items)"
            )
        node = child
    last = path[-1]
    if isinstance(last, int):
        assert isinstance(node, list)
        node[last] = value
    else:
        assert isinstance(node, dict)
        node[last] = value
