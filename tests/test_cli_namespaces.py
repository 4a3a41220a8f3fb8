"""A user's project never clashes with speedtronic's own modules (issue 10, item 7).

Through the real launchers (a fresh interpreter is the point: what it finds on ``sys.path``
at start-up), run from a temporary project directory: nothing in the working directory runs
unless ``imports:`` names it, and the built-in callbacks load beside a project's own
``callbacks.py`` / ``callbacks/``. A project ``callbacks`` module named in ``imports:`` runs
the command in a forked child with a clean ``sys.modules`` (tests/forked.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli as run_in_process
from forked import Forked, cli_main_stderr_to

ROOT = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = Path(sys.executable).with_name("speedtronic")

TINY = {
    "run": {"name": "ns", "device": "cpu", "max_steps": 2, "seed": 1, "output_dir": "out"},
    "model": {
        "vocab_size": 16,
        "max_seq_len": 4,
        "n_layer": 1,
        "n_head": 2,
        "d_model": 8,
        "d_ff": 16,
    },
    "data": {
        "synthetic_kind": "learnable",
        "num_tokens": 32,
        "micro_batch_size": 2,
        "target_batch_size": 2,
    },
    "optimizer": {"lr": 0.01},
    "logging": {"every_steps": 1},
    "checkpoint": {"enabled": False},
}


def marker_module(name: str) -> str:
    """Source of a module that leaves ``<name>.ran`` behind when anything executes it."""
    return (
        "from pathlib import Path\n"
        f"Path(__file__).resolve().parent.joinpath('{name}.ran').touch()\n"
        f"raise ImportError('the project file {name} was executed')\n"
    )


def launcher(kind: str) -> list[str]:
    if kind == "console script":
        if not CONSOLE_SCRIPT.is_file():
            pytest.skip("the speedtronic console script is not installed next to python")
        return [str(CONSOLE_SCRIPT)]
    return [sys.executable, "-m", "speedtronic"]


def start_cli(kind: str, *args: str, cwd: Path) -> subprocess.Popen[str]:
    path = os.pathsep.join([str(ROOT), str(ROOT / "callbacks")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [*launcher(kind), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_cli(kind: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return finish(start_cli(kind, *args, cwd=cwd))


def write_config(project: Path, **changes: object) -> Path:
    path = project / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    return path


def assert_default_sinks_ran(done: subprocess.CompletedProcess[str], project: Path) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed steps=2" in done.stdout
    assert "step 2/2" in done.stdout  # the console callback
    assert (project / "out" / "metrics.jsonl").is_file()  # the jsonl callback


def test_a_project_module_named_callbacks_in_imports_works_with_the_builtins(
    tmp_path: Path, forked: Forked
) -> None:
    # The command runs in a child forked from the preloaded fork server (tests/forked.py):
    # like the console script, it starts with a clean ``sys.modules`` (the server never
    # imported the project's module) and without the working directory on ``sys.path``;
    # the console script's own start-up is tested below.
    (tmp_path / "callbacks.py").write_text(
        "from speedtronic import Callback, register_callback\n"
        "@register_callback('hello')\n"
        "class Hello(Callback):\n"
        "    def on_fit_start(self, trainer, ctx):\n"
        "        print('HELLO from the project callbacks module')\n"
    )
    write_config(tmp_path, imports=["callbacks"], callbacks=[{"name": "hello"}])
    stderr = tmp_path / "stderr.txt"
    args = ("fit", "--config", "run.yaml")
    child = forked.start(cli_main_stderr_to, str(stderr), *args, cwd=tmp_path)
    code = child.wait(timeout=300)
    done = subprocess.CompletedProcess(args, code, child.output, stderr.read_text())
    assert_default_sinks_ran(done, tmp_path)
    assert "HELLO from the project callbacks module" in done.stdout


def test_imports_are_found_beside_the_config_from_another_directory(tmp_path: Path) -> None:
    # Where ``imports:`` look is decided inside the command (no fresh interpreter needed).
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_plugins.py").write_text(
        "from speedtronic import Callback, register_callback\n"
        "@register_callback('beside')\n"
        "class Beside(Callback):\n"
        "    pass\n"
    )
    config = write_config(project, imports=["my_plugins"], callbacks=[{"name": "beside"}])
    done = run_in_process("validate", "--config", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "beside" in done.stdout


@pytest.mark.parametrize(
    ("kind", "shadows"),
    [
        # ``python -m speedtronic`` runs a ./speedtronic.py itself (Python's rule, before any
        # of our code); the console script is immune to that name too.
        ("console script", ("yaml", "json", "torch", "speedtronic", "speedtronic_callbacks")),
        ("python -m", ("yaml", "json", "torch", "speedtronic_callbacks")),
    ],
)
def test_nothing_in_the_working_directory_runs_unless_imported(
    tmp_path: Path, kind: str, shadows: tuple[str, ...]
) -> None:
    """Neither modules named like dependencies nor a project ``callbacks.py`` /
    ``callbacks/`` run, and the built-in callbacks still load beside the latter."""
    for name in shadows:
        (tmp_path / f"{name}.py").write_text(marker_module(name))
    (tmp_path / "callbacks.py").write_text(marker_module("callbacks_module"))
    (tmp_path / "callbacks").mkdir()
    (tmp_path / "callbacks" / "__init__.py").write_text(marker_module("callbacks_package"))
    write_config(tmp_path)
    # Two independent processes (validate writes nothing): started together, on two cores.
    validating = start_cli(kind, "validate", "--config", "run.yaml", cwd=tmp_path)
    fitting = start_cli(kind, "fit", "--config", "run.yaml", cwd=tmp_path)
    validated, fitted = finish(validating), finish(fitting)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert_default_sinks_ran(fitted, tmp_path)
    assert sorted(path.name for path in tmp_path.glob("*.ran")) == []
    assert sorted(path.name for path in (tmp_path / "callbacks").glob("*.ran")) == []


def test_search_dirs_are_on_sys_path_only_while_a_named_module_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from speedtronic.user_imports import import_user_module, search_dirs

    (tmp_path / "h3_probe_plugins.py").write_text(
        "import sys\nSEEN = list(sys.path)\nimport h3_probe_sibling\n"
    )
    (tmp_path / "h3_probe_sibling.py").write_text("VALUE = 1\n")
    (tmp_path / "h3_probe_broken.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "h3_probe_plugins", raising=False)
    before = list(sys.path)
    with search_dirs(tmp_path, tmp_path):
        module = import_user_module("h3_probe_plugins")
        assert sys.path == before
        with pytest.raises(ImportError, match="broken on purpose"):
            import_user_module("h3_probe_broken")
        assert sys.path == before
    seen = module.SEEN
    assert seen[: len(before)] == before and seen[len(before) :] == [str(tmp_path.resolve())]
    (tmp_path / "h3_probe_outside.py").write_text("VALUE = 1\n")
    with pytest.raises(ModuleNotFoundError):  # outside search_dirs nothing is added
        import_user_module("h3_probe_outside")
    for name in ("h3_probe_plugins", "h3_probe_sibling"):
        sys.modules.pop(name, None)
