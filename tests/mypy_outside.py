"""One ``mypy --strict`` run outside the repository, shared by every test that types a file.

A downstream user's project lies outside this repository and finds ``speedtronic`` and
``speedtronic_callbacks`` through the environment's path entries (no ``MYPYPATH``, no
repository config). Test modules ``register`` the files they need typed there when they are
imported; once collection is done, conftest writes them all into one temporary project and
starts mypy on it in the background (it runs on the other core while the suite goes on), and
the ``mypy_outside`` fixture waits for it. mypy types each top-level module on its own, so
each test reads only its own file's lines (``MypyRun.lines``).

Analysing torch's stubs is most of a cold run (~45 s); one run instead of four pays it once.
The cache lies in the repository's ``.mypy_cache`` (git-ignored), so later runs are warm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".mypy_cache" / "outside-the-repository"

_SOURCES: dict[str, Callable[[], str]] = {}


def register(filename: str, source: Callable[[], str]) -> None:
    """Have ``filename`` (a top-level module of the project) typed with ``source()``."""
    _SOURCES[filename] = source


class MypyRun:
    """The background mypy run over every registered file."""

    def __init__(self) -> None:
        self.project = Path(tempfile.mkdtemp(prefix="speedtronic-downstream-"))
        for filename, source in _SOURCES.items():
            (self.project / filename).write_text(source(), encoding="utf-8")
        self._output = (self.project.parent / (self.project.name + ".mypy-out")).open("w+")
        env = {key: value for key, value in os.environ.items() if key != "MYPYPATH"}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(CACHE), "."],
            cwd=self.project,
            env=env,
            stdout=self._output,  # a file, not a pipe: nothing reads it until a test asks
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._stdout: str | None = None

    @property
    def stdout(self) -> str:
        if self._stdout is None:
            self._process.wait(timeout=900)
            self._output.seek(0)
            self._stdout = self._output.read()
        return self._stdout

    @property
    def returncode(self) -> int:
        self.stdout  # noqa: B018 - waits for the run
        assert self._process.returncode is not None
        return self._process.returncode

    def lines(self, filename: str) -> list[str]:
        """mypy's lines about ``filename`` (errors and notes)."""
        lines = (line.removeprefix("./") for line in self.stdout.splitlines())
        return [line for line in lines if line.startswith(f"{filename}:")]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._output.close()
        Path(self._output.name).unlink(missing_ok=True)
        shutil.rmtree(self.project, ignore_errors=True)


def wanted(fixturenames: list[list[str]]) -> bool:
    """Whether any collected test uses the ``mypy_outside`` fixture."""
    return bool(_SOURCES) and any("mypy_outside" in names for names in fixturenames)
