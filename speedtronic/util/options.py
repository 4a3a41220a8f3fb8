"""One declaration per option: a dataclass field that carries its type, default, bounds and doc.

Every setting -- a core section's key (``RunConfig.max_steps``), a plugin's option
(``CheckpointOptions.every_steps``), a model's ``model.options`` key
(``HFCausalLMOptions.dtype``), a key a plugin adds to ``logging:`` -- is one field, its type
annotated with an ``Opt``::

    @dataclass(frozen=True)
    class HeartbeatOptions:
        seconds: Annotated[float, Opt("Seconds between beats.", exclusive_minimum=0)] = 60.0

and everything else is derived from it here: the JSON Schema (``object_schema``; types,
``null``, enums, lists, tuples and nested dataclasses, bounds, defaults, descriptions), the
defaults (``defaults_of``) and the typed object built from validated data (``build``, which
never validates again). ``speedtronic.config.declare`` adds the docs tables and the plugin
declaration, and re-exports all of this. So adding an option is adding a field.

The field's type says what JSON may hold: ``bool``, ``int``, ``float``, ``str``,
``Literal[...]`` (an enum), ``X | None``, ``list[X]``, ``tuple[X, Y]`` (a fixed-length
array), ``dict[str, ...]`` (a free-form mapping) and nested dataclasses. ``Opt.schema``
replaces what the type gives for the rare key the type cannot say (``int | Literal["auto"]``
with bounds on the number only).

It imports nothing of speedtronic, so every layer declares its options the same way (the
models below the config package included).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar, cast

T = TypeVar("T")

SchemaDict = dict[str, object]
Fold = Literal["lower", "upper"]


@dataclass(frozen=True)
class Opt:
    """What a field declares beside its type and default (see ``option``)."""

    doc: str
    """One line: the description in the schema and the text of the docs table."""
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    min_length: int | None = None
    pattern: str | None = None
    items: Mapping[str, object] | None = None
    """Keywords added to the schema of a list's (or tuple's) items (their bounds)."""
    schema: Mapping[str, object] | None = None
    """Replaces the schema the type gives (default and description are still added)."""
    extra: Mapping[str, object] | None = None
    """Keywords added to the derived schema (``maxItems`` of a list, say)."""
    fold: Fold | None = None
    """Enumerated strings that are case- (and whitespace-) insensitive: the loader folds
    them (``lower``: ``"AdamW"`` -> ``"adamw"``) before validation."""
    shorthand: bool = False
    """The key may also be written at the root of a config (``max_steps:`` for
    ``run.max_steps``); the loader moves it into its section."""
    fills: str | None = None
    """Another key (``"logging.every_steps"``) that takes this key's value when the config
    does not give it; both given with different values is a conflict."""
    default_text: str | None = None
    """How the docs table shows the default when the value alone says too little
    (``"`null` → `n_head`"``)."""
    type_text: str | None = None
    """How the docs table shows the type when the derived text says too little."""
    documented: bool = True
    """``False``: a field of the typed object that is no option (not in schema or docs)."""


# -- reading a declaration ---------------------------------------------------------------


@dataclass(frozen=True)
class Declared:
    """One declared field: its name, resolved type, default and ``Opt``."""

    name: str
    hint: object
    opt: Opt
    field: dataclasses.Field[object]

    @property
    def has_default(self) -> bool:
        return (
            self.field.default is not dataclasses.MISSING
            or self.field.default_factory is not dataclasses.MISSING
        )

    def default(self) -> object:
        """A fresh default value (``MISSING`` when the field has none)."""
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default


_DECLARED: dict[type, tuple[Declared, ...]] = {}


def declared(cls: type) -> tuple[Declared, ...]:
    """The declared fields of dataclass ``cls``, in order (fields without an ``Opt`` are
    declared with an empty doc). Computed once per class."""
    found = _DECLARED.get(cls)
    if found is None:
        found = _DECLARED[cls] = _read_declarations(cls)
    return found


def _read_declarations(cls: type) -> tuple[Declared, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    found = []
    for item in dataclasses.fields(cls):
        hint, opt = _unannotated(hints[item.name])
        field = cast("dataclasses.Field[object]", item)
        found.append(Declared(item.name, hint, opt or Opt(""), field))
    return tuple(found)


def _unannotated(hint: object) -> tuple[object, Opt | None]:
    """``Annotated[int, Opt(...)]`` -> ``(int, Opt(...))``; other hints have no ``Opt``."""
    if typing.get_origin(hint) is not Annotated:
        return hint, None
    inner, *extras = typing.get_args(hint)
    opts = [extra for extra in extras if isinstance(extra, Opt)]
    return inner, (opts[0] if opts else None)


def documented(cls: type) -> tuple[Declared, ...]:
    """The fields of ``cls`` that are options (``Opt.documented``)."""
    return tuple(item for item in declared(cls) if item.opt.documented)


def field_of(cls: type, name: str) -> Declared:
    """The declaration of ``cls``'s field ``name``."""
    for item in declared(cls):
        if item.name == name:
            return item
    raise KeyError(f"{cls.__name__} declares no option {name!r}")


def default_of(cls: type, name: str) -> object:
    """The declared default of ``cls.<name>`` (a fresh copy of a mutable one)."""
    return field_of(cls, name).default()


def defaults_of(cls: type) -> dict[str, object]:
    """Every option's default as JSON data (tuples as lists, dataclasses as mappings)."""
    return {item.name: to_json(item.default()) for item in documented(cls) if item.has_default}


def to_json(value: object) -> object:
    """A default or built value as JSON data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {item.name: to_json(getattr(value, item.name)) for item in documented(type(value))}
    if isinstance(value, Mapping):
        return {str(key): to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    return value


# -- JSON Schema -------------------------------------------------------------------------


_LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")


def plain_doc(text: str) -> str:
    """A doc as a schema description: markdown links become their text."""
    return _LINK.sub(r"\1", text)


def object_schema(
    cls: type,
    *,
    exclude: Iterable[str] = (),
    defaults: bool = True,
    extra: Mapping[str, object] | None = None,
) -> SchemaDict:
    """The closed object schema of dataclass ``cls``: one property per option (those in
    ``exclude`` left out), fields without a default ``required``; ``defaults=False`` leaves
    the ``default`` keywords out (options whose defaults come from elsewhere)."""
    skipped = set(exclude)
    properties: SchemaDict = {}
    required = []
    for item in documented(cls):
        if item.name in skipped:
            continue
        properties[item.name] = property_schema(item, defaults=defaults)
        if not item.has_default:
            required.append(item.name)
    schema: SchemaDict = {"type": "object", "additionalProperties": False}
    if required:
        schema["required"] = required
    schema.update(extra or {})
    schema["properties"] = properties
    return schema


def property_schema(item: Declared, *, defaults: bool = True) -> SchemaDict:
    """The schema of one declared field."""
    opt = item.opt
    schema: SchemaDict = dict(opt.schema) if opt.schema is not None else type_schema(item.hint)
    if defaults and item.has_default and (item.default() is not None or _admits_null(schema)):
        schema["default"] = to_json(item.default())  # an absent key is not null
    if opt.doc:
        schema["description"] = plain_doc(opt.doc)
    bounds = (
        ("minimum", opt.minimum),
        ("maximum", opt.maximum),
        ("exclusiveMinimum", opt.exclusive_minimum),
        ("exclusiveMaximum", opt.exclusive_maximum),
        ("minLength", opt.min_length),
        ("pattern", opt.pattern),
    )
    schema.update((key, value) for key, value in bounds if value is not None)
    if opt.items:
        items = schema.get("items")
        if isinstance(items, dict):
            items.update(opt.items)
    schema.update(opt.extra or {})
    return schema


def _admits_null(schema: Mapping[str, object]) -> bool:
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    enum = schema.get("enum")
    if isinstance(enum, list) and None in enum:
        return True
    branches = schema.get("anyOf")
    return isinstance(branches, list) and any(
        isinstance(branch, Mapping) and _admits_null(branch) for branch in branches
    )


_SCALARS: dict[object, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


def type_schema(hint: object) -> SchemaDict:
    """The schema of a type (see the module docstring for the types understood)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_schema(args)
    if origin is Literal:
        return {"enum": list(args)}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if origin in (list, Sequence) or hint is list:
        return {"type": "array", "items": type_schema(args[0]) if args else {}}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": type_schema(args[0])}
        item = type_schema(args[0]) if len(set(args)) == 1 else {}
        return {"type": "array", "items": item, "minItems": len(args), "maxItems": len(args)}
    if origin in (dict, Mapping) or hint is dict:
        return {"type": "object"}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        nested = object_schema(hint, defaults=True)
        if hint.__doc__:
            nested = {
                **{k: v for k, v in nested.items() if k != "properties"},
                "description": _first_line(hint.__doc__),
                "properties": nested["properties"],
            }
        return nested
    raise TypeError(f"no JSON Schema for the option type {hint!r}")


def _union_schema(args: tuple[object, ...]) -> SchemaDict:
    nullable = type(None) in args
    rest = [arg for arg in args if arg is not type(None)]
    if len(rest) == 1:
        inner = type_schema(rest[0])
        if not nullable:
            return inner
        if "enum" in inner:
            return {**inner, "enum": [*cast("list[object]", inner["enum"]), None]}
        kind = inner.get("type")
        if isinstance(kind, str):
            return {**inner, "type": [kind, "null"]}
        return {"anyOf": [inner, {"type": "null"}]}
    branches = [type_schema(arg) for arg in rest] + ([{"type": "null"}] if nullable else [])
    return {"anyOf": branches}


def _first_line(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


# -- building typed objects from validated data ------------------------------------------


def build(cls: type[T], data: Mapping[str, object]) -> T:
    """An instance of dataclass ``cls`` from data the schema has already accepted: keys
    left out take their defaults, nested dataclasses and tuples are built, a whole float
    for an ``int`` field becomes an int and an int for a ``float`` field a float. It never
    validates: ``__init__`` and ``__post_init__`` (where a class checks values given from
    Python) do not run; a ``__post_build__`` method, when the class has one, derives what
    depends on other fields."""
    instance = cls.__new__(cls)
    for item in declared(cls):
        value = data[item.name] if item.name in data else item.default()
        object.__setattr__(instance, item.name, coerce(item.hint, value))
    post_build = getattr(instance, "__post_build__", None)
    if callable(post_build):
        post_build()
    return instance


def coerce(hint: object, value: object) -> object:
    """The lossless conversions a caller expects (``lr=1`` -> ``1.0``, a list for a tuple, a
    mapping for a nested dataclass, a path for a string). Anything else is returned unchanged
    (validation, where it still runs, reports it)."""
    if value is None or isinstance(value, bool):
        return value
    origin = typing.get_origin(hint)
    choices = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    if float in choices and isinstance(value, int):
        return float(value)
    if int in choices and float not in choices and isinstance(value, float):
        return int(value) if value.is_integer() else value
    if str in choices and hasattr(value, "__fspath__"):
        return str(value.__fspath__())
    for choice in choices:
        choice_origin, args = typing.get_origin(choice), typing.get_args(choice)
        if choice_origin is tuple and isinstance(value, (list, tuple)):
            if len(args) == len(value):
                return tuple(coerce(arg, item) for arg, item in zip(args, value, strict=True))
            return tuple(value)
        if choice_origin is list and isinstance(value, (list, tuple)):
            return [coerce(args[0], item) for item in value]
        if choice_origin is dict and isinstance(value, Mapping):
            return dict(value)
        if isinstance(choice, type) and dataclasses.is_dataclass(choice):
            if isinstance(value, Mapping):
                return _nested(choice, value)
    return value


def _nested(cls: type, value: Mapping[str, object]) -> object:
    """A nested dataclass from a mapping, or the mapping when its keys do not fit (a
    ``RoutingRule`` without ``to``: validation reports it)."""
    names = {item.name for item in declared(cls)}
    missing = [
        item.name for item in declared(cls) if not item.has_default and item.name not in value
    ]
    if set(value) - names or missing:
        return value
    return build(cls, value)
