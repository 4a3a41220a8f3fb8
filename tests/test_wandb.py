"""W&B: real offline runs of the real client, read back with ``wandb leet inspect``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import wandb
from sink_helpers import StateAtStep, make_trainer

from speedtronic import Trainer
from speedtronic.config import SpeedtronicConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.integrations import WandbHook
from speedtronic_callbacks.early_stopping import EarlyStopping
from speedtronic_callbacks.wandb import WandbCallback


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Offline W&B with every directory it touches inside the test's tmp dir.

    W&B reads its environment once per process setup; ``wandb.teardown()`` around each
    test makes the next run read this test's environment.
    """
    wandb.teardown()
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        path = home / variable.lower()
        path.mkdir(parents=True)
        monkeypatch.setenv(variable, str(path))
    yield
    wandb.teardown()


def run_files(output_dir: Path) -> list[Path]:
    return sorted((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def inspect_records(run_file: Path) -> list[dict[str, Any]]:
    """Every record of a run's transaction log, as W&B's own inspector reads it."""
    completed = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in completed.stdout.splitlines()]


def history(run_file: Path) -> list[dict[str, Any]]:
    """The run's history rows (one per ``run.log`` call)."""
    return [r["history"]["item"] for r in inspect_records(run_file) if r["type"] == "history"]


def test_offline_run_holds_the_logged_history(tmp_path: Path) -> None:
    sink = WandbCallback(project="speedtronic-test", name="history")
    trainer = make_trainer(tmp_path / "out", [sink], max_steps=4, metrics_every=2)
    trainer.config = SpeedtronicConfig.from_dict({"run": {"name": "wandb-config"}})
    result = trainer.fit()
    assert sink.finished and sink.run is None
    files = run_files(tmp_path / "out")
    assert len(files) == 1 and sink.run_id is not None
    assert files[0].name == f"run-{sink.run_id}.wandb"
    rows = history(files[0])
    assert [row["_step"] for row in rows] == [2, 4]
    assert [row["loss"] for row in rows] == pytest.approx([r["loss"] for r in result.metrics])
    assert all("tokens_per_sec" in row and "lr" in row for row in rows)
    run_record = next(r for r in inspect_records(files[0]) if r["type"] == "run")
    assert run_record["run"]["config"]["update"]["run"]["name"] == "wandb-config"


def test_resumed_fit_continues_the_same_run(tmp_path: Path) -> None:
    output = tmp_path / "out"
    snapshot = StateAtStep(3)
    first_sink = WandbCallback(project="speedtronic-test")
    make_trainer(output, [first_sink, snapshot], max_steps=3).fit()
    assert snapshot.state is not None
    callback_states = snapshot.state["callbacks"]
    assert isinstance(callback_states, dict)
    assert callback_states["wandb"] == {"run_id": first_sink.run_id}

    second_sink = WandbCallback(project="speedtronic-test")
    resumed = make_trainer(output, [second_sink], max_steps=5)
    resumed.load_state_dict(snapshot.state)
    resumed.fit()
    assert second_sink.run_id == first_sink.run_id
    files = run_files(output)
    assert len(files) == 2  # one offline directory per session, both for the same run id
    assert {path.name for path in files} == {f"run-{first_sink.run_id}.wandb"}
    steps = sorted(int(str(row["_step"])) for path in files for row in history(path))
    assert steps == [1, 2, 3, 4, 5]


def test_disabled_mode_from_the_environment_is_respected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = WandbCallback(project="speedtronic-test")
    result = make_trainer(tmp_path / "out", [sink], max_steps=2).fit()
    assert result.steps == 2 and sink.finished
    assert run_files(tmp_path / "out") == []


class FailAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        if ctx.step == self.step:
            raise RuntimeError(f"failure at step {ctx.step}")


def test_a_failing_fit_still_logs_queued_records_and_finishes(tmp_path: Path) -> None:
    sink = WandbCallback(project="speedtronic-test")  # background thread on
    trainer = make_trainer(tmp_path / "out", [sink, FailAtStep(3)], max_steps=6)
    with pytest.raises(RuntimeError, match="failure at step 3"):
        trainer.fit()
    assert sink.finished and sink.run is None
    files = run_files(tmp_path / "out")
    assert [row["_step"] for row in history(files[0])] == [1, 2, 3]


def test_a_clean_early_stop_finishes_the_run_with_its_reason(tmp_path: Path) -> None:
    sink = WandbCallback(project="speedtronic-test")
    stopper = EarlyStopping("loss", mode="max", patience=1, min_delta=1e9)
    result = make_trainer(tmp_path / "out", [stopper, sink], max_steps=6).fit()
    assert result.steps == 2 and result.stop_reason is not None
    assert sink.finished and sink.closed
    records = inspect_records(run_files(tmp_path / "out")[0])
    summaries = [r["summary"]["update"] for r in records if r["type"] == "summary"]
    assert any(update.get("stop_reason") == result.stop_reason for update in summaries)


def test_wandb_hook_logs_events_and_finishes(tmp_path: Path) -> None:
    hook = WandbHook(project="speedtronic-test", dir=str(tmp_path))
    hook.on_event("train_step", {"step": 1, "loss": 0.75})
    run = hook.run
    assert run is not None
    run_id = run.id
    hook.finish()
    hook.close()  # idempotent
    assert hook.run is None
    files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert [path.name for path in files] == [f"run-{run_id}.wandb"]
    rows = history(files[0])
    assert rows[0]["loss"] == 0.75 and rows[0]["event"] == "train_step"


def test_wandb_hook_logs_through_the_wandb_callback_as_2_0_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hook is the `wandb` sink callback (looked up in the registry) set up outside a fit:
    # its payload's `step` stays a logged value and W&B numbers the rows, as in 2.0.
    from speedtronic.plugins import callback_registry

    built: list[WandbCallback] = []

    class Recorded(WandbCallback):
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            built.append(self)

    monkeypatch.setattr(callback_registry, "_items", {"wandb": Recorded})
    hook = WandbHook(project="speedtronic-test", dir=str(tmp_path), name="hooked")
    hook.on_event("train_start", {"max_steps": 2})
    hook.on_event("train_step", {"step": 5, "loss": 0.5})
    assert len(built) == 1 and built[0].run is hook.run and hook.run is not None
    assert hook.run.name == "hooked"
    hook.finish()
    assert built[0].finished and built[0].closed
    rows = history(sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))[0])
    assert [(row["_step"], row["event"]) for row in rows] == [(0, "train_start"), (1, "train_step")]
    assert rows[1]["step"] == 5 and rows[0]["max_steps"] == 2
    with pytest.raises(RuntimeError, match="after finish"):
        hook.on_event("train_step", {"step": 6})


def test_text_samples_are_a_wandb_table(tmp_path: Path) -> None:
    from speedtronic.runtime import train_from_config
    from tests.text_runs import text_run_config

    samples = {"name": "text_samples", "prompts": ["the cat", "the dog"], "every_steps": 2}
    extra = {
        "logging": {"console": False, "jsonl": True, "every_steps": 2},
        "callbacks": [{**samples, "max_new_tokens": 6}, {"name": "wandb"}],
    }
    train_from_config(text_run_config(tmp_path, extra=extra))
    run = tmp_path / "run"
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    written = {r["step"]: [r["text_samples/0"], r["text_samples/1"]] for r in jsonl
               if "text_samples/0" in r}  # fmt: skip
    files = run_files(run)
    assert len(files) == 1
    # W&B's history flattens the table reference: text_samples._type, text_samples.path...
    rows = [row for row in history(files[0]) if "text_samples._type" in row]
    assert [row["_step"] for row in rows] == [2, 4]
    for row in rows:
        assert row["text_samples._type"] == "table-file" and "text_samples/0" not in row
        table = files[0].parent / "files" / row["text_samples.path"]
        saved = json.loads(table.read_text(encoding="utf-8"))
        assert saved["columns"] == ["step", "key", "text"]
        assert saved["data"] == [
            [row["_step"], str(i), text] for i, text in enumerate(written[row["_step"]])
        ]
