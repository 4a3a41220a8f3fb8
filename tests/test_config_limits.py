"""Issue 12.3/12.9: hostile or broken configuration text gets a ``ConfigError`` naming the
file, fast -- alias bombs, absurd nesting, cycles, non-UTF-8 bytes, unbuildable values."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli_runner import run_cli as cli

from speedtronic.config import ConfigError, load_config
from speedtronic.config.loading import MAX_NESTING, parse_override, parse_yaml


def alias_bomb(levels: int = 6, fan_out: int = 9) -> str:
    """``a: &a [x, ...]``, ``b: &b [*a, *a, ...]``, ...: ``fan_out ** levels`` values from
    about 300 bytes."""
    lines = [f"a: &a [{', '.join(['x'] * fan_out)}]"]
    for level in range(1, levels + 1):
        name, previous = chr(ord("a") + level), chr(ord("a") + level - 1)
        lines.append(f"{name}: &{name} [{', '.join(['*' + previous] * fan_out)}]")
    return "\n".join(lines) + "\n"


def refuses_quickly(action: object, match: str, limit_s: float = 0.5) -> ConfigError:
    assert callable(action)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=match) as caught:
        action()
    assert time.perf_counter() - start < limit_s
    return caught.value


def test_alias_bomb_in_a_file_is_refused_fast(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 400
    error = refuses_quickly(lambda: load_config(path), "alias bomb")
    assert str(path) in str(error)


def test_alias_bomb_through_set_is_refused_fast() -> None:
    bomb = alias_bomb().replace("\n", ", ")
    refuses_quickly(lambda: parse_override(f"run.name={{{bomb}}}"), "alias bomb")


def test_modest_aliases_still_work() -> None:
    assert parse_yaml("a: &a [1, 2]\nb: *a\n") == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        "{a: " * 100_000 + "1" + "}" * 100_000,
        "- " * 100_000 + "x",
        "".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "end",
    ],
    ids=["flow-lists", "flow-maps", "block-lists", "block-maps"],
)
def test_absurd_nesting_is_a_config_error(text: str) -> None:
    refuses_quickly(lambda: parse_yaml(text), f"nested more than {MAX_NESTING} levels")


def test_nesting_through_aliases_counts_too() -> None:
    deep = "[" * 40 + "1" + "]" * 40
    assert parse_yaml(f"a: &a {deep}\nb: [[[[[[*a]]]]]]\n") is not None  # 47 deep: fine
    refuses_quickly(
        lambda: parse_yaml(f"a: &a {deep}\nb: {'[' * 30}*a{']' * 30}\n"), "aliases are expanded"
    )


def test_cyclic_alias_is_a_config_error() -> None:
    refuses_quickly(lambda: parse_yaml("a: &a [1, *a]\n"), "cycle")


def test_deep_json_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    error = refuses_quickly(lambda: load_config(path), "nested")
    assert str(path) in str(error)


def test_unbuildable_value_is_a_config_error() -> None:
    refuses_quickly(lambda: parse_yaml("when: 2001-13-45\n"), "month must be in 1..12")


@pytest.mark.parametrize("kind", ["bomb", "deep", "latin-1"])
def test_cli_exits_2_naming_the_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "run.yaml"
    if kind == "bomb":
        path.write_text(alias_bomb())
    elif kind == "deep":
        path.write_text("model: " + "[" * 100_000 + "]" * 100_000 + "\n")
    else:
        path.write_bytes("run: {name: caf\u00e9}\n".encode("latin-1"))
    done = cli("validate", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "speedtronic: error:" in done.stderr and str(path) in done.stderr
    assert "Traceback" not in done.stderr
    if kind == "latin-1":
        assert "not UTF-8" in done.stderr


def test_cli_set_alias_bomb_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("run: {name: x}\n")
    bomb = alias_bomb().replace("\n", ", ")
    done = cli("validate", "--config", str(path), "--set", f"run.name={{{bomb}}}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "alias bomb" in done.stderr
