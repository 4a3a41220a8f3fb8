"""Warnings for the user, reported at the user's own line.

A warning raised inside the framework -- by a built-in callback's hook, the trainer, the
composition root -- is about the user's run, so Python should report it where the user's
code led to it (the ``trainer.fit()`` line, the user's hook), not at the framework line
that happened to call the hook (``speedtronic/engine/dispatch.py:158``). A fixed
``stacklevel`` cannot know that: the same hook is called by the loop, by ``emit`` and from
tests. ``warn`` walks up the stack past every frame in a framework directory, as Python
3.12's ``skip_file_prefixes`` does, on 3.10 and 3.11 too.

The framework directories are ``speedtronic`` and every package that calls
``skip_frames_under`` (``speedtronic_callbacks`` does in its ``__init__``; a plugin package
may do the same so that its warnings point at its users' code). Nothing here runs unless a
warning is raised.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType, TracebackType

__all__ = ["skip_frames_under", "warn", "warn_at_failure"]


def _prefixes(directory: str | Path) -> list[str]:
    """``directory`` as code objects may name it: as imported and with links resolved."""
    forms = {os.path.abspath(directory), str(Path(directory).resolve())}
    return sorted(form + os.sep for form in forms)


_SKIPPED: list[str] = _prefixes(Path(__file__).parent)


def skip_frames_under(directory: str | Path) -> None:
    """Count the frames of files under ``directory`` as the framework's (``warn`` skips them)."""
    for prefix in _prefixes(directory):
        if prefix not in _SKIPPED:
            _SKIPPED.append(prefix)


def _in_framework(filename: str) -> bool:
    return filename.startswith(tuple(_SKIPPED))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` reported at the innermost frame outside the
    framework (the caller's own frame when every frame is the framework's, as on a thread
    it started)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # ``warnings.warn``'s stacklevel of our caller's frame
    while frame is not None and _in_framework(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def warn_at_failure(
    message: str, category: type[Warning], error: BaseException, function: Callable[..., object]
) -> None:
    """Warn about ``error``, raised by ``function`` (a hook), at the innermost line of
    ``function``'s file in its traceback -- the line of the user's hook that raised -- when
    that file is not the framework's; otherwise (a built-in failed) as ``warn`` does."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    filename = code.co_filename if isinstance(code, CodeType) else None
    where = _innermost_line_in(error.__traceback__, filename) if filename else None
    if filename is None or _in_framework(filename) or where is None:
        warn(message, category)
        return
    frame, line = where
    module = frame.f_globals.get("__name__")
    warnings.warn_explicit(
        message,
        category,
        filename,
        line,
        module=module if isinstance(module, str) else None,
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
        module_globals=frame.f_globals,
    )


def _innermost_line_in(trace: TracebackType | None, filename: str) -> tuple[FrameType, int] | None:
    found = None
    while trace is not None:
        if trace.tb_frame.f_code.co_filename == filename:
            found = (trace.tb_frame, trace.tb_lineno)
        trace = trace.tb_next
    return found
