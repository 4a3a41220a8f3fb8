"""The held-out set: where it comes from (``eval:`` config), that training never sees it,
config validation of the ``eval:`` section, and a config-driven run with evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_tensorboard import load_scalars
from torch.utils.data import Dataset

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.config.sections import DataConfig, EvalConfig
from speedtronic.data import (
    DatasetRequest,
    DataSourceError,
    LearnableLanguageDataset,
    SyntheticTokenDataset,
    TextFileTokenDataset,
    build_dataloader,
    register_dataset,
)
from speedtronic.data.held_out import build_eval_loader, held_out_dataset, training_excludes_tail
from speedtronic.data.text import held_out_cut
from speedtronic.runtime import build_runtime, train_from_config


def tokens_of(dataset: TextFileTokenDataset) -> list[int]:
    """Every token the dataset streams, in order (the groups are disjoint)."""
    out: list[int] = []
    for item in dataset:
        out += item["input_ids"].tolist() + item["labels"][-1:].tolist()
    return out


def write_corpus(path: Path, words: int = 400) -> bytes:
    text = " ".join(f"w{(i * 7919) % 101}é" for i in range(words)) + "\n"
    path.write_text(text, encoding="utf-8")
    return text.encode("utf-8")


# -- text files -------------------------------------------------------------------------------


def test_text_training_and_held_out_parts_split_the_file_at_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    raw = write_corpus(path)
    cut = held_out_cut(path, 0.1)
    assert cut >= math.floor(len(raw) * 0.9)
    assert raw[cut : cut + 1] == b" "  # a word boundary, never inside a character
    train = TextFileTokenDataset(path, 16, part="train", held_out_fraction=0.1, chunk_bytes=64)
    held = TextFileTokenDataset(path, 16, part="held_out", held_out_fraction=0.1, chunk_bytes=64)
    train_tokens, held_tokens = tokens_of(train), tokens_of(held)
    # Byte tokenizer: token ids are the bytes. Training stops before the cut, the held-out
    # part starts at it; together they are the whole file (up to a short last group).
    assert bytes(train_tokens) == raw[: len(train_tokens)]
    assert len(train_tokens) <= cut and cut - len(train_tokens) <= 16
    assert bytes(held_tokens) == raw[cut : cut + len(held_tokens)]
    assert len(held_tokens) > 0


def test_training_stream_excludes_the_tail_only_when_evaluation_uses_it(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    raw = write_corpus(path)
    data = DataConfig(text_path=str(path), block_size=16, micro_batch_size=4, drop_last=False)
    assert training_excludes_tail(EvalConfig()) is None  # evaluation off: train on all of it
    assert training_excludes_tail(EvalConfig(every_steps=5, text_path=str(path))) is None
    fraction = training_excludes_tail(EvalConfig(every_steps=5, fraction=0.2))
    assert fraction == 0.2
    loader = build_dataloader(data, vocab_size=256, held_out_fraction=fraction)
    seen = b"".join(
        bytes(row.tolist())
        for batch in loader
        for row in batch["input_ids"]  # type: ignore[index]  # dict batches
    )
    tail = raw[held_out_cut(path, 0.2) :]
    assert len(seen) < len(raw) * 0.8 + 16
    assert tail[:40] not in seen


def test_an_empty_held_out_tail_is_a_clear_error(tmp_path: Path) -> None:
    from speedtronic.engine.evaluation import EvaluationError, evaluate_model

    path = tmp_path / "one_word.txt"
    path.write_text("x" * 200, encoding="utf-8")  # no whitespace: nothing to cut off
    data = DataConfig(text_path=str(path), block_size=8, micro_batch_size=2)
    loader = build_eval_loader(data, EvalConfig(every_steps=1), vocab_size=256)
    with pytest.raises(EvaluationError, match="held-out set is empty"):
        evaluate_model(torch.nn.Linear(1, 1), loader, device=torch.device("cpu"))


# -- synthetic sources -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", [SyntheticTokenDataset, LearnableLanguageDataset])
def test_synthetic_held_out_items_come_from_another_stream(
    kind: type[SyntheticTokenDataset] | type[LearnableLanguageDataset],
) -> None:
    train = kind(num_samples=64, block_size=12, vocab_size=16, seed=3)
    held = kind(num_samples=64, block_size=12, vocab_size=16, seed=3, held_out=True)
    train_rows = {tuple(train[i]["input_ids"].tolist()) for i in range(64)}
    held_rows = [tuple(held[i]["input_ids"].tolist()) for i in range(64)]
    assert not train_rows.intersection(held_rows)
    # Deterministic per index, like the training items.
    assert held_rows[5] == tuple(held[5]["input_ids"].tolist())
    # The training items are exactly what they were before held-out splits existed.
    first = torch.randint(
        0, 16, (13,), generator=torch.Generator().manual_seed(3), dtype=torch.int64
    )
    if kind is SyntheticTokenDataset:
        assert train[0]["input_ids"].tolist() == first[:-1].tolist()


def test_learnable_held_out_speaks_the_same_language() -> None:
    train = LearnableLanguageDataset(num_samples=8, block_size=12, vocab_size=16, seed=3)
    held = LearnableLanguageDataset(
        num_samples=8, block_size=12, vocab_size=16, seed=3, held_out=True
    )
    assert (train.successors == held.successors).all()
    assert held.entropy_floor == train.entropy_floor
    for index in range(8):
        row = held[index]["input_ids"].tolist() + held[index]["labels"][-1:].tolist()
        for a, b in zip(row, row[1:], strict=False):
            assert b in held.successors[a]


def test_held_out_from_config_sources(tmp_path: Path) -> None:
    data = DataConfig(synthetic=True, synthetic_kind="learnable", block_size=8, vocab_size=16)
    dataset = held_out_dataset(data, EvalConfig(every_steps=1))
    assert isinstance(dataset, LearnableLanguageDataset) and dataset.held_out
    other = tmp_path / "eval.txt"
    write_corpus(other, 20)
    from_file = held_out_dataset(data, EvalConfig(text_path=str(other)))
    assert isinstance(from_file, TextFileTokenDataset) and from_file.part == "all"


class Squares(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, offset: int) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.full((5,), (index + self.offset) % 16)
        return {"input_ids": ids[:-1], "labels": ids[1:]}


@register_dataset("eval-test-squares")
def _squares(request: DatasetRequest) -> Dataset[object]:
    return Squares(
        int(str(request.options.get("n", 4))), int(str(request.options.get("offset", 0)))
    )


def test_a_user_dataset_names_its_held_out_split_with_eval_dataset() -> None:
    data = DataConfig(dataset="eval-test-squares", block_size=4, micro_batch_size=2)
    with pytest.raises(DataSourceError, match="eval.dataset"):
        held_out_dataset(data, EvalConfig(every_steps=1))
    settings = EvalConfig(dataset="eval-test-squares", dataset_options={"n": 3, "offset": 7})
    loader = build_eval_loader(data, settings)
    batches = list(loader)
    assert [len(b["input_ids"]) for b in batches] == [2, 1]  # type: ignore[index]  # dict batches
    with pytest.raises(ConfigError, match="eval.dataset: unknown dataset 'nope'"):
        EvalConfig(dataset="nope")  # the config names it first, with the other names
    unchecked = EvalConfig()
    unchecked.dataset = "nope"  # settings that skipped validation: the data layer says it
    with pytest.raises(DataSourceError, match="eval.dataset: unknown dataset 'nope'"):
        held_out_dataset(data, unchecked)


def test_eval_loader_shards_by_rank() -> None:
    data = DataConfig(dataset="eval-test-squares", block_size=4, micro_batch_size=1)
    settings = EvalConfig(dataset="eval-test-squares", dataset_options={"n": 5})
    shards = [
        [int(b["input_ids"][0, 0]) for b in build_eval_loader(data, settings, rank=r, world_size=2)]  # type: ignore[index]  # dict batches
        for r in (0, 1)
    ]
    assert shards == [[0, 2, 4], [1, 3]]


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ({"every_steps": 0}, "eval.every_steps"),
        ({"max_batches": -1}, "eval.max_batches"),
        ({"fraction": 0}, "eval.fraction"),
        ({"fraction": 0.6}, "eval.fraction"),
        ({"every_step": 5}, "eval.every_step: unknown key (did you mean 'every_steps'?)"),
        ({"text_path": "a.txt", "dataset": "b"}, "eval.dataset: give eval.text_path or"),
    ],
)
def test_bad_eval_config_is_an_error_naming_the_key(section: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.load({"eval": section})
    assert any(error.startswith(path) for error in caught.value.errors), caught.value.errors


def test_eval_config_defaults_and_round_trip() -> None:
    config = SpeedtronicConfig.load({"eval": {"every_steps": 50, "max_batches": 20}})
    assert (config.eval.every_steps, config.eval.max_batches, config.eval.fraction) == (
        50,
        20,
        0.05,
    )
    assert SpeedtronicConfig.load(config.to_dict()) == config


# -- a run from config -----------------------------------------------------------------------


def run_config(tmp_path: Path, **sections: object) -> dict[str, object]:
    config: dict[str, object] = {
        "run": {"device": "cpu", "max_steps": 5, "output_dir": str(tmp_path / "run")},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
        "logging": {"every_steps": 100, "console": True, "jsonl": True},
        "checkpoint": {"enabled": False},
        "callbacks": [{"name": "csv"}, {"name": "tensorboard"}],
        "eval": {"every_steps": 2, "max_batches": 3},
    }
    config.update(sections)
    return config


def test_a_config_run_logs_eval_metrics_in_every_sink(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = train_from_config(run_config(tmp_path))
    assert [r["step"] for r in result.metrics] == [2, 4, 5]
    lines = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [line["step"] for line in lines] == [2, 4, 5]
    for line, record in zip(lines, result.metrics, strict=True):
        assert line["eval/loss"] == record["eval/loss"]
        assert line["eval/ppl"] == pytest.approx(math.exp(line["eval/loss"]))
    csv_header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]
    assert "eval/loss" in csv_header and "eval/ppl" in csv_header
    scalars = load_scalars(tmp_path / "run" / "tensorboard")
    assert [step for step, _ in scalars["eval/loss"]] == [2, 4, 5]
    assert [value for _, value in scalars["eval/loss"]] == pytest.approx(
        [float(r["eval/loss"]) for r in result.metrics], rel=1e-6
    )
    out = capsys.readouterr()
    console = [line for line in (out.out + out.err).splitlines() if line.startswith("step 4/5")]
    assert console and "eval/loss" in console[0] and "eval/ppl" in console[0]


def test_a_config_run_evaluates_a_text_tail_it_does_not_train_on(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    write_corpus(path, 300)
    config = run_config(
        tmp_path,
        model={"vocab_size": 256, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
        data={"text_path": str(path), "micro_batch_size": 2},
        eval={"every_steps": 5, "fraction": 0.1},
        logging={"console": False},
    )
    trainer, _ = build_runtime(config)
    assert trainer.eval_every == 5
    loader = trainer.stream.source  # the training DataLoader reads the part before the cut
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert isinstance(loader.dataset, TextFileTokenDataset) and loader.dataset.part == "train"
    result = trainer.fit()
    assert math.isfinite(float(result.metrics[-1]["eval/loss"]))


def test_a_held_out_set_known_to_be_empty_fails_before_training(tmp_path: Path) -> None:
    path = tmp_path / "one_word.txt"
    path.write_text("x" * 300, encoding="utf-8")  # no whitespace: the tail cannot be cut
    config = run_config(
        tmp_path,
        model={"vocab_size": 256, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
        data={"text_path": str(path), "micro_batch_size": 2},
        logging={"console": False},
    )
    with pytest.raises(ConfigError, match=r"eval: the held-out set is empty \(.*held-out tail"):
        build_runtime(config)
    user = run_config(tmp_path, data={"dataset": "eval-test-squares", "block_size": 8})
    with pytest.raises(ConfigError, match="eval: data.dataset 'eval-test-squares' has no"):
        build_runtime(user)


def test_console_and_progress_lines_show_the_eval_keys_when_present() -> None:
    from speedtronic_callbacks.console import describe_record
    from speedtronic_callbacks.progress import progress_line

    record = {"step": 10, "loss": 2.5, "eval/loss": 2.75, "eval/ppl": 15.642, "lr": 1e-3}
    line = describe_record(record, 20)
    assert "loss 2.5000 | eval/loss 2.7500 | eval/ppl 15.6420" in line
    assert "eval/loss 2.7500" in progress_line(record, 0, 20)
    plain = {"step": 11, "loss": 2.5, "lr": 1e-3}
    assert "eval" not in describe_record(plain, 20) + progress_line(plain, 0, 20)
