"""The ``text_samples`` callback: generations for fixed prompts every N steps, in the JSONL
records and as TensorBoard text; the training stream is untouched; bad options exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from speedtronic.runtime import train_from_config
from tests.cli_runner import run_cli
from tests.text_runs import text_run_config

SAMPLES = {"name": "text_samples", "prompts": ["the cat", "the dog"], "every_steps": 2}


def records(run: Path) -> list[dict[str, object]]:
    lines = (run / "metrics.jsonl").read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("samples")
    extra = {
        "logging": {"console": False, "jsonl": True, "every_steps": 2},
        "callbacks": [{**SAMPLES, "max_new_tokens": 8}, {"name": "tensorboard"}],
    }
    config = text_run_config(tmp_path, extra=extra)
    train_from_config(config)
    return tmp_path / "run"


def test_samples_are_in_the_jsonl_records_of_their_steps(sampled: Path) -> None:
    found = {
        r["step"]: (r["text_samples/0"], r["text_samples/1"])
        for r in records(sampled)
        if "text_samples/0" in r
    }
    assert sorted(found) == [2, 4]
    for first, second in found.values():
        assert isinstance(first, str) and first.startswith("the cat") and len(first) > 7
        assert isinstance(second, str) and second.startswith("the dog")


def test_samples_are_tensorboard_text(sampled: Path) -> None:
    accumulator = EventAccumulator(str(sampled / "tensorboard"), size_guidance={"tensors": 0})
    accumulator.Reload()
    assert "text_samples/0/text_summary" in accumulator.Tags()["tensors"]
    events = accumulator.Tensors("text_samples/0/text_summary")
    assert [event.step for event in events] == [2, 4]
    jsonl = {r["step"]: r["text_samples/0"] for r in records(sampled) if "text_samples/0" in r}
    for event in events:
        assert event.tensor_proto.string_val[0].decode() == jsonl[event.step]


def test_samples_change_nothing_the_training_depends_on(sampled: Path, tmp_path: Path) -> None:
    extra = {"logging": {"console": False, "jsonl": True, "every_steps": 2}}
    config = text_run_config(tmp_path, extra=extra)
    train_from_config(config)
    plain = [r["loss"] for r in records(tmp_path / "run")]
    assert plain == [r["loss"] for r in records(sampled)]


def test_a_prompt_too_long_for_the_model_exits_2(tmp_path: Path) -> None:
    extra = {"callbacks": [{**SAMPLES, "prompts": ["x" * 40]}]}
    config = text_run_config(tmp_path, extra=extra)
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "text_samples: prompts[0] (40 tokens)" in result.stderr
    assert "Traceback" not in result.stderr


def test_samples_are_generated_on_their_steps_only(tmp_path: Path) -> None:
    """Off the hot path: the callback is not called on the steps it is not due (logging
    every step, sampling every 2), and its texts reach the records of its steps only."""
    from speedtronic.config import load_config
    from speedtronic.evaluation.text import run_text
    from speedtronic.runtime import build_runtime
    from speedtronic_callbacks.samples import SamplesCallback

    calls: list[int] = []

    class Counting(SamplesCallback):
        def generate(self, trainer):  # type: ignore[no-untyped-def]  # a test double
            calls.append(trainer.step)
            return super().generate(trainer)

    extra = {"logging": {"console": False, "jsonl": True, "every_steps": 1}}
    config = load_config(text_run_config(tmp_path, steps=5, extra=extra))
    sampler = Counting(text=run_text(config.data.to_dict()), prompts=["the cat"], every_steps=2,
                       max_new_tokens=4, context_length=config.model.max_seq_len)  # fmt: skip
    trainer, _ = build_runtime(config, extra_callbacks=[sampler])
    trainer.fit()
    assert calls == [2, 4, 5]  # every 2 steps and the final step
    sampled = [r["step"] for r in records(tmp_path / "run") if "text_samples/0" in r]
    assert sampled == [2, 4, 5]
    assert len(records(tmp_path / "run")) == 5
