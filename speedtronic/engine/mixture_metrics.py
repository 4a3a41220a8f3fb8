"""The samples and tokens a mixture has drawn from each source, in the metric record
(``data/<source>/samples``, ``data/<source>/tokens``), so a run shows its 70/30 split
happening.

Nothing is counted per step: the mixture's order is a pure function of ``(seed, epoch,
position)`` (``speedtronic.data.mixture``), so on a logging step the counts are computed from
where the data stream stands: in each epoch so far, the global positions the ranks' batches
covered (rank ``r`` reads positions ``r, r + W, ...``; a dropped short last batch is not read;
the positions a rank pads an epoch with wrap around to its start), dealt to the sources as
the mixture deals them. The figures are the whole run's (all ranks, resumed fits included)
on every rank, so no collective is needed. A source is named by its shard directory's name,
or by its index in ``data.mixture`` when two directories share a name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from torch.utils.data import DataLoader

from speedtronic.data.mixture import MixtureDataset, MixtureSampler
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import MetricsContext
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS
from speedtronic.engine.view import TrainerView

__all__ = ["MixtureMetrics", "mixture_metrics"]


def _source_names(mixture: MixtureDataset) -> list[str]:
    """Each source's name in metric keys (module docstring)."""
    names = [Path(str(getattr(source, "directory", index))).name for index, source in
             enumerate(mixture.sources)]  # fmt: skip
    return names if len(set(names)) == len(names) else [str(i) for i in range(len(names))]


class MixtureMetrics(Callback):
    """Contributes each source's drawn samples and tokens on logging steps only."""

    due_when = METRICS_ON_LOGGING_STEPS

    def __init__(self, sampler: MixtureSampler, batch_size: int, epoch_batches: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.epoch_batches = epoch_batches  # a rank's batches per epoch (drop_last counted)
        self.names = _source_names(sampler.mixture)
        self.block_size = int(sampler.mixture.sources[0].block_size)

    def _drawn_in(self, epoch: int, batches: int) -> npt.NDArray[np.int64]:
        """Each source's samples among the first ``batches`` batches of every rank in
        ``epoch``: the global positions read, those past the epoch's end wrapped around."""
        sampler, length = self.sampler, len(self.sampler.mixture)
        read = min(batches * self.batch_size, sampler.num_samples) * sampler.world_size
        whole = sampler.drawn_in_epoch(epoch, min(read, length))
        return whole + sampler.drawn_in_epoch(epoch, read - length)

    def drawn(self, epoch: int, batches_in_epoch: int) -> npt.NDArray[np.int64]:
        """Each source's samples drawn by all ranks before batch ``batches_in_epoch`` of
        every rank in epoch ``epoch``, the epochs before included."""
        total = np.zeros(len(self.names), dtype=np.int64)
        for past in range(epoch):
            total += self._drawn_in(past, self.epoch_batches)
        return total + self._drawn_in(epoch, batches_in_epoch)

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        position = trainer.data_position()
        drawn = self.drawn(int(position["epoch"]), int(position["batches_in_epoch"]))
        for name, samples in zip(self.names, drawn.tolist(), strict=True):
            ctx.record.set(f"data/{name}/samples", int(samples))
            ctx.record.set(f"data/{name}/tokens", int(samples) * self.block_size)


def mixture_metrics(loader: object) -> Sequence[Callback]:
    """``[MixtureMetrics]`` for a loader that reads a mixture, else nothing."""
    if not isinstance(loader, DataLoader) or not isinstance(loader.sampler, MixtureSampler):
        return []
    return [MixtureMetrics(loader.sampler, int(loader.batch_size or 1), len(loader))]
