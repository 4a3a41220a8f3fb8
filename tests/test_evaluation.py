"""Evaluation during a fit and on demand: events, the metric record, the pass itself
(eval mode, no RNG or data disturbance, token weighting), and bad settings."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from speedtronic import Callback, Event, Trainer
from speedtronic.engine.contexts import EvalEndContext, EvalStartContext, MetricsContext
from speedtronic.engine.evaluation import EvaluationError, evaluate_model
from speedtronic.engine.events import expected_step_trace
from speedtronic.engine.filters import logging_steps
from speedtronic.engine.view import TrainerView
from speedtronic.testing import EventRecorder, expected_fit_trace


class TinyLM(nn.Module):
    """Embedding + dropout + linear head: a causal LM small enough for many fits."""

    def __init__(self, vocab: int = 11, width: int = 8, dropout: float = 0.5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, vocab)
        self.modes: list[bool] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.modes.append(self.training)
        return {"logits": self.head(self.drop(self.embed(input_ids)))}


def lm_batches(n: int, seed: int, batch: int = 2, seq: int = 5) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 11, (batch, seq + 1), generator=g)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def lm_trainer(
    *callbacks: Callback,
    steps: int = 5,
    eval_every: int | None = 2,
    eval_data: list[dict[str, torch.Tensor]] | None = None,
    metrics_every: int = 1,
    seed: int = 0,
) -> Trainer:
    torch.manual_seed(seed)
    model = TinyLM()
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lm_batches(6, seed=1),
        device="cpu",
        callbacks=list(callbacks),
        max_steps=steps,
        metrics_every=metrics_every,
        eval_data=lm_batches(3, seed=2) if eval_data is None else eval_data,
        eval_every=eval_every,
    )


# -- events -----------------------------------------------------------------------------


def test_golden_trace_with_evaluation_steps() -> None:
    recorder = EventRecorder()
    lm_trainer(recorder, steps=5, eval_every=2).fit()
    assert recorder.events == expected_fit_trace(5, 1, eval_steps=frozenset({2, 4, 5}))
    assert recorder.steps_of(Event.EVAL_START) == [2, 4, 5]
    assert recorder.steps_of(Event.EVAL_END) == [2, 4, 5]
    # Written out once by hand: the evaluation sits after coordinate, before metrics.
    tail = expected_step_trace(1, evaluation=True)[-6:]
    assert tail == [
        Event.COORDINATE,
        Event.EVAL_START,
        Event.EVAL_END,
        Event.METRICS,
        Event.CHECKPOINT,
        Event.STEP_END,
    ]


def test_no_evaluation_events_without_eval() -> None:
    recorder = EventRecorder()
    lm_trainer(recorder, steps=3, eval_every=None).fit()
    assert recorder.events == expected_fit_trace(3, 1)


class EvalSpy(Callback):
    """Records the eval contexts and whether each metric record carries the eval keys."""

    def __init__(self) -> None:
        self.starts: list[EvalStartContext] = []
        self.ends: list[EvalEndContext] = []
        self.records: dict[int, tuple[bool, bool, bool]] = {}

    def on_eval_start(self, trainer: TrainerView, ctx: EvalStartContext) -> None:
        self.starts.append(ctx)

    def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
        self.ends.append(ctx)

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        self.records[ctx.step] = (ctx.evaluated, "eval/loss" in ctx.record, ctx.due)


def test_eval_metrics_join_the_record_of_their_step() -> None:
    spy = EvalSpy()
    result = lm_trainer(spy, steps=5, eval_every=2, metrics_every=100).fit()
    # Evaluation steps are logging steps even off the metrics cadence.
    logged = [record["step"] for record in result.metrics]
    assert logged == [2, 4, 5]
    for record in result.metrics:
        loss = record["eval/loss"]
        assert isinstance(loss, float) and math.isfinite(loss)
        assert record["eval/ppl"] == pytest.approx(math.exp(loss))
        assert "loss" in record  # the training metrics of the same step
    assert spy.records[1] == (False, False, False)
    assert spy.records[2] == (True, True, True)
    assert [ctx.step for ctx in spy.ends] == [2, 4, 5]
    assert [ctx.metrics["eval/loss"] for ctx in spy.ends] == [
        record["eval/loss"] for record in result.metrics
    ]
    assert spy.ends[0].batches == 3
    assert spy.ends[0].weight == 3 * 2 * 5  # tokens: 3 batches of 2 x 5 labels
    assert spy.starts[0].max_batches is None


def test_logging_filter_is_due_on_evaluation_steps() -> None:
    recorder = EventRecorder({Event.METRICS: logging_steps()})
    lm_trainer(recorder, steps=7, eval_every=3, metrics_every=5).fit()
    assert recorder.steps_of(Event.METRICS) == [3, 5, 6, 7]


# -- the pass -----------------------------------------------------------------------------


def test_eval_runs_in_eval_mode_and_restores_train_mode() -> None:
    trainer = lm_trainer(steps=2, eval_every=2)
    model = trainer.model
    assert isinstance(model, TinyLM)
    trainer.fit()
    # 2 training forwards, then 3 evaluation forwards in eval mode.
    assert model.modes == [True, True, False, False, False]
    assert model.training
    model.eval()
    trainer.evaluate()
    assert not model.training  # evaluate() leaves the mode it found


def test_evaluation_does_not_disturb_training() -> None:
    """Dropout draws from the global RNG in training; evaluating between steps must not
    change the training losses (nor consume training batches)."""
    plain = lm_trainer(steps=6, eval_every=None).fit()
    evaluated = lm_trainer(steps=6, eval_every=2).fit()
    assert [r["loss"] for r in plain.metrics] == [r["loss"] for r in evaluated.metrics]
    assert plain.samples == evaluated.samples


def test_eval_loss_is_deterministic_and_matches_evaluate() -> None:
    trainer = lm_trainer(steps=4, eval_every=4)
    result = trainer.fit()
    again = trainer.evaluate()
    assert again["eval/loss"] == result.metrics[-1]["eval/loss"]
    assert set(again) == {"eval/loss", "eval/ppl"}
    assert trainer.step == 4


class MeanLoss(nn.Module):
    """Returns a fixed loss per batch (its ``value``) as a mean over its real labels."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(()))

    def forward(self, value: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return value[0] + 0 * self.p


def test_loss_is_averaged_over_tokens_not_batches() -> None:
    labels_a = torch.tensor([[1, 2, 3, 4], [5, -100, -100, -100]])  # 5 real tokens
    labels_b = torch.tensor([[1, -100, -100, -100]])  # 1 real token
    data = [
        {"value": torch.tensor([1.0, 1.0]), "labels": labels_a},
        {"value": torch.tensor([4.0]), "labels": labels_b},
    ]
    outcome = evaluate_model(MeanLoss(), data, device=torch.device("cpu"))
    assert outcome.metrics["eval/loss"] == pytest.approx((5 * 1.0 + 1 * 4.0) / 6)
    assert outcome.weight == 6


def test_loss_is_averaged_over_samples_without_token_labels() -> None:
    class Regression(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((x - y) ** 2).mean()

    data = [
        (torch.zeros(3, 1), torch.ones(3, 1)),  # loss 1, 3 samples
        (torch.zeros(1, 1), torch.full((1, 1), 3.0)),  # loss 9, 1 sample
    ]
    outcome = evaluate_model(Regression(), data, device=torch.device("cpu"))
    assert outcome.metrics["eval/loss"] == pytest.approx((3 * 1 + 9) / 4)


def test_max_batches_pulls_no_more_batches_than_it_uses() -> None:
    pulled: list[int] = []

    def held_out() -> Iterator[dict[str, torch.Tensor]]:
        for index, batch in enumerate(lm_batches(10, seed=3)):
            pulled.append(index)
            yield batch

    outcome = evaluate_model(TinyLM(), held_out(), device=torch.device("cpu"), max_batches=2)
    assert outcome.batches == 2
    assert pulled == [0, 1]


def test_evaluate_with_explicit_data_and_without_any() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_batches(2, 1))
    metrics = trainer.evaluate(lm_batches(2, seed=5))
    assert metrics["eval/ppl"] == pytest.approx(math.exp(metrics["eval/loss"]))
    with pytest.raises(EvaluationError, match="no held-out data"):
        trainer.evaluate()


# -- bad settings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eval_every": 0}, "eval_every must be a positive integer"),
        ({"eval_every": 2, "eval_max_batches": -1}, "eval_max_batches must be a positive"),
        ({"eval_every": 2, "eval_data": None}, "eval_every=2 needs eval_data"),
    ],
)
def test_bad_eval_settings_are_clear_errors(kwargs: dict[str, object], message: str) -> None:
    model = TinyLM()
    options: dict[str, object] = {"eval_data": lm_batches(1, 0), **kwargs}
    with pytest.raises(EvaluationError, match=message):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_batches(2, 1), **options)  # type: ignore[arg-type]  # the kwargs vary per case


def test_an_empty_held_out_set_is_a_clear_error_at_the_first_evaluation() -> None:
    recorder = EventRecorder()
    trainer = lm_trainer(recorder, steps=3, eval_every=2, eval_data=[])
    with pytest.raises(EvaluationError, match="held-out set is empty"):
        trainer.fit()
    assert recorder.steps_of(Event.EVAL_START) == [2]


# -- distributed reduction (in process) -----------------------------------------------------


def test_ranks_all_reduce_token_weighted_sums_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank evaluates its shard; one all-reduce of (loss sum, token count) before the
    division gives the one-process eval/loss over the whole held-out set. Rank 1's side of
    the collective is played by its own local sums."""
    import types

    import torch.distributed as dist

    torch.manual_seed(3)
    model = TinyLM(dropout=0.0)
    data = lm_batches(5, seed=7)
    for batch in data:
        batch["labels"] = batch["labels"].clone()  # not a view of input_ids
    data[1]["labels"][:, 2:] = -100  # padding: rank 1 has fewer real tokens
    data[3]["labels"][0, :] = -100
    cpu = torch.device("cpu")
    full = evaluate_model(model, data, device=cpu)
    shard0, shard1 = data[0::2], data[1::2]
    other = evaluate_model(model, shard1, device=cpu)
    other_sums = [other.metrics["eval/loss"] * other.weight, other.weight]
    calls: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, op: object = None) -> None:
        calls.append(tensor.clone())
        tensor += torch.tensor(other_sums, dtype=tensor.dtype)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    context = types.SimpleNamespace(world_size=2, rank=0)
    rank0 = evaluate_model(
        model,
        shard0,
        device=cpu,
        distributed=context,  # type: ignore[arg-type]  # only world_size is read
    )
    assert len(calls) == 1 and calls[0].shape == (2,)
    assert rank0.metrics["eval/loss"] == pytest.approx(full.metrics["eval/loss"], rel=1e-12)
    assert rank0.weight == full.weight
    mine = evaluate_model(model, shard0, device=cpu).metrics["eval/loss"]
    batch_mean = (mine + other.metrics["eval/loss"]) / 2
    assert batch_mean != pytest.approx(full.metrics["eval/loss"], rel=1e-6)  # weighting matters
