"""Test-wide settings: one thread (2-core CI machines), deterministic, offline W&B.

Suite time (issue 15, item 14; measurements in docs/performance.md, "Test suite time"): a
subprocess costs ~3 s of ``import torch`` before it does anything, and a cold mypy run over
torch's stubs ~40 s, so

- CLI behaviour runs in this process (``cli_runner.run_cli``: ``speedtronic.cli.main`` with
  argv, stdout/stderr and the exit code captured, imported user modules and registrations
  undone afterwards). Fresh interpreters stay where the start-up is the point: the
  launchers and a fresh interpreter's ``sys.path`` (test_cli_namespaces), a closed pipe
  (test_cli_preflight), fresh-interpreter import order (test_static_types, test_public_api),
  one real torchrun (test_distributed), and the DiLoCo end-to-end nodes (test_diloco_e2e:
  its learning outcome depends on how far apart the nodes start). Independent processes of
  one test start together, so they share the two cores.
- the files the tests type with mypy are checked in ONE ``mypy --strict`` run outside the
  repository (``mypy_outside``), started in the background once collection is done, so it
  runs on the other core; each test reads only its own file's lines. Under pytest-xdist
  (the README's ``-n 2``) the workers share that one run.
- processes that need not be a fresh interpreter (rank processes, signalled and killed
  training runs, a process holding a run lock) are forked from a server that
  imported torch once (``forked``: the fixture below, tests/forked.py).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
from forked import Forked, forked_children
from mypy_outside import RUN_DIRECTORY, MypyRun, session_directory, stop, wanted

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """A test that changes torch's thread count (``run.threads``) does not slow the rest."""
    import torch

    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _runs_tests(config: pytest.Config) -> bool:
    """False only in pytest-xdist's controller, which starts the workers and runs no test
    (it need not import torch: ~4 s of CPU)."""
    return _is_xdist_worker(config) or not getattr(config.option, "numprocesses", None)


def pytest_configure(config: pytest.Config) -> None:
    """The session's process (the xdist controller, or the only one) makes the directory its
    test processes share; the workers it starts inherit the variable."""
    if not _is_xdist_worker(config):
        os.environ[RUN_DIRECTORY] = tempfile.mkdtemp(prefix="speedtronic-mypy-run-")
    if _runs_tests(config):
        import torch

        torch.set_num_threads(1)  # before any test module is imported


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _is_xdist_worker(config) and RUN_DIRECTORY in os.environ:
        stop(session_directory())


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared mypy run as soon as the tests that read it are known."""
    names = [list(getattr(item, "fixturenames", ())) for item in session.items]
    if wanted(names):
        MypyRun.start_or_join(session_directory())


@pytest.fixture(scope="session")
def mypy_outside() -> MypyRun:
    """``mypy --strict`` over every registered file, in a project outside the repository."""
    # started by collection (here or in another xdist worker); if collection did not see
    # the request, this starts it
    return MypyRun.start_or_join(session_directory())


@pytest.fixture
def forked() -> Iterator[Forked]:
    """Real child processes forked from a server that already imported torch (tests/forked.py)."""
    yield from forked_children()
