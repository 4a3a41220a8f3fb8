"""The loop's lean path (``loop._lean_step``: no in-step hook due, one plain microbatch)
trains exactly as the full path with its hook tables does."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from sink_helpers import TinyRegressor, make_batches

from speedtronic import Callback, Event, Trainer
from speedtronic.engine.contexts import (
    BackwardContext,
    CheckpointContext,
    CoordinateContext,
    MetricsContext,
    MicrobatchContext,
    OptimizerStepContext,
    SchedulerContext,
    StepContext,
)
from speedtronic.engine.filters import StepFilter, logging_steps
from speedtronic.engine.view import TrainerView

TIMING_KEYS = {"steps_per_sec", "samples_per_sec", "tokens_per_sec", "elapsed_s"}


class OnStepEnd(Callback):
    """Listens to ``step_end`` on every step: the loop has to take its full path."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.steps.append(ctx.step)


def fit(
    tmp_path: Path, callbacks: list[Callback], grad_clip: float | None = None
) -> tuple[Trainer, list[dict[str, object]]]:
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
        grad_clip=grad_clip,
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


class ContextRecorder(Callback):
    """Listens to every in-step event and keeps (event, context) with tensors as numbers and
    the batch as its identity in the data (its first tensor's values)."""

    def __init__(self) -> None:
        self.trace: list[tuple[str, str, tuple[object, ...]]] = []
        self.paths: set[str] = set()  # the loop functions that called step_start

    def _add(self, name: str, ctx: tuple[object, ...]) -> None:
        fields: list[object] = []
        for value in ctx:
            if isinstance(value, torch.Tensor):
                value = value.detach().tolist()
            elif isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
                value = value[0].tolist()  # the microbatch
            fields.append(value)
        self.trace.append((name, type(ctx).__name__, tuple(fields)))

    def on_step_start(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.paths.add(sys._getframe(1).f_code.co_name)
        self._add("step_start", ctx)

    def on_microbatch_start(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        self._add("microbatch_start", ctx)

    def on_before_backward(self, trainer: TrainerView, ctx: BackwardContext) -> None:
        self._add("before_backward", ctx)

    def on_after_backward(self, trainer: TrainerView, ctx: BackwardContext) -> None:
        self._add("after_backward", ctx)

    def on_microbatch_end(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        self._add("microbatch_end", ctx)

    def on_before_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        self._add("before_optimizer_step", ctx._replace(grad_norm=None))

    def on_after_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        self._add("after_optimizer_step", ctx._replace(grad_norm=None))

    def on_after_scheduler_step(self, trainer: TrainerView, ctx: SchedulerContext) -> None:
        self._add("after_scheduler_step", ctx)

    def on_coordinate(self, trainer: TrainerView, ctx: CoordinateContext) -> None:
        self._add("coordinate", ctx)

    def on_checkpoint(self, trainer: TrainerView, ctx: CheckpointContext) -> None:
        self._add("checkpoint", ctx)

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self._add("step_end", ctx)


def test_the_one_batch_path_emits_what_the_k_microbatch_path_emits(tmp_path: Path) -> None:
    """With hooks due, one plain microbatch takes ``loop._one_batch_step``; a clipping norm
    too large to clip anything sends the same step through the K-microbatch path (clipping
    scales the gradients by exactly 1.0). Both emit the same events with the same contexts
    (the clipping norm aside) and train the same weights."""
    one, general = ContextRecorder(), ContextRecorder()
    one_batch, one_records = fit(tmp_path / "one", [one])
    clipped, general_records = fit(tmp_path / "general", [general], grad_clip=1e30)
    assert (one.paths, general.paths) == ({"_one_batch_step"}, {"run_global_step"})
    assert len(one.trace) == 9 * 11 and one.trace[:3] == [
        ("step_start", "StepContext", (1, 1)),
        ("microbatch_start", "MicrobatchContext", (1, 0, 1, make_batches(5)[0][0].tolist())),
        ("before_backward", "BackwardContext", (1, 0, 1, one.trace[2][2][3])),
    ]
    assert one.trace == general.trace
    strip = [{k: v for k, v in r.items() if k != "grad_norm"} for r in general_records]
    assert one_records == strip
    for a, b in zip(one_batch.model.parameters(), clipped.model.parameters(), strict=True):
        assert torch.equal(a, b)


class AnyBatchModel(torch.nn.Module):
    """Takes every batch layout of the batch protocol; ``reduce=False`` returns a vector
    (the loop takes its mean)."""

    def __init__(self, reduce: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5))
        self.reduce = reduce

    def forward(
        self,
        x: object = None,
        y: object = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del attention_mask, labels
        source = x if input_ids is None else input_ids
        values = (torch.as_tensor(source, dtype=torch.float32) * self.w).square()
        return values.sum() if self.reduce else values.reshape(-1)


def _batch_layouts() -> dict[str, tuple[object, bool]]:
    """A batch of each layout (the same one every step) and whether the model reduces."""
    x, y = torch.arange(15.0).reshape(3, 5) / 10, torch.ones(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    return {
        "pair of 2-d inputs": ((x, y), True),
        "pair, vector output": ((x, y), False),
        "pair of 0-d inputs": ((torch.tensor(0.3), y), True),
        "pair of non-tensor inputs": (([0.1, 0.2], y), True),
        "triple": ((x, y, torch.zeros(2)), True),
        "list": ([x, y], True),
        "mapping with a mask": ({"input_ids": x, "attention_mask": mask, "labels": y}, True),
    }


def test_every_batch_layout_counts_and_trains_alike_on_each_path(tmp_path: Path) -> None:
    """The lean and one-batch steps spell out the batch protocol's common case (an
    ``(inputs, labels)`` tensor pair, a 0-d loss); every layout counts its samples and tokens
    as ``batch_size_and_tokens`` does and trains as the K-microbatch path does."""
    from speedtronic.data.collate import batch_size_and_tokens

    for name, (batch, reduce) in _batch_layouts().items():
        outcomes = []
        for path, callbacks, grad_clip in (
            ("lean", [], None),
            ("one batch", [OnStepEnd()], None),
            ("k microbatches", [OnStepEnd()], 1e9),  # clipping by 1.0: the same gradients
        ):
            torch.manual_seed(0)
            model = AnyBatchModel(reduce)
            trainer = Trainer(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                [batch] * 3,
                device="cpu",
                callbacks=callbacks,
                max_steps=3,
                output_dir=tmp_path / name / path,
                grad_clip=grad_clip,
            )
            trainer.fit()
            loss = trainer.last_loss
            assert loss is not None and loss.ndim == 0, (name, path)
            outcomes.append(
                (trainer.state.samples, trainer.state.tokens, loss.item(), model.w.item())
            )
        samples, tokens = batch_size_and_tokens(batch)
        assert outcomes[0][:2] == (3 * samples, 3 * tokens), name
        assert outcomes[0] == outcomes[1] == outcomes[2], name


class MetricsRecorder(Callback):
    """Listens to ``metrics`` alone (on every step, or on the steps ``due_when`` says) and
    keeps each context's fields with the record's values (timings aside), and which loop
    function ran the step."""

    def __init__(self, due_when: StepFilter | None = None) -> None:
        if due_when is not None:
            self.due_when = {Event.METRICS: due_when}
        self.seen: list[tuple[int, bool, bool, dict[str, object]]] = []
        self.paths: set[str] = set()

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        self.paths.add(sys._getframe(2).f_code.co_name)  # the caller of ``_emit_metrics``
        values = {k: v for k, v in ctx.record.values().items() if k not in TIMING_KEYS}
        self.seen.append((ctx.step, ctx.due, ctx.evaluated, values))


def test_a_step_with_only_metrics_hooks_due_takes_the_lean_path(tmp_path: Path) -> None:
    """Sinks on a logging step (``CallbackPlan.step_metrics_only``) run on the lean path:
    the same ``metrics`` contexts and records, on the same steps, as on the one-batch path
    a ``step_end`` listener sends the step through; an unfiltered metrics hook still hears
    every step."""
    for due_when, steps in ((logging_steps(), [2, 4, 6, 8, 9]), (None, list(range(1, 10)))):
        lean, full = MetricsRecorder(due_when), MetricsRecorder(due_when)
        lean_trainer, lean_records = fit(tmp_path / f"lean-{steps[0]}", [lean])
        _, full_records = fit(tmp_path / f"full-{steps[0]}", [full, OnStepEnd()])
        assert (lean.paths, full.paths) == ({"_lean_step"}, {"_one_batch_step"})
        assert lean.seen == full.seen and [seen[0] for seen in lean.seen] == steps
        assert [seen[1] for seen in lean.seen] == [s in (2, 4, 6, 8, 9) for s in steps]
        assert lean_records == full_records
        assert lean_trainer.plan.step_metrics_only and not lean_trainer.plan.step_idle
