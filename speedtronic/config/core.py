"""The core's declarations as the config machinery reads them: the loader's tables
(``CoreKeys``) and the core part of the run schema.

The machinery (``schema``, ``validation``, ``loading``) checks and normalises what the section
declarations describe, and the declarations use the machinery (a section validates itself
when it is built). So the machinery does not import the declarations: the package
(``speedtronic.config``) hands them down once, when it is imported (``bind``), and the
machinery reads them here when first needed. Imports inside ``config/`` point one way:
``declare``, ``core`` <- ``schema`` <- ``validation`` <- ``loading`` <- ``section_base`` <- the
section modules <- ``sections`` (the root) <- the package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from speedtronic.config.declare import Fold

__all__ = ["CoreDeclarations", "CoreKeys", "bind", "declarations"]


@dataclass(frozen=True)
class CoreKeys:
    """What the loader reads from the core's declarations (``Opt.shorthand``, ``Opt.fold``,
    ``Opt.fills``)."""

    shorthands: Mapping[str, str]
    """Root key -> the section it is a shorthand of (``max_steps`` -> ``run``)."""
    folds: Mapping[tuple[str, str], Fold]
    """``(section, key)`` of the case-insensitive enumerated strings, and how they fold."""
    fills: Mapping[tuple[str, str], tuple[str, str]]
    """``(section, key)`` -> the key it fills when that is not given (``run.log_every`` ->
    ``logging.every_steps``)."""
    bare_values: Mapping[str, str]
    """Section -> the key a bare value means (``Section.bare_value``)."""


class _SchemaDocument(Protocol):
    """Builds the core's part of the run schema from the declarations."""

    def __call__(self, *, dialect: str, schema_id: str) -> dict[str, object]: ...


@dataclass(frozen=True)
class CoreDeclarations:
    """What the section declarations give the machinery."""

    keys: CoreKeys
    schema_document: _SchemaDocument


_bound: list[CoreDeclarations] = []
"""The declarations the package bound (one entry once ``speedtronic.config`` is imported)."""


def bind(core: CoreDeclarations) -> None:
    """Hand the core's declarations to the machinery (``speedtronic.config`` does, once)."""
    _bound[:] = [core]


def declarations() -> CoreDeclarations:
    """The declarations the package bound. Importing any module of ``speedtronic.config``
    imports the package first, which binds them, so they are there before any caller."""
    if not _bound:
        raise RuntimeError(
            "the core's config declarations are not bound yet: a config module asked for them "
            "while speedtronic.config was still being imported"
        )
    return _bound[0]
