"""``speedtronic evaluate``: the held-out metrics of a run's checkpoint, in-process, writing
nothing; clear exit-2 errors for a missing checkpoint or path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from speedtronic.cli import main
from speedtronic.runtime import train_from_config

LINE = re.compile(r"^eval/loss=(\S+) eval/ppl=(\S+) step=(\d+) batches=(\d+) checkpoint=(.+)$")


def write_config(tmp_path: Path, output: str = "run") -> Path:
    config = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(tmp_path / output)},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
        "logging": {"console": False, "jsonl": True},
        "checkpoint": {"every_steps": 2, "keep_last": None},
        "eval": {"every_steps": 2, "max_batches": 3},
    }
    path = tmp_path / f"{output}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    tmp_path = tmp_path_factory.mktemp("evaluate")
    config = write_config(tmp_path)
    result = train_from_config(config)
    evals = {int(r["step"]): float(r["eval/loss"]) for r in result.metrics if "eval/loss" in r}
    assert sorted(evals) == [2, 4]
    return config, evals


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_evaluate_latest_matches_training_and_writes_nothing(
    trained: tuple[Path, dict[int, float]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, evals = trained
    before = snapshot(config.parent)
    code, out, err = run(capsys, "evaluate", "--config", str(config))
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1
    match = LINE.match(lines[0])
    assert match is not None, lines[0]
    assert float(match.group(1)) == evals[4]  # the same weights and batches as step 4's
    assert float(match.group(2)) == pytest.approx(2.718281828459045 ** evals[4])
    assert (match.group(3), match.group(4)) == ("4", "3")
    # Nothing new, nothing touched: no lock file, no metrics, no checkpoint.
    assert snapshot(config.parent) == before


def test_evaluate_a_named_checkpoint_with_overrides(
    trained: tuple[Path, dict[int, float]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, evals = trained
    checkpoint = config.parent / "run" / "checkpoints" / "step_000000000002.pt"
    code, out, err = run(
        capsys, "evaluate", "--config", str(config), "--checkpoint", str(checkpoint)
    )
    assert code == 0, err
    match = LINE.match(out.strip())
    assert match is not None and float(match.group(1)) == evals[2]
    code, out, err = run(capsys, "evaluate", "--config", str(config), "--set", "eval.max_batches=1")
    assert code == 0, err
    match = LINE.match(out.strip())
    assert match is not None and match.group(4) == "1"


def test_evaluate_errors_exit_2_without_traceback(
    trained: tuple[Path, dict[int, float]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = trained
    fresh = write_config(tmp_path, "fresh")
    code, out, err = run(capsys, "evaluate", "--config", str(fresh))
    assert (code, out) == (2, "")
    assert "no checkpoint to evaluate" in err and "--checkpoint" in err
    assert "Traceback" not in err
    assert not (tmp_path / "fresh").exists()  # nothing created for a run that never ran

    missing = tmp_path / "nope.pt"
    code, _, err = run(capsys, "evaluate", "--config", str(config), "--checkpoint", str(missing))
    assert code == 2 and f"checkpoint {missing} does not exist" in err

    code, _, err = run(capsys, "evaluate", "--config", str(config), "--set", "eval.max_batches=-1")
    assert code == 2 and "eval.max_batches" in err

    bad_model = json.dumps(
        {"vocab_size": 32, "max_seq_len": 8, "n_layer": 2, "n_head": 2, "d_model": 16}
    )
    code, _, err = run(capsys, "evaluate", "--config", str(config), "--set", f"model={bad_model}")
    assert code == 2 and "does not match the model" in err


def test_fit_with_a_bad_held_out_source_exits_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    config = yaml.safe_load(config_path.read_text())
    config["eval"]["dataset"] = "synthetic"
    config["data"]["num_tokens"] = 64
    config["eval"]["dataset_options"] = {"unknown": 1}
    config_path.write_text(yaml.safe_dump(config))
    code, out, err = run(capsys, "fit", "--config", str(config_path))
    assert code == 2 and "eval: dataset 'synthetic': unknown option(s) ['unknown']" in err
    assert "completed" not in out
