"""One ``mypy --strict`` run outside the repository, shared by every test that types a file.

A downstream user's project lies outside this repository and finds ``speedtronic`` and
``speedtronic_callbacks`` through the environment's path entries (no ``MYPYPATH``, no
repository config). Test modules ``register`` the files they need typed there when they are
imported; once collection is done, conftest writes them all into one temporary project and
starts mypy on it in the background (it runs on another core while the suite goes on), and
the ``mypy_outside`` fixture waits for it. Under pytest-xdist the first worker to finish
collecting starts the run and every worker reads its result: one run per test session.
mypy types each top-level module on its own, so each test reads only its own file's lines
(``MypyRun.lines``).

Analysing torch's stubs is most of a cold run (~45 s); one run instead of four pays it once.
The cache lies in the repository's ``.mypy_cache`` (git-ignored), so later runs are warm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".mypy_cache" / "outside-the-repository"

_SOURCES: dict[str, Callable[[], str]] = {}


def register(filename: str, source: Callable[[], str]) -> None:
    """Have ``filename`` (a top-level module of the project) typed with ``source()``."""
    _SOURCES[filename] = source


RUN_DIRECTORY = "SPEEDTRONIC_TEST_MYPY_RUN"
"""Environment variable naming the test session's shared run directory (``session_directory``)."""

# Runs mypy and then records its exit code, so that any process of the session can wait for
# the result (the process that started it may finish its own tests first).
_RECORD_EXIT = (
    "import subprocess, sys; code = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1] + '.part', 'w').write(str(code)); "
    "__import__('os').replace(sys.argv[1] + '.part', sys.argv[1])"
)


def session_directory() -> Path:
    """The directory the session's test processes share (pytest-xdist workers inherit the
    variable from the controller; without xdist the one process sets and uses it)."""
    return Path(os.environ[RUN_DIRECTORY])


class MypyRun:
    """The background mypy run over every registered file: started by the first process of
    the test session that needs it (``start_or_join``), read by all of them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.project = directory / "project"
        self._stdout: str | None = None

    @classmethod
    def start_or_join(cls, directory: Path) -> MypyRun:
        run = cls(directory)
        try:
            fd = os.open(directory / "started", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return run  # another worker of this session started it
        run.project.mkdir()
        for filename, source in _SOURCES.items():
            (run.project / filename).write_text(source(), encoding="utf-8")
        env = {key: value for key, value in os.environ.items() if key != "MYPYPATH"}
        with (directory / "mypy.out").open("w") as output:
            process = subprocess.Popen(
                [sys.executable, "-c", _RECORD_EXIT, str(directory / "returncode")]
                + [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(CACHE), "."],
                cwd=run.project,
                env=env,
                stdout=output,  # a file, not a pipe: nothing reads it until a test asks
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # ``stop`` ends mypy with the process that runs it
            )
        os.write(fd, str(process.pid).encode())
        os.close(fd)
        _STARTED.append(process)
        return run

    @property
    def stdout(self) -> str:
        if self._stdout is None:
            deadline = time.monotonic() + 900
            while not (self.directory / "returncode").is_file():
                assert (self.directory / "started").is_file(), "the mypy run was not started"
                assert time.monotonic() < deadline, "the shared mypy run took over 900 s"
                time.sleep(0.2)
            self._stdout = (self.directory / "mypy.out").read_text(encoding="utf-8")
        return self._stdout

    @property
    def returncode(self) -> int:
        self.stdout  # noqa: B018 - waits for the run
        return int((self.directory / "returncode").read_text(encoding="utf-8"))

    def lines(self, filename: str) -> list[str]:
        """mypy's lines about ``filename`` (errors and notes)."""
        lines = (line.removeprefix("./") for line in self.stdout.splitlines())
        return [line for line in lines if line.startswith(f"{filename}:")]


_STARTED: list[subprocess.Popen[str]] = []


def stop(directory: Path) -> None:
    """End the session's run if it still runs and remove its files (the controller, last)."""
    started = directory / "started"
    pid = started.read_text().strip() if started.is_file() else ""
    if pid and not (directory / "returncode").is_file():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid), signal.SIGKILL)
    for process in _STARTED:
        process.wait()
    shutil.rmtree(directory, ignore_errors=True)


def wanted(fixturenames: list[list[str]]) -> bool:
    """Whether any collected test uses the ``mypy_outside`` fixture."""
    return bool(_SOURCES) and any("mypy_outside" in names for names in fixturenames)
