"""Monitoring a metric: ``best.json`` and retention in the checkpoint callback, early
stopping on an evaluation metric, and the errors for a monitor that cannot work."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from speedtronic import Callback, Trainer
from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.engine.contexts import MetricsContext
from speedtronic.engine.view import TrainerView
from speedtronic.state.checkpoint import BEST_POINTER_NAME, CheckpointManager
from speedtronic.state.resume import resume_from
from speedtronic_callbacks.checkpoint import CheckpointCallback
from speedtronic_callbacks.early_stopping import EarlyStopping
from speedtronic_callbacks.monitor import MonitorError


class Scripted(Callback):
    """Contributes ``score`` with a scripted value per step."""

    def __init__(self, values: dict[int, float]) -> None:
        self.values = values

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if ctx.step in self.values:
            ctx.record.set("score", self.values[ctx.step])


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.linear(x), y)


def data(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, 2, generator=g), torch.randn(3, 1, generator=g)) for _ in range(n)]


def trainer(
    *callbacks: Callback, steps: int, eval_every: int | None = None, lr: float = 0.05
) -> Trainer:
    torch.manual_seed(0)
    model = Regression()
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        data(),
        callbacks=list(callbacks),
        max_steps=steps,
        metrics_every=1,
        eval_data=data(2) if eval_every else None,
        eval_every=eval_every,
    )


def saved_steps(manager: CheckpointManager) -> list[int]:
    return [int(p.name[5:-3]) for p in manager.checkpoint_paths()]


SCORES = {1: 5.0, 2: 3.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 7.0}


def test_best_json_names_the_best_checkpoint_and_retention_keeps_it(tmp_path: Path) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=100, keep_last=1, monitor="score")
    trainer(Scripted(SCORES), callback, steps=6).fit()
    manager = callback.manager
    # Saved at each improvement (1, 2, 4) and at the end (6); keep_last=1 keeps the newest
    # and the best.
    assert saved_steps(manager) == [4, 6]
    best = manager.read_best()
    assert best is not None
    assert (best.step, best.value, best.monitor, best.mode) == (4, 2.0, "score", "min")
    pointer = json.loads((tmp_path / BEST_POINTER_NAME).read_text())
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert pointer["file"] == "step_000000000004.pt"
    assert pointer["checkpoints"]["step_000000000004.pt"] == latest["checkpoints"][pointer["file"]]
    assert manager.load(best.path)["counters"]["step"] == 4  # type: ignore[index]  # checkpoint dict


def test_mode_max_picks_the_highest(tmp_path: Path) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=100, monitor="score", mode="max")
    trainer(Scripted(SCORES), callback, steps=6).fit()
    best = callback.manager.read_best()
    assert best is not None and (best.step, best.value) == (6, 7.0)


def test_best_value_survives_resume(tmp_path: Path) -> None:
    first = CheckpointCallback(tmp_path, every_steps=100, monitor="score")
    trainer(Scripted(SCORES), first, steps=4).fit()
    second = CheckpointCallback(tmp_path, every_steps=100, monitor="score")
    resumed = trainer(Scripted({5: 3.0, 6: 2.5}), second, steps=6)
    resume_from(resumed, second.manager)
    assert (second.best_value, second.best_step) == (2.0, 4)
    resumed.fit()
    best = second.manager.read_best()
    assert best is not None and best.step == 4  # 3.0 and 2.5 are not better than 2.0
    assert 5 not in saved_steps(second.manager)  # no save for a value that is no best


def test_best_json_is_validated(tmp_path: Path) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=100, monitor="score")
    trainer(Scripted(SCORES), callback, steps=2).fit()
    manager = callback.manager
    pointer = tmp_path / BEST_POINTER_NAME
    good = json.loads(pointer.read_text())
    for bad in (
        {**good, "file": "../step_000000000002.pt"},
        {**good, "value": "nan"},
        {**good, "mode": "sideways"},
        {**good, "file": "step_000000000009.pt", "step": 9},
    ):
        pointer.write_text(json.dumps(bad))
        with pytest.warns(UserWarning, match="ignoring best-checkpoint pointer"):
            assert manager.best_path() is None
    pointer.write_text("{not json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager.read_best(warn=False) is None


def test_eval_loss_monitor_end_to_end(tmp_path: Path) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=100, monitor="eval/loss")
    result = trainer(callback, steps=6, eval_every=2).fit()
    evaluated = {int(r["step"]): float(r["eval/loss"]) for r in result.metrics if "eval/loss" in r}
    assert sorted(evaluated) == [2, 4, 6]
    best_step = min(evaluated, key=lambda s: evaluated[s])
    best = callback.manager.read_best()
    assert best is not None and (best.step, best.value) == (best_step, evaluated[best_step])


def test_a_monitored_key_that_never_appears_fails_at_the_first_evaluation(tmp_path: Path) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=100, monitor="eval/accuracy")
    with pytest.raises(MonitorError, match=r"'eval/accuracy'.*step 2 \(keys: .*eval/loss"):
        trainer(callback, steps=4, eval_every=2).fit()


@pytest.mark.parametrize(
    "make",
    [
        lambda d: CheckpointCallback(d, monitor="eval/loss"),
        lambda d: EarlyStopping("eval/loss"),
    ],
)
def test_an_eval_monitor_without_evaluation_fails_before_training(
    tmp_path: Path, make: object
) -> None:
    assert callable(make)
    run = trainer(make(tmp_path), steps=3)
    with pytest.raises(MonitorError, match="evaluation is off"):
        run.fit()
    assert run.step == 0


def test_an_eval_monitor_without_evaluation_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.load(
            {
                "checkpoint": {"monitor": "eval/loss"},
                "callbacks": [{"name": "early_stopping", "monitor": "eval/loss"}],
            }
        )
    assert sorted(caught.value.errors) == [
        "callbacks[0].monitor: 'eval/loss' is an evaluation metric, but evaluation is off "
        "(set eval.every_steps)",
        "checkpoint.monitor: 'eval/loss' is an evaluation metric, but evaluation is off "
        "(set eval.every_steps)",
    ]
    config = SpeedtronicConfig.load(
        {"eval": {"every_steps": 5}, "checkpoint": {"monitor": "eval/loss", "mode": "min"}}
    )
    assert config.checkpoint.monitor == "eval/loss"


def test_early_stopping_counts_only_evaluations_for_an_eval_metric() -> None:
    # lr 0: eval/loss never improves after the first evaluation (step 2). Counting every
    # logging record would stop at step 4; counting evaluations stops at step 6.
    stopper = EarlyStopping("eval/loss", patience=2)
    result = trainer(stopper, steps=20, eval_every=2, lr=0.0).fit()
    assert result.steps == 6
    assert result.stop_reason is not None and "did not improve for 2 checks" in result.stop_reason
