"""A newcomer's second hour (issue 25, items 2, 3, 4 and 6), through the real CLI
(``cli_runner.run_cli``) where it is a CLI matter:

* a checkpoint that does not fit is reported the same way by ``evaluate`` and ``fit
  --resume`` (every shape difference), and every subcommand takes ``--traceback``;
* ``--resume`` prints which checkpoint it loaded, and after a fall-back which newer one
  could not be read -- without calling the run's own checkpoint another run's;
* ``validate`` lists every mistake at once, plugin names with the closest known one,
  before (instead of) the resolved config;
* from Python, the built-in plugins' relative paths are under ``Trainer(output_dir=...)``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli
from torch import nn

from speedtronic import Callback, Trainer
from speedtronic.config import load_config
from speedtronic.models.registry import build_model
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.model_fit import MODEL_MISMATCH, tensor_shapes
from speedtronic.state.resume import resume_from
from speedtronic_callbacks.checkpoint import CheckpointCallback
from speedtronic_callbacks.console import ConsoleCallback
from speedtronic_callbacks.csv_sink import CsvCallback
from speedtronic_callbacks.jsonl import JsonlCallback

TINY = {
    "run": {"device": "cpu", "max_steps": 4, "seed": 5, "output_dir": "run"},
    "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
    "logging": {"console": False},
    "checkpoint": {"every_steps": 2, "keep_last": None},
    "eval": {"every_steps": 2, "max_batches": 2},
}
CHECKPOINTS = Path("run") / "checkpoints"


@pytest.fixture()
def trained(tmp_path: Path) -> Path:
    """A finished 4-step run in ``tmp_path/run`` (checkpoints of steps 2 and 4)."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(TINY), encoding="utf-8")
    result = run_cli("fit", "--config", "run.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return tmp_path


# -- item 2: one report of a checkpoint that does not fit, one set of flags ------------------


def test_evaluate_and_resume_list_every_shape_difference_alike(trained: Path) -> None:
    narrower = "model.d_model=8"
    evaluated = run_cli("evaluate", "--config", "run.yaml", "--set", narrower, cwd=trained)
    resumed = run_cli("fit", "--config", "run.yaml", "--set", narrower, "--resume", cwd=trained)
    assert (evaluated.returncode, resumed.returncode) == (2, 2)
    # Every tensor whose shape the change touched is named, with both shapes.
    old = tensor_shapes(build_model(load_config(TINY).model).state_dict())
    new_config = load_config({**TINY, "model": {**TINY["model"], "d_model": 8}})
    new = tensor_shapes(build_model(new_config.model).state_dict())
    differing = [key for key in new if new[key] != old[key]]
    assert len(differing) > 10  # more than the ten the report used to stop at
    for key in differing:
        assert f"{key}: checkpoint {old[key]} vs model {new[key]}" in evaluated.stderr
    # Word for word the same report from both (evaluate used to stop at torch's first line).
    report = evaluated.stderr.split(MODEL_MISMATCH, 1)[1].strip()
    assert report and resumed.stderr.split(MODEL_MISMATCH, 1)[1].strip() == report
    assert "Traceback" not in evaluated.stderr + resumed.stderr


def test_every_subcommand_takes_traceback_and_the_common_flags(trained: Path) -> None:
    mistakes = {
        "fit": ["--config", "missing.yaml"],
        "train": ["--config", "missing.yaml"],
        "evaluate": ["--config", "run.yaml", "--set", "model.d_model=8"],
        "validate": ["--config", "run.yaml", "--set", "optimizer.lrr=1"],
        "schema": ["--config", "missing.yaml"],
        "plugins": ["--config", "missing.yaml"],
        "plot": ["no-such-run"],
    }
    for command, argv in mistakes.items():
        plain = run_cli(command, *argv, cwd=trained)
        traced = run_cli(command, *argv, "--traceback", cwd=trained)
        assert plain.returncode == traced.returncode == 2, (command, traced.stderr)
        assert "Traceback" not in plain.stderr, command
        # The stack of where the mistake was found, then the same one-line message.
        assert traced.stderr.startswith("Traceback (most recent call last):"), command
        assert traced.stderr.endswith(plain.stderr), command
    # evaluate and validate take fit's --output-dir and --device (validate --max-steps too).
    elsewhere = run_cli("evaluate", "--config", "run.yaml", "--output-dir", "other", cwd=trained)
    assert elsewhere.returncode == 2
    assert f"no checkpoint to evaluate in {trained / 'other' / 'checkpoints'}" in elsewhere.stderr
    meta = run_cli("evaluate", "--config", "run.yaml", "--device", "meta", cwd=trained)
    assert meta.returncode == 2 and "meta" in meta.stderr
    checked = run_cli(
        "validate", "--config", "run.yaml", "--max-steps", "0", "--device", "cpu", cwd=trained
    )
    assert checked.returncode == 2 and "--max-steps must be positive" in checked.stderr


# -- item 3: resume says where it resumed from -----------------------------------------------


def test_resume_prints_the_checkpoint_it_loaded(trained: Path) -> None:
    result = run_cli("fit", "--config", "run.yaml", "--resume", "--max-steps", "6", cwd=trained)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"resumed from {CHECKPOINTS / 'step_000000000004.pt'} (step 4)" in lines
    assert "already holds a checkpoint" not in result.stderr


def test_resume_after_a_fall_back_names_the_unreadable_checkpoint(trained: Path) -> None:
    newest = trained / CHECKPOINTS / "step_000000000004.pt"
    damaged = bytearray(newest.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    newest.write_bytes(bytes(damaged))
    result = run_cli("fit", "--config", "run.yaml", "--resume", "--max-steps", "3", cwd=trained)
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("resumed from"))
    assert line.startswith(
        f"resumed from {CHECKPOINTS / 'step_000000000002.pt'} (step 2; "
        "step_000000000004.pt is unreadable ("
    ), line
    # The newer file is called what it is: this run's own checkpoint that could not be read.
    assert "already holds a checkpoint of step 4" in result.stderr
    assert "it is this run's newest checkpoint, which could not be read" in result.stderr
    assert "another run" not in result.stderr


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ((self.w(x) - labels) ** 2).mean()


def _trainer(output_dir: Path, callbacks: list[Callback]) -> Trainer:
    torch.manual_seed(0)
    model = _Tiny()
    data = [{"x": torch.randn(2, 2), "labels": torch.randn(2, 1)} for _ in range(8)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, optimizer, data, output_dir=output_dir, callbacks=callbacks)


def test_a_newer_uncommitted_checkpoint_is_not_called_another_runs(tmp_path: Path) -> None:
    _trainer(tmp_path, [CheckpointCallback(every_steps=2)]).fit(4)
    directory = tmp_path / "checkpoints"
    # A save of step 6 that was cut short before latest.json named it.
    uncommitted = (directory / "step_000000000004.pt").read_bytes()
    (directory / "step_000000000006.pt").write_bytes(uncommitted)
    checkpoint = CheckpointCallback(every_steps=2)
    trainer = _trainer(tmp_path, [checkpoint])
    assert resume_from(trainer, checkpoint.manager) == directory / "step_000000000004.pt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(5)
    messages = [str(w.message) for w in caught if "already holds" in str(w.message)]
    assert len(messages) == 1 and "never committed" in messages[0], messages
    assert "step_000000000004.pt" in messages[0]


# -- item 4: validate lists every mistake at once ---------------------------------------------


def test_validate_lists_every_mistake_at_once_with_hints(tmp_path: Path) -> None:
    config = {
        **TINY,
        "model": {**TINY["model"], "name": "referance_transformer"},
        "data": {**TINY["data"], "shuffle": 3, "dataset": "learnabel", "collate": "causl"},
        "optimizer": {"lrr": 0.1},
        "callbacks": [{"name": "jsonn"}, {"name": "consol"}],
    }
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = run_cli("validate", "--config", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""  # no resolved config ahead of (or instead of) the errors
    expected = [
        "optimizer.lrr: unknown key (did you mean 'lr'?)",
        "data.shuffle: 3 is not of type 'boolean'",
        "model.name: unknown model 'referance_transformer' (did you mean 'reference_transformer'?",
        "callbacks[0].name: unknown callback 'jsonn' (did you mean 'jsonl'?",
        "callbacks[1].name: unknown callback 'consol' (did you mean 'console'?",
        "data.dataset: unknown dataset 'learnabel' (did you mean 'learnable'?",
        "data.collate: unknown collate 'causl' (did you mean 'causal'?",
    ]
    for message in expected:
        assert message in result.stderr, (message, result.stderr)
    assert f"{len(expected)} configuration errors in bad.yaml" in result.stderr
    # A name nothing is close to still lists what is known, without a guess.
    config = {**TINY, "callbacks": [{"name": "emma"}]}
    (tmp_path / "emma.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = run_cli("validate", "--config", "emma.yaml", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    # A built-in ``ema`` callback exists now: the issue's own example gets its hint.
    assert "unknown callback 'emma' (did you mean 'ema'?" in result.stderr
    assert "known: checkpoint, console" in result.stderr


# -- item 6: from Python, relative plugin paths are under the trainer's output_dir -------------


def test_python_plugins_write_under_the_trainers_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd, run = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    saving = CheckpointCallback(every_steps=2)
    _trainer(run, [saving, JsonlCallback(), CsvCallback(), ConsoleCallback(file="train.log")]).fit(
        4
    )
    assert list(cwd.iterdir()) == []  # nothing where the process happens to run
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")) == [
        "step_000000000002.pt",
        "step_000000000004.pt",
    ]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [1, 2, 3, 4]
    assert (run / "metrics.csv").is_file() and "fit end" in (run / "train.log").read_text()
    # Where the run lock would look is where the callback wrote.
    assert saving.run_paths(run).directories == (run / "checkpoints",)
    # And a resume before the first fit looks there too (not under the working directory).
    checkpoint = CheckpointCallback(every_steps=2)
    resumed = _trainer(run, [checkpoint])
    assert resume_from(resumed, checkpoint.manager) == run / "checkpoints" / "step_000000000004.pt"
    assert resumed.resumed_from is not None and resumed.resumed_from.step == 4
    # A manager handed in keeps its own directory, as 2.0's Trainer(checkpoint_manager=) did.
    manager = CheckpointManager("own", every_steps=2)
    _trainer(run, [CheckpointCallback(manager=manager)]).fit(2)
    assert (cwd / "own" / "step_000000000002.pt").is_file()
