"""The engine's reduction of logged metrics over ranks (a callback the trainer attaches in
distributed runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import MetricsContext
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView
    from speedtronic.systems.distributed import DistributedContext

__all__ = ["RankMetricReducer"]


class RankMetricReducer(Callback):
    """Makes the logged metrics global: on logging steps only, one all-reduce turns the
    local loss (and grad norm) into the mean over ranks and the sample/token counts and
    rates into sums. The trainer adds it, last among the contributors, in distributed runs."""

    MEAN_KEYS: ClassVar[tuple[str, ...]] = ("loss", "grad_norm")
    SUM_KEYS: ClassVar[tuple[str, ...]] = ("samples", "tokens", "samples_per_sec", "tokens_per_sec")
    due_when = METRICS_ON_LOGGING_STEPS  # on_metrics only on logging steps

    def __init__(self, context: DistributedContext, batch_sharers: int = 1) -> None:
        self.context = context
        self.batch_sharers = batch_sharers
        """Ranks training on the same batch (the tensor-parallel degree): the sums count
        each batch once."""

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        record = ctx.record
        present = [key for key in (*self.MEAN_KEYS, *self.SUM_KEYS) if key in record]
        values = record.finished()  # one host transfer; sinks reuse the materialised values
        numbers = [values[key] for key in present]
        local = torch.tensor(
            [float(n) if isinstance(n, (int, float)) else 0.0 for n in numbers],
            dtype=torch.float64,
            device=self.context.collective_device,
        )
        dist.all_reduce(local)
        world = self.context.world_size
        for key, total, original in zip(present, local.tolist(), numbers, strict=True):
            if key in self.MEAN_KEYS:
                record.set(key, total / world)
            elif isinstance(original, int):
                record.set(key, int(round(total / self.batch_sharers)))
            else:
                record.set(key, total / self.batch_sharers)
