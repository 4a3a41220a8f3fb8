"""Training samples from token shards (``data.tokens``): windows read through ``np.memmap``,
in a seeded order that is sharded by rank and resumes mid-shard.

Windows. A sample is a window of ``block_size + 1`` consecutive tokens of one shard
(``input_ids`` its first ``block_size``, ``labels`` its last). Window ``i`` of a shard starts
at token ``i * block_size``: consecutive windows share one token, so every next-token pair of
a shard is a training target exactly once per epoch (nanoGPT's stride), except the last
``(n - 1) % block_size`` pairs of a shard of ``n`` tokens. Windows never span two shards;
documents may span windows (an end-of-document id separates them). With ``document_mask``
(``data.document_mask``) the records also carry ``position_ids`` that restart after each
end-of-document id (``speedtronic.data.documents``): the models attend within documents.

Order. ``WindowSampler`` (``speedtronic.data.window_order``) visits the windows of epoch
``e`` in a seeded order that keeps the reads local (chunks of one ``FAULT_BYTES`` block of
tokens, dealt in working sets sized by ``locality`` to what the dataset keeps mapped),
in O(1) memory, each rank taking its stride of the same global order, and a resumed run
starts at the exact window.

Reading. ``TokenWindowDataset.__getitems__`` returns a ``_TokenWindows`` (a lazy sequence of
records); its own collate (``_collate_windows``, what ``data.collate: auto`` picks) copies the
batch's windows (``block_size + 1`` tokens each) out of the memmaps into one ``bytes`` (one
``join`` of their ``memoryview`` slices) and converts it to the two contiguous ``int64``
arrays in one step, no per-item tensors (``FastLoader`` calls the same read directly).
Another ``data.collate`` gets ordinary ``{input_ids, labels}`` records.

Memory. Pages of a memory-mapped file count in the process's RSS once touched (and on
kernels with large folios one touch maps up to 2 MiB), so reading a shuffled epoch would
grow RSS towards the corpus size although nothing is copied. The dataset therefore counts
the ``FAULT_BYTES`` blocks of the files its reads touched (a page-cache folio never spans
two of them) and, before the count would pass ``resident_bytes``, unmaps those blocks
(``madvise(MADV_DONTNEED)`` of each; the maps stay open): RSS stays within about
``resident_bytes`` whatever the corpus size and whatever the order, and a split smaller
than that (a held-out set) stays mapped and is never faulted in twice. With the sampler's
order the release falls where one working set ends and the next begins. The pages stay in
the kernel's page cache; only this process's mapping of them goes. At most
``MAX_OPEN_MAPS`` shards are mapped at a time.
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path
from typing import overload

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from speedtronic.data.collate import IGNORE_INDEX, collate_batch
from speedtronic.data.documents import document_positions
from speedtronic.data.loss_masks import read_loss_masks
from speedtronic.data.shard_lock import ShardsInUse, ShardsInUseError
from speedtronic.data.shards import (
    MANIFEST_NAME,
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
from speedtronic.data.text import DataSourceError, TextPart
from speedtronic.data.window_order import (  # the order's names, here where they were first
    ChunkedPermutation,
    Permutation,
    WindowSampler,
)

__all__ = [
    "FAULT_BYTES",
    "ChunkedPermutation",
    "Permutation",
    "TokenWindowDataset",
    "WindowSampler",
    "WindowSource",
    "locality",
    "open_token_dataset",
    "source_manifest",
]

FAULT_BYTES = 2 << 20
"""What one window may map at most beyond its own bytes (a 2 MiB large folio)."""
_BLOCK_SHIFT = FAULT_BYTES.bit_length() - 1  # byte offset >> _BLOCK_SHIFT: its block
_SHARD_SHIFT = 32
"""A block's key: ``shard << _SHARD_SHIFT | block`` (an int hashes faster than a pair)."""
_BLOCK_MASK = (1 << _SHARD_SHIFT) - 1
_ARRAYS = (np.ndarray, torch.Tensor)
DEFAULT_RESIDENT_BYTES = 32 << 20
MAX_OPEN_MAPS = 64


def locality(block_size: int, itemsize: int, resident_bytes: int) -> tuple[int, int]:
    """``(chunk, group)`` of the shuffled order over windows of ``block_size + 1`` tokens of
    ``itemsize`` bytes: a chunk is the windows that start in one ``FAULT_BYTES`` block of
    tokens (one window if a window is longer), and a working set is as many chunks as fit in
    ``resident_bytes`` counting every block that a chunk's windows can touch."""
    stride = block_size * itemsize  # bytes from one window's start to the next's
    chunk = max(1, FAULT_BYTES // stride)
    span = chunk * stride + itemsize  # the chunk's bytes, the last window's extra token too
    # A chunk starts at a multiple of ``stride`` in its shard: at most ``FAULT_BYTES - step``
    # into a block, so it touches at most this many blocks.
    step = math.gcd(stride, FAULT_BYTES)
    blocks = (FAULT_BYTES - step + span - 1) // FAULT_BYTES + 1
    return chunk, max(1, resident_bytes // FAULT_BYTES // blocks)


_ShardMap = np.memmap[tuple[int], np.dtype[np.unsignedinteger]]


class _Maps:
    """Read-only memmaps of a set of shards (module docstring, "Memory"): opened lazily, at
    most ``MAX_OPEN_MAPS`` at a time (each holds a file descriptor; the earliest opened is
    closed), read through ``memoryview`` slices of their bytes (a slice of an ``ndarray``
    costs several times more, of an ``np.memmap`` object more again). What the reads can
    have mapped is counted in ``FAULT_BYTES`` blocks of the files (each block once until the
    next release); when that reaches ``resident_bytes`` those blocks are unmapped from this
    process's memory -- ``madvise(MADV_DONTNEED)`` of each block where the platform has it
    (the maps stay open), else their maps are closed and reopened on the next read."""

    def __init__(
        self,
        paths: Sequence[Path],
        lengths: Sequence[int],
        dtype: np.dtype[np.unsignedinteger],
        resident_bytes: int,
    ) -> None:
        self.paths = paths  # a lazy sequence for shards fetched on first use (remote_shards)
        self.lengths = list(lengths)
        self.dtype = dtype
        self.resident_bytes = resident_bytes
        self._maps: dict[int, _ShardMap] = {}  # in the order they were opened
        self._raw: list[memoryview | None] = [None] * len(self.lengths)  # each open map's bytes
        # The key of the block of shard s's byte b is (bases[s] + b) >> _BLOCK_SHIFT.
        self._bases = [shard << (_SHARD_SHIFT + _BLOCK_SHIFT) for shard in range(len(self.lengths))]
        self._counted: set[int] = set()  # the blocks read since the release (_block_key)

    @property
    def _blocks(self) -> set[tuple[int, int]]:
        """The blocks read since the last release, as ``(shard, block)``."""
        return {(key >> _SHARD_SHIFT, key & _BLOCK_MASK) for key in self._counted}

    def _open(self, shard: int) -> memoryview:
        """Map shard ``shard`` (closing the earliest opened beyond ``MAX_OPEN_MAPS``)."""
        if len(self._maps) >= MAX_OPEN_MAPS:
            oldest = next(iter(self._maps))
            del self._maps[oldest]
            self._raw[oldest] = None
        try:
            mapped: _ShardMap = np.memmap(
                self.paths[shard], dtype=self.dtype, mode="r", shape=(self.lengths[shard],)
            )
        except FileNotFoundError:  # a cached shard evicted between its fetch and this open
            mapped = np.memmap(
                self.paths[shard], dtype=self.dtype, mode="r", shape=(self.lengths[shard],)
            )
        self._maps[shard] = mapped
        raw = self._raw[shard] = mapped.view(np.ndarray).view(np.uint8).data
        return raw

    def slices(
        self, indices: Sequence[int], starts: Sequence[int], per: int, step: int, width: int
    ) -> tuple[list[memoryview], list[int | tuple[int, int]]]:
        """The bytes of windows ``indices``, not read yet: window ``i`` is the ``width``
        bytes at ``(i - starts[s]) * step`` of shard ``s``, the last shard whose first window
        ``starts[s]`` is at most ``i`` (``i // per`` when every shard but the last holds
        ``per`` windows and the last no more; ``per`` 0 when not). With each, the key of the
        block it lies in, or the first and last keys of the blocks it spans (``copy``).
        Python ints: a batch is a few windows, where each NumPy call costs more than this
        loop."""
        raw, bases, shift = self._raw, self._bases, _BLOCK_SHIFT
        count, end = starts[-1], width - 1  # the window's last byte: at + end
        parts: list[memoryview] = []
        keys: list[int | tuple[int, int]] = []
        for index in indices:
            if index < 0 or index >= count:  # (a chained comparison is not specialised)
                raise IndexError(f"window {index} out of range for {count} windows")
            shard = index // per if per else bisect_right(starts, index) - 1
            at = (index - starts[shard]) * step  # the window's first byte in its shard
            byte = bases[shard] + at
            first, last = byte >> shift, (byte + end) >> shift
            keys.append(first if first == last else (first, last))
            source = raw[shard]
            if source is None:
                source = self._open(shard)
            parts.append(source[at : at + width])
        return parts, keys

    def copy(self, parts: list[memoryview], keys: list[int | tuple[int, int]]) -> bytes:
        """``parts`` (``slices``) one after the other in one ``bytes``. When every block they
        lie in is counted already (all but the first reads of a block), that is one copy of
        them all; else they are read one by one, each one's blocks counted first and what is
        mapped released when they would pass the budget."""
        counted = self._counted
        if counted.issuperset(keys):  # a key of blocks spanned (a tuple) is never in it
            return b"".join(parts)
        limit = max(1, self.resident_bytes // FAULT_BYTES)  # blocks mapped at most
        read = []
        for part, key in zip(parts, keys, strict=True):
            first, last = key if isinstance(key, tuple) else (key, key)
            new = set(range(first, last + 1)) - counted  # a shard's blocks: consecutive keys
            if new:
                if len(counted) + len(new) > limit:
                    self.release()  # clears counted
                    new = set(range(first, last + 1))
                counted |= new
            read.append(bytes(part))  # read now, before a later release unmaps it
        return b"".join(read)

    def release(self) -> None:
        """Unmap the blocks read since the last release; the maps stay usable."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        for shard, block in sorted(self._blocks):
            mapped = self._maps.get(shard)
            if mapped is None:  # closed since (MAX_OPEN_MAPS): nothing of it is mapped
                continue
            raw = getattr(mapped, "_mmap", None)  # numpy's mmap.mmap behind it, from offset 0
            if advice is not None and isinstance(raw, mmap.mmap):
                start = block * FAULT_BYTES
                raw.madvise(advice, start, min(FAULT_BYTES, len(raw) - start))
            else:
                del self._maps[shard]
                self._raw[shard] = None
        self._counted.clear()

    @property
    def open_maps(self) -> int:
        return len(self._maps)


class WindowSource(Dataset[dict[str, torch.Tensor]], ABC):
    """A dataset of windows that reads a whole batch at once: ``__getitems__`` gives a
    ``_TokenWindows``, which its ``collate_fn`` (``_collate_windows``) reads with one
    ``gather``. Items are ``{"input_ids", "labels"}`` (``int64``, ``block_size`` each)."""

    default_shuffle = True
    """``data.shuffle: null`` shuffles windows."""
    chunk_windows = 1
    """Consecutive windows that the shuffled order keeps near each other (a chunk, module
    docstring); 1 where reading nearby windows costs nothing less."""
    group_chunks = 1
    """Chunks whose windows the shuffled order deals together (a working set)."""
    document_eos: int | None = None
    """With ``data.document_mask``: the end-of-document id, and the records carry
    ``position_ids`` that restart after it (``speedtronic.data.documents``)."""

    def records(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch of gathered windows: ``input_ids``, ``labels`` and, with document
        masks, ``position_ids``."""
        batch = {"input_ids": inputs, "labels": labels}
        if self.document_eos is not None:
            batch["position_ids"] = document_positions(inputs, self.document_eos)
        return batch

    @abstractmethod
    def gather(
        self, indices: Sequence[int] | npt.NDArray[np.int64]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of ``indices``: two ``[len, block_size]`` int64 tensors."""

    def read_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The batch of windows ``indices``, what ``collate_fn`` makes of ``__getitems__``
        (``FastLoader`` calls it for them)."""
        inputs, labels = self.gather(indices)
        return self.records(inputs, labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        inputs, labels = self.gather([index])
        return {key: value[0] for key, value in self.records(inputs, labels).items()}

    def __getitems__(self, indices: Sequence[int]) -> _TokenWindows:
        return _TokenWindows(self, indices)

    @staticmethod
    def collate_fn(batch: Sequence[object]) -> object:
        return _collate_windows(batch)


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
        document_mask: bool = False,
        loss_masks: Sequence[Path] | None = None,
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
        self._start_list: list[int] = self._starts.tolist()
        self._count = int(
            self._start_list[-1]
        )  # len(self), a Python int (no NumPy scalar per call)
        uniform = counts[:1] * (len(counts) - 1) == counts[:-1] and 0 < counts[-1] <= counts[0]
        self._per_shard = counts[0] if uniform else 0  # windows of every shard but the last
        self._resident_bytes = resident_bytes
        self.in_use: ShardsInUse | None = None
        """The shared lock that keeps ``prepare --overwrite`` off these shards while this
        dataset lives (``open_token_dataset`` sets it; ``speedtronic.data.shard_lock``)."""
        self.document_eos = manifest.eos_id if document_mask else None
        self.loss_masks = None if loss_masks is None else list(loss_masks)
        """One mask shard per shard (``speedtronic.data.loss_masks``): labels whose mask
        byte is 0 become ``-100``."""
        self.chunk_windows, self.group_chunks = locality(
            block_size, manifest.numpy_dtype.itemsize, resident_bytes
        )
        self._dtype = manifest.numpy_dtype
        itemsize = self._dtype.itemsize
        self._step, self._width = block_size * itemsize, (block_size + 1) * itemsize  # bytes
        # gather's view of a batch's bytes, [2, rows, block_size]: [0] each window from its
        # first token, [1] from its second.
        self._strides = (itemsize, self._width, itemsize)
        self._maps = self._new_maps()
        self._mask_maps = self._new_mask_maps()

    def _new_maps(self) -> _Maps:
        return _Maps(
            [self.directory / shard.file for shard in self.shards],
            [shard.tokens for shard in self.shards],
            self.manifest.numpy_dtype,
            self._resident_bytes,
        )

    def _new_mask_maps(self) -> _Maps | None:
        if self.loss_masks is None:
            return None
        lengths = [shard.tokens for shard in self.shards]
        return _Maps(self.loss_masks, lengths, np.dtype(np.uint8), self._resident_bytes)

    def __getstate__(self) -> dict[str, object]:
        # A worker started by spawn gets its own maps; a pickled memmap would be a copy.
        state = dict(self.__dict__)
        state["_maps"] = None
        state["in_use"] = None  # the parent process holds the lock for its workers
        state["_mask_maps"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._maps = self._new_maps()
        self._mask_maps = self._new_mask_maps()

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return super().__getitem__(index + len(self) if index < 0 else index)

    sampler_type: type[WindowSampler] = WindowSampler
    """The sampler ``make_sampler`` builds (shards in object storage: one that prefetches)."""

    def make_sampler(
        self, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1
    ) -> WindowSampler:
        """The training order of these windows (module docstring): chunks of a block, in
        working sets that fit ``resident_bytes``."""
        return self.sampler_type(
            len(self),
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            world_size=world_size,
            chunk=self.chunk_windows,
            group=self.group_chunks,
        )

    def gather(
        self, indices: Sequence[int] | npt.NDArray[np.int64]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of the windows ``indices``: two ``[len, block_size]``
        ``int64`` tensors, copied straight out of the memmaps.

        The windows' ``block_size + 1`` tokens are sliced as bytes of their maps
        (``_Maps.slices``), copied into one ``bytes`` by one ``join`` (``_Maps.copy``), and
        both tensors converted from it in one step, through a strided view that reads each
        window twice, from its first token and from its second: two contiguous arrays (a
        model may ``view`` either), each token converted once per tensor."""
        wanted = indices.tolist() if isinstance(indices, _ARRAYS) else indices
        size, starts, per = self.block_size, self._start_list, self._per_shard
        parts, keys = self._maps.slices(wanted, starts, per, self._step, self._width)
        rows = len(parts)
        if rows:
            copied = self._maps.copy(parts, keys)
            both = np.ndarray((2, rows, size), self._dtype, copied, 0, self._strides)
            converted = both.astype(np.int64, "C")
        else:  # (a view of no bytes at an offset is refused)
            converted = np.empty((2, 0, size), dtype=np.int64)
        inputs, labels = converted[0], converted[1]  # (unpacking would raise IndexError once)
        if self._mask_maps is not None:  # fine-tuning data: the loss on the answers only
            maps = self._mask_maps
            parts, keys = maps.slices(wanted, starts, per, size, size + 1)
            masks = np.ndarray((rows, size), np.uint8, maps.copy(parts, keys), 1, (size + 1, 1))
            labels[masks == 0] = IGNORE_INDEX
        return torch.from_numpy(inputs), torch.from_numpy(labels)


class _TokenWindows(Sequence[dict[str, torch.Tensor]]):
    """The windows of one batch, not yet read: ``_collate_windows`` reads them all at once;
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
            return _TokenWindows(self.dataset, self.indices[index])
        return self.dataset[self.indices[index]]

    def batch(self) -> dict[str, torch.Tensor]:
        return self.dataset.read_batch(self.indices)


def _collate_windows(batch: Sequence[object]) -> object:
    """A ``_TokenWindows`` -> ``{input_ids, labels}`` of shape ``[batch, block_size]``;
    anything else (records of another source) goes to ``collate_batch``."""
    if isinstance(batch, _TokenWindows):
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
    document_mask: bool = False,
) -> TokenWindowDataset:
    """The windows of a shard directory: its training shards (``part`` ``"all"`` or
    ``"train"``: training never reads the held-out shards) or its held-out shards
    (``"held_out"``). Checks first, each a ``DataSourceError`` naming ``key``: the manifest,
    that its vocabulary fits ``vocab_size`` (the model's), that ``tokenizer`` (when given)
    made the shards, and the shards' sizes and, with ``verify``, sha256 and largest ids. With
    ``document_mask`` the records carry ``position_ids`` (``speedtronic.data.documents``). The
    dataset holds a shared lock on the set while it lives (``shard_lock``), so ``prepare
    --overwrite`` does not replace it under the run."""
    in_use = _hold(directory)
    try:
        dataset = _open_checked(
            directory,
            block_size,
            part,
            vocab_size,
            tokenizer,
            verify=verify,
            key=key,
            document_mask=document_mask,
        )
    except BaseException:
        if in_use is not None:
            in_use.close()
        raise
    dataset.in_use = in_use
    return dataset


def _hold(directory: str | Path) -> ShardsInUse | None:
    """A shared lock on the set, taken before its manifest is read (``shard_lock``); None
    when ``index.json`` cannot be opened (reading the manifest then says why)."""
    try:
        return ShardsInUse(directory, MANIFEST_NAME)
    except ShardsInUseError:
        raise
    except (OSError, DataSourceError):
        return None


def checked_split(
    manifest: TokenManifest,
    directory: str,
    where: str,
    split: Split,
    vocab_size: int | None,
    tokenizer: str | None,
) -> tuple[ShardEntry, ...]:
    """The shards of ``split``, after checking that the vocabulary fits ``vocab_size`` and
    that ``tokenizer`` (when given) made them (``DataSourceError`` naming ``where``)."""
    if vocab_size is not None:
        check_vocab_fits(manifest.vocab_size, vocab_size, source=where)
    if tokenizer is not None:
        check_tokenizer(manifest, directory, tokenizer)
    shards = manifest.split(split)
    if not shards:
        raise DataSourceError(
            f"{where} has no held-out shards (prepared with --eval-fraction 0): prepare with "
            "--eval-fraction, or name a held-out source with eval.text_path or eval.dataset"
            if split == "eval"
            else f"{where} has no training shards"
        )
    return shards


def _open_checked(
    directory: str | Path,
    block_size: int,
    part: TextPart,
    vocab_size: int | None,
    tokenizer: str | None,
    *,
    verify: bool,
    key: str,
    document_mask: bool,
) -> TokenWindowDataset:
    manifest = source_manifest(directory, key)
    where = f"{key}: {directory}"
    split: Split = "eval" if part == "held_out" else "train"
    shards = checked_split(manifest, str(directory), where, split, vocab_size, tokenizer)
    try:
        verify_shards(directory, manifest, shards, checksums=verify)
    except ShardError as exc:
        raise ShardError(f"{key}: {exc}") from None
    loss_masks = read_loss_masks(directory, manifest, shards, verify=verify, key=key)
    if loss_masks is not None:
        sft = loss_masks[1]
        if sft.pack == "first-fit" and sft.window != block_size:
            raise DataSourceError(
                f"{where} was packed first-fit into windows of {sft.window} tokens, but the "
                f"model's block size is {block_size}: set model.max_seq_len: {sft.window}, "
                "or prepare with --window matching it"
            )
    dataset = TokenWindowDataset(
        directory,
        manifest,
        shards,
        block_size,
        document_mask=document_mask,
        loss_masks=None if loss_masks is None else loss_masks[0],
    )
    if len(dataset) == 0:
        what = "held-out" if split == "eval" else "training"
        raise DataSourceError(
            f"{where}: its {what} shards hold {dataset.tokens} tokens, not one window of "
            f"block_size + 1 = {block_size + 1} tokens"
        )
    return dataset
