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

An entry must be a dotted module name (``my_plugins``, ``pkg.plugins``): a path such as
``../x``, ``/abs/x`` or ``x.py`` is refused before anything is imported. A module that
fails while it is imported -- raises any exception, or calls ``sys.exit()`` -- is reported as
a ``UserImportError`` (an ``ImportError``) naming the module and where it failed, so the
config is refused with a clear error instead of a traceback or a silent exit. Only
``KeyboardInterrupt`` passes through.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType

__all__ = ["UserImportError", "import_user_module", "search_dirs"]

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


class UserImportError(ImportError):
    """An ``imports:`` entry that is not a module name, or a module that failed while it was
    being imported (an exception or ``sys.exit()`` in its top-level code)."""


def _check_module_name(name: str) -> None:
    """Raise ``UserImportError`` unless ``name`` is a dotted module name (not a path). The
    messages complete ``cannot import 'NAME': ...``."""
    if name.endswith(".py") and all(part.isidentifier() for part in name[:-3].split(".")):
        raise UserImportError(f"a file name, not a module name: write {name[:-3]!r}")
    if not all(part.isidentifier() for part in name.split(".")):
        raise UserImportError(
            "not a module name: imports are dotted Python module names such as "
            "'my_plugins' or 'package.plugins', never paths; put the file in the working "
            "directory or beside the config and name it without '.py'"
        )


def _installed_code_prefixes() -> tuple[str, ...]:
    """Where installed libraries and the standard library live (``site-packages``, ...)."""
    paths = sysconfig.get_paths()
    return tuple(
        os.path.join(os.path.realpath(paths[key]), "")
        for key in ("purelib", "platlib", "stdlib", "platstdlib")
        if key in paths
    )


def _where(error: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame of ``error`` outside importlib, and outside
    installed libraries where the user's own code has a frame: a library that wraps
    ``sys.exit`` (wandb, once imported, does) is not where the user's module exited."""
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith("<frozen importlib")
        and frame.filename != importlib.__file__
    ]
    installed = _installed_code_prefixes()
    own = [f for f in frames if not os.path.realpath(f.filename).startswith(installed)]
    frames = own or frames
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def import_user_module(name: str) -> ModuleType:
    """Import ``name`` with the current ``search_dirs`` appended to ``sys.path`` meanwhile.

    Raises ``UserImportError`` for a name that is not a module name and for a module that
    raises or calls ``sys.exit()`` while being imported; a missing module is the usual
    ``ModuleNotFoundError``."""
    _check_module_name(name)
    added = [str(path) for path in _SEARCH_DIRS.get() if str(path) not in sys.path]
    sys.path.extend(added)
    try:
        return importlib.import_module(name)
    except ImportError:
        raise
    except SystemExit as exc:
        where = _where(exc)
        raise UserImportError(
            f"it called sys.exit({exc.code!r}) while being imported{where}"
        ) from None
    except Exception as exc:
        raise UserImportError(
            f"it raised {type(exc).__name__} while being imported{_where(exc)}: {exc}"
        ) from exc
    finally:
        for entry in added:
            if entry in sys.path:
                sys.path.remove(entry)
