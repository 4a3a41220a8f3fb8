"""Test-wide settings: one thread (2-core CI machines), deterministic, offline W&B.

Suite time (issue 15, item 14; measurements in docs/performance.md, "Test suite time"): a
subprocess costs ~3 s of ``import torch`` before it does anything, and a cold mypy run over
torch's stubs ~40 s, so

- CLI behaviour runs in this process (``cli_runner.run_cli``: ``speedtronic.cli.main`` with
  argv, stdout/stderr and the exit code captured, imported user modules and registrations
  undone afterwards). Real processes stay where the boundary is the point: the launchers and
  a fresh interpreter's ``sys.path`` (test_cli_namespaces), signals (test_checkpoint), a
  closed pipe (test_cli_preflight), a second process holding a run lock (test_run_lock),
  fresh-interpreter import order (test_static_types), torchrun/DDP ranks and DiLoCo nodes.
  Independent processes of one test start together, so they share the two cores.
- the files the tests type with mypy are checked in ONE ``mypy --strict`` run outside the
  repository (``mypy_outside``), started in the background once collection is done, so it
  runs on the other core; each test reads only its own file's lines.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from forked import Forked, forked_children
from mypy_outside import MypyRun, wanted

torch.set_num_threads(1)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """A test that changes torch's thread count (``run.threads``) does not slow the rest."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


_MYPY_RUNS: list[MypyRun] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared mypy run as soon as the tests that read it are known."""
    names = [list(getattr(item, "fixturenames", ())) for item in session.items]
    if wanted(names):
        _MYPY_RUNS.append(MypyRun())


def pytest_sessionfinish(session: pytest.Session) -> None:
    for run in _MYPY_RUNS:
        run.close()


@pytest.fixture(scope="session")
def mypy_outside() -> MypyRun:
    """``mypy --strict`` over every registered file, in a project outside the repository."""
    if not _MYPY_RUNS:  # requested in a way collection did not see
        _MYPY_RUNS.append(MypyRun())
    return _MYPY_RUNS[0]


@pytest.fixture
def forked() -> Iterator[Forked]:
    """Real child processes forked from a server that already imported torch (tests/forked.py)."""
    yield from forked_children()
