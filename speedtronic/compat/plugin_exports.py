"""2.0 names whose implementation now lives in a plugin, resolved at first use.

``speedtronic.HubClient`` or ``speedtronic.distributed.DumbDiLoCoCoordinator`` are found
through the plugin's entry point (group ``speedtronic.callbacks``), so the engine never
imports the built-in callbacks package itself; the modules declare the names for type
checkers under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import importlib
from importlib import metadata

__all__ = ["plugin_attribute"]


def plugin_attribute(plugin: str, name: str, owner: str) -> object:
    """Attribute ``name`` of the module that plugin ``plugin`` is registered in; an
    ``AttributeError`` (saying which plugin is missing) for ``owner``'s ``__getattr__``."""
    from speedtronic.plugins import CALLBACK_GROUP

    for entry in metadata.entry_points(group=CALLBACK_GROUP, name=plugin):
        return getattr(importlib.import_module(entry.module), name)
    raise AttributeError(
        f"module {owner!r} has no attribute {name!r}: the {plugin!r} plugin is not installed"
    )
