"""What a fit returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from speedtronic.engine.metrics import MetricValue


@dataclass
class TrainResult:
    """The outcome of ``Trainer.fit``.

    ``steps``/``samples``/``tokens`` are cumulative (they include restored state after a
    resume); ``final_loss`` is the mean microbatch loss of the last update of this fit
    (``None`` when the fit ran no update); ``metrics`` holds every record that was due
    (logging cadence plus the final step), each as a plain dict.
    """

    steps: int
    samples: int
    tokens: int
    final_loss: float | None
    elapsed_s: float
    metrics: list[dict[str, MetricValue]] = field(default_factory=list)
    stop_reason: str | None = None
