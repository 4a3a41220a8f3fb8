"""A downstream user's module runs; mypy --strict, run outside the repository on the
installed package, types it (and rejects a wrong hook signature)."""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "downstream"


def test_downstream_module_trains() -> None:
    namespace = runpy.run_path(str(EXAMPLES / "good_user.py"), run_name="downstream")
    losses = namespace["main"]()
    assert len(losses) == 5
    assert losses[-1] < losses[0]


def test_mypy_rejects_a_wrong_override_signature() -> None:
    # The good module is checked in CI's type step; here we prove the check can fail.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(EXAMPLES / "bad_user.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout
    assert 'Argument 2 of "on_step_end" is incompatible with supertype' in done.stdout


def test_reference_example_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(ROOT / "examples" / "train_reference.py"), run_name="example")
    result = namespace["main"]()
    assert (result.steps, result.samples, result.tokens) == (10, 20, 640)
    assert (tmp_path / "runs" / "example" / "metrics.jsonl").is_file()


USES_A_BUILTIN = """
from speedtronic import Callback
from speedtronic_callbacks import ConsoleCallback
from speedtronic_callbacks.checkpoint import CheckpointCallback


class QuietConsole(ConsoleCallback):
    \"\"\"A downstream subclass of a built-in (an error under --strict if it were Any).\"\"\"


def as_callback(callback: CheckpointCallback) -> Callback:
    return callback


reveal_type(QuietConsole)
reveal_type(as_callback)
"""


def test_mypy_strict_from_another_directory_resolves_the_installed_package(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """After the README's install, mypy run from outside the repository finds
    ``speedtronic`` and ``speedtronic_callbacks`` through the environment's path entries
    (the editable install is a ``.pth`` path entry), so nothing becomes ``Any``."""
    project = tmp_path_factory.mktemp("downstream-project")
    assert ROOT not in project.parents
    shutil.copy(EXAMPLES / "good_user.py", project / "good_user.py")
    (project / "uses_builtin.py").write_text(USES_A_BUILTIN)
    cache = tmp_path_factory.getbasetemp() / "mypy-cache"
    env = {key: value for key, value in os.environ.items() if key != "MYPYPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "."],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    notes = [line for line in done.stdout.splitlines() if ": note: Revealed type" in line]
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert errors == [], done.stdout
    assert len(notes) == 2, done.stdout
    assert "-> uses_builtin.QuietConsole" in notes[0]
    assert "speedtronic_callbacks.checkpoint.CheckpointCallback" in notes[1]
    assert "speedtronic.callback.Callback" in notes[1]
    assert "Any" not in " ".join(notes)
