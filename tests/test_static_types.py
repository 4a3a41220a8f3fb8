"""Every public name has the same type at run time as type checkers see (issue 10, item 9).

For each name in ``speedtronic.__all__`` and ``speedtronic_callbacks.__all__``, a fresh
interpreter describes the runtime object (module, class, function or instance of a class) --
once straight after ``import speedtronic`` and once after importing every submodule first,
since a submodule import rebinds a package attribute of the same name. mypy describes the
static declaration of the same name (``reveal_type``), and the two must agree.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mypy_outside import MypyRun, register

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("speedtronic", "speedtronic_callbacks")
ORDERS = ("fresh import", "every submodule first")

DESCRIBE_RUNTIME = """
import importlib, inspect, json, pkgutil, sys, types

packages = [importlib.import_module(name) for name in {packages!r}]
if sys.argv[1] == "every submodule first":
    for package in packages:
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.rpartition(".")[2] != "__main__":  # __main__ runs the CLI
                importlib.import_module(info.name)

def full_name(obj):
    return obj.__module__ + "." + obj.__qualname__

def describe(value):
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, type):
        return ["class", full_name(value)]
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return ["function", full_name(value)]
    return ["instance", full_name(type(value))]

def checked(package):
    if package.__name__ != "speedtronic":
        return package.__all__
    # the front door and the names kept beside it (speedtronic.compat.exports)
    return [*package.__all__, *importlib.import_module("speedtronic.compat.exports").kept_names()]

print(json.dumps({{
    package.__name__ + "." + name: describe(getattr(package, name))
    for package in packages
    for name in checked(package)
}}))
"""


def checked_names(package: str) -> list[str]:
    """``__all__``, and for ``speedtronic`` the names kept importable beside its front door."""
    names = list(importlib.import_module(package).__all__)
    if package == "speedtronic":
        from speedtronic.compat.exports import kept_names

        names += kept_names()
    return names


def public_names() -> list[str]:
    # ``__all__`` is a literal list: reading it here equals reading it in a fresh interpreter.
    return [p + "." + n for p in PACKAGES for n in checked_names(p)]


def start_runtime_description(order: str) -> subprocess.Popen[str]:
    """A fresh interpreter describing every public name (the process is the point: nothing
    this test process imported may leak into "fresh import")."""
    code = DESCRIBE_RUNTIME.format(packages=PACKAGES)
    return subprocess.Popen(
        [sys.executable, "-c", code, order],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@functools.cache
def runtime_kinds(process: subprocess.Popen[str]) -> dict[str, list[str]]:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr
    kinds: dict[str, list[str]] = json.loads(stdout)
    return kinds


class StaticView:
    """mypy's view of each public name: its revealed type and whether it is a class."""

    def __init__(self, revealed: dict[str, str], classes: set[str]) -> None:
        self.revealed = revealed
        self.classes = classes


@pytest.fixture(scope="module")
def describing() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Both runtime descriptions, started at once (one on each core)."""
    processes = {order: start_runtime_description(order) for order in ORDERS}
    yield processes
    for process in processes.values():
        if process.poll() is None:  # a test failed before reading it
            process.kill()
            process.communicate()


class Probe:
    """``probe.py``: for each public name a ``reveal_type`` line and a class probe line."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        lines = [f"import {package}" for package in PACKAGES]
        self.reveal_line: dict[int, str] = {}
        self.class_probe_line: dict[int, str] = {}
        for index, name in enumerate(names):
            lines.append(f"reveal_type({name})")
            self.reveal_line[len(lines)] = name
            # Only a class object has ``__mro__`` (mypy reports an error for anything else).
            lines.append(f"_probe_{index} = {name}.__mro__")
            self.class_probe_line[len(lines)] = name
        self.source = "\n".join(lines) + "\n"


PROBE = Probe(public_names())
register("probe.py", lambda: PROBE.source)  # typed in the suite's shared mypy run


@pytest.fixture(scope="module")
def static_view(mypy_outside: MypyRun) -> StaticView:
    names, reveal_line, class_probe_line = PROBE.names, PROBE.reveal_line, PROBE.class_probe_line
    revealed: dict[str, str] = {}
    not_classes: set[str] = set()
    unexpected: list[str] = []
    for line in mypy_outside.lines("probe.py"):
        match = re.match(r"probe\.py:(\d+): (note|error): (.*)", line)
        if match is None:
            continue
        number, kind, message = int(match[1]), match[2], match[3]
        if kind == "note" and number in reveal_line:
            revealed[reveal_line[number]] = message.removeprefix("Revealed type is ").strip('"')
        elif kind == "error" and number in class_probe_line:
            not_classes.add(class_probe_line[number])
        else:
            unexpected.append(line)
    assert not unexpected, mypy_outside.stdout
    assert set(revealed) == set(names), mypy_outside.stdout
    return StaticView(revealed, set(names) - not_classes)


def static_mismatch(name: str, runtime: list[str], view: StaticView) -> str | None:
    """Why ``name``'s static declaration disagrees with its runtime ``[kind, full name]``."""
    kind, full_name = runtime
    full_name = full_name.removeprefix("builtins.")  # mypy writes builtins unqualified
    revealed = view.revealed[name]
    if kind == "class":
        returns_exactly = re.search(rf"-> {re.escape(full_name)}(\[.*\])?\)?$", revealed)
        if name in view.classes and returns_exactly:
            return None
    elif kind == "function":
        if name not in view.classes and revealed.startswith(("def ", "Overload(")):
            return None
    elif kind == "instance":
        if revealed == full_name or revealed.startswith(full_name + "["):
            return None
    elif revealed == "types.ModuleType":
        return None
    return f"{name}: at run time a {kind} {full_name}, statically {revealed!r}"


@pytest.mark.parametrize("order", ORDERS)
def test_public_names_have_their_declared_type_at_run_time(
    order: str, describing: dict[str, subprocess.Popen[str]], static_view: StaticView
) -> None:
    runtime = runtime_kinds(describing[order])
    assert set(runtime) == set(static_view.revealed)
    mismatches = [
        problem
        for name, kind in sorted(runtime.items())
        if (problem := static_mismatch(name, kind, static_view)) is not None
    ]
    assert mismatches == []


def test_no_public_name_is_also_a_submodule() -> None:
    """A submodule import rebinds the package attribute of its name (the old
    ``speedtronic.registry`` bug), so the two name spaces must not overlap."""
    for package, folder in (
        ("speedtronic", ROOT / "speedtronic"),
        ("speedtronic_callbacks", ROOT / "callbacks" / "speedtronic_callbacks"),
    ):
        submodules = {path.stem for path in folder.glob("*.py")} | {
            path.parent.name for path in folder.glob("*/__init__.py")
        }
        exported = set(__import__(package).__all__)
        assert exported & submodules == set(), package


def test_hub_client_is_a_real_class() -> None:
    import speedtronic

    assert isinstance(speedtronic.HubClient, type)


def test_the_2_0_top_level_names_are_among_the_checked_names() -> None:
    """Issue 15 item 1: the 25 names 2.0 exported are public again, so the runtime/static
    comparison above covers them too."""
    from test_compat_v2 import V2_TOP_LEVEL_NAMES

    assert set(V2_TOP_LEVEL_NAMES) <= set(checked_names("speedtronic"))
