"""Trainer step semantics: accumulation math, output protocol, counters, coordinator."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from speedtronic import Callback, Trainer
from speedtronic.engine.batch import ModelOutputError, loss_from_logits, resolve_loss
from speedtronic.engine.contexts import EvalEndContext, MetricsContext, StepContext
from speedtronic.engine.view import TrainerView


class MeanModel(nn.Module):
    """loss = (v - mean(labels))^2 for dict batches."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.zeros(()))

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return (self.v - labels.float().mean()) ** 2


def test_accumulation_scales_gradients_and_reports_mean_loss() -> None:
    model = MeanModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"labels": torch.tensor([0.0])}, {"labels": torch.tensor([2.0])}]
    result = Trainer(model, opt, data, device="cpu", accumulation_steps=2, max_steps=1).fit()
    # grad = d/dv [(v-0)^2/2 + (v-2)^2/2] at 0 = -2 -> v = 0.2; loss = mean(0, 4) = 2.
    assert model.v.item() == pytest.approx(0.2)
    assert result.final_loss == pytest.approx(2.0)
    assert result.steps == 1
    assert result.samples == 2



@pytest.mark.parametrize("k", [1, 2])
def test_last_loss_is_the_steps_mean_loss_detached(k: int) -> None:
    """With one microbatch the loop keeps the model's loss as returned (no ``detach`` per
    step); ``last_loss`` hands it out detached, the value of that step's loss."""
    seen: list[tuple[float, bool]] = []

    class Reader(Callback):
        def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
            loss = trainer.last_loss
            assert loss is not None
            seen.append((loss.item(), loss.requires_grad))

    model = MeanModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"labels": torch.tensor([2.0])}]
    trainer = Trainer(
        model, opt, data, callbacks=[Reader()], accumulation_steps=k, max_steps=2
    )
    result = trainer.fit()
    # v: 0 -> 0.4 after step 1 (grad -4, lr 0.1): losses (0-2)^2 = 4, then (0.4-2)^2 = 2.56.
    assert seen == [(pytest.approx(4.0), False), (pytest.approx(2.56), False)]
    assert result.final_loss == pytest.approx(2.56)
    assert trainer.last_loss is not None and not trainer.last_loss.requires_grad
    # Read once, the detached tensor is what the trainer keeps: the graph's nodes are gone.
    assert trainer.step_loss is trainer.last_loss

def test_absolute_max_steps_and_repeated_fit() -> None:
    model = MeanModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"labels": torch.tensor([1.0])}]
    trainer = Trainer(model, opt, data, max_steps=3)
    assert trainer.fit().steps == 3
    again = trainer.fit(3)
    assert again.steps == 3 and again.final_loss is None
    assert trainer.fit(5).steps == 5


def test_counters_and_metrics_cadence() -> None:
    model = nn.Embedding(16, 4)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 16)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.emb(input_ids)}

    del model
    net = LM()
    data = [{"input_ids": torch.randint(0, 16, (2, 8)), "labels": torch.randint(0, 16, (2, 8))}]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    result = Trainer(net, opt, data, max_steps=5, metrics_every=2, accumulation_steps=2).fit()
    assert (result.samples, result.tokens) == (20, 160)
    assert [m["step"] for m in result.metrics] == [2, 4, 5]
    last = result.metrics[-1]
    assert last["samples"] == 20 and last["micro_batches"] == 2
    assert isinstance(last["loss"], float) and last["loss"] == pytest.approx(result.final_loss)


def test_loss_resolution_protocol() -> None:
    logits = torch.randn(2, 3, 4)
    labels = torch.randint(0, 4, (2, 3))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 4), labels.reshape(-1))
    batch = {"labels": labels}
    assert torch.allclose(resolve_loss({"logits": logits}, batch), expected)
    assert torch.allclose(resolve_loss((logits,), batch), expected)
    assert torch.allclose(resolve_loss({"loss": expected}, batch), expected)
    assert torch.allclose(resolve_loss(torch.tensor([1.0, 3.0]), batch), torch.tensor(2.0))
    shorter = labels[:, :-1]
    assert torch.allclose(
        loss_from_logits(logits, shorter),
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 4), shorter.reshape(-1)),
    )
    ignored = torch.full((2, 3), -100)
    zero = loss_from_logits(logits.requires_grad_(), ignored)
    assert zero.item() == 0.0
    zero.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    with pytest.raises(ModelOutputError, match="no labels"):
        resolve_loss({"logits": logits}, {"input_ids": labels})
    with pytest.raises(ModelOutputError, match="cannot get a loss"):
        resolve_loss("nope", batch)


def test_grad_clip_reports_norm() -> None:
    model = MeanModel()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = [{"labels": torch.tensor([10.0])}]
    result = Trainer(model, opt, data, max_steps=1, grad_clip=1.0).fit()
    # Unclipped grad is -20; clipped to norm 1 -> v == 1.0.
    assert model.v.item() == pytest.approx(1.0)
    assert result.metrics[-1]["grad_norm"] == pytest.approx(20.0)


class CountingCoordinator:
    def __init__(self) -> None:
        self.starts = 0
        self.stops = 0
        self.calls: list[int] = []
        self.loaded: dict[str, object] | None = None

    def start(self) -> None:
        self.starts += 1

    def after_optimizer_step(self, model: nn.Module, step: int) -> bool | None:
        self.calls.append(step)
        return step == 2

    def stop(self) -> None:
        self.stops += 1

    def state_dict(self) -> dict[str, object] | None:
        return {"calls": len(self.calls)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.loaded = state


def test_sync_coordinator_protocol_is_adapted() -> None:
    model = MeanModel()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    coordinator = CountingCoordinator()
    data = [{"labels": torch.tensor([1.0])}]
    trainer = Trainer(model, opt, data, coordinator=coordinator, max_steps=1)
    trainer.fit()
    trainer.fit(max_steps=3)
    assert (coordinator.starts, coordinator.stops) == (2, 2)
    assert coordinator.calls == [1, 2, 3]
    state = trainer.state_dict()
    assert state["callbacks"] == {"coordinator": {"calls": 3}}


def test_state_dict_round_trip_continues_identically() -> None:
    def build() -> Trainer:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
        data = [(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(5)]

        class Wrap(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return ((self.net(x) - y) ** 2).mean()

        model = Wrap()
        return Trainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            data,
            max_steps=10,
            accumulation_steps=2,
        )

    straight = build()
    straight.fit(4)
    saved = copy.deepcopy(straight.state_dict())  # state_dict holds live references
    expected = straight.fit(9)

    resumed = build()
    resumed.load_state_dict(saved)
    assert resumed.step == 4
    got = resumed.fit(9)
    assert got.final_loss == expected.final_loss
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_mismatched_state_is_a_clear_error() -> None:
    from speedtronic.engine.trainer import TrainingStateError

    model = MeanModel()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [{"labels": torch.ones(1)}]
    )
    state = trainer.state_dict()
    bad = dict(state, model={"w": torch.zeros(2)})
    with pytest.raises(TrainingStateError, match="missing keys: v.*unexpected keys: w"):
        trainer.load_state_dict(bad)
    with pytest.raises(TrainingStateError, match="format version 99"):
        trainer.load_state_dict(dict(state, format_version=99))


def test_a_different_optimizer_group_layout_is_a_clear_error() -> None:
    """A checkpoint whose optimizer has other parameter groups than this run's (e.g. written
    before ``optimizer.decay_norms_and_biases: false`` split gains and biases off) names the
    setting, and leaves the trainer's weights as they were."""
    from speedtronic.engine.trainer import TrainingStateError

    class TwoWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.v = nn.Parameter(torch.zeros(()))
            self.b = nn.Parameter(torch.ones(()))

        def forward(self, labels: torch.Tensor) -> torch.Tensor:
            return (self.v + self.b - labels.float().mean()) ** 2

    def trainer(groups: int) -> Trainer:
        model = TwoWeights()
        params = list(model.parameters())
        grouped = [{"params": params}] if groups == 1 else [{"params": [p]} for p in params]
        return Trainer(model, torch.optim.SGD(grouped, lr=0.1), [{"labels": torch.ones(1)}])

    one, two = trainer(1), trainer(2)
    assert len(two.optimizer.param_groups) == 2
    before = [p.detach().clone() for p in two.model.parameters()]
    expected = r"1 parameter group.*this run's has 2.*decay_norms_and_biases"
    with pytest.raises(TrainingStateError, match=expected):
        two.load_state_dict(one.state_dict())
    for kept, now in zip(before, two.model.parameters(), strict=True):
        assert torch.equal(kept, now)


def test_original_constructor_arguments_still_work(tmp_path: Path) -> None:
    """The original Trainer(logger=..., checkpoint_manager=...) keeps its behaviour."""
    import io

    from speedtronic.profiling import MetricLogger
    from speedtronic.state.checkpoint import CheckpointManager

    model = MeanModel()
    stream = io.StringIO()
    events: list[str] = []
    logger = MetricLogger(stream=stream, hooks=[lambda event, payload: events.append(event)])
    manager = CheckpointManager(tmp_path / "checkpoints", every_steps=2)
    data = [{"labels": torch.tensor([1.0])}]
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        max_steps=3,
        logger=logger,
        checkpoint_manager=manager,
        metrics_every=1,
    )
    result = trainer.fit()
    assert result.steps == 3 and len(result.metrics) == 3
    assert (tmp_path / "checkpoints" / "latest.json").is_file()
    assert manager.latest_path() == manager.path_for(3)  # the final save
    assert events.count("train_step") == 3 and "train_start" in events and "train_end" in events
    assert "train_step" in stream.getvalue()


def test_failed_load_leaves_the_trainer_untouched() -> None:
    model = MeanModel()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [{"labels": torch.ones(1)}]
    )
    state = copy.deepcopy(trainer.state_dict())
    state["model"] = {"v": torch.tensor(5.0)}
    state["optimizer"] = {"state": {}, "param_groups": []}  # wrong number of groups
    with pytest.raises(ValueError):
        trainer.load_state_dict(state)
    assert model.v.item() == 0.0


def test_config_target_follows_data_max_steps() -> None:
    from speedtronic.config import SpeedtronicConfig

    config = SpeedtronicConfig.from_dict({"max_steps": 10, "data": {"max_steps": 4}})
    model = MeanModel()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [{"labels": torch.ones(1)}],
        config=config,
        device="cpu",
    )
    assert trainer.fit().steps == 4


def test_scaler_overflow_step_is_not_counted_and_is_retried() -> None:
    """The fp16 path: a step the grad scaler skips is reported, not counted, and retried.

    CUDA fp16 is the only place speedtronic makes a scaler; torch's CPU GradScaler exercises
    the same loop logic here."""
    from speedtronic import Callback
    from speedtronic.engine.contexts import OptimizerStepContext

    class Overflows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.v = nn.Parameter(torch.zeros(()))
            self.calls = 0

        def forward(self, labels: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            scale = float("inf") if self.calls == 1 else 1.0  # the first forward overflows
            return (self.v * scale - labels.float().mean()) ** 2

    class SeeSkips(Callback):
        def __init__(self) -> None:
            self.skipped: list[tuple[int, bool]] = []

        def on_after_optimizer_step(self, trainer: Trainer, ctx: OptimizerStepContext) -> None:
            self.skipped.append((ctx.step, ctx.skipped))

    model = Overflows()
    seen = SeeSkips()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, opt, [{"labels": torch.tensor([1.0])}], max_steps=2, callbacks=[seen])
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.warns(RuntimeWarning, match="step 1: the fp16 grad scaler skipped"):
        result = trainer.fit()
    assert seen.skipped == [(1, True), (1, False), (2, False)]
    assert result.steps == 2 and trainer.skipped_steps == 1
    assert torch.isfinite(model.v).all()


# -- issue 24 item 4: the Trainer is a training state plus its parts ----------------------------


def test_the_loop_checkpoints_and_the_view_share_one_training_state() -> None:
    model = MeanModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"labels": torch.tensor([1.0, 3.0])}]
    trainer = Trainer(model, opt, data, max_steps=3)
    state = trainer.state
    trainer.fit()
    assert (state.step, state.samples, state.tokens) == (3, 6, 6)
    assert (trainer.step, trainer.samples, trainer.tokens) == (3, 6, 6)
    assert trainer.model is state.model and trainer.stream is state.stream
    trainer.step = 1  # written to the state the loop and the checkpoints read
    assert state.step == 1 and trainer.state_dict()["counters"] == {
        "step": 1,
        "samples": 6,
        "tokens": 6,
        "world_size": 1,
    }
    trainer.fit(max_steps=2)  # continues from the state's step 1
    assert state.step == 2 and state.samples == 8


def test_the_engine_trainer_trains_from_resolved_settings_alone() -> None:
    import inspect

    from speedtronic.engine.evaluation import Evaluation
    from speedtronic.engine.settings import TrainerSettings
    from speedtronic.engine.trainer import Trainer as EngineTrainer

    # Eleven, from the 26 of the Trainer that resolved its own config; no 2.0 argument.
    parameters = [name for name in inspect.signature(EngineTrainer.__init__).parameters]
    assert parameters[1:] == [
        "model",
        "optimizer",
        "data",
        "callbacks",
        "max_steps",
        "start_step",
        "scheduler",
        "settings",
        "evaluation",
        "distributed",
        "run_config",
    ]
    model = MeanModel()
    data = [{"labels": torch.tensor([0.0])}, {"labels": torch.tensor([2.0])}]
    trainer = EngineTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        max_steps=1,
        settings=TrainerSettings(accumulation_steps=2),
        evaluation=Evaluation(data, every=1),
    )
    result = trainer.fit()
    # The accumulation example above, and the held-out loss of the updated v = 0.2.
    assert model.v.item() == pytest.approx(0.2) and result.final_loss == pytest.approx(2.0)
    assert result.metrics[0]["eval/loss"] == pytest.approx((0.2**2 + 1.8**2) / 2)
    with pytest.raises(ValueError, match="accumulation_steps must be >= 1, got 0"):
        TrainerSettings(accumulation_steps=0)


def test_evaluation_and_restore_work_on_the_trainers_one_training_state() -> None:
    seen: list[tuple[str, object, object]] = []

    class Watch(Callback):
        def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
            # The pass's results wait in the state the metric record takes them from.
            seen.append(("eval_end", built.state.pending_eval == ctx.metrics, built.state.step))

        def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
            seen.append(("metrics", built.state.pending_eval, "eval/loss" in ctx.record.values()))

    model = MeanModel()
    held_out = [{"labels": torch.tensor([2.0])}]
    built = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [{"labels": torch.tensor([1.0, 3.0])}],
        callbacks=[Watch()],
        max_steps=2,
        metrics_every=2,
        eval_data=held_out,
        eval_every=2,
    )
    state = built.state
    at_start = copy.deepcopy(built.state_dict())
    built.fit()
    assert seen == [("metrics", None, False), ("eval_end", True, 2), ("metrics", None, True)]
    assert model.v.item() != 0.0
    built.load_state_dict(at_start)  # restored into the same state, not a new one
    assert built.state is state and (state.step, state.samples, state.tokens) == (0, 0, 0)
    assert model.v.item() == 0.0 and built.step == 0
    # Evaluation reads the state's (restored) model: (0 - 2)^2.
    assert built.evaluate(held_out)["eval/loss"] == pytest.approx(4.0)
