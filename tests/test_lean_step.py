"""The loop's lean path (``loop._lean_step``: no in-step hook due, one plain microbatch)
trains exactly as the full path with its hook tables does."""

from __future__ import annotations

from pathlib import Path

import torch
from sink_helpers import TinyRegressor, make_batches

from speedtronic import Callback, Trainer
from speedtronic.engine.contexts import StepContext
from speedtronic.engine.view import TrainerView

TIMING_KEYS = {"steps_per_sec", "samples_per_sec", "tokens_per_sec", "elapsed_s"}


class OnStepEnd(Callback):
    """Listens to ``step_end`` on every step: the loop has to take its full path."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.steps.append(ctx.step)


def fit(tmp_path: Path, callbacks: list[Callback]) -> tuple[Trainer, list[dict[str, object]]]:
    torch.manual_seed(0)
    model = TinyRegressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    trainer = Trainer(
        model,
        optimizer,
        make_batches(5),
        scheduler=scheduler,
        device="cpu",
        callbacks=callbacks,
        max_steps=9,
        metrics_every=2,
        output_dir=tmp_path,
    )
    result = trainer.fit()
    records = [
        {key: value for key, value in record.items() if key not in TIMING_KEYS}
        for record in result.metrics
    ]
    return trainer, records


def test_the_lean_path_trains_as_the_full_path(tmp_path: Path) -> None:
    lean, lean_records = fit(tmp_path / "lean", [])
    listener = OnStepEnd()
    full, full_records = fit(tmp_path / "full", [listener])
    assert lean.plan.step_idle and not full.plan.step_idle  # each took the path meant
    assert listener.steps == list(range(1, 10))
    assert lean_records == full_records and [r["step"] for r in lean_records] == [2, 4, 6, 8, 9]
    for a, b in zip(lean.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert (lean.step, lean.state.samples, lean.state.tokens) == (
        full.step,
        full.state.samples,
        full.state.tokens,
    )
    assert lean.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]
