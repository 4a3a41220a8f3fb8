"""Issue 12.3/12.9, 22.6/22.10: hostile or broken configuration text gets a ``ConfigError``
naming the file, fast -- alias bombs, absurd nesting, cycles, non-UTF-8 bytes, unbuildable
values, numbers too long to be a setting, megabytes of keys."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cli_runner import run_cli as cli

from speedtronic.config import ConfigError, load_config
from speedtronic.config.loading import (
    MAX_NESTING,
    MAX_NODES,
    MAX_TEXT_BYTES,
    parse_override,
    parse_yaml,
)


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
    start = time.process_time()  # CPU time: a loaded machine's waiting does not count
    with pytest.raises(ConfigError, match=match) as caught:
        action()
    assert time.process_time() - start < limit_s
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


# -- issue 22, item 6: a number too long to be a setting ---------------------------------

HUGE_NUMBERS = {
    "hex": "0x" + "f" * 3700,  # above 10**4300: Python's int/str conversion limit
    "decimal": "9" * 5000,
    "binary": "0b" + "1" * 5000,
    "octal": "0" + "7" * 5000,  # YAML 1.1 octal
    "underscores": "1_" * 3000 + "1",
    "sexagesimal": ":".join(["59"] * 2000),  # YAML 1.1 base 60
    "negative": "-0x" + "f" * 3700,
}


@pytest.mark.parametrize("form", sorted(HUGE_NUMBERS))
def test_a_huge_integer_in_yaml_exits_2_naming_the_key(tmp_path: Path, form: str) -> None:
    literal = HUGE_NUMBERS[form]
    path = tmp_path / "run.yaml"
    path.write_text(f"run:\n  seed: {literal}\ndata:\n  dataset_options: {{n: {literal}}}\n")
    start = time.perf_counter()
    done = cli("validate", "--config", str(path), cwd=tmp_path)
    assert time.perf_counter() - start < 2
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "ValueError" not in done.stderr
    assert f"run.seed: {literal[:12]}..." in done.stderr  # a preview, never every digit
    assert f"is a number of {len(literal):,} characters, out of range" in done.stderr
    assert "data.dataset_options.n: " in done.stderr  # free-form options too
    assert len(done.stderr) < 1000


def test_a_huge_integer_in_json_or_through_set_exits_2_naming_the_key(tmp_path: Path) -> None:
    digits = "9" * 5000
    path = tmp_path / "run.json"
    path.write_text(f'{{"run": {{"seed": {digits}}}}}')
    done = cli("validate", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "run.seed: 999999999999...999999 is a number of 5,000 characters" in done.stderr
    (tmp_path / "run.yaml").write_text("run: {name: x}\n")
    done = cli("validate", "--config", "run.yaml", "--set", f"optimizer.lr=0x{'f' * 4000}",
               cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "optimizer.lr: 0xffffffffff...ffffff is a number of 4,002 characters" in done.stderr
    assert len(done.stderr) < 1000


def test_a_huge_python_int_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"run\.seed: 0x.* out of range") as caught:
        load_config({"run": {"seed": 10**5000}, "seed": 10**5000})
    assert len(str(caught.value)) < 1000
    # Below the bound of the schema's messages, a number is reported as any other.
    with pytest.raises(ConfigError, match=r"run\.seed: 1(0){30} is greater than the maximum"):
        load_config({"run": {"seed": 10**30}})


@pytest.mark.parametrize("literal", ["1e999", "-1e999", "1" + "0" * 400 + ".0", ".inf", ".nan"])
def test_an_infinite_float_is_refused_where_it_matters(tmp_path: Path, literal: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"optimizer:\n  lr: {literal}\ndata:\n  dataset_options: {{x: {literal}}}\n")
    done = cli("validate", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "optimizer.lr: " in done.stderr
    assert "data.dataset_options.x: " in done.stderr and "is not a finite number" in done.stderr


# -- issue 22, item 10: bounded work before composing --------------------------------------


def test_a_megabytes_config_is_refused_before_parsing(tmp_path: Path) -> None:
    # 150,000 flat keys, 2.3 MB: took 24 s to refuse, and called itself "an alias bomb?".
    path = tmp_path / "run.yaml"
    path.write_text(
        "run:\n  seed: 1\nextra:\n" + "".join(f"  k{i:07d}: {i}\n" for i in range(150_000))
    )
    assert path.stat().st_size > 2_000_000
    error = refuses_quickly(lambda: load_config(path), "more than the limit of 1,048,576")
    assert f"is {path.stat().st_size:,} bytes long" in str(error) and str(path) in str(error)
    assert "alias" not in str(error)
    done = cli("validate", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 2 and "more than the limit of 1,048,576" in done.stderr


@pytest.mark.parametrize("kind", ["block", "flow", "json"])
def test_too_many_values_are_refused_while_parsing(tmp_path: Path, kind: str) -> None:
    # Under the size limit, but 25,000 keys (or 400,000 list items): refused after
    # MAX_NODES of them, not after parsing everything.
    if kind == "block":
        text, name = "".join(f"k{i}: {i}\n" for i in range(25_000)), "run.yaml"
    elif kind == "flow":
        text, name = "a: [" + ",".join(["1"] * 400_000) + "]\n", "run.yaml"
    else:
        text, name = json.dumps({f"k{i}": i for i in range(25_000)}), "run.json"
    path = tmp_path / name
    path.write_text(text)
    assert len(text) < MAX_TEXT_BYTES
    # Typically 0.5 s; the bound is generous for a loaded machine (the 2.3 MB file of the
    # issue took 24 s before the limit). What proves the work is
    # bounded is where parsing stopped: at MAX_NODES values, not at the end of the text.
    error = refuses_quickly(
        lambda: load_config(path), f"holds more than {MAX_NODES:,} values", limit_s=20.0
    )
    assert str(path) in str(error) and "alias" not in str(error)
    if kind == "block":  # two values (key and value) a line
        assert f"(up to line {MAX_NODES // 2}, column " in str(error)
    elif kind == "flow":  # two characters a value
        assert "(up to line 1, column 399" in str(error)


def test_a_huge_set_value_is_refused_with_a_short_message(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("run: {name: x}\n")
    value = "[" + ",".join(["1"] * 600_000) + "]"
    done = cli("validate", "--config", "run.yaml", "--set", f"run.name={value}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "more than the limit of 1,048,576" in done.stderr
    assert "(1,200,010 characters)" in done.stderr and len(done.stderr) < 1000
