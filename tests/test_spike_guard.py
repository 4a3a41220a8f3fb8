"""``spike_guard``: a spiking step leaves weights and optimizer state bit for bit as they were,
the scheduler and data position move on, the skip is reported, and spikes that keep coming
stop ``speedtronic fit`` with exit 2 after the last good checkpoint."""

from __future__ import annotations

import copy
import json
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from scalar_model import Scalar

from speedtronic import Callback, Trainer, TrainerView
from speedtronic.engine.contexts import StepContext
from speedtronic.state.signals import stop_exit_code
from speedtronic_callbacks.spike_guard import SKIPPED_KEY, RunningBand, SpikeGuard

SPIKE_STEPS = (30,)


def _batches(count: int, spikes: tuple[int, ...] = SPIKE_STEPS) -> list[tuple[torch.Tensor, ...]]:
    """Batches of y = 2x plus noise; the batch of each step in ``spikes`` (1-based, one
    microbatch per step) has targets a thousand times too large."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(1, count + 1):
        x = torch.randn(8, generator=generator)
        y = 2 * x + 0.1 * torch.randn(8, generator=generator)
        batches.append((x, y * 1000 if step in spikes else y))
    return batches


class Snapshots(Callback):
    """The weights, optimizer state and learning rate at the end of every step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, object]] = {}

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.at[ctx.step] = {
            "weights": copy.deepcopy(trainer.model.state_dict()),
            "optimizer": copy.deepcopy(trainer.state_dict()["optimizer"]),
            "lr": trainer.param_groups[0]["lr"],
            "position": dict(trainer.data_position()),
        }


def _fit(guard: SpikeGuard | None, steps: int = 40) -> tuple[Trainer, Snapshots]:
    torch.manual_seed(0)
    model = Scalar()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    snapshots = Snapshots()
    callbacks: list[Callback] = [snapshots] if guard is None else [guard, snapshots]
    trainer = Trainer(
        model,
        optimizer,
        _batches(steps),
        scheduler=scheduler,
        max_steps=steps,
        callbacks=callbacks,
        metrics_every=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.fit()
    return trainer, snapshots


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_a_skipped_step_changes_no_weight_and_no_optimizer_state() -> None:
    guard = SpikeGuard(warmup_steps=10, window=50, threshold=6.0)
    _, snapshots = _fit(guard)
    before, after = snapshots.at[29], snapshots.at[30]
    assert _equal(before["weights"], after["weights"])
    assert _equal(before["optimizer"]["state"], after["optimizer"]["state"])  # moments, step
    assert after["lr"] < before["lr"]  # the scheduler advanced
    assert after["position"] != before["position"]  # the batch was consumed
    assert [skip.step for skip in guard.skipped] == [30]
    assert guard.skipped[0].data_position == after["position"]
    # the steps on either side trained as usual
    assert not _equal(snapshots.at[28]["weights"], snapshots.at[29]["weights"])
    assert not _equal(snapshots.at[30]["weights"], snapshots.at[31]["weights"])


def test_without_the_guard_the_spike_lands_in_the_weights() -> None:
    _, snapshots = _fit(None)
    assert not _equal(snapshots.at[29]["weights"], snapshots.at[30]["weights"])
    second_moment = [snapshots.at[step]["optimizer"]["state"][0]["exp_avg_sq"] for step in (29, 30)]
    assert second_moment[1] > 1000 * second_moment[0]  # Adam's scale is spoilt for long after


def test_the_skip_is_reported_counted_and_checkpointed() -> None:
    guard = SpikeGuard(warmup_steps=10, window=50)
    model = Scalar()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    trainer = Trainer(
        model, optimizer, _batches(35), max_steps=35, callbacks=[guard], metrics_every=1
    )
    with pytest.warns(RuntimeWarning, match=r"spike_guard: step 30: loss .* update skipped"):
        result = trainer.fit()
    assert result.metrics[-1][SKIPPED_KEY] == 1
    assert result.metrics[28][SKIPPED_KEY] == 0
    state = trainer.state_dict()["callbacks"]["spike_guard"]  # type: ignore[index]  # a dict
    restored = SpikeGuard(warmup_steps=10, window=50)
    restored.load_state_dict(state)
    assert restored.skipped == guard.skipped and restored.skipped_steps == 1
    assert list(restored.bands["loss"].values) == list(guard.bands["loss"].values)
    assert restored.bands["loss"].sums() == guard.bands["loss"].sums()  # rounding included
    assert restored.bands["loss"].mean_std() == guard.bands["loss"].mean_std()


def test_the_guard_only_learns_during_warm_up() -> None:
    guard = SpikeGuard(warmup_steps=40, window=50)  # the spike at step 30 is in the warm-up
    _, snapshots = _fit(guard)
    assert guard.skipped == []
    assert not _equal(snapshots.at[29]["weights"], snapshots.at[30]["weights"])


def test_spikes_that_keep_coming_stop_cleanly_with_the_bad_input_exit_code() -> None:
    guard = SpikeGuard(warmup_steps=10, window=50, max_skips=2, skip_window=10)
    model = Scalar()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    trainer = Trainer(
        model, optimizer, _batches(60, spikes=(20, 22, 24, 26)), max_steps=60, callbacks=[guard]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = trainer.fit()
    assert result.steps == 24  # the third skip in ten steps: stop after that step
    assert result.stop_reason is not None and "3 steps skipped" in result.stop_reason
    assert stop_exit_code(result.stop_reason) == 2


def test_options_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="warmup_steps .100. must not exceed window .50."):
        SpikeGuard(warmup_steps=100, window=50)
    with pytest.raises(ValueError, match="watch must be"):
        SpikeGuard("gradnorm")  # type: ignore[arg-type]  # the mistake under test


SPIKY_MODULE = textwrap.dedent(
    """
    import torch
    from speedtronic.data import register_dataset
    from speedtronic.models.registry import register_model


    class Scalar(torch.nn.Module):
        def __init__(self, **_):
            super().__init__()
            self.v = torch.nn.Parameter(torch.zeros(()))

        def forward(self, batch):
            x, y = batch[:, 0], batch[:, 1]
            return ((self.v * x - y) ** 2).mean()


    class Spiky(torch.utils.data.Dataset):
        def __len__(self):
            return 4096

        def __getitem__(self, index):
            x = torch.randn((), generator=torch.Generator().manual_seed(index))
            y = 2 * x * (1000.0 if index >= 8 * 40 else 1.0)  # every step from 41 on spikes
            return torch.stack([x, y])


    register_model("spiky_scalar", lambda **kwargs: Scalar(**kwargs))

    @register_dataset("spiky")
    def spiky(request):
        return Spiky()
    """
)

SPIKY_CONFIG = textwrap.dedent(
    """
    imports: [spiky_run]
    run: {name: spiky, device: cpu, max_steps: 80, seed: 1, output_dir: out}
    model: {name: spiky_scalar, vocab_size: 8, max_seq_len: 2}
    data: {dataset: spiky, micro_batch_size: 8, shuffle: false, collate: default}
    optimizer: {lr: 0.05}
    scheduler: {name: constant, warmup_steps: 0}
    logging: {every_steps: 1, console: false}
    checkpoint: {every_steps: 20}
    callbacks:
      - {name: spike_guard, warmup_steps: 10, window: 30, max_skips: 3, skip_window: 10}
    """
)


def test_speedtronic_fit_exits_2_after_the_last_good_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "spiky_run.py").write_text(SPIKY_MODULE)
    (tmp_path / "run.yaml").write_text(SPIKY_CONFIG)
    result = run_cli("fit", "--config", "run.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "stopped early: bad input: spike_guard: 4 steps skipped within the last 10" in (
        result.stdout
    )
    assert "Traceback" not in result.stderr
    pointer = json.loads((tmp_path / "out" / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == 44  # the final save after the stop: weights of step 40
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    assert records[-1][SKIPPED_KEY] == 4


def test_the_running_band_equals_the_exact_statistics_of_its_window() -> None:
    generator = torch.Generator().manual_seed(3)
    values = (torch.randn(1000, generator=generator) * 5 + 100).tolist()
    band = RunningBand(64)
    for count, value in enumerate(values, start=1):
        band.append(value)
        if count % 97 == 0 or count == len(values):
            window = torch.tensor(values[max(0, count - 64) : count], dtype=torch.float64)
            mean, std = band.mean_std()
            assert mean == pytest.approx(window.mean().item(), rel=1e-12)
            assert std == pytest.approx(window.std().item(), rel=1e-9)
