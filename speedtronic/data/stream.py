"""Endless, resumable batch streams: ``ResumableSampler``, ``BatchStream``, ``infinite_batches``.

The trainer pulls every batch from a ``BatchStream``. Its position -- ``(epoch,
batches_in_epoch)`` -- is part of the training state, and restoring it makes the next batch
exactly the one an uninterrupted run would have received:

* a ``DataLoader`` whose sampler is a ``ResumableSampler`` (what ``build_dataloader`` makes
  for map-style data) restarts the epoch's permutation at the first unread sample, so the
  skipped samples are never loaded;
* anything else (iterable datasets such as the text stream, lists, other loaders) is
  re-iterated for that epoch and the already-seen batches are read and dropped.

With a ``ResumableSampler`` the position also holds a global cursor (``samples``: the
positions of the epoch's order all ranks together consumed). Ranks take strided positions of
one global order, so a run resumed on another number of ranks, or with another batch size,
continues from the cursor: the same global sample sequence, no sample skipped or repeated
(``speedtronic.engine.batch_layout`` keeps the global batch).

Exactness needs a source whose epoch ``e`` is the same every time it is iterated: a
``ResumableSampler``, a fixed order, or randomness seeded per epoch. A ``DataLoader`` with
torch's default ``RandomSampler`` and no ``generator`` draws its order from the global RNG
and cannot be resumed exactly.

Global RNG: creating a ``DataLoader`` iterator draws a worker base seed from the loader's
``generator`` -- the global torch RNG when it has none -- and dropping already-seen batches
runs the dataset's code again. Both happen at different moments in a resumed run than in an
uninterrupted one, so both run with the global torch, NumPy and Python RNG states saved and
restored around them; training randomness (dropout, ...) is unaffected by where the data
stream stands.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from speedtronic.user_warnings import warn

__all__ = [
    "BatchStream",
    "DataPass",
    "EMPTY_SOURCE_MESSAGE",
    "EpochLimitReached",
    "RankShardedIterable",
    "ResumableSampler",
    "infinite_batches",
]

_BatchT = TypeVar("_BatchT")

EMPTY_SOURCE_MESSAGE = "data loader produced no batches"

_UINT64 = (1 << 64) - 1


def _epoch_seed(seed: int, epoch: int) -> int:
    """A well-mixed 64-bit seed for ``(seed, epoch)`` (SplitMix64 finaliser), so nearby
    seeds and epochs give unrelated permutations."""
    value = ((seed & _UINT64) ^ ((epoch + 1) * 0x9E3779B97F4A7C15)) & _UINT64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _UINT64
    return value ^ (value >> 31)


def _non_negative(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


class ResumableSampler(Sampler[int]):
    """Indices ``0..n-1`` in a per-epoch order that can start anywhere, optionally one
    rank's shard of them.

    With ``shuffle`` the order of epoch ``e`` is ``torch.randperm`` from a generator seeded
    by ``(seed, e)``; without it, the identity. ``set_epoch`` selects the epoch (and starts
    it from the beginning); ``set_start(k)`` then skips the first ``k`` indices of that
    order without anyone loading them.

    Sharding (``world_size > 1``): every rank computes the same epoch order, pads it by
    wrapping around to a multiple of ``world_size`` (so all ranks get equally many indices
    and stay in step), and takes every ``world_size``-th index from position ``rank``. The
    ranks together see every sample once per epoch (the first ``-n % world_size`` of the
    order twice when ``n`` is not a multiple). Striding keeps global batches identical to
    a single process's: the ``world_size`` micro-batches of step ``s`` together hold exactly
    the samples a single process with a ``world_size`` times larger batch would read.
    ``num_samples``, ``start`` and ``len`` count this rank's shard.
    """

    def __init__(
        self,
        data_source_len: int,
        *,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        self.dataset_len = _non_negative("data_source_len", data_source_len)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self.rank = _non_negative("rank", rank)
        if self.rank >= world_size:
            raise ValueError(f"rank {rank} is not below world_size {world_size}")
        self.world_size = world_size
        self.num_samples = -(-self.dataset_len // world_size)  # this rank's shard size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.epoch = 0
        self.start = 0

    @property
    def order_version(self) -> int:
        """Which rule maps ``(seed, epoch)`` to this sampler's order: a checkpoint records
        it, so a position saved under another rule is not silently read in the new one."""
        return 1

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from its first index."""
        self.epoch = _non_negative("epoch", epoch)
        self.start = 0

    def set_start(self, index: int) -> None:
        """Begin the current epoch at position ``index`` of its order."""
        position = _non_negative("start index", index)
        if position > self.num_samples:
            raise ValueError(
                f"start index {position} is past the end of the data ({self.num_samples} samples)"
            )
        self.start = position

    def global_order(self) -> list[int]:
        """The current epoch's order of the whole dataset (the same on every rank)."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
        permutation: list[int] = torch.randperm(self.dataset_len, generator=generator).tolist()
        return permutation

    def order(self) -> list[int]:
        """This rank's index order of the current epoch (all of it without sharding)."""
        order = self.global_order()
        if self.world_size == 1 or not order:
            return order
        padded_len = self.num_samples * self.world_size
        while len(order) < padded_len:  # wrap around (several times for tiny datasets)
            order.extend(order[: padded_len - len(order)])
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start

    def state_dict(self) -> dict[str, int]:
        state = {
            "epoch": self.epoch,
            "start": self.start,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "num_samples": self.num_samples,
        }
        if self.world_size > 1:
            state["world_size"] = self.world_size
        return state

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore epoch and start; the data size, seed and shuffle flag must match."""
        for key, expected in (
            ("num_samples", self.num_samples),
            ("seed", self.seed),
            ("shuffle", int(self.shuffle)),
            ("world_size", self.world_size),
        ):
            if int(state.get(key, 1 if key == "world_size" else expected)) != expected:
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {expected}; "
                    "the saved data order does not apply to this data"
                )
        self.set_epoch(int(state.get("epoch", 0)))
        self.set_start(int(state.get("start", 0)))


class RankShardedIterable(IterableDataset[_BatchT], Generic[_BatchT]):
    """One rank's share of an iterable dataset.

    The source's items are dealt out in rounds of ``world_size``: item ``i`` of each
    complete round goes to rank ``i``, and an incomplete last round is dropped, so every
    rank yields equally many items (ranks stay in step; at most ``world_size - 1`` items per
    pass are unused). Each rank iterates the whole source. Splitting among DataLoader
    workers stays the source's job (``get_worker_info``, as ``TextFileTokenDataset`` does);
    combined, rank ``r`` and worker ``w`` of ``W`` get items ``w + W * (r + world_size * j)``,
    every item once.
    """

    def __init__(self, source: Iterable[_BatchT], *, rank: int, world_size: int) -> None:
        super().__init__()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.source = source
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[_BatchT]:
        last_slot = self.world_size - 1
        held: _BatchT | None = None
        for position, item in enumerate(self.source):
            slot = position % self.world_size
            if slot == self.rank:
                held = item
            if slot == last_slot:  # the round is complete: hand out this rank's item
                yield cast(_BatchT, held)


def data_shards(source: object) -> int:
    """How many rank shards ``source`` (a loader or dataset) is one of (1: not sharded)."""
    dataset = source.dataset if isinstance(source, DataLoader) else source
    if isinstance(dataset, RankShardedIterable):
        return dataset.world_size
    position = _resumable_sampler(source)
    return position.sampler.world_size if position is not None else 1


def _data_order_version(source: object) -> int:
    """The ``order_version`` of ``source``'s ``ResumableSampler`` (1 without one)."""
    position = _resumable_sampler(source)
    return position.sampler.order_version if position is not None else 1


@contextmanager
def _rng_preserved() -> Generator[None, None, None]:
    """Leave the global torch (CPU), NumPy and Python RNG states as they were."""
    torch_state = torch.get_rng_state()
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


@dataclass(frozen=True)
class _SamplerPosition:
    """How a loader's ``ResumableSampler`` maps batches to indices."""

    sampler: ResumableSampler
    batch_size: int
    drop_last: bool

    def epoch_batches(self) -> int:
        full, rest = divmod(self.sampler.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def cursor(self, batches: int) -> int:
        """The global cursor after ``batches`` batches of every rank: positions of the
        epoch's order consumed, all ranks together (ranks take strided positions)."""
        return min(batches * self.batch_size, self.sampler.num_samples) * self.sampler.world_size

    def batches_at(self, cursor: int, epoch: int) -> int:
        """The batches of every rank that leave the global cursor at ``cursor``: another
        rank count or batch size continues the same global order (``ValueError`` when
        ``cursor`` falls inside a batch of this layout)."""
        sampler = self.sampler
        share, rest = divmod(cursor, sampler.world_size)
        if share >= sampler.num_samples:
            return self.epoch_batches()  # the epoch's end, whatever the padding was
        batches, within = divmod(share, self.batch_size)
        if rest or within:
            raise ValueError(
                f"the data position, sample {cursor} of epoch {epoch}'s order (all ranks "
                f"together), falls inside a batch of {sampler.world_size} rank(s) x "
                f"{self.batch_size} samples: choose a rank count and micro-batch whose batches "
                "end there"
            )
        return batches


def _resumable_sampler(source: object) -> _SamplerPosition | None:
    """The loader's ``ResumableSampler`` and its batching, if it has one."""
    if not isinstance(source, DataLoader):
        return None
    batch_sampler = source.batch_sampler
    if batch_sampler is None:  # no automatic batching: one index per "batch"
        sampler = source.sampler
        if isinstance(sampler, ResumableSampler):
            return _SamplerPosition(sampler, 1, drop_last=False)
        return None
    if isinstance(batch_sampler, BatchSampler) and isinstance(
        batch_sampler.sampler, ResumableSampler
    ):
        return _SamplerPosition(
            batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
        )
    return None


def _set_sampler_epoch(source: object, epoch: int) -> None:
    """Tell an epoch-aware sampler (``DistributedSampler`` and the like) which epoch this is,
    so its order depends on the epoch number alone and resumes exactly."""
    if not isinstance(source, DataLoader):
        return
    for sampler in (source.sampler, getattr(source.batch_sampler, "sampler", None)):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            return


class EpochLimitReached(Exception):
    """The stream's last allowed epoch (``BatchStream.max_epochs``) is used up."""

    def __init__(self, max_epochs: int) -> None:
        super().__init__(f"max_epochs={max_epochs} reached")
        self.max_epochs = max_epochs


class BatchStream(Iterator[_BatchT], Generic[_BatchT]):
    """Yields batches from ``source`` forever, one epoch (pass over ``source``) after another.

    ``source`` is any re-iterable of batches: a ``DataLoader``, a list, an object whose
    ``__iter__`` is a generator. A one-shot iterator works for a single pass only. A pass
    that yields nothing raises ``RuntimeError("data loader produced no batches")``.
    ``state_dict()``/``load_state_dict()`` save and restore the position (module docs).

    With ``max_epochs`` the stream ends instead of opening epoch number ``max_epochs``: the
    ``next()`` that would start it raises ``EpochLimitReached`` (checked only where an
    epoch runs out, so it costs nothing per batch).
    """

    def __init__(self, source: Iterable[_BatchT], *, max_epochs: int | None = None) -> None:
        self.source = source
        self.max_epochs = max_epochs
        self.epoch = 0
        self.batches_in_epoch = 0
        self._iterator: Iterator[_BatchT] | None = None
        self._pulled = False

    def __iter__(self) -> BatchStream[_BatchT]:
        return self

    def __next__(self) -> _BatchT:
        if self._iterator is None:
            self._iterator = self._open_epoch(skip=self.batches_in_epoch)
        try:
            batch = next(self._iterator)
        except StopIteration:
            batch = self._first_of_next_epoch()
        self._pulled = True
        self.batches_in_epoch += 1
        return batch

    def _first_of_next_epoch(self) -> _BatchT:
        if self.batches_in_epoch == 0:
            raise RuntimeError(self._empty_message())
        if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
            raise EpochLimitReached(self.max_epochs)
        self.epoch += 1
        self.batches_in_epoch = 0
        self._iterator = self._open_epoch(skip=0)
        try:
            return next(self._iterator)
        except StopIteration:
            raise RuntimeError(self._empty_message()) from None

    def _empty_message(self) -> str:
        if isinstance(self.source, Iterator):
            return (
                f"{EMPTY_SOURCE_MESSAGE} (the source is a one-shot iterator and is exhausted; "
                "pass a re-iterable such as a DataLoader or a list)"
            )
        return EMPTY_SOURCE_MESSAGE

    def _open_epoch(self, *, skip: int) -> Iterator[_BatchT]:
        """An iterator over epoch ``self.epoch`` positioned after its first ``skip`` batches."""
        position = _resumable_sampler(self.source)
        if position is not None:
            sampler = position.sampler
            sampler.set_epoch(self.epoch)
            if skip:
                available = position.epoch_batches()
                if skip > available:
                    raise ValueError(self._past_end_message(skip, available))
                sampler.set_start(min(skip * position.batch_size, sampler.num_samples))
            return self._new_iterator()
        _set_sampler_epoch(self.source, self.epoch)
        iterator = self._new_iterator()
        if skip:
            with _rng_preserved():
                for seen in range(skip):
                    if next(iterator, _END) is _END:
                        raise ValueError(self._past_end_message(skip, seen))
        return iterator

    def _past_end_message(self, skip: int, available: int) -> str:
        return (
            f"cannot resume the data stream at epoch {self.epoch}, batch {skip}: that epoch has "
            f"only {available} batches (did the data or the batch size change?)"
        )

    def _new_iterator(self) -> Iterator[_BatchT]:
        source = self.source
        if isinstance(source, DataLoader) and not _draws_order_from_global_rng(source):
            with _rng_preserved():
                return iter(source)
        return iter(source)

    def abandon(self) -> None:
        """Drop the pass in progress at once, e.g. after giving up on a batch that never came.

        A ``DataLoader``'s worker processes are stopped without waiting for them (they may be
        stuck in the dataset's code: torch's workers exit at once on their parent's SIGTERM)
        and then shut down as usual. The position is kept: the next batch opens the pass
        again where it stood."""
        iterator, self._iterator = self._iterator, None
        _stop_workers(self.source, iterator)

    def state_dict(self) -> dict[str, int]:
        """The position: the epoch and how many of its batches were handed out (plus the
        number of rank shards of a sharded source, and the global cursor ``samples`` of a
        ``ResumableSampler``'s order)."""
        state = {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}
        shards = data_shards(self.source)
        if shards > 1:
            state["shards"] = shards
        order = _data_order_version(self.source)
        if order != 1:
            state["order"] = order
        position = _resumable_sampler(self.source)
        if position is not None:  # the global cursor: what another rank count resumes from
            state["samples"] = position.cursor(self.batches_in_epoch)
        return state

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a saved position; the iterator is rebuilt lazily on the next batch."""
        epoch = _non_negative("data state epoch", state.get("epoch"))
        batches = _non_negative("data state batches_in_epoch", state.get("batches_in_epoch"))
        if isinstance(self.source, Iterator) and (epoch > 0 or self._pulled):
            raise ValueError(
                "cannot resume a data stream over a one-shot iterator once it has been read; "
                "pass a re-iterable source such as a DataLoader or a list"
            )
        saved_shards = int(state.get("shards", 1))
        shards = data_shards(self.source)
        position = _resumable_sampler(self.source)
        cursor = state.get("samples")
        if position is not None and cursor is not None:
            cursor = _non_negative("data state samples", cursor)
            if cursor != position.cursor(batches):  # another rank count or micro-batch
                batches = position.batches_at(cursor, epoch)
        elif saved_shards != shards:
            warn(
                f"the data position was saved with the data split into {saved_shards} rank "
                f"shard(s) and is now restored with {shards}: the run continues at batch "
                f"{batches} of epoch {epoch} of the new split, so this epoch may repeat or "
                "skip samples (the world size changed)",
                UserWarning,
            )
        saved_order, order = int(state.get("order", 1)), _data_order_version(self.source)
        if saved_order != order:
            warn(
                f"the data position was saved in data order version {saved_order} and this "
                f"version of speedtronic reads version {order} (the token-shard order became "
                f"locality-aware): the run continues at batch {batches} of epoch {epoch} in "
                "the new order, so this epoch may repeat or skip samples",
                UserWarning,
            )
        self.epoch = epoch
        self.batches_in_epoch = batches
        self._iterator = None


class DataPass(Iterator[_BatchT], Generic[_BatchT]):
    """One pass over ``source`` (a held-out set, say) that counts the batches it handed out
    (``batches``) and can be dropped at once (``abandon``), as ``BatchStream`` can: the stop
    watch (``speedtronic.engine.stop_watch``) bounds a wait in its ``__next__`` like a wait
    for a training batch. Nothing per batch beyond the count."""

    def __init__(self, source: Iterable[_BatchT]) -> None:
        self.source = source
        self.batches = 0
        self._iterator: Iterator[_BatchT] | None = iter(source)

    def __iter__(self) -> DataPass[_BatchT]:
        return self

    def __next__(self) -> _BatchT:
        if self._iterator is None:
            raise StopIteration
        batch = next(self._iterator)
        self.batches += 1
        return batch

    def abandon(self) -> None:
        """End the pass now, stopping a ``DataLoader``'s workers without waiting for them."""
        iterator, self._iterator = self._iterator, None
        _stop_workers(self.source, iterator)


def _stop_workers(source: object, iterator: Iterator[object] | None) -> None:
    """Stop the worker processes of ``source``'s (a ``DataLoader``'s) ``iterator`` without
    waiting for them -- they may be stuck in the dataset's code; torch's workers exit at once
    on their parent's SIGTERM -- and then shut them down as usual."""
    if isinstance(source, DataLoader) and getattr(source, "_iterator", None) is iterator:
        source._iterator = None  # a persistent-workers loader must not reuse it
    workers = getattr(iterator, "_workers", None)
    for worker in workers if isinstance(workers, list) else ():
        if worker.is_alive():
            worker.terminate()
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


_END = object()
"""Sentinel for an exhausted iterator."""


def _draws_order_from_global_rng(loader: DataLoader[object]) -> bool:
    """True for torch's ``RandomSampler`` without its own generator: its per-epoch order
    comes from the global RNG, which must keep advancing or every epoch repeats."""
    sampler = loader.sampler
    return isinstance(sampler, RandomSampler) and sampler.generator is None


def infinite_batches(loader: Iterable[_BatchT]) -> Iterator[_BatchT]:
    """Re-iterate ``loader`` forever (``RuntimeError`` when a whole pass yields nothing)."""
    return BatchStream(loader)
