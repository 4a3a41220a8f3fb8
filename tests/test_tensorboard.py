"""TensorBoard: real event files, read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from sink_helpers import StateAtStep, make_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from speedtronic.config import SpeedtronicConfig
from speedtronic.integrations import TensorboardHook
from speedtronic_callbacks.tensorboard import TensorBoardCallback


def load_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] as TensorBoard shows it (purged points removed)."""
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_scalars_have_the_record_keys_and_steps(tmp_path: Path) -> None:
    sink = TensorBoardCallback()
    result = make_trainer(tmp_path, [sink], max_steps=5, metrics_every=2).fit()
    assert sink.closed
    scalars = load_scalars(tmp_path / "tensorboard")
    expected = {"loss", "lr", "steps_per_sec", "samples_per_sec", "tokens_per_sec"}
    assert expected | {"samples", "tokens", "micro_batches", "elapsed_s"} <= set(scalars)
    assert "step" not in scalars
    assert [step for step, _ in scalars["loss"]] == [2, 4, 5]
    losses = [value for _, value in scalars["loss"]]
    assert losses == pytest.approx([float(str(r["loss"])) for r in result.metrics], rel=1e-6)
    assert [value for _, value in scalars["lr"]] == pytest.approx([0.05] * 3)


def test_the_run_config_is_stored_as_text(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [TensorBoardCallback()], max_steps=1)
    trainer.config = SpeedtronicConfig.from_dict({"run": {"name": "tb-config"}})
    trainer.fit()
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert "config/text_summary" in accumulator.Tags()["tensors"]
    text = accumulator.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"name": "tb-config"' in text


def test_prefix_and_log_dir_options(tmp_path: Path) -> None:
    sink = TensorBoardCallback("tb/run1", prefix="train/")
    make_trainer(tmp_path, [sink], max_steps=2).fit()
    scalars = load_scalars(tmp_path / "tb" / "run1")
    assert "train/loss" in scalars and "loss" not in scalars


def test_resumed_fit_purges_the_old_points_past_the_resume_step(tmp_path: Path) -> None:
    snapshot = StateAtStep(4)
    first = make_trainer(tmp_path, [TensorBoardCallback(), snapshot], max_steps=6).fit()
    assert snapshot.state is not None
    resumed = make_trainer(tmp_path, [TensorBoardCallback()], max_steps=8)
    resumed.load_state_dict(snapshot.state)
    second = resumed.fit()
    loss = load_scalars(tmp_path / "tensorboard")["loss"]
    assert [step for step, _ in loss] == list(range(1, 9))
    expected = [r["loss"] for r in first.metrics[:4]] + [r["loss"] for r in second.metrics]
    assert [value for _, value in loss] == pytest.approx(expected, rel=1e-6)


def test_tensorboard_hook_writes_event_scalars(tmp_path: Path) -> None:
    with TensorboardHook(tmp_path / "hook") as hook:
        hook.on_event("train_step", {"step": 3, "loss": 0.5, "device": "cpu", "ok": True})
        hook.on_event("train_end", {"steps": 3, "elapsed_s": 1.5})
    scalars = load_scalars(tmp_path / "hook")
    assert scalars["train_step/loss"] == [(3, 0.5)]
    assert scalars["train_end/steps"] == [(0, 3.0)]
    assert "train_step/device" not in scalars and "train_step/ok" not in scalars


def test_tensorboard_hook_writes_through_the_tensorboard_callback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from speedtronic.plugins import callback_registry

    built: list[TensorBoardCallback] = []

    class Recorded(TensorBoardCallback):
        def __init__(self, *args: object, **options: object) -> None:
            super().__init__(*args, **options)  # type: ignore[arg-type]  # forwarded as given
            built.append(self)

    monkeypatch.setattr(callback_registry, "_items", {"tensorboard": Recorded})
    hook = TensorboardHook(tmp_path / "hook")
    hook.on_event("train_step", {"step": 2, "loss": 0.25})
    hook.flush()
    assert len(built) == 1 and not built[0].closed
    assert load_scalars(tmp_path / "hook")["train_step/loss"] == [(2, 0.25)]
    hook.close()
    assert built[0].closed
    with pytest.raises(RuntimeError, match="after close"):
        hook.on_event("train_step", {"step": 3, "loss": 0.5})
