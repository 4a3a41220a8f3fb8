"""Test-wide settings: one thread (2-core CI machines), deterministic, offline W&B.

Suite time (issue 15, item 14; measurements in docs/performance.md, "Test suite time"): a
subprocess costs ~3 s of ``import torch`` before it does anything, and a cold mypy run over
torch's stubs ~40 s, so

- CLI behaviour runs in this process (``cli_runner.run_cli``: ``speedtronic.cli.main`` with
  argv, stdout/stderr and the exit code captured, imported user modules and registrations
  undone afterwards). Fresh interpreters stay where the start-up is the point: the
  launchers and a fresh interpreter's ``sys.path`` (test_cli_namespaces), a closed pipe
  (test_cli_preflight), fresh-interpreter import order (test_static_types, test_public_api),
  and one real torchrun (test_distributed). Independent processes of one test start
  together, so they share the two cores.
- the files the tests type with mypy are checked in ONE ``mypy --strict`` run outside the
  repository (``mypy_outside``), started in the background once collection is done, so it
  runs on the other core; each test reads only its own file's lines. Under pytest-xdist
  (the README's ``-n 2``) the workers share that one run.
- processes that need not be a fresh interpreter (rank processes, DiLoCo nodes, signalled
  and killed training runs, a process holding a run lock, a CLI run that needs a clean
  ``sys.modules``) are forked from a server that imported torch once (``forked``: the
  fixture below, tests/forked.py); each test process starts its server in the background
  once collection is done.
- the known-slow tests run first (``SLOW_FIRST``), so that the two xdist workers finish
  together on short tests.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
from forked import Forked, forked_children, start_server
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


# The slowest tests (durations measured with ``--durations``), longest first. They run first,
# so that the two xdist workers end together on short tests instead of one waiting for a
# long test that happened to start last. A file name moves the whole file (its
# module-scoped fixtures still run once per worker); a test name moves that test alone.
SLOW_FIRST = (
    "tests/test_cli_namespaces.py::test_nothing_in_the_working_directory_runs_unless_imported",
    "tests/test_diloco_wire_fuzz.py::test_any_json_header_decodes_or_is_rejected",
    "tests/test_distributed.py::test_torchrun_runs_the_cli_data_parallel",
    "tests/test_distributed.py::test_synchronous_diloco_h4_trains_and_resumes_exactly",
    "tests/test_launch.py",  # three launchers, each starting two fresh rank interpreters
    "tests/test_remote_ownership.py",
    "tests/test_adapters.py::test_two_ddp_ranks_train_the_adapters_as_one_process",
    "tests/test_public_api.py::test_the_trainer_imports_no_config_machinery",
    "tests/test_wandb.py",
    "tests/test_fuzz.py",
    "tests/test_fsdp.py",
    "tests/test_ema_fsdp.py",
    "tests/test_crash_safety.py",
    "tests/test_remote_checkpoint.py::test_sigkill_during_uploads_then_resume_elsewhere_continues_bit_for_bit",
    "tests/test_diloco_streaming.py",
    "tests/test_distributed.py::test_two_rank_ddp_matches_one_process_and_resumes_exactly",
    "tests/test_diloco_nodes.py",
    "tests/test_compile.py::test_compiled_training_matches_eager",
    "tests/test_public_api.py::test_engine_modules_never_import_callbacks",
    "tests/test_diloco_wire_fuzz.py",
    "tests/test_cli_preflight.py::test_validate_into_a_closed_pipe_exits_quietly",
    "tests/test_plot.py",
    "tests/test_docs.py",
    "tests/test_prepare.py::test_prepare_fit_and_resume_on_token_shards_is_bitwise",
    "tests/test_token_shards.py::test_two_ranks_read_disjoint_windows_that_cover_the_epoch",
    "tests/test_diloco_e2e.py",
    "tests/test_run_lock.py::test_two_runs_started_together_on_one_checkpoint_directory",
    "tests/test_export.py",  # the first test of each imports transformers' models (~8 s)
    "tests/test_hf_models.py",
    "tests/test_checkpoint_signals.py::test_a_second_sigint_during_a_save_never_breaks_it",
)


def _slow_rank(item: pytest.Item) -> int:
    for rank, prefix in enumerate(SLOW_FIRST):
        if item.nodeid.startswith(prefix):
            return rank
    return len(SLOW_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Known-slow tests first (``SLOW_FIRST``); the rest keep their order."""
    items.sort(key=_slow_rank)  # stable


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared mypy run and this process's fork server as soon as the tests that
    use them are known: both work in the background while the first tests run."""
    if session.config.option.collectonly:
        return
    names = [list(getattr(item, "fixturenames", ())) for item in session.items]
    if wanted(names):
        MypyRun.start_or_join(session_directory())
    if _runs_tests(session.config) and any("forked" in fixtures for fixtures in names):
        start_server()


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
