"""Exact resume: 6 steps + resume to 12 gives the losses of one uninterrupted 12-step run,
bit for bit, with gradient accumulation, dropout, a scheduler and every data setup; plus the
resume rules (absolute max_steps, no checkpoint, callback state, mismatches, metrics.jsonl)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from speedtronic import Trainer
from speedtronic.config.sections import DataConfig, EvalConfig
from speedtronic.data import TextFileTokenDataset, build_dataloader
from speedtronic.data.held_out import build_eval_loader
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import MetricsContext, StepContext
from speedtronic.engine.trainer import TrainingStateError
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.resume import resume_from
from speedtronic.state.training_state import _rank_share
from speedtronic_callbacks.checkpoint import CheckpointCallback
from speedtronic_callbacks.jsonl import JsonlCallback

VOCAB = 48
CONTEXT = 8
MICRO = 2
K = 3


class LossRecorder(Callback):
    """Every step's reported loss (a float made from the float32 tensor: exact)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
        loss = ctx.record.values()["loss"]
        assert isinstance(loss, float)
        self.losses[ctx.step] = loss


class StepCounter(Callback):
    """A stateful callback: counts the steps it has seen across resumes."""

    state_key = "step_counter"

    def __init__(self) -> None:
        self.seen = 0

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, object]:
        return {"seen": self.seen}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        seen = state["seen"]
        assert isinstance(seen, int)
        self.seen = seen


class RandomTokens(Dataset[dict[str, torch.Tensor]]):
    """A user's own map-style dataset (20 fixed samples: epochs wrap within the test)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(11)
        self.tokens = torch.randint(0, VOCAB, (20, CONTEXT + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.tokens[index]
        return {"input_ids": row[:-1], "labels": row[1:]}


def data_config(**overrides: object) -> DataConfig:
    settings: dict[str, object] = {
        "micro_batch_size": MICRO,
        "target_batch_size": MICRO * K,
        "block_size": CONTEXT,
        "vocab_size": VOCAB,
        "seed": 5,
    }
    settings.update(overrides)
    return DataConfig(**settings)  # type: ignore[arg-type]  # test-local keyword bag


def make_loader(source: str, tmp_path: Path) -> DataLoader[object]:
    if source == "map_shuffled":
        return build_dataloader(data_config(shuffle=True), dataset=RandomTokens())
    if source == "text_stream":
        text_file = tmp_path / "corpus.txt"
        if not text_file.exists():
            words = " ".join(f"w{(i * 7919) % 97}" for i in range(90))
            text_file.write_text(words + "\n", encoding="utf-8")
        dataset = TextFileTokenDataset(text_file, CONTEXT, vocab_size=VOCAB)
        return build_dataloader(data_config(), dataset=dataset)
    kind = {"synthetic_uniform": "uniform", "synthetic_learnable": "learnable"}[source]
    config = data_config(synthetic=True, synthetic_kind=kind, num_tokens=25, shuffle=True)
    return build_dataloader(config)


def held_out_loader(source: str, tmp_path: Path) -> DataLoader[object]:
    """The held-out set of ``source`` (the text file's tail; another synthetic stream)."""
    if source == "text_stream":
        make_loader(source, tmp_path)  # writes the file
        dataset = TextFileTokenDataset(
            tmp_path / "corpus.txt",
            CONTEXT,
            vocab_size=VOCAB,
            part="held_out",
            held_out_fraction=0.2,
        )
        return build_dataloader(data_config(drop_last=False), dataset=dataset)
    kind = {"synthetic_uniform": "uniform", "synthetic_learnable": "learnable"}[source]
    settings = EvalConfig(every_steps=2)
    return build_eval_loader(
        data_config(synthetic=True, synthetic_kind=kind, num_tokens=5), settings
    )


def make_trainer(
    source: str,
    tmp_path: Path,
    callbacks: list[Callback],
    *,
    init_seed: int,
    eval_every: int | None = None,
) -> Trainer:
    torch.manual_seed(init_seed)
    model = ReferenceTransformer(
        vocab_size=VOCAB, block_size=CONTEXT, n_layer=2, n_head=2, d_model=24, dropout=0.1
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return Trainer(
        model,
        optimizer,
        make_loader(source, tmp_path),
        device="cpu",
        scheduler=scheduler,
        callbacks=callbacks,
        accumulation_steps=K,
        grad_clip=1.0,
        metrics_every=1,
        eval_data=held_out_loader(source, tmp_path) if eval_every else None,
        eval_every=eval_every,
    )


SOURCES = ["map_shuffled", "text_stream", "synthetic_uniform", "synthetic_learnable"]


@pytest.mark.parametrize(
    ("source", "async_save"), [(s, False) for s in SOURCES] + [("synthetic_learnable", True)]
)
def test_interrupted_and_resumed_run_matches_uninterrupted_bitwise(
    tmp_path: Path, source: str, async_save: bool
) -> None:
    reference = LossRecorder()
    make_trainer(source, tmp_path, [reference], init_seed=0).fit(12)
    assert sorted(reference.losses) == list(range(1, 13))

    directory = tmp_path / "ck"
    first = LossRecorder()
    make_trainer(
        source,
        tmp_path,
        [first, CheckpointCallback(directory, every_steps=4, async_save=async_save)],
        init_seed=0,
    ).fit(6)
    assert first.losses == {s: reference.losses[s] for s in range(1, 7)}

    torch.manual_seed(999)  # a different process would have a different RNG state
    torch.rand(17)
    second = LossRecorder()
    callback = CheckpointCallback(directory, every_steps=4, async_save=async_save)
    trainer = make_trainer(source, tmp_path, [second, callback], init_seed=1)
    assert resume_from(trainer, callback.manager) == directory / "step_000000000006.pt"
    assert trainer.step == 6
    result = trainer.fit(12)
    assert result.steps == 12
    assert second.losses == {s: reference.losses[s] for s in range(7, 13)}


class EvalRecorder(Callback):
    """Every evaluation's ``eval/loss``, by step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
        if ctx.evaluated:
            loss = ctx.record.values()["eval/loss"]
            assert isinstance(loss, float)
            self.losses[ctx.step] = loss


@pytest.mark.parametrize("source", ["text_stream", "synthetic_learnable"])
def test_resume_with_evaluation_matches_uninterrupted_bitwise(tmp_path: Path, source: str) -> None:
    """Evaluation consumes no training data and no training randomness (the model has
    dropout): training losses and eval/loss of 4 + resume to 8 equal one 8-step run."""
    reference, reference_eval = LossRecorder(), EvalRecorder()
    make_trainer(source, tmp_path, [reference, reference_eval], init_seed=0, eval_every=3).fit(8)
    assert sorted(reference_eval.losses) == [3, 6, 8]

    directory = tmp_path / "ck"
    first = EvalRecorder()
    make_trainer(
        source,
        tmp_path,
        [first, CheckpointCallback(directory, every_steps=4)],
        init_seed=0,
        eval_every=3,
    ).fit(4)
    assert first.losses == {3: reference_eval.losses[3], 4: first.losses[4]}

    torch.manual_seed(999)
    second, second_eval = LossRecorder(), EvalRecorder()
    callback = CheckpointCallback(directory, every_steps=4)
    trainer = make_trainer(
        source, tmp_path, [second, second_eval, callback], init_seed=1, eval_every=3
    )
    resume_from(trainer, callback.manager)
    trainer.fit(8)
    assert second.losses == {s: reference.losses[s] for s in range(5, 9)}
    assert second_eval.losses == {6: reference_eval.losses[6], 8: reference_eval.losses[8]}


def test_max_steps_is_absolute_after_resume(tmp_path: Path) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=5)
    make_trainer("synthetic_uniform", tmp_path, [callback], init_seed=0).fit(5)
    trainer = make_trainer("synthetic_uniform", tmp_path, [callback], init_seed=0)
    resume_from(trainer, callback.manager)
    result = trainer.fit(5)
    assert (result.steps, result.final_loss) == (5, None)
    assert [p.name for p in callback.manager.checkpoint_paths()] == ["step_000000000005.pt"]


def test_no_checkpoint_warns_and_starts_fresh(tmp_path: Path) -> None:
    trainer = make_trainer("synthetic_uniform", tmp_path, [], init_seed=0)
    with pytest.warns(UserWarning, match="no checkpoint found in .*starting fresh"):
        assert resume_from(trainer, CheckpointManager(tmp_path / "empty")) is None
    assert trainer.step == 0


def test_callback_state_is_restored_by_default(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    counter = StepCounter()
    make_trainer(
        "synthetic_uniform", tmp_path, [counter, CheckpointCallback(directory)], init_seed=0
    ).fit(4)
    assert counter.seen == 4

    restored = StepCounter()
    trainer = make_trainer("synthetic_uniform", tmp_path, [restored], init_seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing missing, nothing unexpected
        resume_from(trainer, CheckpointManager(directory))
    assert restored.seen == 4
    trainer.fit(6)
    assert restored.seen == 6

    skipped = StepCounter()
    trainer = make_trainer("synthetic_uniform", tmp_path, [skipped], init_seed=0)
    resume_from(trainer, CheckpointManager(directory), load_callback_state=False)
    assert skipped.seen == 0 and trainer.step == 4


def test_missing_and_unexpected_callback_state_are_reported(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    make_trainer(
        "synthetic_uniform", tmp_path, [StepCounter(), CheckpointCallback(directory)], init_seed=0
    ).fit(2)

    class Other(StepCounter):
        state_key = "other"

    trainer = make_trainer("synthetic_uniform", tmp_path, [Other()], init_seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume_from(trainer, CheckpointManager(directory))
    messages = " | ".join(str(w.message) for w in caught)
    assert "no state for callback" in messages and "'other'" in messages
    assert "'step_counter'" in messages and "ignored" in messages


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path: Path) -> None:
    make_trainer(
        "synthetic_uniform", tmp_path, [CheckpointCallback(tmp_path / "ck")], init_seed=0
    ).fit(1)
    torch.manual_seed(0)
    wider = ReferenceTransformer(
        vocab_size=VOCAB, block_size=CONTEXT, n_layer=2, n_head=2, d_model=32
    )
    trainer = Trainer(
        wider, torch.optim.AdamW(wider.parameters()), make_loader("synthetic_uniform", tmp_path)
    )
    with pytest.raises(TrainingStateError, match=r"step_000000000001\.pt.*shape mismatch"):
        resume_from(trainer, CheckpointManager(tmp_path / "ck"))


def test_unknown_format_version_is_a_clear_error(tmp_path: Path) -> None:
    trainer = make_trainer("synthetic_uniform", tmp_path, [], init_seed=0)
    state = trainer.state_dict()
    state["format_version"] = 99
    CheckpointManager(tmp_path).save(3, state)
    with pytest.raises(TrainingStateError, match="unknown training-state format version 99"):
        resume_from(trainer, CheckpointManager(tmp_path))


def test_metrics_jsonl_continues_without_duplicates_after_a_crash(tmp_path: Path) -> None:
    """Killed after step 7 was logged but with step 6 as the last checkpoint: the resumed
    run re-does step 7 and metrics.jsonl holds every step exactly once."""

    def trainer(callbacks: list[Callback]) -> Trainer:
        built = make_trainer("synthetic_learnable", tmp_path, callbacks, init_seed=0)
        built.output_dir = tmp_path
        return built

    directory = tmp_path / "ck"
    crashed = CheckpointCallback(directory, every_steps=3, save_final=False)
    trainer([JsonlCallback(), crashed]).fit(7)
    assert [p.name for p in crashed.manager.checkpoint_paths()][-1] == "step_000000000006.pt"

    callback = CheckpointCallback(directory, every_steps=3)
    resumed = trainer([JsonlCallback(), callback])
    resume_from(resumed, callback.manager)
    with pytest.warns(UserWarning, match="metrics.jsonl"):
        resumed.fit(12)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 13))


@pytest.mark.parametrize(("saved_world", "world"), [(2, 1), (1, 2), (2, 3), (3, 2), (4, 4), (0, 3)])
def test_a_changed_world_size_splits_the_saved_run_totals_over_the_new_ranks(
    saved_world: int, world: int
) -> None:
    """Counters are per rank and a checkpoint holds rank 0's: in another world size the
    saved run's totals are split so that the new ranks' sum continues from them (a state
    without ``world_size``, written before it was recorded, carries over as it is)."""
    counters = {"step": 9, "samples": 7, "tokens": 301}
    if saved_world:
        counters["world_size"] = saved_world
    shares = [
        _rank_share(
            cast(
                Trainer,
                SimpleNamespace(distributed=SimpleNamespace(rank=r, world_size=world), tensor=1),
            ),
            counters,
        )
        for r in range(world)
    ]
    if saved_world in (0, world):
        assert shares == [(7, 301)] * world
    else:
        assert sum(s for s, _ in shares) == 7 * saved_world
        assert sum(t for _, t in shares) == 301 * saved_world
        assert max(s for s, _ in shares) - min(s for s, _ in shares) <= 1


@pytest.mark.parametrize(
    ("saved_world", "saved_tensor", "world", "tensor"),
    [(2, 2, 2, 1), (2, 1, 2, 2), (4, 2, 2, 1), (2, 2, 4, 2), (4, 2, 2, 2), (3, 1, 4, 2)],
)
def test_a_changed_tensor_layout_keeps_the_run_totals(
    saved_world: int, saved_tensor: int, world: int, tensor: int
) -> None:
    """The ranks of a tensor-parallel group train (and count) the same batches: the saved
    run's totals are rank 0's counts times its data-parallel degree, and the new ranks'
    shares make the same totals (sum over ranks / tensor degree), tensor peers alike."""
    counters = {"step": 9, "samples": 7, "tokens": 301, "world_size": saved_world}
    counters["tensor"] = saved_tensor
    shares = [
        _rank_share(
            cast(
                Trainer,
                SimpleNamespace(
                    distributed=SimpleNamespace(rank=r, world_size=world), tensor=tensor
                ),
            ),
            counters,
        )
        for r in range(world)
    ]
    data_ranks = saved_world // saved_tensor
    assert sum(s for s, _ in shares) == 7 * data_ranks * tensor
    assert sum(t for _, t in shares) == 301 * data_ranks * tensor
    assert all(len(set(shares[d * tensor : (d + 1) * tensor])) == 1 for d in range(world // tensor))
