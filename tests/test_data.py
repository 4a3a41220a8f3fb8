"""Data: tokenizer, datasets, collators, resumable streams, build_dataloader, registry."""

from __future__ import annotations

import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from speedtronic.data import (
    BatchStream,
    CharTokenizer,
    DatasetRequest,
    DataSourceError,
    LearnableLanguageDataset,
    ResumableSampler,
    SyntheticTokenDataset,
    TextFileTokenDataset,
    batch_size_and_tokens,
    build_dataloader,
    collate_batch,
    collate_causal,
    dataset_registry,
    encode_text,
    infinite_batches,
    register_dataset,
)

LETTERS = "abcdefghijklmnopqrstuvwxyz"
MULTIBYTE = "héllo wörld ñandú 日本語 ok 🙂 end é\nnext line ça va — oui 🙂🙂 fin"


@dataclass(frozen=True)
class Settings:
    """A ``data`` section as the config layer provides it."""

    text_path: str | None = None
    dataset: object = None
    dataset_options: Mapping[str, object] = field(default_factory=dict)
    synthetic: bool = True
    synthetic_kind: str = "uniform"
    num_tokens: int = 10
    vocab_size: int | None = 64
    block_size: int | None = 8
    micro_batch_size: int = 3
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool | None = None
    shuffle: bool = False
    drop_last: bool = True
    seed: int | None = 7

    @property
    def micro_batch(self) -> int:
        return self.micro_batch_size


def write(tmp_path: Path, text: str | bytes, name: str = "data.txt") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def blocks_of(dataset: TextFileTokenDataset) -> list[tuple[list[int], list[int]]]:
    return [(item["input_ids"].tolist(), item["labels"].tolist()) for item in dataset]


def expected_blocks(ids: list[int], block_size: int) -> list[tuple[list[int], list[int]]]:
    size = block_size + 1
    groups = [ids[start : start + size] for start in range(0, len(ids), size)]
    return [(group[:-1], group[1:]) for group in groups if len(group) >= 2]


def assert_same_batch(left: object, right: object) -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and torch.equal(left, right)
    elif isinstance(left, Mapping):
        assert isinstance(right, Mapping) and set(left) == set(right)
        for key in left:
            assert_same_batch(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert isinstance(right, type(left)) and len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            assert_same_batch(a, b)
    else:
        assert left == right


# --- tokenizer ------------------------------------------------------------------------


def test_char_tokenizer_encodes_utf8_bytes_modulo_vocab() -> None:
    assert CharTokenizer().encode("aé") == [97, 0xC3, 0xA9]
    small = CharTokenizer(vocab_size=32)
    assert small.encode("aé") == [97 % 32, 0xC3 % 32, 0xA9 % 32]
    assert small("aé") == small.encode("aé")
    with pytest.raises(ValueError):
        CharTokenizer(vocab_size=0)


def test_encode_text_accepts_encode_objects_callables_and_tensors() -> None:
    class TensorTokenizer:
        def encode(self, text: str) -> torch.Tensor:
            return torch.tensor([len(text), 1])

    assert encode_text(TensorTokenizer(), "abc") == [3, 1]
    assert encode_text(lambda text: np.array([ord(c) for c in text]), "ab") == [97, 98]
    with pytest.raises(TypeError):
        encode_text(lambda text: 5, "ab")


# --- synthetic datasets ---------------------------------------------------------------


def test_synthetic_dataset_shapes_shift_and_determinism() -> None:
    dataset = SyntheticTokenDataset(num_samples=16, block_size=8, vocab_size=32, seed=3)
    assert len(dataset) == 16
    item = dataset[5]
    assert item["input_ids"].shape == item["labels"].shape == (8,)
    assert item["input_ids"].dtype == item["labels"].dtype == torch.int64
    assert torch.equal(item["input_ids"][1:], item["labels"][:-1])
    assert int(item["input_ids"].max()) < 32 and int(item["input_ids"].min()) >= 0
    again = SyntheticTokenDataset(num_samples=16, block_size=8, vocab_size=32, seed=3)
    assert torch.equal(again[5]["input_ids"], item["input_ids"])  # independent of order
    assert torch.equal(dataset[-11]["labels"], item["labels"])
    other = SyntheticTokenDataset(num_samples=16, block_size=8, vocab_size=32, seed=4)
    assert not torch.equal(other[5]["input_ids"], item["input_ids"])
    assert dataset.entropy_floor == pytest.approx(math.log(32))
    with pytest.raises(IndexError):
        dataset[16]


def test_learnable_dataset_follows_its_chain() -> None:
    dataset = LearnableLanguageDataset(num_samples=64, block_size=16, vocab_size=32, seed=5)
    assert dataset.branching == 4
    assert dataset.successors.shape == dataset.successor_probs.shape == (32, 4)
    assert np.allclose(dataset.successor_probs.sum(axis=1), 1.0)
    assert all(len(set(row)) == 4 for row in dataset.successors.tolist())
    for index in range(64):
        item = dataset[index]
        assert item["input_ids"].shape == (16,) and item["input_ids"].dtype == torch.int64
        assert torch.equal(item["input_ids"][1:], item["labels"][:-1])
        for state, following in zip(
            item["input_ids"].tolist(), item["labels"].tolist(), strict=True
        ):
            assert following in dataset.successors[state]
    again = LearnableLanguageDataset(num_samples=64, block_size=16, vocab_size=32, seed=5)
    assert np.array_equal(again.successors, dataset.successors)
    assert torch.equal(again[9]["labels"], dataset[9]["labels"])
    other = LearnableLanguageDataset(num_samples=64, block_size=16, vocab_size=32, seed=6)
    assert not np.array_equal(other.successors, dataset.successors)


def test_learnable_dataset_entropy_floor_matches_generated_data() -> None:
    dataset = LearnableLanguageDataset(num_samples=3000, block_size=32, vocab_size=64, seed=11)
    floor = dataset.entropy_floor
    assert 0.5 < floor < math.log(64) - 2  # far below guessing
    log_prob: dict[tuple[int, int], float] = {}
    for state in range(64):
        for successor, prob in zip(
            dataset.successors[state], dataset.successor_probs[state], strict=True
        ):
            log_prob[(state, int(successor))] = math.log(prob)
    pairs: Counter[tuple[int, int]] = Counter()
    for index in range(len(dataset)):
        item = dataset[index]
        pairs.update(zip(item["input_ids"].tolist(), item["labels"].tolist(), strict=True))
    total = sum(pairs.values())
    # Loss of the true predictor on the data (an unbiased estimate of the floor) ...
    true_nll = -sum(count * log_prob[pair] for pair, count in pairs.items()) / total
    assert true_nll == pytest.approx(floor, abs=0.02)
    # ... and the conditional entropy estimated from bigram counts alone.
    from_state: Counter[int] = Counter()
    for (state, _), count in pairs.items():
        from_state[state] += count
    empirical = -sum(
        count * math.log(count / from_state[state]) for (state, _), count in pairs.items()
    )
    assert empirical / total == pytest.approx(floor, abs=0.03)
    # The uniform start makes position 0's floor the plain mean of the state entropies.
    assert dataset.position_entropy[0] == pytest.approx(dataset.state_entropy.mean())


def test_learnable_dataset_is_fast_and_validates_options() -> None:
    start = time.process_time()  # CPU time: a loaded machine's waiting does not count
    dataset = LearnableLanguageDataset(num_samples=256, block_size=32, vocab_size=128, seed=1)
    items = [dataset[i] for i in range(256)]
    assert time.process_time() - start < 1.0
    assert len(items) == 256
    assert LearnableLanguageDataset(4, 4, vocab_size=2).branching == 2
    with pytest.raises(ValueError, match="branching"):
        LearnableLanguageDataset(4, 4, vocab_size=8, branching=9)
    with pytest.raises(ValueError, match="concentration"):
        LearnableLanguageDataset(4, 4, vocab_size=8, concentration=0.0)


# --- text dataset ---------------------------------------------------------------------


def test_text_dataset_26_letters_block_4_gives_5_blocks(tmp_path: Path) -> None:
    dataset = TextFileTokenDataset(write(tmp_path, LETTERS), block_size=4, vocab_size=32)
    items = list(dataset)
    assert len(items) == 5
    assert all(item["input_ids"].shape == (4,) for item in items)
    ids = CharTokenizer(32).encode(LETTERS)
    assert blocks_of(dataset) == expected_blocks(ids, 4)[:5]  # the lone 'z' is dropped


def test_text_dataset_emits_a_short_final_block(tmp_path: Path) -> None:
    dataset = TextFileTokenDataset(write(tmp_path, LETTERS[:13]), block_size=4)
    shapes = [item["input_ids"].shape[0] for item in dataset]
    assert shapes == [4, 4, 2]  # 13 tokens: 5 + 5 + a carry of 3


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 7, 64])
def test_text_dataset_decodes_characters_split_across_chunks(
    tmp_path: Path, chunk_bytes: int
) -> None:
    path = write(tmp_path, MULTIBYTE)
    dataset = TextFileTokenDataset(path, block_size=6, chunk_bytes=chunk_bytes)
    assert blocks_of(dataset) == expected_blocks(list(MULTIBYTE.encode("utf-8")), 6)


def test_text_dataset_cuts_chunks_at_whitespace_for_word_tokenizers(tmp_path: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog " * 5
    path = write(tmp_path, text)

    def word_lengths(piece: str) -> list[int]:  # a tokenizer that never merges across spaces
        return [len(word) for word in re.findall(r"\s*\S+", piece)]

    dataset = TextFileTokenDataset(path, 3, word_lengths, vocab_size=16, chunk_bytes=7)
    assert blocks_of(dataset) == expected_blocks(word_lengths(text), 3)


def test_text_dataset_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        TextFileTokenDataset(missing, block_size=4)
    bad = write(tmp_path, b"abcdef\xffxyz", "bad.txt")
    for chunk in (2, 4, 64):
        with pytest.raises(DataSourceError, match=r"bad\.txt: invalid UTF-8 at byte 6"):
            list(TextFileTokenDataset(bad, block_size=4, chunk_bytes=chunk))
    truncated = write(tmp_path, "abcé".encode()[:-1], "cut.txt")
    with pytest.raises(DataSourceError, match=r"cut\.txt: invalid UTF-8 at byte 3"):
        list(TextFileTokenDataset(truncated, block_size=2, chunk_bytes=2))
    big_ids = write(tmp_path, "hello", "ids.txt")
    with pytest.raises(DataSourceError, match="outside"):
        list(TextFileTokenDataset(big_ids, 2, lambda text: [300] * len(text), vocab_size=256))


def test_text_dataset_workers_yield_disjoint_complete_shards(tmp_path: Path) -> None:
    path = write(tmp_path, LETTERS * 3)
    dataset = TextFileTokenDataset(path, block_size=4, chunk_bytes=8)
    single = blocks_of(dataset)
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    sharded = [(item["input_ids"].tolist(), item["labels"].tolist()) for item in loader]
    assert len(sharded) == len(single) == 16  # 78 bytes: 15 blocks + a short one
    assert sorted(sharded) == sorted(single)
    assert sharded == single  # workers alternate, so DataLoader order is file order


# --- collators and counting -------------------------------------------------------------


def record(length: int, start: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + length)
    return {"input_ids": ids, "labels": ids + 1}


def test_collate_causal_equal_lengths_emit_no_mask() -> None:
    batch = collate_causal([record(4), record(4, 10)])
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (2, 4)


def test_collate_causal_pads_and_masks() -> None:
    batch = collate_causal([record(4), record(2, 10)])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [10, 11, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4, 5], [11, 12, -100, -100]]
    assert batch["attention_mask"].dtype == torch.bool
    assert batch["attention_mask"].tolist() == [[True] * 4, [True, True, False, False]]


def test_collate_causal_one_shorter_labels_and_item_masks() -> None:
    items = [
        {"input_ids": torch.arange(4), "labels": torch.arange(3)},
        {"input_ids": torch.arange(3), "labels": torch.arange(2)},
    ]
    batch = collate_causal(items)
    assert batch["labels"].shape == (2, 3)
    own = [{**record(3), "attention_mask": torch.tensor([1, 1, 0])}, record(3)]
    assert collate_causal(own)["attention_mask"].tolist() == [[True, True, False], [True] * 3]


def test_collate_causal_rejects_bad_records() -> None:
    with pytest.raises(ValueError, match="empty"):
        collate_causal([])
    with pytest.raises(ValueError, match="lacks"):
        collate_causal([{"input_ids": torch.arange(3)}])
    with pytest.raises(ValueError, match="does not handle"):
        collate_causal([{**record(3), "text": "hi"}])
    with pytest.raises(ValueError, match="one shorter"):
        collate_causal([{"input_ids": torch.arange(4), "labels": torch.arange(2)}])


def test_collate_batch_dispatch() -> None:
    pair = collate_batch([(torch.ones(2), torch.zeros(2))] * 2)
    assert isinstance(pair, tuple) and pair[0].shape == (2, 2)
    columns = collate_batch([[torch.ones(2), "a"], [torch.ones(2), "b"]])
    assert isinstance(columns, list) and columns[1] == ["a", "b"]
    ragged = collate_batch([(torch.ones(2),), (torch.ones(3),)])
    assert isinstance(ragged, tuple) and isinstance(ragged[0], list)
    stacked = collate_batch([torch.ones(3), torch.zeros(3)])
    assert isinstance(stacked, torch.Tensor) and stacked.shape == (2, 3)
    assert collate_batch([1, 2]) == [1, 2]
    collated = collate_batch([record(2), record(2)])
    assert isinstance(collated, dict) and set(collated) == {"input_ids", "labels"}
    with pytest.raises(ValueError):
        collate_batch([])
    with pytest.raises(ValueError, match="fields"):
        collate_batch([(1, 2), (1,)])


def test_batch_size_and_tokens() -> None:
    fixed = collate_causal([record(4), record(4)])
    assert batch_size_and_tokens(fixed) == (2, 8)
    padded = collate_causal([record(4), record(2)])
    assert batch_size_and_tokens(padded) == (2, 6)  # CPU mask: the real tokens
    assert batch_size_and_tokens((torch.zeros(3, 5), torch.zeros(3))) == (3, 15)
    assert batch_size_and_tokens({"inputs": torch.zeros(2, 3)}) == (2, 6)
    assert batch_size_and_tokens(torch.zeros(4)) == (4, 4)
    assert batch_size_and_tokens("what") == (1, 1)


# --- samplers and streams -------------------------------------------------------------


def test_resumable_sampler_orders() -> None:
    plain = ResumableSampler(5, shuffle=False, seed=0)
    assert list(plain) == [0, 1, 2, 3, 4]
    shuffled = ResumableSampler(50, shuffle=True, seed=3)
    epoch0 = list(shuffled)
    assert sorted(epoch0) == list(range(50)) and epoch0 != list(range(50))
    assert list(ResumableSampler(50, shuffle=True, seed=3)) == epoch0
    shuffled.set_epoch(1)
    epoch1 = list(shuffled)
    assert epoch1 != epoch0 and sorted(epoch1) == list(range(50))
    shuffled.set_start(20)
    assert list(shuffled) == epoch1[20:] and len(shuffled) == 30
    state = shuffled.state_dict()
    restored = ResumableSampler(50, shuffle=True, seed=3)
    restored.load_state_dict(state)
    assert list(restored) == epoch1[20:]
    shuffled.set_epoch(2)
    assert shuffled.start == 0
    with pytest.raises(ValueError, match="past the end"):
        shuffled.set_start(51)
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(50, shuffle=True, seed=4).load_state_dict(state)


def test_infinite_batches_cycles_and_rejects_empty_sources() -> None:
    stream = infinite_batches([1, 2, 3])
    assert [next(stream) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(RuntimeError, match="data loader produced no batches"):
        next(infinite_batches([]))
    with pytest.raises(RuntimeError, match="data loader produced no batches"):
        next(BatchStream(DataLoader(SyntheticTokenDataset(2, 4, 8), batch_size=3, drop_last=True)))
    one_shot = BatchStream(iter([1, 2]))
    assert [next(one_shot), next(one_shot)] == [1, 2]
    with pytest.raises(RuntimeError, match="one-shot"):
        next(one_shot)


def test_batch_stream_counts_epochs() -> None:
    stream = BatchStream(["a", "b", "c"])
    assert [next(stream) for _ in range(4)] == ["a", "b", "c", "a"]
    assert stream.state_dict() == {"epoch": 1, "batches_in_epoch": 1}


def resume_matches(
    make_stream: Callable[[], BatchStream[object]], consumed: int, more: int
) -> None:
    """After ``consumed`` batches, a fresh stream restored from the saved state yields the
    same next ``more`` batches as an uninterrupted stream."""
    uninterrupted = make_stream()
    expected = [next(uninterrupted) for _ in range(consumed + more)]
    first = make_stream()
    for _ in range(consumed):
        next(first)
    state = first.state_dict()
    resumed = make_stream()
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(more)]
    assert_same_batch(got, expected[consumed:])


def loader_stream(settings: Settings) -> Callable[[], BatchStream[object]]:
    return lambda: BatchStream(build_dataloader(settings))


SHUFFLED = Settings(shuffle=True)  # 10 samples, 3 per batch, drop_last: 3 batches per epoch
LEARNABLE = Settings(synthetic_kind="learnable", shuffle=True, drop_last=False)  # 4 per epoch


@pytest.mark.parametrize("consumed", [0, 2, 3, 4, 8])
@pytest.mark.parametrize(
    "settings", [SHUFFLED, Settings(), LEARNABLE], ids=["shuffled", "synthetic", "learnable"]
)
def test_batch_stream_resumes_map_style_sources_exactly(settings: Settings, consumed: int) -> None:
    resume_matches(loader_stream(settings), consumed, more=7)


@pytest.mark.parametrize("consumed", [0, 3, 5, 6, 11])
def test_batch_stream_resumes_the_text_stream_exactly(tmp_path: Path, consumed: int) -> None:
    path = write(tmp_path, MULTIBYTE)  # 87 bytes, block 4: 17 blocks + a short one
    settings = Settings(text_path=str(path), block_size=4, micro_batch_size=3, drop_last=False)
    assert sum(1 for _ in build_dataloader(settings)) == 6
    resume_matches(loader_stream(settings), consumed, more=8)


def test_batch_stream_resumes_with_worker_processes(tmp_path: Path) -> None:
    text = Settings(text_path=str(write(tmp_path, MULTIBYTE)), block_size=4, num_workers=2)
    resume_matches(loader_stream(text), consumed=7, more=4)
    resume_matches(loader_stream(replace(SHUFFLED, num_workers=2)), consumed=4, more=4)


def test_shuffled_stream_reshuffles_every_epoch() -> None:
    stream = BatchStream(build_dataloader(replace(SHUFFLED, num_tokens=12, drop_last=False)))
    epochs = []
    for _ in range(3):
        batches = _drain(stream, 4)
        rows = torch.cat([b["input_ids"] for b in batches if isinstance(b, dict)])
        epochs.append(rows)
    reference = SyntheticTokenDataset(12, 8, 64, seed=7)
    every_sample = sorted(reference[i]["input_ids"].tolist() for i in range(12))
    assert all(sorted(rows.tolist()) == every_sample for rows in epochs)
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])


def test_batch_stream_resumes_lists_and_rejects_impossible_positions() -> None:
    resume_matches(lambda: BatchStream(list(range(5))), consumed=7, more=6)
    stream = BatchStream(list(range(5)))
    stream.load_state_dict({"epoch": 2, "batches_in_epoch": 6})
    with pytest.raises(ValueError, match="only 5 batches"):
        next(stream)
    one_shot = BatchStream(iter(range(5)))
    with pytest.raises(ValueError, match="one-shot"):
        one_shot.load_state_dict({"epoch": 1, "batches_in_epoch": 0})
    with pytest.raises(ValueError):
        BatchStream([1]).load_state_dict({"epoch": -1, "batches_in_epoch": 0})


class CountingDataset(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, inner: SyntheticTokenDataset) -> None:
        self.inner = inner
        self.loads = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.loads += 1
        return self.inner[index]


def test_resume_through_the_sampler_loads_nothing_twice() -> None:
    dataset = CountingDataset(SyntheticTokenDataset(10, 8, 64))
    stream = BatchStream(build_dataloader(SHUFFLED, dataset=dataset))
    stream.load_state_dict({"epoch": 1, "batches_in_epoch": 2})
    next(stream)
    assert dataset.loads == 3  # one batch of three, nothing skipped by loading
    assert stream.state_dict() == {"epoch": 1, "batches_in_epoch": 3, "samples": 9}


def test_resume_without_automatic_batching_skips_single_samples() -> None:
    def make() -> BatchStream[object]:
        sampler = ResumableSampler(5, shuffle=True, seed=2)
        return BatchStream(
            DataLoader(SyntheticTokenDataset(5, 4, 8), batch_size=None, sampler=sampler)
        )

    resume_matches(make, consumed=7, more=5)


def test_stream_leaves_the_global_rng_alone() -> None:
    loader = DataLoader(SyntheticTokenDataset(6, 4, 8), batch_size=2)  # no generator
    stream = BatchStream(loader)
    torch.manual_seed(0)
    random.seed(0)
    before = (torch.get_rng_state(), random.random())
    random.seed(0)
    for _ in range(5):  # crosses an epoch: a new iterator draws a base seed
        next(stream)
    stream.load_state_dict({"epoch": 1, "batches_in_epoch": 2})
    next(stream)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.random() == before[1]


# --- build_dataloader and the registry ------------------------------------------------


def test_build_dataloader_arguments() -> None:
    loader = build_dataloader(Settings(shuffle=True, drop_last=False), pin_memory_device=False)
    assert loader.batch_size == 3 and loader.drop_last is False
    assert isinstance(loader.sampler, ResumableSampler) and loader.sampler.shuffle
    assert loader.sampler.seed == 7
    assert loader.collate_fn is collate_batch
    assert loader.num_workers == 0 and not loader.persistent_workers
    assert loader.prefetch_factor is None
    assert isinstance(loader.dataset, SyntheticTokenDataset)
    assert len(loader.dataset) == 10 and loader.dataset.vocab_size == 64
    batch = next(iter(loader))
    assert isinstance(batch, dict) and set(batch) == {"input_ids", "labels"}  # no mask
    workers = build_dataloader(Settings(num_workers=2, prefetch_factor=None, pin_memory=True))
    assert workers.persistent_workers and workers.prefetch_factor == 2 and workers.pin_memory
    unpinned = build_dataloader(Settings(pin_memory=None), pin_memory_device=True)
    assert unpinned.pin_memory


def test_build_dataloader_source_order(tmp_path: Path) -> None:
    text = str(write(tmp_path, LETTERS))
    explicit = SyntheticTokenDataset(4, 8, 16)
    everything = Settings(text_path=text, dataset="learnable", synthetic=True)
    assert build_dataloader(everything, dataset=explicit).dataset is explicit
    from_text = build_dataloader(everything, vocab_size=32).dataset
    assert isinstance(from_text, TextFileTokenDataset) and from_text.vocab_size == 32
    named = build_dataloader(replace(everything, text_path=None)).dataset
    assert isinstance(named, LearnableLanguageDataset) and named.vocab_size == 64
    live = build_dataloader(replace(everything, text_path=None, dataset=explicit)).dataset
    assert live is explicit
    learnable = build_dataloader(Settings(synthetic_kind="learnable"), vocab_size=16).dataset
    assert isinstance(learnable, LearnableLanguageDataset) and learnable.vocab_size == 16
    with pytest.raises(DataSourceError, match="no data source"):
        build_dataloader(Settings(synthetic=False))
    with pytest.raises(DataSourceError, match="synthetic_kind"):
        build_dataloader(Settings(synthetic_kind="zipf"))


def test_iterable_datasets_get_no_sampler_and_warn_about_shuffle(tmp_path: Path) -> None:
    settings = Settings(text_path=str(write(tmp_path, LETTERS)), block_size=4, shuffle=True)
    with pytest.warns(UserWarning, match="shuffle is ignored"):
        loader = build_dataloader(settings)
    assert not isinstance(loader.sampler, ResumableSampler)


def test_pickled_dataset_files_are_refused(tmp_path: Path) -> None:
    torch.save(SyntheticTokenDataset(2, 2, 2), tmp_path / "data.pt")
    for name in (str(tmp_path / "data.pt"), "data.pkl", "some/dir/data"):
        with pytest.raises(DataSourceError, match="refused"):
            build_dataloader(Settings(dataset=name))
    with pytest.raises(DataSourceError, match="unknown dataset 'nope'.*learnable"):
        build_dataloader(Settings(dataset="nope"))


def test_register_dataset_and_builtin_factories(tmp_path: Path) -> None:
    seen: list[DatasetRequest] = []

    @register_dataset("test-constant")
    def constant(request: DatasetRequest) -> Dataset[object]:
        seen.append(request)
        return SyntheticTokenDataset(request.num_samples, request.block_size, 8, request.seed)

    settings = Settings(dataset="test-constant", dataset_options={"flavour": "x"})
    loader = build_dataloader(settings)
    assert "test-constant" in dataset_registry.names()
    assert seen == [DatasetRequest(8, 64, 7, 10, {"flavour": "x"})]
    assert isinstance(loader.dataset, SyntheticTokenDataset)
    text = dataset_registry.get("text")(
        DatasetRequest(4, 32, 0, 1, {"path": write(tmp_path, "ab")})
    )
    assert isinstance(text, TextFileTokenDataset)
    with pytest.raises(DataSourceError, match="options.path"):
        dataset_registry.get("text")(DatasetRequest(4, 32, 0, 1))
    with pytest.raises(DataSourceError, match="unknown option"):
        dataset_registry.get("synthetic")(DatasetRequest(4, 32, 0, 1, {"branching": 2}))
    learnable = dataset_registry.get("learnable")(
        DatasetRequest(4, 32, 0, 1, {"branching": 2, "concentration": 0.5})
    )
    assert isinstance(learnable, LearnableLanguageDataset) and learnable.branching == 2


def _drain(stream: Iterator[object], count: int) -> list[object]:
    return [next(stream) for _ in range(count)]


def test_learnable_data_trains_the_reference_model_toward_its_floor() -> None:
    from speedtronic.models.transformer import ReferenceTransformer

    torch.manual_seed(0)
    settings = Settings(
        synthetic_kind="learnable",
        num_tokens=256,
        vocab_size=16,
        block_size=16,
        micro_batch_size=16,
        shuffle=True,
    )
    loader = build_dataloader(settings)
    assert isinstance(loader.dataset, LearnableLanguageDataset)
    floor = loader.dataset.entropy_floor
    model = ReferenceTransformer(vocab_size=16, block_size=16, n_layer=1, n_head=2, d_model=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _drain(BatchStream(loader), 150):
        assert isinstance(batch, dict)
        loss = model(**batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > math.log(16) - 0.5
    assert sum(losses[-20:]) / 20 < floor + 0.15


def test_batch_stream_sets_the_epoch_of_epoch_aware_samplers() -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    data = list(range(12))

    def loader() -> DataLoader[int]:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
        return DataLoader(data, batch_size=4, sampler=sampler)

    straight = BatchStream(loader())
    expected = [next(straight).tolist() for _ in range(8)]  # crosses two epoch boundaries
    assert expected[0:3] != expected[3:6]  # the order changes with the epoch
    partial = BatchStream(loader())
    for _ in range(4):
        next(partial)
    resumed = BatchStream(loader())
    resumed.load_state_dict(partial.state_dict())
    assert [next(resumed).tolist() for _ in range(4)] == expected[4:]
