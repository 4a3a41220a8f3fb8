"""``TokenWindowDataset.gather`` against a plain NumPy reading of the shard files: every
window in any order and any index form, shards of equal and of unequal sizes, windows across
a block boundary, the blocks counted and released exactly as window-by-window reading would,
and ``FastLoader``'s direct batch read giving torch's batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from speedtronic.data.fast_loader import FastLoader
from speedtronic.data.shards import ShardEntry, TokenizerRecord, TokenManifest
from speedtronic.data.tokenizer import BYTE_TOKENIZER_SHA256
from speedtronic.data.windows import DEFAULT_RESIDENT_BYTES, FAULT_BYTES, TokenWindowDataset

BLOCK = 1024


def shard_set(directory: Path, sizes: list[int], *, seed: int = 0) -> list[np.ndarray]:
    """Random ``uint16`` shards of ``sizes`` tokens in ``directory`` (with no manifest:
    ``dataset`` builds one)."""
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 65_535, size, dtype=np.uint16) for size in sizes]
    for index, shard in enumerate(tokens):
        shard.tofile(directory / f"train-{index:05d}.bin")
    return tokens


def dataset(
    directory: Path,
    tokens: list[np.ndarray],
    block: int = BLOCK,
    resident_bytes: int = DEFAULT_RESIDENT_BYTES,
) -> TokenWindowDataset:
    entries = tuple(
        ShardEntry(f"train-{index:05d}.bin", "train", shard.size, "0" * 64)
        for index, shard in enumerate(tokens)
    )
    # dtype, vocabulary, end-of-document id, tokenizer, documents, held-out fraction,
    # tokens per shard, shards
    tokenizer = TokenizerRecord("bytes", BYTE_TOKENIZER_SHA256, None)
    longest = max(shard.size for shard in tokens)
    manifest = TokenManifest("uint16", 65_536, 0, tokenizer, 1, 0.0, longest, entries)
    return TokenWindowDataset(directory, manifest, entries, block, resident_bytes=resident_bytes)


def expected(tokens: list[np.ndarray], indices: list[int], block: int = BLOCK) -> np.ndarray:
    """``[len, block + 1]`` int64: each window read from the shard arrays."""
    counts = [(shard.size - 1) // block for shard in tokens]
    starts = np.concatenate([[0], np.cumsum(counts)])
    rows = []
    for index in indices:
        shard = int(np.searchsorted(starts, index, side="right")) - 1
        at = (index - int(starts[shard])) * block
        rows.append(tokens[shard][at : at + block + 1].astype(np.int64))
    return np.stack(rows) if rows else np.empty((0, block + 1), dtype=np.int64)


@pytest.mark.parametrize(
    "sizes",
    [
        [5 * BLOCK + 1] * 3 + [2 * BLOCK + 7],  # equal shards, a shorter last: shard = i // per
        [2 * BLOCK + 1, 7 * BLOCK + 3, 10, 3 * BLOCK + 1],  # unequal, one with no window
    ],
)
def test_gather_reads_every_window_as_numpy_does_in_any_index_form(
    tmp_path: Path, sizes: list[int]
) -> None:
    tokens = shard_set(tmp_path, sizes)
    data = dataset(tmp_path, tokens)
    assert data._per_shard == (5 if sizes[0] == sizes[1] else 0)
    order = np.random.default_rng(1).permutation(len(data)).tolist()
    for begin in range(0, len(order), 3):
        chosen = order[begin : begin + 3]
        want = torch.from_numpy(expected(tokens, chosen))
        for form in (chosen, np.array(chosen), torch.tensor(chosen), tuple(chosen)):
            inputs, labels = data.gather(form)  # type: ignore[arg-type]
            assert torch.equal(inputs, want[:, :-1]) and torch.equal(labels, want[:, 1:])
            assert inputs.dtype == labels.dtype == torch.int64
            assert inputs.is_contiguous() and labels.is_contiguous()
    inputs, labels = data.gather([])
    assert inputs.shape == labels.shape == (0, BLOCK)
    for bad in (-1, len(data)):
        with pytest.raises(IndexError, match=f"window {bad} out of range"):
            data.gather([0, bad])


def test_labels_are_their_own_memory(tmp_path: Path) -> None:
    """Loss masks write the labels in place: that must not touch the inputs."""
    tokens = shard_set(tmp_path, [4 * BLOCK + 1])
    inputs, labels = dataset(tmp_path, tokens).gather([2, 0])
    before = inputs.clone()
    labels.fill_(-100)
    assert torch.equal(inputs, before)


def test_blocks_are_counted_and_released_as_window_by_window_reading_would(
    tmp_path: Path,
) -> None:
    """2 MiB blocks, uint16: 1024 windows of 1024 tokens start in each block, and the last
    window of a block ends in the next one. A budget of two blocks."""
    per_block = FAULT_BYTES // 2 // BLOCK
    tokens = shard_set(tmp_path, [4 * per_block * BLOCK + 1, 4 * per_block * BLOCK + 1])
    data = dataset(tmp_path, tokens, resident_bytes=2 * FAULT_BYTES)
    maps = data._maps
    released: list[set[tuple[int, int]]] = []
    original = maps.release

    def release() -> None:
        released.append(set(maps._blocks))
        original()

    maps.release = release  # type: ignore[method-assign]

    def read(indices: list[int]) -> None:
        inputs, labels = data.gather(indices)
        want = torch.from_numpy(expected(tokens, indices))
        assert torch.equal(inputs, want[:, :-1]) and torch.equal(labels, want[:, 1:])

    read([3, 5])  # block 0 of shard 0
    assert maps._blocks == {(0, 0)} and released == []
    read([per_block - 1])  # across blocks 0 and 1
    assert maps._blocks == {(0, 0), (0, 1)} and released == []
    read([7, per_block + 2, 4])  # nothing new: one copy of all three
    assert maps._blocks == {(0, 0), (0, 1)} and released == []
    # shard 1's block 0 would be a third block: released before it is read, mid-batch
    second = 4 * per_block  # shard 1's first window
    read([1, second + 9, second + 10, per_block + 3])
    assert released == [{(0, 0), (0, 1)}]
    assert maps._blocks == {(1, 0), (0, 1)}
    read([2 * per_block - 1])  # spans blocks 1 and 2 of shard 0: block 2 is new
    assert released[1:] == [{(1, 0), (0, 1)}] and maps._blocks == {(0, 1), (0, 2)}


def test_fast_loader_reads_window_batches_directly_with_torchs_batches(tmp_path: Path) -> None:
    tokens = shard_set(tmp_path, [40 * 16 + 1, 23 * 16 + 1])
    data = dataset(tmp_path, tokens, block=16)
    sampler = data.make_sampler(shuffle=True, seed=4)
    ours = FastLoader(data, batch_size=5, sampler=sampler, collate_fn=data.collate_fn)
    theirs = DataLoader(data, batch_size=5, sampler=sampler, collate_fn=data.collate_fn)
    iterator = iter(ours)
    assert iterator._read is not None  # type: ignore[attr-defined]
    batches = list(iterator)
    assert len(batches) == len(list(theirs)) == 13  # 63 windows, the last batch of 3
    for mine, torchs in zip(batches, theirs, strict=True):
        assert isinstance(mine, dict) and mine.keys() == torchs.keys() == {"input_ids", "labels"}
        for key in mine:
            assert torch.equal(mine[key], torchs[key])

    class OwnItems(TokenWindowDataset):
        def __getitems__(self, indices):  # type: ignore[no-untyped-def]
            return super().__getitems__(indices)

    other = OwnItems(data.directory, data.manifest, data.shards, 16)
    for loader in (
        FastLoader(data, batch_size=5, collate_fn=lambda batch: batch),  # another collate
        FastLoader(data, batch_size=None),  # no batching
        FastLoader(other, batch_size=5, collate_fn=other.collate_fn),  # its own __getitems__
    ):
        assert iter(loader)._read is None  # type: ignore[attr-defined]
