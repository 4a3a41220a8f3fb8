"""A downstream user's module runs; mypy --strict, run outside the repository on the
installed package (the suite's one shared run, ``mypy_outside``), types it (and rejects a
wrong hook signature)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
from mypy_outside import MypyRun, register

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "downstream"


def test_downstream_module_trains() -> None:
    namespace = runpy.run_path(str(EXAMPLES / "good_user.py"), run_name="downstream")
    losses = namespace["main"]()
    assert len(losses) == 5
    assert losses[-1] < losses[0]


register("bad_user.py", (EXAMPLES / "bad_user.py").read_text)


def test_mypy_rejects_a_wrong_override_signature(mypy_outside: MypyRun) -> None:
    # The good module is checked in CI's type step; here we prove the check can fail.
    assert mypy_outside.returncode == 1, mypy_outside.stdout
    errors = [line for line in mypy_outside.lines("bad_user.py") if ": error:" in line]
    assert any('Argument 2 of "on_step_end" is incompatible with supertype' in e for e in errors)
    # ``@override`` on a misspelled hook: the typo is caught statically too.
    assert any(
        'Method "on_step_ended" is marked as an override, but no base method was found' in e
        for e in errors
    ), mypy_outside.stdout


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


register("good_user.py", (EXAMPLES / "good_user.py").read_text)
register("uses_builtin.py", lambda: USES_A_BUILTIN)


def test_mypy_strict_from_another_directory_resolves_the_installed_package(
    mypy_outside: MypyRun,
) -> None:
    """After the README's install, mypy run from outside the repository finds
    ``speedtronic`` and ``speedtronic_callbacks`` through the environment's path entries
    (the editable install is a ``.pth`` path entry), so nothing becomes ``Any``."""
    assert ROOT not in mypy_outside.project.parents
    lines = mypy_outside.lines("good_user.py") + mypy_outside.lines("uses_builtin.py")
    notes = [line for line in lines if ": note: Revealed type" in line]
    errors = [line for line in lines if ": error:" in line]
    assert errors == [], mypy_outside.stdout
    assert len(notes) == 2, mypy_outside.stdout
    assert "-> uses_builtin.QuietConsole" in notes[0]
    assert "speedtronic_callbacks.checkpoint.CheckpointCallback" in notes[1]
    assert "speedtronic.engine.callback.Callback" in notes[1]
    assert "Any" not in " ".join(notes)


STATE_KEYS = """
from typing import ClassVar

from speedtronic import Callback


class AsClassVar(Callback):
    state_key: ClassVar[str] = "as_class_var"


class Plain(Callback):
    state_key = "plain"


class Optional(Callback):
    state_key: str | None = "optional"


class PerInstance(Callback):
    def __init__(self, name: str) -> None:
        self.state_key = f"per_instance_{name}"


def key_of(callback: Callback) -> str | None:
    return callback.state_key


reveal_type(AsClassVar.state_key)
"""


register("state_keys.py", lambda: STATE_KEYS)


def test_every_spelling_of_state_key_type_checks_in_a_subclass(mypy_outside: MypyRun) -> None:
    # ``state_key: ClassVar[str]`` was "Cannot override instance variable ... with class
    # variable"; the other plugin attributes (``plugin_name``, ...) accept it.
    lines = mypy_outside.lines("state_keys.py")
    assert [line for line in lines if ": error:" in line] == [], mypy_outside.stdout
    notes = [line.split("note: ")[1] for line in lines]
    assert len(notes) == 1 and notes[0].endswith('str"') and "None" not in notes[0], notes
