"""The held-out set an evaluation reads (the ``eval:`` config section).

Source order (first match wins):

1. ``eval.text_path`` -> a ``TextFileTokenDataset`` of that whole file, through
   ``data.tokenizer`` as the training text is;
2. ``eval.dataset`` -> a registered dataset, built like ``data.dataset`` with
   ``eval.dataset_options`` -- a user's held-out split through the same plugin mechanism as
   training data;
3. the training source's own held-out split: the synthetic sources draw held-out items from
   another random stream (never a training item); a text file (``data.text_path`` or the
   ``text`` dataset) gives its last ``eval.fraction`` of bytes, which training then skips
   (``training_excludes_tail``); token shards (``data.tokens``) give their held-out shards,
   a mixture the held-out shards of all its sources; a dataset registered with
   ``held_out=True`` builds its own (``DatasetRequest.part``). Another named dataset has no
   split of its own: an error that says to name one.

The loader never shuffles, keeps the last incomplete batch, uses no worker processes and
has its own generator, so every evaluation reads the same batches and touches no random
state of training.

``eval.max_batches`` counts the batches of the whole evaluation, not of one rank: the
held-out set is cut to its first ``max_batches * data.micro_batch_size`` samples, and in a
distributed run each rank reads a strided share of those (sample ``i`` on rank
``i % world_size``, none dropped). The ranks' sums are all-reduced once, so ``eval/loss`` is
the loss over the same samples on 1, 2 or N ranks, and ``speedtronic evaluate`` (one process)
reproduces the figure a distributed fit logged.

A mixture's held-out set (``data.mixture``) is read source by source instead
(``speedtronic.data.held_out_sources``): each batch from one source, so each source's loss
is reported (``eval/<source>/loss``); a bound gives every source its batches, the whole
evaluation at most ``eval.max_batches`` batches, dealt to the ranks batch by batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sized
from itertools import islice
from typing import Protocol

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from speedtronic.data.collate import collate_batch
from speedtronic.data.held_out_sources import SourceBatches
from speedtronic.data.interleave import Interleave
from speedtronic.data.loader import (
    DEFAULT_DATA_SEED,
    DatasetRequest,
    DataSettings,
    _block_size,
    _named_dataset,
    _text_vocab,
    resolve_dataset,
    text_tokenizer,
)
from speedtronic.data.text import DataSourceError, TextFileTokenDataset

__all__ = ["build_eval_loader", "held_out_dataset", "known_empty", "training_excludes_tail"]


class _EvalSettings(Protocol):
    """The ``eval`` config attributes the held-out loader reads (read-only)."""

    @property
    def every_steps(self) -> int | None: ...
    @property
    def fraction(self) -> float: ...
    @property
    def text_path(self) -> str | None: ...
    @property
    def dataset(self) -> str | None: ...
    @property
    def dataset_options(self) -> Mapping[str, object]: ...
    @property
    def max_batches(self) -> int | None: ...


def _own_source(settings: _EvalSettings) -> bool:
    return not settings.text_path and not settings.dataset


def training_excludes_tail(settings: _EvalSettings) -> float | None:
    """The ``held_out_fraction`` for ``build_dataloader``: ``eval.fraction`` when evaluation
    is on and takes its held-out set from the training source, else ``None`` (training
    reads all of it)."""
    if settings.every_steps is None or not _own_source(settings):
        return None
    return settings.fraction


def held_out_dataset(
    data: DataSettings, settings: _EvalSettings, *, vocab_size: int | None = None
) -> Dataset[object]:
    """The held-out dataset (source order in the module docstring)."""
    vocab = vocab_size if vocab_size is not None else data.vocab_size
    if settings.text_path:
        tokenizer = text_tokenizer(data, vocab)
        return TextFileTokenDataset(
            settings.text_path, _block_size(data), tokenizer, _text_vocab(tokenizer, vocab)
        )
    if settings.dataset:
        request = DatasetRequest(
            block_size=_block_size(data),
            vocab_size=vocab,
            seed=data.seed if data.seed is not None else DEFAULT_DATA_SEED,
            num_samples=data.num_tokens,
            options=dict(settings.dataset_options),
        )
        try:
            return _named_dataset(settings.dataset, request)
        except DataSourceError as exc:
            raise DataSourceError(str(exc).replace("data.dataset", "eval.dataset")) from None
    return resolve_dataset(
        data, vocab_size=vocab, part="held_out", held_out_fraction=settings.fraction
    )


def known_empty(dataset: Dataset[object]) -> str | None:
    """Why ``dataset`` is certainly empty (a map-style dataset of length 0, a text part with
    no bytes), or ``None`` when it is not, or cannot be known without reading it."""
    if isinstance(dataset, TextFileTokenDataset):
        if dataset.byte_count() == 0:
            where = "its held-out tail" if dataset.part == "held_out" else "it"
            return f"{dataset.path} has no bytes in {where}"
        return None
    if isinstance(dataset, Sized) and len(dataset) == 0:
        return f"{type(dataset).__name__} has no samples"
    return None


class _HeldOutShare(IterableDataset[object]):
    """Rank ``rank``'s share of an iterable held-out set: of its first ``limit`` items
    (``None``: all), those at positions ``rank``, ``rank + world_size``, ... -- none dropped:
    the ranks meet only at the evaluation's one all-reduce, so they need not stay in step."""

    def __init__(
        self, source: Iterable[object], *, rank: int, world_size: int, limit: int | None
    ) -> None:
        super().__init__()
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.limit = limit

    def __iter__(self) -> Iterator[object]:
        items = iter(self.source) if self.limit is None else islice(self.source, self.limit)
        return islice(items, self.rank, None, self.world_size)


def build_eval_loader(
    data: DataSettings,
    settings: _EvalSettings,
    *,
    vocab_size: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    dataset: Dataset[object] | None = None,
) -> DataLoader[object]:
    """This rank's ``DataLoader`` over the held-out set (``dataset``, default
    ``held_out_dataset(data, settings)``), ``data.micro_batch_size`` samples a batch: its
    share of the first ``eval.max_batches`` batches of the whole set (module docstring)."""
    source = (
        dataset if dataset is not None else held_out_dataset(data, settings, vocab_size=vocab_size)
    )
    if isinstance(source, Interleave):  # a mixture's: source by source (module docstring)
        batches = SourceBatches(
            source,
            batch_size=data.micro_batch,
            max_batches=settings.max_batches,
            rank=rank,
            world_size=world_size,
        )
        return DataLoader(source, batch_sampler=batches, num_workers=0, collate_fn=collate_batch)
    limit = None if settings.max_batches is None else settings.max_batches * data.micro_batch
    if isinstance(source, IterableDataset):
        if world_size > 1 or limit is not None:
            source = _HeldOutShare(source, rank=rank, world_size=world_size, limit=limit)
    elif isinstance(source, Sized) and (world_size > 1 or limit is not None):
        end = len(source) if limit is None else min(limit, len(source))
        source = Subset(source, range(rank, end, world_size))
    return DataLoader(
        source,
        batch_size=data.micro_batch,
        shuffle=False,
        num_workers=0,
        collate_fn=collate_batch,
        drop_last=False,
        generator=torch.Generator().manual_seed(0),
    )
