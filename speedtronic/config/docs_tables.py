"""The option tables of ``docs/``, generated from the declarations.

A page marks each table it shows with the declaration it comes from::

    <!-- options: speedtronic.config.sections:RunConfig -->
    | key | type | default | rule |
    ...
    <!-- end options -->

and ``speedtronic schema --docs docs`` (``write_docs``) rewrites what lies between the marks
from that dataclass (``declare.markdown_table``); ``tests/test_docs.py`` checks that every
page is current. After the ``options:`` mark come one or more ``module:Class`` names (their
rows in order), then optionally ``only=a,b`` or ``exclude=a,b`` (option names) and
``header=option`` (the first column's title; ``key`` by default, with ``rule`` as the last
column's, ``option`` goes with ``meaning``). ``<!-- options: bounds -->`` stands for the table
of the core keys' upper bounds (``_bounds_table``).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from pathlib import Path
from typing import cast

from speedtronic.config import declare
from speedtronic.state.atomic_io import atomic_write_text

_BLOCK = re.compile(
    r"(?P<open><!-- options: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(?P<close><!-- end options -->)",
    re.S,
)


class _DocsTableError(ValueError):
    """A marked table that names no declaration, or an unknown option."""


def _declaration(name: str) -> type:
    module_name, _, attribute = name.partition(":")
    try:
        declared = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise _DocsTableError(f"docs table: cannot find the declaration {name!r}: {exc}") from None
    if not isinstance(declared, type):
        raise _DocsTableError(f"docs table: {name!r} is not a dataclass")
    return declared


def _bounds_table() -> str:
    """Every upper bound of the core's keys: one row per bound, its keys in declaration order
    (``data.mixture[i].weight`` for the items of a list)."""
    from speedtronic.config.sections import _SECTION_TYPES, SpeedtronicConfig

    groups: dict[tuple[float, bool], list[str]] = {}
    for prefix, cls in _SECTION_TYPES.items():
        for item in declare.documented(cls):
            _groups_of(item, f"{prefix}.{item.name}", groups)
    for item in declare.documented(SpeedtronicConfig):
        if item.name not in _SECTION_TYPES:
            _groups_of(item, item.name, groups)
    rows = ["| key | maximum | |", "|---|---|---|"]
    for (bound, exclusive), keys in groups.items():
        names = ", ".join(f"`{key}`" for key in keys)
        rows.append(f"| {names} | {_number(bound)} | {'exclusive' if exclusive else ''} |")
    return "\n".join(rows) + "\n"


def _groups_of(
    item: declare.Declared, path: str, groups: dict[tuple[float, bool], list[str]]
) -> None:
    """Add the bounds ``item`` declares (its own, its items', nested fields') to ``groups``."""
    for bound, exclusive, where in _bounds(item, path):
        groups.setdefault((bound, exclusive), []).append(where)


def _bounds(item: declare.Declared, path: str) -> list[tuple[float, bool, str]]:
    opt = item.opt
    found: list[tuple[float, bool, str]] = []
    schemas: list[tuple[dict[str, object], str]] = [
        (dict(opt.schema or {}), path),
        (dict(opt.items or {}), f"{path}[i]"),
    ]
    for branch in cast("list[object]", (opt.schema or {}).get("anyOf", [])):
        if isinstance(branch, dict):
            schemas.append((branch, path))
    if opt.maximum is not None:
        found.append((opt.maximum, False, path))
    if opt.exclusive_maximum is not None:
        found.append((opt.exclusive_maximum, True, path))
    for schema, where in schemas:
        for key, exclusive in (("maximum", False), ("exclusiveMaximum", True)):
            bound = schema.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool):
                found.append((bound, exclusive, where))
    # A list's items are ``path[i].field``; an optional nested section is ``path.field``.
    items = typing.get_origin(item.hint) in (list, tuple)
    for nested in typing.get_args(item.hint):
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            for field in declare.documented(nested):
                found.extend(_bounds(field, f"{path}{'[i]' if items else ''}.{field.name}"))
    return found


def _number(value: float) -> str:
    if isinstance(value, float) and not value.is_integer():
        return repr(value)
    if isinstance(value, float) and value >= 1e9:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    return f"{int(value):,}"


def table(spec: str) -> str:
    """The table a mark's text (``module:Class [only=...] [exclude=...] [header=...]``)
    stands for."""
    classes: list[type] = []
    only: set[str] | None = None
    exclude: set[str] = set()
    header = "key"
    if spec.strip() == "bounds":
        return _bounds_table()
    for word in spec.split():
        key, sep, value = word.partition("=")
        if not sep:
            classes.append(_declaration(word))
        elif key == "only":
            only = set(value.split(","))
        elif key == "exclude":
            exclude = set(value.split(","))
        elif key == "header":
            header = value
        else:
            raise _DocsTableError(f"docs table: unknown setting {key!r} in {spec!r}")
    last = "meaning" if header == "option" else "rule"
    rows: list[str] = []
    seen: set[str] = set()
    for cls in classes:
        names = [item.name for item in declare.documented(cls)]
        seen.update(names)
        skipped = exclude | ({name for name in names if name not in only} if only else set())
        lines = declare.markdown_table(
            cls, exclude=skipped, header=(header, "type", "default", last)
        )
        rows.extend(lines.splitlines()[2:])
    unknown = ((only or set()) | exclude) - seen
    if unknown:
        raise _DocsTableError(f"docs table {spec!r}: no option(s) {sorted(unknown)}")
    head = f"| {header} | type | default | {last} |\n|---|---|---|---|"
    return "\n".join([head, *rows]) + "\n"


def render(text: str) -> str:
    """``text`` with every marked table regenerated."""
    return _BLOCK.sub(lambda match: match["open"] + table(match["spec"]) + match["close"], text)


def write_docs(directory: Path) -> list[Path]:
    """Regenerate the marked tables of every ``*.md`` page in ``directory``; returns the
    pages that changed."""
    changed: list[Path] = []
    for page in sorted(Path(directory).glob("*.md")):
        text = page.read_text(encoding="utf-8")
        rendered = render(text)
        if rendered != text:
            atomic_write_text(page, rendered)  # an editor reading it never sees half a page
            changed.append(page)
    return changed
