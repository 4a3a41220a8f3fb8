"""A downstream codebase using speedtronic with full mypy --strict types.

It registers its own model, adds a typed callback, and runs a fit from Python. CI type-checks
this file (tox env ``type``); ``tests/test_downstream_types.py`` runs it. Its hooks carry
``@override``, so a misspelled hook (``on_step_ended``) is a mypy error, not a method that is
never called (the Trainer also rejects it when it is built: ``UnknownHookError``).
"""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override  # ``typing.override`` on Python 3.12+

from speedtronic import Callback, Trainer, register_model
from speedtronic.engine.contexts import EvalEndContext, MetricsContext, StepContext
from speedtronic.engine.view import TrainerView


@register_model("downstream_mlp")
def make_mlp(**fields: object) -> nn.Module:
    width = fields.get("d_model", 16)
    assert isinstance(width, int)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))


class LossPrinter(Callback):
    """Collects the loss whenever a metric record is due."""

    metrics_phase = "consume"

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.eval_losses: list[float] = []

    @override  # mypy reports a hook name that Callback does not have
    def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
        self.eval_losses.append(ctx.metrics["eval/loss"])

    @override
    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if ctx.due:
            loss = ctx.record.get("loss")
            assert isinstance(loss, float)
            self.losses.append(loss)

    @override
    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        if ctx.step >= 50:
            trainer.request_stop("enough")


class Regression(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(x), y)


def main() -> list[float]:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True)
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]
    held_out = [(x[i : i + 8] * 0.5, y[i : i + 8] * 0.5) for i in range(0, 16, 8)]
    model = Regression(make_mlp(d_model=16))
    printer = LossPrinter()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        data,
        device="cpu",
        callbacks=[printer],
        max_steps=100,
        metrics_every=10,
        eval_data=held_out,
        eval_every=10,
    )
    result = trainer.fit()
    assert result.stop_reason == "enough"
    assert len(printer.eval_losses) == 5
    metrics: dict[str, float] = trainer.evaluate()
    assert metrics["eval/loss"] == printer.eval_losses[-1]
    return printer.losses


if __name__ == "__main__":
    print(main())
