"""The shuffled order of token windows: keyed permutations that keep reads local, and the
sampler that walks them (``WindowSampler``); ``speedtronic.data.windows`` reads the windows.

Order. ``WindowSampler`` is a ``ResumableSampler``: epoch ``e`` visits the windows in the
order of ``ChunkedPermutation`` keyed by ``(data.seed, e)``, a shuffle in two levels that keeps
the reads local. The windows are cut into chunks of ``chunk`` consecutive windows (one 2 MiB
block of tokens: ``FAULT_BYTES``), the chunks are put in a seeded order, and every ``group``
consecutive chunks of that order are a working set whose windows are dealt in a seeded order
of their own; both orders are keyed bijections (a Feistel network with cycle walking,
computed in NumPy blocks), so every window is visited once per epoch, the order of any corpus
takes O(1) memory (no permutation array) and position ``k`` costs the same as position 0. A
working set is sized to what the dataset keeps mapped (``resident_bytes``: the blocks its
chunks can touch fit in it), so while one is read nothing is mapped twice, and the release
that makes room for the next drops the finished set's blocks (and the few the next one has
read by then). Ranks take strided positions of the same order (as ``ResumableSampler``
does), so together they read every window once per epoch, and a resumed run starts at the
exact window.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from speedtronic.data.stream import ResumableSampler, _epoch_seed

__all__ = ["ChunkedPermutation", "ORDER_BLOCK", "Permutation", "WindowSampler"]

_FEISTEL_ROUNDS = 6
ORDER_BLOCK = 8192
"""Positions of the order computed per NumPy call."""
_TABLE_LIMIT = 1 << 16
"""A ``Permutation`` of at most this many values is a lookup table once used."""

_TAIL_STREAM = 0x7A11_C4A0
_SET_STREAM = 0x5E7_0DE4

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
    below ``n``; the domain is under ``4 n``, so a few rounds on average). One of at most
    ``_TABLE_LIMIT`` values is tabulated on its first use (one encryption of the domain, and
    the walks are lookups): the same bijection, without a dozen walking rounds per call."""

    def __init__(self, n: int, key: int) -> None:
        self.n = n
        self.key = key
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self._domain = 1 << bits
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        keys = [_epoch_seed(key, round_) for round_ in range(_FEISTEL_ROUNDS)]
        self._keys = [np.uint64(k & _UINT64) for k in keys]
        self._table: npt.NDArray[np.int64] | None = None

    def _encrypt(self, values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        left, right = values >> self._half, values & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def _tabulated(self) -> npt.NDArray[np.int64]:
        if self._table is None:
            encrypted = self._encrypt(np.arange(self._domain, dtype=np.uint64)).astype(np.int64)
            table = encrypted[: self.n].copy()
            walking = np.flatnonzero(table >= self.n)
            while walking.size:
                values = table[walking] = encrypted[table[walking]]
                walking = walking[values >= self.n]
            self._table = table
        return self._table

    def __call__(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        if self.n <= 1:
            return positions.copy()
        if self.n <= _TABLE_LIMIT:
            return self._tabulated()[positions]
        values = self._encrypt(positions.astype(np.uint64))
        outside = values >= np.uint64(self.n)
        while outside.any():
            values[outside] = self._encrypt(values[outside])
            outside = values >= np.uint64(self.n)
        return values.astype(np.int64)


def _distinct(values: npt.NDArray[np.int64]) -> list[int]:
    """The distinct values of ``values`` (a few, mostly in runs), ascending; cheaper than
    ``np.unique`` for that."""
    if values.size == 0:
        return []
    low = int(values.min())
    if int(values.max()) - low < 4096:
        present = np.flatnonzero(np.bincount(values - low)) + low
        found: list[int] = present.tolist()
        return found
    unique: list[int] = np.unique(values).tolist()
    return unique


class ChunkedPermutation:
    """A keyed bijection of ``[0, n)`` that keeps runs of ``chunk`` consecutive values near
    each other in its order (module docstring, "Order").

    Chunk ``c`` is the values ``c * chunk .. (c + 1) * chunk - 1``; the last one, the tail, is
    shorter when ``chunk`` does not divide ``n``. The full chunks are put in the order of
    ``Permutation(n // chunk, key)`` and the tail is placed at a keyed slot among them. Every
    ``group`` consecutive slots of that order are a working set, and its values (its chunks'
    values, concatenated) are dealt in the order of a ``Permutation`` of their own, keyed by
    ``key`` and the set's number. Position ``p`` therefore lies in working set ``p //
    (chunk * group)``, counting the tail as a full chunk, and costs O(1) like position 0. With
    ``chunk == 1`` this is ``Permutation(n, key)``."""

    def __init__(self, n: int, key: int, *, chunk: int = 1, group: int = 1) -> None:
        for name, value in (("chunk", chunk), ("group", group)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.n, self.key, self.chunk, self.group = n, key, chunk, group
        self.full, self.tail = divmod(n, chunk)
        self.slots = self.full + (1 if self.tail else 0)
        self._chunks = Permutation(self.full, key)
        self._tail_slot = (
            _epoch_seed(key ^ _TAIL_STREAM, 0) % self.slots if self.tail else self.slots
        )
        self._gap = chunk - self.tail if self.tail else 0  # positions the tail lacks
        self._sets: dict[int, Permutation] = {}

    def _slot_start(self, slot: int) -> int:
        """The first position of slot ``slot`` (``n`` for ``slot == slots``)."""
        return slot * self.chunk - (self._gap if slot > self._tail_slot else 0)

    def _virtual(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``positions`` as if the tail were a full chunk: its missing positions skipped."""
        if not self._gap:
            return positions
        after = positions >= self._slot_start(self._tail_slot + 1)
        return positions + self._gap * after

    def _chunk_ids(self, first: int, count: int) -> npt.NDArray[np.int64]:
        """The chunks in slots ``first .. first + count - 1``."""
        slots = np.arange(first, first + count, dtype=np.int64)
        is_tail = slots == self._tail_slot
        chunks = np.full(count, self.full, dtype=np.int64)  # the tail's chunk number
        ranked = slots[~is_tail] - (slots[~is_tail] > self._tail_slot)
        chunks[~is_tail] = self._chunks(ranked)
        return chunks

    def _set_order(self, number: int, size: int) -> Permutation:
        """The order within working set ``number`` (a few kept: a block of positions asks
        for the same ones)."""
        found = self._sets.get(number)
        if found is None:
            if len(self._sets) >= 4:
                del self._sets[next(iter(self._sets))]  # the earliest made
            found = Permutation(size, _epoch_seed(self.key ^ _SET_STREAM, number))
            self._sets[number] = found
        return found

    def __call__(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        if self.chunk == 1:
            return self._chunks(positions)
        span = self.chunk * self.group
        sets = self._virtual(positions) // span
        values = np.empty_like(positions)
        for number in _distinct(sets):
            chosen = sets == number
            first = number * self.group
            count = min(self.group, self.slots - first)
            start = self._slot_start(first)
            size = self._slot_start(first + count) - start
            local = self._set_order(number, size)(positions[chosen] - start)
            slots, within = np.divmod(self._virtual(local + start) - first * self.chunk, self.chunk)
            values[chosen] = self._chunk_ids(first, count)[slots] * self.chunk + within
        return values


class WindowSampler(ResumableSampler):
    """``ResumableSampler``'s contract (epochs, ``set_start``, rank striding with
    wrap-around padding, state) over ``n`` windows, without materialising the order: the
    order of epoch ``e`` is ``ChunkedPermutation(n, (seed, e), chunk=chunk, group=group)``
    (the identity without ``shuffle``; ``chunk == 1``, the default, is a plain keyed
    permutation). Subclasses map order positions to dataset indices (``_indices``)."""

    def __init__(
        self,
        data_source_len: int,
        *,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        chunk: int = 1,
        group: int = 1,
    ) -> None:
        super().__init__(
            data_source_len, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size
        )
        ChunkedPermutation(0, 0, chunk=chunk, group=group)  # checks them
        self.chunk = chunk
        self.group = group

    @property
    def order_version(self) -> int:
        """2 for the chunked (locality-aware) order; a plain keyed permutation is the order
        of version 1."""
        return 2 if self.shuffle and (self.chunk, self.group) != (1, 1) else 1

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

    def _permutation(self, n: int, key: int) -> ChunkedPermutation:
        """This sampler's ``ChunkedPermutation(n, key)``, the last one kept (one epoch asks
        for the same one for every block)."""
        cached = self.__dict__.get("_cached")
        if isinstance(cached, ChunkedPermutation) and (cached.n, cached.key) == (n, key):
            return cached
        permutation = ChunkedPermutation(n, key, chunk=self.chunk, group=self.group)
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
