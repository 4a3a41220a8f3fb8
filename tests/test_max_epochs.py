"""``run.max_epochs``: the fit ends when the data stream would start the epoch after the
last one, a resumed run continues mid-epoch exactly, and the step target and LR horizon
follow the epochs when the data has a length."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sink_helpers import TinyRegressor, make_batches, make_trainer

from speedtronic import Trainer
from speedtronic.config import ConfigError, load_config
from speedtronic.data import BatchStream, EpochLimitReached
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.runtime import build_runtime


class Losses(Callback):
    """The loss of every step (a host read per step: fine in a test)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        assert trainer.last_loss is not None
        self.losses.append(float(trainer.last_loss))


class Unsized:
    """A re-iterable without ``len()`` (like a streaming dataset): only running out of
    batches can end an epoch."""

    def __init__(self, batches: list[object]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[object]:
        return iter(self.batches)


def test_the_stream_refuses_to_open_the_epoch_after_the_last() -> None:
    stream = BatchStream([1, 2, 3], max_epochs=2)
    assert [next(stream) for _ in range(6)] == [1, 2, 3, 1, 2, 3]
    with pytest.raises(EpochLimitReached):
        next(stream)
    assert stream.state_dict() == {"epoch": 1, "batches_in_epoch": 3}


@pytest.mark.parametrize("source", [list, Unsized])
def test_max_epochs_stops_a_trainer_at_the_end_of_the_data(tmp_path: Path, source: type) -> None:
    batches = make_batches(4)
    trainer = make_trainer(tmp_path, [], max_steps=100, batches=source(batches))
    trainer.stream.max_epochs = 2
    result = trainer.fit()
    assert result.steps == 8 and result.stop_reason is None
    assert result.samples == 8 * batches[0][0].shape[0]


def test_an_unfilled_last_step_is_not_taken(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyRegressor()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        Unsized(make_batches(5)),
        device="cpu",
        max_steps=100,
        accumulation_steps=2,
        max_epochs=1,
    )
    before = [p.detach().clone() for p in model.parameters()]
    assert trainer.fit().steps == 2  # 5 batches: two full steps of 2, the 5th is dropped
    assert all(p.grad is None for p in model.parameters())  # its gradient is not kept
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="max_epochs must be a positive integer"):
        Trainer(model, trainer.optimizer, [1], device="cpu", max_epochs=0)


def config(tmp_path: Path, **run: object) -> dict[str, object]:
    return {
        "run": {"device": "cpu", "max_steps": 1000, "output_dir": str(tmp_path), **run},
        "model": {"vocab_size": 16, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 8},
        "data": {"num_tokens": 10, "micro_batch_size": 2, "shuffle": True},
        "scheduler": {"warmup_steps": 1},
        "logging": {"jsonl": False, "console": False},
        "checkpoint": {"enabled": False},
    }


def test_max_epochs_sets_the_target_and_the_lr_horizon(tmp_path: Path) -> None:
    trainer, _ = build_runtime(config(tmp_path, max_epochs=3))
    assert trainer.max_steps == 15  # 10 samples / 2 per batch * 3 epochs
    steps, _ = build_runtime(config(tmp_path, max_steps=15))  # the same horizon, by steps
    assert trainer.scheduler is not None and steps.scheduler is not None
    by_epochs, by_steps = trainer.scheduler.lr_lambdas[0], steps.scheduler.lr_lambdas[0]
    assert [by_epochs(s) for s in range(16)] == [by_steps(s) for s in range(16)]
    assert by_epochs(15) < by_epochs(5)  # the cosine really ends at step 15, not 1000
    with pytest.warns(UserWarning, match="run stops at step 4 first"):
        short, _ = build_runtime(config(tmp_path, max_epochs=3, max_steps=4))
    assert short.max_steps == 4
    with pytest.raises(ConfigError, match="run.max_epochs"):
        load_config(config(tmp_path, max_epochs=0))


def test_resume_mid_epoch_gives_the_uninterrupted_losses(tmp_path: Path) -> None:
    full_losses = Losses()
    full, _ = build_runtime(config(tmp_path / "a", max_epochs=2), extra_callbacks=[full_losses])
    assert full.fit().steps == 10
    first_losses = Losses()
    first, _ = build_runtime(config(tmp_path / "b", max_epochs=2), extra_callbacks=[first_losses])
    first.fit(max_steps=7)  # two batches into the second epoch
    assert first.stream.state_dict() == {"epoch": 1, "batches_in_epoch": 2, "samples": 4}
    state = copy.deepcopy(first.state_dict())
    second_losses = Losses()
    second, _ = build_runtime(config(tmp_path / "c", max_epochs=2), extra_callbacks=[second_losses])
    second.load_state_dict(state)
    assert second.fit().steps == 10
    assert first_losses.losses + second_losses.losses == full_losses.losses
