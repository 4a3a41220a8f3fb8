"""One declaration per option: a dataclass field that carries its type, default, bounds and doc.

Every setting -- a core section's key (``RunConfig.max_steps``), a plugin's option
(``CheckpointOptions.every_steps``), a key of a 2.0 section, a model's ``model.options`` --
is one field, its type annotated with an ``Opt``::

    @dataclass(frozen=True)
    class HeartbeatOptions:
        seconds: Annotated[float, Opt("Seconds between beats.", exclusive_minimum=0)] = 60.0

The declaration itself and what is derived from it for validation -- the JSON Schema
(``object_schema``), the defaults (``defaults_of``), the typed object built from validated
data (``build``) -- live in ``speedtronic.util.options`` (below every layer, so the models
declare their options the same way) and are re-exported here. This module adds the rows of
the docs tables (``doc_rows``, ``markdown_table``), the check of a constructor against its
options (``signature_mismatches``) and ``plugin``, which declares a callback plugin's
``PluginSpec`` from its options dataclass.

This module imports nothing of the engine (``speedtronic.plugins`` only, for the spec).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar, cast

from speedtronic import plugins
from speedtronic.util.options import (
    Declared as Declared,
)
from speedtronic.util.options import (
    Fold as Fold,
)
from speedtronic.util.options import (
    Opt as Opt,
)
from speedtronic.util.options import (
    SchemaDict as SchemaDict,
)
from speedtronic.util.options import (
    build as build,
)
from speedtronic.util.options import (
    coerce as coerce,
)
from speedtronic.util.options import (
    declared as declared,
)
from speedtronic.util.options import (
    default_of as default_of,
)
from speedtronic.util.options import (
    defaults_of as defaults_of,
)
from speedtronic.util.options import (
    documented as documented,
)
from speedtronic.util.options import (
    field_of as field_of,
)
from speedtronic.util.options import (
    object_schema as object_schema,
)
from speedtronic.util.options import (
    plain_doc as plain_doc,
)
from speedtronic.util.options import (
    property_schema as property_schema,
)
from speedtronic.util.options import (
    to_json as to_json,
)
from speedtronic.util.options import (
    type_schema as type_schema,
)

if TYPE_CHECKING:
    from speedtronic.engine.callback import Callback

T = TypeVar("T")
Options = TypeVar("Options")
_CallbackT = TypeVar("_CallbackT", bound="Callback")

_build_valid = build  # ``plugin`` has a parameter of that name


# -- docs tables -------------------------------------------------------------------------


def doc_rows(cls: type, *, exclude: Iterable[str] = ()) -> Iterator[tuple[str, str, str, str]]:
    """``(key, type, default, doc)`` of each option of ``cls``, as the docs tables show them."""
    skipped = set(exclude)
    for item in documented(cls):
        if item.name in skipped:
            continue
        opt = item.opt
        type_text = opt.type_text or _type_text_of(item.hint, opt)
        if opt.default_text is not None:
            default = opt.default_text
        elif item.has_default:
            default = f"`{_json_text(to_json(item.default()))}`"
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


def _json_text(value: object) -> str:
    """A value as YAML/JSON shows it: ``null``, ``true``, ``3e-4``, ``[0.9, 0.95]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_json_text(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {_json_text(item)}" for key, item in value.items()) + "}"
    return str(value)


_NAMES = {bool: "bool", int: "int", float: "number", str: "string"}


def _type_text_of(hint: object, opt: Opt | None = None) -> str:
    """``int ≥ 1 or null``, ``number in [0, 1)``, ``` `min` | `max` ```, ``list of strings``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_type_text_of(arg, opt) for arg in args if arg is not type(None)]
        text = " or ".join(parts)
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        return " | ".join(f"`{_json_text(arg)}`" for arg in args)
    if hint in _NAMES:
        return _NAMES[hint] + _bounds_text(opt)
    if origin in (list, Sequence) or hint is list:
        inner = _type_text_of(args[0]) if args else "values"
        return f"list of {_plural(inner)}"
    if origin is tuple:
        count = {2: "two", 3: "three"}.get(len(args), str(len(args)))
        return f"{count} {_plural(_type_text_of(args[0]))}"
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
    build: Callable[[type[_CallbackT], Options, plugins.PluginContext], _CallbackT] | None = None,
    sections: plugins.Sections | None = None,
    options_errors: plugins.OptionRules | None = None,
    options_schema: plugins.JSONSchema | None = None,
    enabled_by_default: bool = False,
    default_replaced_by: tuple[str, ...] = (),
    implied_order: int = 0,
) -> Callable[[type[_CallbackT]], type[_CallbackT]]:
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

    def decorate(cls: type[_CallbackT]) -> type[_CallbackT]:
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
    cls: type[_CallbackT],
    spec: plugins.PluginSpec,
    builder: Callable[[type[_CallbackT], Options, plugins.PluginContext], _CallbackT] | None = None,
) -> None:
    """Make ``spec`` the declared spec of ``cls`` (what ``plugins.spec_of_class`` returns), and
    give the class the class-attribute API read from it (``_attach_class_api``). ``plugin``
    does this; a plugin whose options are not one dataclass builds its spec itself."""
    cls.__plugin_spec__ = spec  # type: ignore[attr-defined]  # read back by spec_of_class
    _attach_class_api(cls, spec, builder)


def _keyword_builder(
    cls: type[_CallbackT], options: object, context: plugins.PluginContext
) -> _CallbackT:
    """The default builder of ``plugin``: ``keyword_build``."""
    del context
    return keyword_build(cls, options)


def keyword_build(factory: Callable[..., T], options: object) -> T:
    """``factory(**options)``: each option of a declared options object as the keyword
    argument of its name (for a constructor that takes the options as keywords)."""
    values = {item.name: getattr(options, item.name) for item in documented(type(options))}
    return factory(**values)


def _attach_class_api(
    cls: type[_CallbackT],
    spec: plugins.PluginSpec,
    builder: Callable[[type[_CallbackT], Options, plugins.PluginContext], _CallbackT] | None,
) -> None:
    """The class-attribute API of a plugin, read from ``spec`` (what ``spec_of_class``
    adapts back): for code that calls ``CheckpointCallback.from_options(...)`` or reads
    ``ConsoleCallback.options_schema``. A name the class defines itself is left alone."""
    sections = spec.sections

    def from_options(
        klass: type[_CallbackT], options: Mapping[str, object], context: plugins.PluginContext
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
