"""One declaration per option: a dataclass field that carries its type, default, bounds and doc.

Every setting -- a core section's key (``RunConfig.max_steps``), a plugin's option
(``CheckpointOptions.every_steps``), a key of a 2.0 section -- is one field, its type
annotated with an ``Opt``::

    @dataclass(frozen=True)
    class HeartbeatOptions:
        seconds: Annotated[float, Opt("Seconds between beats.", exclusive_minimum=0)] = 60.0

and everything else is derived from it here: the JSON Schema (``object_schema``; types,
``null``, enums, lists, tuples and nested dataclasses, bounds, defaults, descriptions), the
defaults (``defaults_of``), the typed object built from validated data (``build``, which never
validates again) and the rows of the docs tables (``doc_rows``, ``markdown_table``). So adding
an option is adding a field.

The field's type says what JSON may hold: ``bool``, ``int``, ``float``, ``str``,
``Literal[...]`` (an enum), ``X | None``, ``list[X]``, ``tuple[X, Y]`` (a fixed-length
array), ``dict[str, ...]`` (a free-form mapping) and nested dataclasses. ``Opt.schema``
replaces what the type gives for the rare key the type cannot say (``int | Literal["auto"]``
with bounds on the number only).

``plugin`` declares a callback plugin's ``PluginSpec`` from its options dataclass.

This module imports nothing of the engine (``speedtronic.plugins`` only, for the spec).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar, cast

from speedtronic import plugins

if TYPE_CHECKING:
    from speedtronic.engine.callback import Callback

T = TypeVar("T")
Options = TypeVar("Options")
CallbackT = TypeVar("CallbackT", bound="Callback")

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


_build_valid = build  # ``plugin`` has a parameter of that name


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


# -- docs tables -------------------------------------------------------------------------


def doc_rows(cls: type, *, exclude: Iterable[str] = ()) -> Iterator[tuple[str, str, str, str]]:
    """``(key, type, default, doc)`` of each option of ``cls``, as the docs tables show them."""
    skipped = set(exclude)
    for item in documented(cls):
        if item.name in skipped:
            continue
        opt = item.opt
        type_text = opt.type_text or type_text_of(item.hint, opt)
        if opt.default_text is not None:
            default = opt.default_text
        elif item.has_default:
            default = f"`{json_text(to_json(item.default()))}`"
        else:
            default = "required"
        yield f"`{item.name}`", type_text, default, opt.doc


def markdown_table(
    cls: type,
    *,
    exclude: Iterable[str] = (),
    header: Sequence[str] = ("key", "type", "default", "rule"),
) -> str:
    """The docs table of ``cls``'s options (one row each)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in doc_rows(cls, exclude=exclude):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def json_text(value: object) -> str:
    """A value as YAML/JSON shows it: ``null``, ``true``, ``3e-4``, ``[0.9, 0.95]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, list):
        return "[" + ", ".join(json_text(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {json_text(item)}" for key, item in value.items()) + "}"
    return str(value)


_NAMES = {bool: "bool", int: "int", float: "number", str: "string"}


def type_text_of(hint: object, opt: Opt | None = None) -> str:
    """``int ≥ 1 or null``, ``number in [0, 1)``, ``` `min` | `max` ```, ``list of strings``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [type_text_of(arg, opt) for arg in args if arg is not type(None)]
        text = " or ".join(parts)
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        return " | ".join(f"`{json_text(arg)}`" for arg in args)
    if hint in _NAMES:
        return _NAMES[hint] + _bounds_text(opt)
    if origin in (list, Sequence) or hint is list:
        inner = type_text_of(args[0]) if args else "values"
        return f"list of {_plural(inner)}"
    if origin is tuple:
        count = {2: "two", 3: "three"}.get(len(args), str(len(args)))
        return f"{count} {_plural(type_text_of(args[0]))}"
    if origin in (dict, Mapping) or hint is dict:
        return "mapping"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "{" + ", ".join(item.name for item in documented(hint)) + "}"
    return str(hint)


def _plural(text: str) -> str:
    first, _, rest = text.partition(" ")
    plural = {"string": "strings", "int": "ints", "number": "numbers", "bool": "bools"}
    return " ".join(part for part in (plural.get(first, first), rest) if part)


def _bounds_text(opt: Opt | None) -> str:
    if opt is None:
        return ""
    low = opt.minimum if opt.minimum is not None else opt.exclusive_minimum
    high = opt.maximum if opt.maximum is not None else opt.exclusive_maximum
    if low is not None and high is not None and high <= 1:
        left = "[" if opt.minimum is not None else "("
        right = "]" if opt.maximum is not None else ")"
        return f" in {left}{_number(low)}, {_number(high)}{right}"
    if opt.minimum is not None:
        return f" ≥ {_number(opt.minimum)}"
    if opt.exclusive_minimum is not None:
        return f" > {_number(opt.exclusive_minimum)}"
    return ""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


# -- consistency of a constructor with its options ---------------------------------------


def signature_mismatches(
    function: Callable[..., object], cls: type, *, skip: Iterable[str] = ()
) -> list[str]:
    """How ``function``'s keyword parameters differ from the options of ``cls``: an option
    without a parameter of its name, or with another default (options in ``skip`` are
    mapped by the plugin's builder and not compared). The check for a constructor that
    takes each option as a keyword and so repeats its name."""
    parameters = inspect.signature(function).parameters
    problems = []
    skipped = set(skip)
    for item in documented(cls):
        if item.name in skipped:
            continue
        parameter = parameters.get(item.name)
        if parameter is None:
            problems.append(f"{item.name}: no parameter")
        elif item.has_default:
            expected = to_json(item.default())
            actual = to_json(parameter.default)
            if actual != expected:
                problems.append(
                    f"{item.name}: default {parameter.default!r}, declared {item.default()!r}"
                )
    return problems


# -- plugins ------------------------------------------------------------------------------


def plugin(
    name: str,
    *,
    options: type[Options],
    build: Callable[[type[CallbackT], Options, plugins.PluginContext], CallbackT] | None = None,
    sections: plugins.Sections | None = None,
    options_errors: plugins.OptionRules | None = None,
    options_schema: plugins.JSONSchema | None = None,
    enabled_by_default: bool = False,
    default_replaced_by: tuple[str, ...] = (),
    implied_order: int = 0,
) -> Callable[[type[CallbackT]], type[CallbackT]]:
    """Class decorator: declare the ``PluginSpec`` of a callback class.

    ``options`` is the options dataclass, each field one declared option
    (``speedtronic.config.declare``): the options schema, its defaults and the docs table are
    derived from it (``options_schema`` replaces the derived schema where one type per
    field cannot say it). ``build(cls, options, context)`` makes the callback from a typed
    options object; the default calls ``cls(**options)``. The spec still has to be made
    visible under ``name`` -- an entry point, ``register_callback`` or ``register``.

    The class also gets the class-attribute API that code written before specs reads
    (``plugin_name``, ``options_schema``, ``from_options``, ``legacy_sections``, ...),
    read from the spec, where it does not define those itself.
    """

    def decorate(cls: type[CallbackT]) -> type[CallbackT]:
        builder = build if build is not None else _keyword_builder

        def create(parsed: object, context: plugins.PluginContext) -> Callback:
            return builder(cls, cast(Options, parsed), context)

        rules = {} if options_errors is None else {"options_errors": options_errors}
        spec = plugins.PluginSpec(
            name=name,
            callback=cls,
            options_schema=options_schema if options_schema is not None else object_schema(options),
            options_type=options,
            parse=functools.partial(_build_valid, options),
            build=create,
            sections=sections or plugins.Sections(),
            enabled_by_default=enabled_by_default,
            default_replaced_by=default_replaced_by,
            implied_order=implied_order,
            **rules,
        )
        attach(cls, spec, builder)
        return cls

    return decorate


def attach(
    cls: type[CallbackT],
    spec: plugins.PluginSpec,
    builder: Callable[[type[CallbackT], Options, plugins.PluginContext], CallbackT] | None = None,
) -> None:
    """Make ``spec`` the declared spec of ``cls`` (what ``plugins.spec_of_class`` returns), and
    give the class the class-attribute API read from it (``_attach_class_api``). ``plugin``
    does this; a plugin whose options are not one dataclass builds its spec itself."""
    cls.__plugin_spec__ = spec  # type: ignore[attr-defined]  # read back by spec_of_class
    _attach_class_api(cls, spec, builder)


def _keyword_builder(
    cls: type[CallbackT], options: object, context: plugins.PluginContext
) -> CallbackT:
    """The default builder of ``plugin``: ``keyword_build``."""
    del context
    return keyword_build(cls, options)


def keyword_build(factory: Callable[..., T], options: object) -> T:
    """``factory(**options)``: each option of a declared options object as the keyword
    argument of its name (for a constructor that takes the options as keywords)."""
    values = {item.name: getattr(options, item.name) for item in documented(type(options))}
    return factory(**values)


def _attach_class_api(
    cls: type[CallbackT],
    spec: plugins.PluginSpec,
    builder: Callable[[type[CallbackT], Options, plugins.PluginContext], CallbackT] | None,
) -> None:
    """The class-attribute API of a plugin, read from ``spec`` (what ``spec_of_class``
    adapts back): for code that calls ``CheckpointCallback.from_options(...)`` or reads
    ``ConsoleCallback.options_schema``. A name the class defines itself is left alone."""
    sections = spec.sections

    def from_options(
        klass: type[CallbackT], options: Mapping[str, object], context: plugins.PluginContext
    ) -> Callback:
        if builder is None:
            return spec.create(options, context)
        return builder(klass, cast(Options, spec.parse(options)), context)

    attributes: dict[str, object] = {
        "plugin_name": spec.name,
        "options_schema": spec.options_schema,
        "enabled_by_default": spec.enabled_by_default,
        "default_replaced_by": spec.default_replaced_by,
        "implied_order": spec.implied_order,
        "legacy_sections": sections.keys,
        "legacy_schema": sections.schema,
        "legacy_aliases": sections.aliases,
        "from_options": classmethod(from_options),
        "build": classmethod(from_options),
        "options_from_legacy": staticmethod(spec.options_for),
        "normalise_legacy": staticmethod(sections.normalise),
        "legacy_errors": staticmethod(sections.errors),
        "options_errors": staticmethod(spec.options_errors),
    }
    for attribute, value in attributes.items():
        if attribute not in cls.__dict__:
            setattr(cls, attribute, value)
