"""The batch layout of a run -- micro-batch x accumulation x data-parallel ranks, the global
batch -- and how it changes while the global batch stays fixed.

A checkpoint records the layout it was written with (``"batch"``: ``micro``,
``accumulation``, ``ranks``) beside the data position, whose ``samples`` entry is a global
cursor: how many positions of the epoch's order all ranks together have consumed
(``speedtronic.data.stream``). Ranks take strided positions of one global order, so the
positions of a global batch are the same whatever the layout; only which rank reads which
of them changes.

Resumed on the same number of ranks, the run keeps its configured layout (and its exact
batches). Resumed on another number of data-parallel ranks (2 -> 1, 1 -> 2, 2 -> 4), the
checkpoint's global batch is kept: each rank now takes ``global / ranks`` samples per step,
as the largest micro-batch up to the configured one that divides that share (and the
cursor's share of this rank), accumulated as many times as needed. A global batch that the
new rank count does not divide is refused (``ElasticResumeError``, exit 2 from the CLI)
before anything of the trainer changes.

The micro-batch is the batch size of the loader's ``BatchSampler`` (a loader over a
``ResumableSampler``: ``build_dataloader``'s loaders); a source without one has fixed
batches and keeps its layout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.utils.data import BatchSampler, DataLoader

from speedtronic.data.stream import data_shards
from speedtronic.state.training_state import TrainingStateError
from speedtronic.systems.distributed import SameOnEveryRankError

if TYPE_CHECKING:
    from speedtronic.engine.trainer import Trainer

__all__ = [
    "BatchLayout",
    "ElasticResumeError",
    "LAYOUT_KEY",
    "apply_layout",
    "current_layout",
    "resume_layout",
    "saved_layout",
]

LAYOUT_KEY = "batch"
"""Where a training state records its ``BatchLayout``."""

logger = logging.getLogger(__name__)


class ElasticResumeError(TrainingStateError, SameOnEveryRankError):
    """A checkpoint's global batch cannot be kept on this run's ranks (every rank finds it
    alike: the CLI prints it once)."""


@dataclass(frozen=True)
class BatchLayout:
    """Samples per forward pass on one rank (``micro``), forward passes per optimizer step
    (``accumulation``) and data-parallel ranks (``ranks``)."""

    micro: int
    accumulation: int
    ranks: int

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, all ranks together."""
        return self.micro * self.accumulation * self.ranks

    def to_dict(self) -> dict[str, int]:
        return {"micro": self.micro, "accumulation": self.accumulation, "ranks": self.ranks}

    def describe(self) -> str:
        return (
            f"{self.global_batch} samples (micro-batch {self.micro} x accumulation "
            f"{self.accumulation} x {self.ranks} rank(s))"
        )


def _batch_sampler(source: object) -> BatchSampler | None:
    if isinstance(source, DataLoader) and isinstance(source.batch_sampler, BatchSampler):
        return source.batch_sampler
    return None


def current_layout(trainer: Trainer) -> BatchLayout | None:
    """The layout ``trainer`` runs with; None when its data has no adjustable batch size."""
    source = trainer.state.stream.source
    sampler = _batch_sampler(source)
    if sampler is None:
        return None
    return BatchLayout(sampler.batch_size, trainer.settings.accumulation_steps, data_shards(source))


def _set_micro_batch(source: object, micro: int) -> None:
    """Make ``source`` (a loader with a ``BatchSampler``) hand out batches of ``micro``."""
    sampler = _batch_sampler(source)
    if sampler is None:
        raise ValueError("the data source has fixed batches: its micro-batch cannot change")
    sampler.batch_size = micro
    # DataLoader refuses to set batch_size after construction; its BatchSampler (what
    # iterating reads) just changed, so the attribute only follows it.
    object.__setattr__(source, "batch_size", micro)


def apply_layout(trainer: Trainer, layout: BatchLayout) -> None:
    """Run ``trainer`` with ``layout``'s micro-batch and accumulation (its ranks are the
    run's); takes effect when the data stream next opens its pass."""
    _set_micro_batch(trainer.state.stream.source, layout.micro)
    if layout.accumulation != trainer.settings.accumulation_steps:
        trainer.settings = dataclasses.replace(
            trainer.settings, accumulation_steps=layout.accumulation
        )


def saved_layout(state: Mapping[str, object]) -> BatchLayout | None:
    """The layout a training state records (None when it records none)."""
    saved = state.get(LAYOUT_KEY)
    if not isinstance(saved, Mapping):
        return None  # written before layouts were recorded
    values = [saved.get(key) for key in ("micro", "accumulation", "ranks")]
    if not all(isinstance(value, int) and value > 0 for value in values):
        raise TrainingStateError(f"the checkpoint's batch layout {dict(saved)!r} is not valid")
    return BatchLayout(*(int(str(value)) for value in values))


def _saved_cursor(state: Mapping[str, object]) -> int | None:
    data = state.get("data")
    cursor = data.get("samples") if isinstance(data, Mapping) else None
    return cursor if isinstance(cursor, int) and cursor >= 0 else None


def resume_layout(trainer: Trainer, state: Mapping[str, object]) -> BatchLayout | None:
    """The layout that resuming from ``state`` needs, when it differs from the trainer's
    (module docstring); None to keep the trainer's. ``ElasticResumeError`` when the
    checkpoint's global batch cannot be kept on this run's ranks."""
    saved = saved_layout(state)
    current = current_layout(trainer)
    if saved is None or current is None or saved.ranks == current.ranks:
        return None
    if saved.global_batch == current.global_batch:
        return None  # the config already keeps it
    share, rest = divmod(saved.global_batch, current.ranks)
    cursor = _saved_cursor(state)
    if rest:
        raise ElasticResumeError(
            f"the checkpoint's global batch is {saved.describe()}, which {current.ranks} "
            f"data-parallel ranks cannot share equally ({saved.global_batch} is not a multiple "
            f"of {current.ranks}): resume on a rank count that divides {saved.global_batch}"
        )
    if cursor is not None and cursor % current.ranks:
        raise ElasticResumeError(
            f"the checkpoint's data position ({cursor} samples into the epoch, all ranks "
            f"together) is not a multiple of {current.ranks} ranks: resume on "
            f"{saved.ranks} rank(s), or on a rank count that divides {cursor}"
        )
    limit = share if cursor is None else math.gcd(share, cursor // current.ranks)
    micro = max(d for d in range(1, min(current.micro, limit) + 1) if limit % d == 0)
    layout = BatchLayout(micro, share // micro, current.ranks)
    distributed = trainer.state.distributed
    if distributed is None or distributed.is_main:  # once per job
        # A warning: the checkpoint's layout overrides the config's batch sizes.
        logger.warning(
            "resumed on %d data-parallel rank(s) instead of %d: the global batch stays %s",
            current.ranks,
            saved.ranks,
            layout.describe(),
        )
    return layout
