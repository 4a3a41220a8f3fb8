"""A downstream user's module runs, and mypy --strict rejects a wrong hook signature."""

from __future__ import annotations

import runpy
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
