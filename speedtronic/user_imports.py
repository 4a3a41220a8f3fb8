"""How the config's ``imports:`` find the user's own modules -- and nothing else.

The ``speedtronic`` command never puts the working directory on ``sys.path``: a ``yaml.py``,
``torch.py`` or ``callbacks.py`` there would otherwise shadow a real dependency and run on
``speedtronic validate``. Instead, while a command runs (``search_dirs``), each module the
config names under ``imports:`` is imported with the working directory and the config
file's directory *appended* to ``sys.path`` -- behind every installed package, and only for
the duration of that one import (``import_user_module``). A user module may import its
siblings at import time; nothing else in those directories is ever found.

Outside the CLI (``load_config`` / ``train_from_config`` from Python) no directory is added:
``imports:`` resolve on the caller's own ``sys.path``, as a plain ``import`` would.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType

__all__ = ["import_user_module", "search_dirs"]

_SEARCH_DIRS: ContextVar[tuple[Path, ...]] = ContextVar("speedtronic_import_dirs", default=())


@contextmanager
def search_dirs(*directories: Path) -> Iterator[None]:
    """Look for the modules named in ``imports:`` in ``directories`` (in this order) too."""
    unique = tuple(dict.fromkeys(directory.resolve() for directory in directories))
    token = _SEARCH_DIRS.set(unique)
    try:
        yield
    finally:
        _SEARCH_DIRS.reset(token)


def import_user_module(name: str) -> ModuleType:
    """Import ``name`` with the current ``search_dirs`` appended to ``sys.path`` meanwhile."""
    added = [str(path) for path in _SEARCH_DIRS.get() if str(path) not in sys.path]
    sys.path.extend(added)
    try:
        return importlib.import_module(name)
    finally:
        for entry in added:
            if entry in sys.path:
                sys.path.remove(entry)
