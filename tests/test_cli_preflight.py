"""What ``validate`` and ``fit`` can know before training: machine checks, warnings as one
clean line, the closing verdict, a quiet exit when the reader of the output leaves."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli

from speedtronic.cli import EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parent.parent

TINY = {
    "run": {"name": "preflight", "device": "cpu", "max_steps": 4, "seed": 3},
    "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
    "scheduler": {"warmup_steps": 1},
    "logging": {"every_steps": 2, "jsonl": False},
    "checkpoint": {"enabled": False},
}


def write_config(tmp_path: Path, **sections: dict[str, object]) -> Path:
    config = {key: dict(value) for key, value in TINY.items()}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    config["run"]["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_validate_ends_with_a_one_line_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path)
    assert main(["validate", "--config", str(path)]) == EXIT_OK
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith(f"# OK: {path} is valid (")
    assert "4 steps" in last and "'reference_transformer'" in last


def test_missing_text_file_is_a_validate_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, data={"text_path": str(tmp_path / "missing.txt")})
    assert main(["validate", "--config", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "data.text_path" in err and "missing.txt" in err and "does not exist" in err
    assert main(["fit", "--config", str(path)]) == EXIT_USAGE
    assert not (tmp_path / "out").exists()  # nothing was built or written


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"run": {"device": "meta"}}, "run.device: 'meta' holds no data"),
        ({"run": {"device": "bogus"}}, "run.device: 'bogus' is not a device torch knows"),
        (
            {"eval": {"every_steps": 2, "text_path": "/nonexistent"}},
            "eval.text_path: '/nonexistent' does not exist",
        ),
        ({"data": {"dataset": "nosuch"}}, "data.dataset: unknown dataset 'nosuch'"),
        ({"data": {"dataset": "text"}}, "dataset 'text' needs options.path"),
        (
            {"eval": {"every_steps": 2, "text_path": "EMPTY"}},
            "eval: the held-out set is empty (EMPTY has no bytes in it)",
        ),
    ],
    ids=["meta-device", "unknown-device", "missing-eval-text", "unknown-dataset",
         "text-without-path", "empty-held-out"],
)  # fmt: skip
def test_validate_refuses_what_fit_refuses_before_training(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    sections: dict[str, dict[str, object]],
    expected: str,
) -> None:
    # Issue 22, item 10: validate passed run.device: meta (fit then trained on meta tensors
    # and exited 1) and a missing eval.text_path (fit refused it). Both commands now run the
    # same checks (speedtronic.runtime.preflight): exit 2, one message, nothing written.
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    eval_section = sections.get("eval", {})
    if eval_section.get("text_path") == "EMPTY":
        sections = {**sections, "eval": {**eval_section, "text_path": str(empty)}}
        expected = expected.replace("EMPTY", str(empty))
    path = write_config(tmp_path, **sections)
    assert main(["validate", "--config", str(path)]) == EXIT_USAGE
    validate_err = capsys.readouterr().err
    assert expected in validate_err and "Traceback" not in validate_err
    assert main(["fit", "--config", str(path)]) == EXIT_USAGE
    fit_err = capsys.readouterr().err
    assert fit_err == validate_err  # the same checks, the same words
    assert not (tmp_path / "out").exists()  # nothing was built or written


def test_fit_device_meta_on_the_command_line_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path)
    assert main(["fit", "--config", str(path), "--device", "meta"]) == EXIT_USAGE
    assert "run.device: 'meta' holds no data" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda_is_a_validate_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, run={"device": "cuda"})
    assert main(["validate", "--config", str(path)]) == EXIT_USAGE
    assert "run.device: 'cuda'" in capsys.readouterr().err
    path = write_config(tmp_path)
    assert main(["fit", "--config", str(path), "--device", "cuda:0"]) == EXIT_USAGE
    assert "CUDA is not available" in capsys.readouterr().err


def test_warmup_covering_most_of_the_run_warns_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, scheduler={"warmup_steps": 100})
    assert main(["validate", "--config", str(path)]) == EXIT_OK
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warmup_steps" in line]
    assert lines == [
        "speedtronic: warning: scheduler.warmup_steps=100 covers more than half of the "
        "4-step LR schedule (run.max_steps=4): the learning rate stays low for most of it; "
        "set scheduler.warmup_steps to about 1 (10% of the schedule)"
    ]


def test_max_steps_neither_raises_nor_silences_the_warmup_warning(tmp_path: Path) -> None:
    # The README's smoke run stopped early: the schedule keeps its 200 steps, so 10 warm-up
    # steps are right and advice to shorten them would change the whole run.
    smoke = str(ROOT / "configs" / "smoke.yaml")
    out = ["--output-dir", str(tmp_path / "smoke")]
    fit = run_cli("fit", "--config", smoke, "--max-steps", "3", *out, cwd=tmp_path)
    assert fit.returncode == EXIT_OK and "warmup_steps" not in fit.stderr
    # The schedule's own length decides, and the warning names the key it comes from.
    short = run_cli("validate", "--config", smoke, "--set", "run.max_steps=15", cwd=tmp_path)
    assert short.returncode == EXIT_OK
    assert "of the 15-step LR schedule (run.max_steps=15)" in short.stderr
    assert "set scheduler.warmup_steps to about 1 (10% of the schedule)" in short.stderr
    # A short explicit schedule warns even when --max-steps runs far past it, and says that
    # --max-steps is not what sets the schedule.
    path = write_config(tmp_path, scheduler={"warmup_steps": 3, "max_steps": 4})
    fit = run_cli("fit", "--config", str(path), "--max-steps", "2", cwd=tmp_path)
    warned = [line for line in fit.stderr.splitlines() if "warmup_steps" in line]
    assert fit.returncode == EXIT_OK and len(warned) == 1
    assert "4-step LR schedule (scheduler.max_steps=4; --max-steps 2 moves only" in warned[0]


def test_python_warnings_print_as_one_clean_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import speedtronic.cli as cli

    def warn_and_succeed(args: object) -> int:
        warnings.warn("something to know", UserWarning, stacklevel=1)
        return EXIT_OK

    monkeypatch.setitem(cli._COMMANDS, "validate", warn_and_succeed)
    assert main(["validate", "--config", str(write_config(tmp_path))]) == EXIT_OK
    assert capsys.readouterr().err == "speedtronic: warning: something to know\n"


def test_resumed_fit_says_how_many_steps_it_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, checkpoint={"enabled": True, "every_steps": 2})
    assert main(["fit", "--config", str(path)]) == EXIT_OK
    first = capsys.readouterr().out
    assert "completed steps=4 " in first and "this run" not in first
    assert main(["fit", "--config", str(path), "--max-steps", "6", "--resume"]) == EXIT_OK
    assert "completed steps=6 " in capsys.readouterr().out
    # the summary line ends with the count of this invocation
    assert main(["fit", "--config", str(path), "--max-steps", "9", "--resume"]) == EXIT_OK
    summary = [line for line in capsys.readouterr().out.splitlines() if "completed" in line]
    assert summary[-1].startswith("completed steps=9 ")
    assert summary[-1].endswith("(this run: 3 steps)")


def test_validate_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    # ``speedtronic validate | head -n 1``: the reader is gone before validate writes (the
    # read end is closed right away, while the child is still importing torch).
    path = write_config(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", "validate", "--config", str(path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    stderr = child.stderr.read()
    assert child.wait(timeout=180) == 0
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
