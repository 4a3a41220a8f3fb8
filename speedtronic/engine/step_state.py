"""Per-fit step state besides the counters: where the fit's clock started, and what callbacks
asked for during a step (stop after it, reset the optimizer).

The counters themselves (``step``, ``samples``, ``tokens``, ``step_loss``) are plain trainer
attributes: the loop updates them every microbatch, and plugins read them through
``TrainerView``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FitClock", "StepRequests"]


@dataclass(frozen=True)
class FitClock:
    """Where a fit started, for invocation-local rates."""

    start_time: float
    start_step: int
    start_samples: int
    start_tokens: int


class StepRequests:
    """Requests callbacks made: a stop (the first reason wins; in a multi-rank run the
    ranks agree on it, ``agreed_stop``) and optimizer resets for the current step."""

    __slots__ = ("agreed_stop", "resets", "stop_reason")

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.agreed_stop: str | None = None
        self.resets: list[str] = []

    def begin_fit(self) -> None:
        """A new fit starts: earlier stop requests no longer apply."""
        self.stop_reason = None
        self.agreed_stop = None

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def request_reset(self, requested_by: str) -> None:
        self.resets.append(requested_by)

    def take_resets(self) -> tuple[str, ...]:
        """Who asked for a reset in this step; clears the requests."""
        requested = tuple(self.resets)
        self.resets.clear()
        return requested
