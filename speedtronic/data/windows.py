"""Training samples from token shards (``data.tokens``): windows read through ``np.memmap``,
in a seeded order that is sharded by rank and resumes mid-shard.

Windows. A sample is a window of ``block_size + 1`` consecutive tokens of one shard
(``input_ids`` its first ``block_size``, ``labels`` its last). Window ``i`` of a shard starts
at token ``i * block_size``: consecutive windows share one token, so every next-token pair of
a shard is a training target exactly once per epoch (nanoGPT's stride), except the last
``(n - 1) % block_size`` pairs of a shard of ``n`` tokens. Windows never span two shards;
documents may span windows (an end-of-document id separates them).

Order. ``WindowSampler`` is a ``ResumableSampler``: epoch ``e`` visits the windows in the
order of a keyed bijection of ``[0, n)`` seeded by ``(data.seed, e)`` -- a Feistel network
with cycle walking, computed in NumPy blocks -- so the order of any corpus takes O(1)
memory (no permutation array) and position ``k`` of the order costs the same as position 0.
Ranks take strided positions of the same order (as ``ResumableSampler`` does), so together
they read every window once per epoch, and a resumed run starts at the exact window.

Reading. ``TokenWindowDataset.__getitems__`` returns a ``TokenWindows`` (a lazy sequence of
records); its own collate (``collate_windows``, what ``data.collate: auto`` picks) copies each
of the batch's windows (``block_size + 1`` tokens) out of the memmaps into one array of the
shard dtype and converts it to the two ``int64`` arrays in one step each, no per-item tensors.
Another ``data.collate`` gets ordinary ``{input_ids, labels}`` records.

Memory. Pages of a memory-mapped file count in the process's RSS once touched (and on
kernels with large folios one touch maps up to 2 MiB), so reading a shuffled epoch would
grow RSS towards the corpus size although nothing is copied. The dataset therefore counts
the ``FAULT_BYTES`` blocks of the files its reads touched (a page-cache folio never spans
two of them) and, before the count would pass ``resident_bytes``, unmaps what it touched
(``madvise(MADV_DONTNEED)``; the maps stay open): RSS stays within about ``resident_bytes``
whatever the corpus size, and a split smaller than that (a held-out set) stays mapped
and is never faulted in twice. The pages stay in the kernel's page cache; only this
process's mapping of them goes. At most ``MAX_OPEN_MAPS`` shards are mapped at a time.
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from speedtronic.data.collate import collate_batch
from speedtronic.data.shards import (
    ManifestError,
    ShardEntry,
    ShardError,
    Split,
    TokenManifest,
    check_tokenizer,
    check_vocab_fits,
    read_manifest,
    verify_shards,
)
from speedtronic.data.stream import ResumableSampler, _epoch_seed
from speedtronic.data.text import DataSourceError, TextPart

__all__ = [
    "FAULT_BYTES",
    "Permutation",
    "TokenWindowDataset",
    "TokenWindows",
    "WindowSampler",
    "WindowSource",
    "collate_windows",
    "open_token_dataset",
    "source_manifest",
]

FEISTEL_ROUNDS = 6
ORDER_BLOCK = 8192
"""Positions of the order computed per NumPy call."""
FAULT_BYTES = 2 << 20
"""What one window may map at most beyond its own bytes (a 2 MiB large folio)."""
DEFAULT_RESIDENT_BYTES = 32 << 20
MAX_OPEN_MAPS = 64

_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_UINT64 = (1 << 64) - 1


def _mix(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser, element-wise (uint64 arithmetic wraps)."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(_M1)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(_M2)
    return values ^ (values >> np.uint64(31))


class Permutation:
    """A keyed bijection of ``[0, n)``: a balanced Feistel network on the smallest even
    number of bits that covers ``n``, with cycle walking (re-encrypt until the value is
    below ``n``; the domain is under ``4 n``, so a few rounds on average)."""

    def __init__(self, n: int, key: int) -> None:
        self.n = n
        self.key = key
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        keys = [_epoch_seed(key, round_) for round_ in range(FEISTEL_ROUNDS)]
        self._keys = [np.uint64(k & _UINT64) for k in keys]

    def _encrypt(self, values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        left, right = values >> self._half, values & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        if self.n <= 1:
            return positions.copy()
        values = self._encrypt(positions.astype(np.uint64))
        outside = values >= np.uint64(self.n)
        while outside.any():
            values[outside] = self._encrypt(values[outside])
            outside = values >= np.uint64(self.n)
        return values.astype(np.int64)


class WindowSampler(ResumableSampler):
    """``ResumableSampler``'s contract (epochs, ``set_start``, rank striding with
    wrap-around padding, state) over ``n`` windows, without materialising the order: the
    order of epoch ``e`` is ``Permutation(n, (seed, e))`` (the identity without
    ``shuffle``). Subclasses map order positions to dataset indices (``_indices``)."""

    def _order_positions(self, stop: int | None = None) -> npt.NDArray[np.int64]:
        """This rank's global positions ``0 .. stop`` of the (padded) epoch order."""
        count = self.num_samples if stop is None else stop
        positions = self.rank + self.world_size * np.arange(count, dtype=np.int64)
        return positions % max(1, self.dataset_len)

    def _indices(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The dataset indices at global positions of the current epoch's order."""
        if not self.shuffle:
            return positions
        return self._permutation(self.dataset_len, _epoch_seed(self.seed, self.epoch))(positions)

    def _permutation(self, n: int, key: int) -> Permutation:
        """``Permutation(n, key)``, the last one kept (one epoch asks for the same one for
        every block)."""
        cached = self.__dict__.get("_cached")
        if isinstance(cached, Permutation) and (cached.n, cached.key) == (n, key):
            return cached
        permutation = Permutation(n, key)
        self.__dict__["_cached"] = permutation
        return permutation

    def global_order(self) -> list[int]:
        if self.dataset_len == 0:
            return []
        indices: list[int] = self._indices(np.arange(self.dataset_len, dtype=np.int64)).tolist()
        return indices

    def order(self) -> list[int]:
        if self.dataset_len == 0:
            return []
        indices: list[int] = self._indices(self._order_positions()).tolist()
        return indices

    def __iter__(self) -> Iterator[int]:
        if self.dataset_len == 0:
            return
        for begin in range(self.start, self.num_samples, ORDER_BLOCK):
            end = min(begin + ORDER_BLOCK, self.num_samples)
            positions = self.rank + self.world_size * np.arange(begin, end, dtype=np.int64)
            yield from self._indices(positions % self.dataset_len).tolist()


_ShardMap = np.memmap[tuple[int], np.dtype[np.unsignedinteger]]


class _Maps:
    """Read-only memmaps of a set of shards (module docstring, "Memory"): opened lazily, at
    most ``MAX_OPEN_MAPS`` at a time (each holds a file descriptor; the earliest opened is
    closed), read through plain ``ndarray`` views (a slice of an ``np.memmap`` object
    costs several times more). What the reads can have mapped is counted in ``FAULT_BYTES``
    blocks of the files (each block once until the next release); when that reaches
    ``resident_bytes`` the touched maps are unmapped from this process's memory --
    ``madvise(MADV_DONTNEED)`` where the platform has it (the maps stay open), else the maps
    are closed and reopened on the next read."""

    def __init__(
        self,
        paths: Sequence[Path],
        lengths: Sequence[int],
        dtype: np.dtype[np.unsignedinteger],
        resident_bytes: int,
    ) -> None:
        self.paths = list(paths)
        self.lengths = list(lengths)
        self.dtype = dtype
        self.resident_bytes = resident_bytes
        self._maps: dict[int, _ShardMap] = {}  # in the order they were opened
        self._views: dict[int, npt.NDArray[np.unsignedinteger]] = {}
        self._blocks: set[tuple[int, int]] = set()  # (shard, block) read since the release
        self._touched: set[int] = set()  # shards read since the last release

    def get(self, shard: int) -> npt.NDArray[np.unsignedinteger]:
        view = self._views.get(shard)
        if view is not None:
            return view
        if len(self._maps) >= MAX_OPEN_MAPS:
            oldest = next(iter(self._maps))
            del self._maps[oldest], self._views[oldest]
        mapped: _ShardMap = np.memmap(
            self.paths[shard], dtype=self.dtype, mode="r", shape=(self.lengths[shard],)
        )
        self._maps[shard] = mapped
        view = self._views[shard] = mapped.view(np.ndarray)
        return view

    def read(
        self,
        shards: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        out: npt.NDArray[np.unsignedinteger],
    ) -> None:
        """Copy the ``out.shape[1]`` tokens at ``offsets[i]`` of shard ``shards[i]`` into
        ``out[i]``, releasing what is mapped whenever the blocks read reach the budget."""
        span = out.shape[1]
        itemsize = self.dtype.itemsize
        limit = max(1, self.resident_bytes // FAULT_BYTES)  # blocks mapped at most
        blocks, touched, views = self._blocks, self._touched, self._views  # release clears them
        for row, (shard, offset) in enumerate(zip(shards.tolist(), offsets.tolist(), strict=True)):
            first = offset * itemsize // FAULT_BYTES
            last = ((offset + span) * itemsize - 1) // FAULT_BYTES
            if first == last:  # the usual case: a window within one block
                key = (shard, first)
                if key not in blocks:
                    if len(blocks) >= limit:
                        self.release()
                    blocks.add(key)
            else:
                new = {(shard, block) for block in range(first, last + 1)} - blocks
                if len(blocks) + len(new) > limit:
                    self.release()
                    new = {(shard, block) for block in range(first, last + 1)}
                blocks |= new
            touched.add(shard)
            view = views.get(shard)
            if view is None:
                view = self.get(shard)
            out[row] = view[offset : offset + span]

    def release(self) -> None:
        """Unmap what this process touched; the maps stay usable."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        for shard in self._touched & set(self._maps):
            raw = getattr(self._maps[shard], "_mmap", None)  # numpy's mmap.mmap behind it
            if advice is not None and isinstance(raw, mmap.mmap):
                raw.madvise(advice)
            else:
                del self._maps[shard], self._views[shard]
        self._touched.clear()
        self._blocks.clear()

    @property
    def open_maps(self) -> int:
        return len(self._maps)


class WindowSource(Dataset[dict[str, torch.Tensor]], ABC):
    """A dataset of windows that reads a whole batch at once: ``__getitems__`` gives a
    ``TokenWindows``, which its ``collate_fn`` (``collate_windows``) reads with one
    ``gather``. Items are ``{"input_ids", "labels"}`` (``int64``, ``block_size`` each)."""

    default_shuffle = True
    """``data.shuffle: null`` shuffles windows."""

    @abstractmethod
    def gather(
        self, indices: Sequence[int] | npt.NDArray[np.int64]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of ``indices``: two ``[len, block_size]`` int64 tensors."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        inputs, labels = self.gather([index])
        return {"input_ids": inputs[0], "labels": labels[0]}

    def __getitems__(self, indices: Sequence[int]) -> TokenWindows:
        return TokenWindows(self, indices)

    @staticmethod
    def collate_fn(batch: Sequence[object]) -> object:
        return collate_windows(batch)


class TokenWindowDataset(WindowSource):
    """The windows of some shards of a shard directory (module docstring): map-style,
    ``len`` windows (a negative index counts from the end). ``make_sampler`` builds its
    ``WindowSampler``."""

    def __init__(
        self,
        directory: str | Path,
        manifest: TokenManifest,
        shards: Sequence[ShardEntry],
        block_size: int,
        *,
        resident_bytes: int = DEFAULT_RESIDENT_BYTES,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.directory = Path(directory)
        self.manifest = manifest
        self.shards = tuple(shards)
        self.block_size = block_size
        self.tokens = sum(shard.tokens for shard in self.shards)
        counts = [max(0, (shard.tokens - 1) // block_size) for shard in self.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self._resident_bytes = resident_bytes
        self._maps = self._new_maps()

    def _new_maps(self) -> _Maps:
        return _Maps(
            [self.directory / shard.file for shard in self.shards],
            [shard.tokens for shard in self.shards],
            self.manifest.numpy_dtype,
            self._resident_bytes,
        )

    def __getstate__(self) -> dict[str, object]:
        # A worker started by spawn gets its own maps; a pickled memmap would be a copy.
        state = dict(self.__dict__)
        state["_maps"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._maps = self._new_maps()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return super().__getitem__(index + len(self) if index < 0 else index)

    def make_sampler(
        self, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1
    ) -> WindowSampler:
        """The training order of these windows (module docstring)."""
        return WindowSampler(
            len(self), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size
        )

    def gather(
        self, indices: Sequence[int] | npt.NDArray[np.int64]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of the windows ``indices``: two ``[len, block_size]``
        ``int64`` tensors, copied straight out of the memmaps."""
        wanted = np.asarray(indices, dtype=np.int64)
        if wanted.size and (wanted.view(np.uint64) >= len(self)).any():  # negatives wrap
            bad = int(wanted.min()) if wanted.min() < 0 else int(wanted.max())
            raise IndexError(f"window {bad} out of range for {len(self)} windows")
        shards = np.searchsorted(self._starts, wanted, side="right") - 1
        offsets = (wanted - self._starts[shards]) * self.block_size
        # One copy of each window's block_size + 1 tokens, then one conversion per tensor.
        windows = np.empty((wanted.size, self.block_size + 1), dtype=self.manifest.numpy_dtype)
        self._maps.read(shards, offsets, windows)
        inputs = windows[:, :-1].astype(np.int64, order="C")
        labels = windows[:, 1:].astype(np.int64, order="C")
        return torch.from_numpy(inputs), torch.from_numpy(labels)


class TokenWindows(Sequence[dict[str, torch.Tensor]]):
    """The windows of one batch, not yet read: ``collate_windows`` reads them all at once;
    any other collate indexes it and gets ``{input_ids, labels}`` records."""

    def __init__(self, dataset: WindowSource, indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[dict[str, torch.Tensor]]: ...
    def __getitem__(
        self, index: int | slice
    ) -> dict[str, torch.Tensor] | Sequence[dict[str, torch.Tensor]]:
        if isinstance(index, slice):
            return TokenWindows(self.dataset, self.indices[index])
        return self.dataset[self.indices[index]]

    def batch(self) -> dict[str, torch.Tensor]:
        inputs, labels = self.dataset.gather(self.indices)
        return {"input_ids": inputs, "labels": labels}


def collate_windows(batch: Sequence[object]) -> object:
    """A ``TokenWindows`` -> ``{input_ids, labels}`` of shape ``[batch, block_size]``;
    anything else (records of another source) goes to ``collate_batch``."""
    if isinstance(batch, TokenWindows):
        return batch.batch()
    return collate_batch(batch)


def source_manifest(directory: str | Path, key: str) -> TokenManifest:
    """The manifest of the shard directory that config key ``key`` names (its errors
    prefixed with the key)."""
    try:
        return read_manifest(directory)
    except ManifestError as exc:
        raise ManifestError(f"{key}: {exc}") from None


def open_token_dataset(
    directory: str | Path,
    *,
    block_size: int,
    part: TextPart = "all",
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    verify: bool = True,
    key: str = "data.tokens",
) -> TokenWindowDataset:
    """The windows of a shard directory: its training shards (``part`` ``"all"`` or
    ``"train"``: training never reads the held-out shards) or its held-out shards
    (``"held_out"``). Checks first, each a ``DataSourceError`` naming ``key``: the manifest,
    that its vocabulary fits ``vocab_size`` (the model's), that ``tokenizer`` (when given)
    made the shards, and the shards' sizes and, with ``verify``, sha256."""
    manifest = source_manifest(directory, key)
    where = f"{key}: {directory}"
    if vocab_size is not None:
        check_vocab_fits(manifest.vocab_size, vocab_size, source=where)
    if tokenizer is not None:
        check_tokenizer(manifest, directory, tokenizer)
    split: Split = "eval" if part == "held_out" else "train"
    shards = manifest.split(split)
    if not shards:
        raise DataSourceError(
            f"{where} has no held-out shards (prepared with --eval-fraction 0): prepare with "
            "--eval-fraction, or name a held-out source with eval.text_path or eval.dataset"
            if split == "eval"
            else f"{where} has no training shards"
        )
    try:
        verify_shards(directory, manifest, shards, checksums=verify)
    except ShardError as exc:
        raise ShardError(f"{key}: {exc}") from None
    dataset = TokenWindowDataset(directory, manifest, shards, block_size)
    if len(dataset) == 0:
        what = "held-out" if split == "eval" else "training"
        raise DataSourceError(
            f"{where}: its {what} shards hold {dataset.tokens} tokens, not one window of "
            f"block_size + 1 = {block_size + 1} tokens"
        )
    return dataset
