"""Several map-style datasets read as one, interleaved in proportion: a mixture's held-out set.

Read source after source, a bounded evaluation (``eval.max_batches``) of a mixture's held-out
set would see only its first source. ``Interleave`` holds every item of every dataset once,
in a fixed order where each prefix holds each dataset in proportion to its size (within one
item): item ``j`` of dataset ``s`` (of ``n_s`` items) sits at time ``(j + phase_s) / n_s``,
and the items are read by time. The phases come from ``seed``, so the order is the same on
every run, rank and resume; within one dataset the items keep their order (its reads stay
local).
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Generic, TypeVar

import numpy as np
from torch.utils.data import Dataset

__all__ = ["Interleave"]

_ItemT = TypeVar("_ItemT")


class Interleave(Dataset[_ItemT], Generic[_ItemT]):
    """Every item of ``datasets`` once, dealt in proportion to their sizes (module
    docstring). ``source(index)`` names the dataset position ``index`` reads from."""

    def __init__(self, datasets: Sequence[Dataset[_ItemT]], *, seed: int) -> None:
        self.datasets = list(datasets)
        sizes = np.array([len(d) if isinstance(d, Sized) else 0 for d in self.datasets])
        if any(not isinstance(d, Sized) for d in self.datasets):
            raise TypeError("Interleave reads map-style datasets with a length")
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        phases = np.random.default_rng(seed).random(len(sizes))
        times = np.concatenate(
            [(np.arange(size) + phases[s]) / max(size, 1) for s, size in enumerate(sizes)]
        )
        self.order = np.argsort(times, kind="stable").astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def source(self, index: int) -> int:
        """The position in ``datasets`` of the dataset item ``index`` comes from."""
        return int(np.searchsorted(self.starts, self.order[index], side="right")) - 1

    def __getitem__(self, index: int) -> _ItemT:
        source = self.source(index)
        return self.datasets[source][int(self.order[index] - self.starts[source])]
