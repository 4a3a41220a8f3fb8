"""Run the ``speedtronic`` command in the test process, as a subprocess would see it.

``run_cli("fit", "--config", ..., cwd=tmp_path)`` calls ``speedtronic.cli.main`` with that
argv in ``cwd`` and returns what ``subprocess.run`` would: the exit code and the text written
to stdout and stderr. It saves the ~3 s of ``import torch`` a subprocess costs; the tests where
the process boundary itself is the point (launchers, ``sys.path`` of a fresh interpreter,
signals, closed pipes, a second process holding a lock) still start real processes.

What one command leaves behind in this process is undone after it, as a process exit would:
modules imported from the command's directories (a later test's ``my_plugins.py`` is
imported afresh), callbacks those modules registered, torch's thread count and the global
random states.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from speedtronic.cli import main
from speedtronic.plugins import callback_registry


@dataclass(frozen=True)
class CliResult:
    """The fields of ``subprocess.CompletedProcess`` the tests read."""

    returncode: int
    stdout: str
    stderr: str


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # what the interpreter does with ``sys.exit("message")``
    return 1


def _loaded_from(directories: list[Path], names: set[str]) -> list[str]:
    loaded = []
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and any(Path(file).resolve().is_relative_to(d) for d in directories):
            loaded.append(name)
    return loaded


def run_cli(*args: str, cwd: Path) -> CliResult:
    """``speedtronic *args`` run in ``cwd``, in this process."""
    directories = [Path(cwd).resolve()]
    if "--config" in args:
        directories.append(Path(cwd, args[args.index("--config") + 1]).resolve().parent)
    known_modules = set(sys.modules)
    known_callbacks = set(callback_registry.names())
    threads = torch.get_num_threads()
    torch_rng = torch.get_rng_state()
    python_rng = random.getstate()
    out, err = io.StringIO(), io.StringIO()
    previous_cwd = os.getcwd()
    os.chdir(cwd)  # contextlib.chdir is Python 3.11+
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse: usage errors, --help, --version
                code = _exit_code(exc.code)
    finally:
        os.chdir(previous_cwd)
        for name in _loaded_from(directories, set(sys.modules) - known_modules):
            del sys.modules[name]
        for name in set(callback_registry.names()) - known_callbacks:
            callback_registry.unregister(name)
        torch.set_num_threads(threads)
        torch.set_rng_state(torch_rng)
        random.setstate(python_rng)
    return CliResult(code, out.getvalue(), err.getvalue())
