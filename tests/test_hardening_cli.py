"""Issue 12, item 9: exit codes and messages of user-side failures match docs/cli.md.

In process (``speedtronic.cli.main``): a user module that raises or calls ``sys.exit`` at
import, a path under ``imports:``, absurd numbers, a pointer nested 200,000 deep, and metric
sinks that cannot write. (Non-UTF-8 and 100,000-deep configs: tests/test_config_limits.py.)
"""

from __future__ import annotations

import copy
import csv
import errno
import json
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import cast

import pytest
import yaml
from test_cli_preflight import TINY as PREFLIGHT_TINY

from speedtronic.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from speedtronic.config.schema import INT64_MAX
from speedtronic_callbacks.csv_sink import CsvCallback
from speedtronic_callbacks.tensorboard import TensorBoardCallback

ROOT = Path(__file__).resolve().parent.parent

# The tiny run of the preflight tests, without console output.
TINY = cast(dict[str, dict[str, object]], copy.deepcopy(PREFLIGHT_TINY))
TINY["logging"]["console"] = False


def write_config(tmp_path: Path, **changes: object) -> Path:
    config: dict[str, object] = {key: dict(value) for key, value in TINY.items()}
    for name, value in changes.items():
        section = config.get(name)
        config[name] = {**section, **value} if isinstance(section, dict) else value  # type: ignore[dict-item]  # a section mapping
    config["run"]["output_dir"] = str(tmp_path / "out")  # type: ignore[index]  # the run section
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- imports: -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "fit"])
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("x = 1\nraise ValueError('no GPU here')\n", r"it raised ValueError while being "
         r"imported \(at .*raises_at_import\.py:2\): no GPU here"),
        ("import sys\nsys.exit(7)\n", r"it called sys\.exit\(7\) while being imported "
         r"\(at .*raises_at_import\.py:2\)"),
        ("raise SystemExit\n", r"it called sys\.exit\(None\) while being imported"),
    ],
    ids=["raises", "sys-exit-7", "system-exit"],
)  # fmt: skip
def test_an_import_that_fails_exits_2_naming_module_and_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, body: str, expected: str
) -> None:
    (tmp_path / "raises_at_import.py").write_text(body)
    path = write_config(tmp_path, imports=["raises_at_import"])
    code, _, err = run_cli(command, "--config", str(path), capsys=capsys)
    assert code == EXIT_USAGE, err
    assert err.startswith(f"speedtronic: error: invalid configuration in {path}: ")
    assert "imports[0]: cannot import 'raises_at_import': " in err
    assert re.search(expected, err), err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_sys_exit_wrapped_by_a_library_is_placed_in_the_users_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A library may replace sys.exit by a wrapper (wandb does once imported, so a test that
    # ran after a wandb test saw "(at .../wandb/sdk/lib/exit_hooks.py:38)"): the place named
    # is the user's line, not the library's.
    library_file = os.path.join(sysconfig.get_paths()["purelib"], "exit_hooks_like.py")
    namespace: dict[str, object] = {"real_exit": sys.exit}
    source = "def wrapped_exit(code=None):\n    real_exit(code)\n"
    exec(compile(source, library_file, "exec"), namespace)
    monkeypatch.setattr(sys, "exit", namespace["wrapped_exit"])
    (tmp_path / "raises_at_import.py").write_text("import sys\nsys.exit(7)\n")
    path = write_config(tmp_path, imports=["raises_at_import"])
    code, _, err = run_cli("validate", "--config", str(path), capsys=capsys)
    assert code == EXIT_USAGE, err
    assert re.search(r"sys\.exit\(7\) while being imported \(at .*raises_at_import\.py:2\)", err)
    assert "exit_hooks_like" not in err


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("../x", "not a module name"),
        ("/etc/passwd", "not a module name"),
        ("./plugins", "not a module name"),
        ("sub/plugins", "not a module name"),
        (".relative", "not a module name"),
        ("my plugins", "not a module name"),
        ("plugins.py", "a file name, not a module name: write 'plugins'"),
    ],
)
def test_a_path_in_imports_is_refused_before_anything_is_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, expected: str
) -> None:
    (tmp_path / "plugins.py").write_text("raise AssertionError('must not be imported')\n")
    path = write_config(tmp_path, imports=[name])
    code, _, err = run_cli("validate", "--config", str(path), capsys=capsys)
    assert code == EXIT_USAGE, err
    assert f"invalid configuration in {path}: imports[0]: cannot import {name!r}: " in err
    assert expected in err and "must not be imported" not in err


# -- huge numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "fit"])
@pytest.mark.parametrize(
    ("section", "key", "text", "maximum"),
    [
        ("data", "num_tokens", "1e20", "1000000000000"),
        ("data", "micro_batch_size", "1e11", "1048576"),
        ("run", "max_steps", "1e41", "1000000000000"),
        ("run", "max_steps", "9" * 60, "1000000000000"),
        ("model", "d_model", "1e9", "1048576"),
        ("scheduler", "warmup_steps", "1e13", "1000000000000"),
        ("distributed", "timeout_s", "1e41", "2592000"),
        ("optimizer", "lr", "1e300", "1000"),
    ],
)
def test_huge_numbers_are_refused_naming_the_key(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    section: str,
    key: str,
    text: str,
    maximum: str,
) -> None:
    clean = write_config(tmp_path)
    raw = yaml.safe_load(clean.read_text())
    raw.setdefault(section, {})[key] = "PLACEHOLDER"
    path = tmp_path / "typed.yaml"
    path.write_text(yaml.safe_dump(raw).replace("PLACEHOLDER", text))  # as typed by hand
    code, _, err = run_cli(command, "--config", str(path), capsys=capsys)
    assert code == EXIT_USAGE, err
    assert f"{section}.{key}: " in err and f"is greater than the maximum of {maximum}" in err
    assert str(path) in err and "Traceback" not in err
    # the same through --set
    code, _, err = run_cli(
        command, "--config", str(clean), "--set", f"{section}.{key}={text}", capsys=capsys
    )
    assert code == EXIT_USAGE and f"{section}.{key}: " in err and maximum in err


@pytest.mark.parametrize(
    "change",
    [
        {"checkpoint": {"every_steps": 1e41}},
        {"callbacks": [{"name": "checkpoint", "every_steps": 10**30}]},
        {"callbacks": [{"name": "early_stopping", "patience": 1e20}]},
    ],
    ids=["2.0-section", "callback-entry", "other-plugin"],
)
def test_plugin_integers_without_a_maximum_must_fit_in_64_bits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object]
) -> None:
    path = write_config(tmp_path, **change)
    code, _, err = run_cli("validate", "--config", str(path), capsys=capsys)
    assert code == EXIT_USAGE, err
    assert f"is greater than the maximum of {INT64_MAX}" in err
    assert ("every_steps" in err) or ("patience" in err)


def test_max_steps_flag_has_the_bound_of_run_max_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path)
    code, _, err = run_cli(
        "fit", "--config", str(path), "--max-steps", "10" + "0" * 40, capsys=capsys
    )
    assert code == EXIT_USAGE
    assert "--max-steps 1" in err and "greater than the maximum of 1000000000000" in err


def _numeric_keys(schema: dict[str, object], prefix: str = "") -> dict[str, dict[str, object]]:
    found: dict[str, dict[str, object]] = {}
    for key, spec in dict(schema.get("properties", {})).items():  # type: ignore[call-overload]  # a JSON object
        path = f"{prefix}{key}"
        types = spec.get("type")
        types = types if isinstance(types, list) else [types]
        if "integer" in types or "number" in types:
            found[path] = spec
        for branch in spec.get("anyOf", []):  # e.g. run.threads: "auto" or a number
            if branch.get("type") in ("integer", "number"):
                found[path] = branch
        if "properties" in spec:
            found.update(_numeric_keys(spec, f"{path}."))
        items = spec.get("items")
        if isinstance(items, dict):
            item_types = items.get("type")
            if item_types in ("integer", "number"):
                found[f"{path}[i]"] = items
            if "properties" in items:
                found.update(_numeric_keys(items, f"{path}[i]."))
    return found


def test_every_core_number_has_the_maximum_documented_in_configuration_md() -> None:
    from speedtronic.config.schema import packaged_core_schema

    keys = _numeric_keys(packaged_core_schema())
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = page.split("### Bounds", 1)[1].split("\n\n", 3)[2]
    documented: dict[str, float] = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            documented[name] = float(cells[1].replace(",", ""))
    assert set(documented) == set(keys)
    for name, spec in keys.items():
        bound = spec.get("maximum", spec.get("exclusiveMaximum"))
        assert isinstance(bound, (int, float)), f"{name} has no maximum"
        assert documented[name] == bound, name


# -- pointers nested 200,000 deep ----------------------------------------------------------


def test_a_pointer_nested_200000_deep_is_ignored_with_one_warning_on_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, checkpoint={"enabled": True, "every_steps": 2})
    assert main(["fit", "--config", str(path)]) == EXIT_OK
    pointer = tmp_path / "out" / "checkpoints" / "latest.json"
    assert pointer.is_file()
    pointer.write_text("[" * 200_000 + "]" * 200_000)
    capsys.readouterr()
    code, out, err = run_cli(
        "fit", "--config", str(path), "--resume", "--max-steps", "6", capsys=capsys
    )
    assert code == EXIT_OK, err
    assert f"speedtronic: warning: ignoring checkpoint pointer {pointer}" in err
    assert "completed steps=6 " in out and "(this run: 2 steps)" in out
    assert "Traceback" not in err and "RecursionError" not in err


# -- metric sinks that cannot write -------------------------------------------------------------


def test_a_metrics_file_that_is_a_directory_warns_once_and_fit_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out" / "metrics.jsonl").mkdir(parents=True)
    (tmp_path / "out" / "metrics.csv").mkdir()
    path = write_config(
        tmp_path, logging={"jsonl": True}, callbacks=["csv"], checkpoint={"enabled": True}
    )
    code, out, err = run_cli("fit", "--config", str(path), capsys=capsys)
    assert code == EXIT_FAILED, err
    assert "completed steps=4 " in out  # training went on; the checkpoints are there
    assert (tmp_path / "out" / "checkpoints" / "step_000000000004.pt").is_file()
    jsonl = tmp_path / "out" / "metrics.jsonl"
    warnings = [line for line in err.splitlines() if "speedtronic: warning:" in line]
    csv = tmp_path / "out" / "metrics.csv"
    assert warnings == [
        "speedtronic: warning: callback 'jsonl' failed in 'setup': SinkWriteError: the jsonl "
        f"sink cannot write {jsonl}: Is a directory (its records are lost from here on) "
        "(training continues; further failures of this hook are not reported)",
        "speedtronic: warning: callback 'csv' failed in 'setup': SinkWriteError: the csv sink "
        f"cannot write {csv}: Is a directory (its records are lost from here on) (training "
        "continues; further failures of this hook are not reported)",
    ]
    assert err.splitlines()[-1] == (
        "speedtronic: error: the run finished, but callback 'jsonl' failed in 'setup': "
        f"SinkWriteError: the jsonl sink cannot write {jsonl}: Is a directory (its records are "
        "lost from here on) (and 1 more callback failure(s) above)"
    )


def test_a_full_disk_mid_run_says_no_space_left_and_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /dev/full is a real "disk" that is always full: every write fails with ENOSPC.
    path = write_config(tmp_path, logging={"json_file": "/dev/full", "jsonl": True})
    code, out, err = run_cli("fit", "--config", str(path), capsys=capsys)
    assert code == EXIT_FAILED, err
    assert "completed steps=4 " in out
    reports = [line for line in err.splitlines() if "/dev/full" in line]
    assert len(reports) == 2  # the one warning, and the closing error
    assert "callback 'jsonl' failed in 'metrics'" in reports[0]
    assert "the jsonl sink cannot write /dev/full: No space left on device" in reports[0]
    assert reports[1].startswith("speedtronic: error: the run finished, but callback 'jsonl'")


def test_logging_file_on_a_full_disk_is_one_warning_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 22, item 10: the console sink writing logging.file used to give four warnings
    # (fit_start, metrics, fit_end, teardown), none naming the file.
    path = write_config(tmp_path, logging={"file": "/dev/full", "console": True})
    code, out, err = run_cli("fit", "--config", str(path), capsys=capsys)
    assert code == EXIT_FAILED, err
    assert "completed steps=4 " in out and "fit start:" not in out  # not the terminal either
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1, err
    assert "callback 'console' failed in 'fit_start'" in warnings[0]
    assert "the console sink cannot write /dev/full: No space left on device" in warnings[0]
    # A directory in the way is refused at setup, once, naming it.
    (tmp_path / "log-dir").mkdir()
    path = write_config(tmp_path, logging={"file": str(tmp_path / "log-dir"), "console": True})
    code, out, err = run_cli("fit", "--config", str(path), "--overwrite", capsys=capsys)
    assert code == EXIT_FAILED, err
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1, err
    assert f"the console sink cannot write {tmp_path / 'log-dir'}: Is a directory" in warnings[0]
    assert "fit end:" not in out


def made_directories(tmp_path: Path, *names: str) -> list[Path]:
    made = [tmp_path / name for name in names]
    for directory in made:
        directory.mkdir()
    return made


def test_sinks_refuse_a_symlink_planted_at_their_file_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Someone who can write the run directory plants links at the sinks' file names: the
    # appends followed them, into (or creating) files outside the run. Each sink now
    # refuses its link once, naming it, and training goes on (a sink is an observer).
    elsewhere, out = made_directories(tmp_path, "elsewhere", "out")
    precious = elsewhere / "precious.txt"
    precious.write_text("precious data\n")
    targets = {"metrics.jsonl": precious, "metrics.csv": elsewhere / "new.csv",
               "train.log": elsewhere / "new.log"}  # fmt: skip
    for name, target in targets.items():
        (out / name).symlink_to(target)
    path = write_config(
        tmp_path, logging={"file": "train.log", "console": True}, callbacks=["csv", "jsonl"]
    )
    code, out_text, err = run_cli("fit", "--config", str(path), "--resume", capsys=capsys)
    assert code == EXIT_FAILED, err
    assert "completed steps=4 " in out_text
    warnings = [line for line in err.splitlines() if "warning: callback" in line]
    assert len(warnings) == 3, err
    for sink, name in (
        ("console", "train.log"),
        ("csv", "metrics.csv"),
        ("jsonl", "metrics.jsonl"),
    ):
        assert any(
            f"the {sink} sink cannot write {out / name}: it is a symbolic link "
            f"(to {targets[name]})" in line
            for line in warnings
        ), err
    assert precious.read_text() == "precious data\n"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious.txt"]
    assert all((out / name).is_symlink() for name in targets)


def test_a_symlink_planted_at_a_lock_files_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The lock file was opened "a+" through a link: a dangling one created its target
    # outside the run (and release truncated it).
    elsewhere, shared, out = made_directories(tmp_path, "elsewhere", "shared", "out")
    (out / ".speedtronic-run.lock").symlink_to(elsewhere / "run-lock")
    path = write_config(tmp_path)
    code, _, err = run_cli("fit", "--config", str(path), capsys=capsys)
    assert code == EXIT_USAGE, err
    assert (
        f"speedtronic: error: cannot lock run directory {out}: lock file "
        f"{out / '.speedtronic-run.lock'}: it is a symbolic link (to {elsewhere / 'run-lock'})"
    ) in err
    (out / ".speedtronic-run.lock").unlink()
    # The lock beside a metrics file outside the run directory, likewise.
    (shared / ".m.jsonl.speedtronic-run.lock").symlink_to(elsewhere / "file-lock")
    path = write_config(tmp_path, logging={"json_file": str(shared / "m.jsonl"), "jsonl": True})
    code, _, err = run_cli("fit", "--config", str(path), capsys=capsys)
    assert code == EXIT_USAGE, err
    assert f"lock file {shared / '.m.jsonl.speedtronic-run.lock'}: it is a symbolic link" in err
    assert list(elsewhere.iterdir()) == []


def test_sinks_still_write_the_system_files_users_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /dev/fd/N is a link (to /proc/self/fd/N, and on to a pipe here): the links the system
    # keeps under /dev and /proc are followed, as configured (/dev/stdout is one of them).
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, encoding="utf-8") as lines, os.fdopen(write_end, "w") as writer:
        path = write_config(tmp_path, logging={"json_file": f"/dev/fd/{writer.fileno()}",
                                               "jsonl": True, "file": "/dev/null",
                                               "console": True})  # fmt: skip
        code, out, err = run_cli("fit", "--config", str(path), capsys=capsys)
        writer.close()  # the sink closed its own descriptor: the pipe ends here
        steps = [json.loads(line)["step"] for line in lines]
    assert code == EXIT_OK, err
    assert steps == [2, 4]
    assert "fit start:" not in out  # the console's lines went to /dev/null


def test_a_csv_sink_that_fails_mid_run_is_reported_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    original = CsvCallback.write_record
    calls: list[int] = []

    def fill_the_disk_at_step_4(
        self: CsvCallback, trainer: object, record: dict[str, object]
    ) -> None:
        calls.append(int(record["step"]))  # type: ignore[call-overload]  # an int step
        if record["step"] == 4:
            assert self._handle is not None
            self._handle.close()
            self._handle = open("/dev/full", "a", encoding="utf-8")  # noqa: SIM115  # closed at teardown
            assert self._writer is not None
            self._writer = csv.writer(self._handle)
        original(self, trainer, record)  # type: ignore[arg-type]  # the trainer view

    monkeypatch.setattr(CsvCallback, "write_record", fill_the_disk_at_step_4)
    path = write_config(
        tmp_path, logging={"every_steps": 1}, run={"max_steps": 6}, callbacks=["csv"]
    )
    code, _, err = run_cli("fit", "--config", str(path), capsys=capsys)
    assert code == EXIT_FAILED, err
    assert calls == [1, 2, 3, 4]  # nothing more is written after the failure
    csv_file = tmp_path / "out" / "metrics.csv"
    assert len(csv_file.read_text().splitlines()) == 4  # header and steps 1-3
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1
    assert f"the csv sink cannot write {csv_file}: No space left on device" in warnings[0]


def test_a_tensorboard_sink_that_cannot_write_is_reported_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(self: TensorBoardCallback, item: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TensorBoardCallback, "_write_event", disk_full)
    path = write_config(
        tmp_path,
        logging={"every_steps": 1},
        callbacks=[{"name": "tensorboard", "log_config": False}],
    )
    code, _, err = run_cli("fit", "--config", str(path), capsys=capsys)
    assert code == EXIT_FAILED, err
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1, err
    assert "callback 'tensorboard' failed in " in warnings[0]
    assert (
        f"cannot write {tmp_path / 'out' / 'tensorboard'}: No space left on device" in warnings[0]
    )
    # a log directory that is a file is refused at setup, once
    (tmp_path / "out" / "tb-file").write_text("")
    path = write_config(tmp_path, callbacks=[{"name": "tensorboard", "log_dir": "tb-file"}])
    monkeypatch.undo()
    code, _, err = run_cli("fit", "--config", str(path), "--overwrite", capsys=capsys)
    assert code == EXIT_FAILED
    warnings = [line for line in err.splitlines() if "warning:" in line and "tensorboard" in line]
    assert len(warnings) == 1 and "failed in 'setup'" in warnings[0]
    assert f"cannot write {tmp_path / 'out' / 'tb-file'}" in warnings[0]


def test_a_working_run_still_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, logging={"jsonl": True}, callbacks=["csv"])
    code, _, err = run_cli("fit", "--config", str(path), capsys=capsys)
    assert code == EXIT_OK, err
    assert (
        json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    )
