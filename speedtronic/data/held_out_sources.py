"""A mixture's held-out set read source by source: each batch from one source, so an
evaluation reports each source's loss (``eval/<source>/loss``) beside the whole set's.

The held-out set of ``data.mixture`` is an ``Interleave`` of the sources' held-out windows
(``speedtronic.data.interleave``). ``SourceBatches`` cuts it into batches of
``batch_size`` windows that each come from one source (a source's windows in their order),
puts the batches in the order of the interleave (by the position of their first window)
and deals them to the ranks (batch ``j`` on rank ``j % world_size``): the batches, and so
every loss, are the same on 1, 2 or N ranks.

A bounded evaluation (``eval.max_batches``: ``B`` batches in all) gives every source with
held-out windows one batch first (while ``B`` allows), and the rest in proportion to the
source's share of the interleave's first ``B * batch_size`` windows; a source holds at
most the batches its windows fill. So a bounded evaluation sees every source, and the
whole evaluation is at most ``B`` batches (fewer when a source runs short).

A source is named by its shard directory's name (as in ``data/<source>/samples``), or by
its position among the sources with held-out windows when two directories share a name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader, Sampler

from speedtronic.data.interleave import Interleave
from speedtronic.data.mixture import apportion

__all__ = ["SourceBatches", "held_out_parts", "source_batch_counts"]


def _names(held: Interleave[object]) -> tuple[str, ...]:
    names = [
        Path(str(getattr(dataset, "directory", index))).name
        for index, dataset in enumerate(held.datasets)
    ]
    if len(set(names)) != len(names):
        names = [str(index) for index in range(len(names))]
    return tuple(names)


def source_batch_counts(
    sizes: Sequence[int], leading: Sequence[int], batch_size: int, max_batches: int | None
) -> list[int]:
    """Each source's batches: all its windows' (``max_batches`` ``None``), else one for
    each source with windows (while ``max_batches`` allows) and the rest by ``leading``,
    its windows among the interleave's first ``max_batches * batch_size``; never more than
    its ``sizes`` fill."""
    filled = [-(-size // batch_size) for size in sizes]
    if max_batches is None:
        return filled
    present = [index for index, size in enumerate(sizes) if size > 0]
    if max_batches < len(present):
        counts = apportion(max_batches, [float(count) for count in leading])
    else:
        extra = apportion(max_batches - len(present), [float(count) for count in leading])
        counts = [extra[i] + (1 if sizes[i] > 0 else 0) for i in range(len(sizes))]
    return [min(count, most) for count, most in zip(counts, filled, strict=True)]


class SourceBatches(Sampler[list[int]]):
    """This rank's batches of ``held`` (positions in it), each from one source (module
    docstring); ``names`` names every source, ``of_batch`` the source of each batch."""

    def __init__(
        self,
        held: Interleave[object],
        *,
        batch_size: int,
        max_batches: int | None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.names = _names(held)
        sizes = [int(held.starts[i + 1] - held.starts[i]) for i in range(len(held.datasets))]
        window = len(held) if max_batches is None else min(len(held), max_batches * batch_size)
        leading_sources = np.searchsorted(held.starts, held.order[:window], side="right") - 1
        leading = np.bincount(leading_sources, minlength=len(sizes)).tolist()
        counts = source_batch_counts(sizes, leading, batch_size, max_batches)
        position = np.empty(len(held), dtype=np.int64)
        position[held.order] = np.arange(len(held), dtype=np.int64)  # where each item sits
        batches: list[tuple[int, int, list[int]]] = []
        for source, count in enumerate(counts):
            items = min(count * batch_size, sizes[source])
            where = position[held.starts[source] : held.starts[source] + items].tolist()
            for start in range(0, items, batch_size):
                chunk = where[start : start + batch_size]
                batches.append((chunk[0], source, chunk))
        batches.sort(key=lambda batch: batch[0])
        mine = batches[rank::world_size]
        self.batches = [chunk for _, _, chunk in mine]
        self.of_batch = tuple(source for _, source, _ in mine)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def held_out_parts(loader: object) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """``(names, of_batch)`` of a loader reading a mixture's held-out set source by
    source (``SourceBatches``), else ``None``."""
    if isinstance(loader, DataLoader) and isinstance(loader.batch_sampler, SourceBatches):
        return loader.batch_sampler.names, loader.batch_sampler.of_batch
    return None
