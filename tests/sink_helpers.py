"""Shared helpers of the observability tests: a tiny model, batches, a trainer factory."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from speedtronic import Trainer
from speedtronic.config import SpeedtronicConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.plugins import PluginContext

Batch = tuple[torch.Tensor, torch.Tensor]


class TinyRegressor(nn.Module):
    """A linear model returning its mean-squared error: the loss is the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.linear(x), y)


def make_batches(count: int = 8, *, nan_at: int | None = None, seed: int = 0) -> list[Batch]:
    """``count`` (x, y) batches of 2 samples; batch ``nan_at`` has a NaN input."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(count):
        x = torch.randn(2, 4, generator=generator)
        y = torch.randn(2, 1, generator=generator)
        if index == nan_at:
            x[0, 0] = float("nan")
        batches.append((x, y))
    return batches


def make_trainer(
    output_dir: Path,
    callbacks: Sequence[Callback],
    *,
    max_steps: int = 6,
    metrics_every: int = 1,
    batches: list[Batch] | None = None,
    model: nn.Module | None = None,
    seed: int = 0,
) -> Trainer:
    """A CPU trainer on ``TinyRegressor`` (seeded, so two calls build the same model)."""
    torch.manual_seed(seed)
    model = model if model is not None else TinyRegressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return Trainer(
        model,
        optimizer,
        batches if batches is not None else make_batches(),
        device="cpu",
        callbacks=list(callbacks),
        max_steps=max_steps,
        metrics_every=metrics_every,
        output_dir=output_dir,
    )


class StateAtStep(Callback):
    """Keeps a deep copy of ``trainer.state_dict()`` taken at the end of step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.state: dict[str, object] | None = None

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        if ctx.step == self.step:
            self.state = copy.deepcopy(trainer.state_dict())


def plugin_context(output_dir: Path, config: dict[str, object] | None = None) -> PluginContext:
    return PluginContext(
        config=SpeedtronicConfig.from_dict(config or {}),
        output_dir=output_dir,
        device=torch.device("cpu"),
    )


def read_jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
