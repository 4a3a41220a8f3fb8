"""The plugin boundary, checked on the source: built-in callbacks use the trainer only
through ``TrainerView`` and import nothing of the engine's internals.

Every function under ``callbacks/`` with a parameter named ``trainer`` (every hook has one)
or annotated ``TrainerView`` may only read members of ``TrainerView`` from it, never assign
to it and never reach around it with ``getattr``/``setattr``/``vars``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from speedtronic.engine.trainer import Trainer
from speedtronic.engine.view import TrainerView

ROOT = Path(__file__).resolve().parent.parent
CALLBACKS = ROOT / "callbacks"
ENGINE_INTERNALS = (
    "speedtronic.trainer",  # the 2.0 import path of the Trainer
    "speedtronic.engine.trainer",
    "speedtronic.engine.loop",
    "speedtronic.engine.dispatch",
)
REACHING_BUILTINS = {"getattr", "setattr", "delattr", "vars", "hasattr"}


def view_members() -> set[str]:
    return {
        name
        for name in vars(TrainerView)
        if not name.startswith("_") and name not in {"register", "mro"}
    }


def callback_sources() -> list[Path]:
    return sorted(CALLBACKS.rglob("*.py"))


def _annotation_text(node: ast.expr | None) -> str:
    return "" if node is None else ast.unparse(node)


def _view_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    return {
        arg.arg
        for arg in every
        if arg.arg == "trainer" or "TrainerView" in _annotation_text(arg.annotation)
    }


def boundary_violations(source: str, filename: str) -> Iterator[str]:
    """Each use of a trainer parameter outside ``TrainerView`` in ``source``."""
    members = view_members()
    tree = ast.parse(source, filename)
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = _view_parameters(function)
        if not names:
            continue
        for node in ast.walk(function):
            where = f"{filename}:{getattr(node, 'lineno', '?')} in {function.name}()"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id not in names:
                    continue
                if not isinstance(node.ctx, ast.Load):
                    yield f"{where}: assigns {node.value.id}.{node.attr}"
                elif node.attr not in members:
                    yield f"{where}: {node.value.id}.{node.attr} is not a TrainerView member"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in REACHING_BUILTINS and any(
                    isinstance(arg, ast.Name) and arg.id in names for arg in node.args
                ):
                    yield f"{where}: {node.func.id}() on the trainer reaches around TrainerView"


def engine_imports(source: str, filename: str) -> Iterator[str]:
    """Each import of an engine internal (or of the concrete ``Trainer``) in ``source``."""
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(ENGINE_INTERNALS):
                    yield f"{where}: import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith(ENGINE_INTERNALS):
                yield f"{where}: from {node.module} import ..."
            elif node.module in ("speedtronic", "speedtronic.engine"):
                for alias in node.names:
                    if alias.name in ("trainer", "loop", "dispatch", "Trainer"):
                        yield f"{where}: from {node.module} import {alias.name}"


@pytest.mark.parametrize("path", callback_sources(), ids=lambda p: str(p.relative_to(CALLBACKS)))
def test_callbacks_touch_the_trainer_only_through_the_view(path: Path) -> None:
    found = list(boundary_violations(path.read_text(encoding="utf-8"), str(path)))
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("path", callback_sources(), ids=lambda p: str(p.relative_to(CALLBACKS)))
def test_callbacks_import_no_engine_internals(path: Path) -> None:
    found = list(engine_imports(path.read_text(encoding="utf-8"), str(path)))
    assert found == [], "\n".join(found)


def test_the_checks_catch_what_they_are_for() -> None:
    reach = (
        "def on_step_end(self, trainer, ctx):\n"
        "    trainer.scaler.update()\n"
        "    trainer.step = 3\n"
        "    getattr(trainer, 'stream')\n"
        "def helper(view: TrainerView) -> None:\n"
        "    view.optimizer.zero_grad()\n"
        "def fine(trainer):\n"
        "    trainer.request_stop('x'); trainer.model.eval()\n"
    )
    found = list(boundary_violations(reach, "x.py"))
    assert len(found) == 4, found
    text = "\n".join(found)
    for expected in ("trainer.scaler", "assigns trainer.step", "getattr()", "view.optimizer"):
        assert expected in text
    imports = "from speedtronic.engine.trainer import Trainer\nimport speedtronic.engine.loop\n"
    imports += "from speedtronic import Trainer\nfrom speedtronic.engine.view import TrainerView\n"
    imports += "from speedtronic.trainer import Trainer\nfrom speedtronic.engine import loop\n"
    assert len(list(engine_imports(imports, "x.py"))) == 5


def test_the_trainer_satisfies_the_view_structurally() -> None:
    # mypy checks the same statically (the loop hands a Trainer to hooks typed TrainerView).
    missing = sorted(name for name in view_members() if not hasattr(Trainer, name))
    instance_attributes = {
        "model",
        "step",
        "samples",
        "tokens",
        "accumulation_steps",
        "metrics_every",
        "eval_every",
        "last_loss",
        "device",
        "output_dir",
        "distributed",
        "trainable_parameters",
        "target_step",  # plain attributes, not properties: the loop reads them every step
        "multi_rank",
        "resumed_from",  # set by resume_from
    }
    assert set(missing) <= instance_attributes, missing


def test_the_view_offers_evaluation_of_the_current_weights() -> None:
    # DiLoCo's master evaluates each global model it installs through this one member; the
    # engine's evaluation internals (data, precision plan) stay behind it.
    assert "evaluate" in view_members()
    assert "eval_data" not in view_members() and "run_evaluation" not in view_members()


def test_view_members_are_documented() -> None:
    page = (ROOT / "docs" / "callbacks.md").read_text(encoding="utf-8")
    undocumented = sorted(
        name for name in view_members() if f"`{name}" not in page and f".{name}(" not in page
    )
    assert undocumented == [], (
        f"document these TrainerView members in docs/callbacks.md: {undocumented}"
    )
