"""Robust aggregation and work weighting of pseudo-gradients (hub master and collective).

Two rules, both pure arithmetic on norms and counts so the hub master and every rank of a
collective run compute the same answer from the same numbers (and both keep their memory of
recent rounds in ``Screens``):

**Outlier screening** (``outlier_policy``, ``outlier_factor``, ``outlier_window``). The
reference is the median of the recent norms (``NormHistory``: the last ``window`` norms
that were applied, clipped ones at their clipped value) together with the norms of this
round. A pseudo-gradient whose norm is above ``factor x median`` is an outlier: ``clip``
scales it down to that bound, ``reject`` leaves it out. While fewer than
``_MIN_REFERENCE`` norms are known the median is not trusted and the bound is ``factor x``
the norm of the global model's synchronised weights instead (an honest pseudo-gradient of
H inner steps moves the model by a fraction of its own size; a zero model sets no bound).
A non-finite norm is always left out unless the policy is ``off``. So a pseudo-gradient
of 1e6-valued entries is never applied as it is.

**Work weighting** (``weight_by_work``). Each pseudo-gradient counts ``work_i / mean(work)``
where work is the tokens trained for it when every one in the round reports tokens, else
the samples, else nothing (weight 1; ``work_unit``). Equal work gives weight exactly 1, so
a round of equal nodes averages as before. In hub mode this multiplies the staleness
weight, and a work figure is a claim in a file: the master caps it at what the node could
have trained (``work_cap``: at most ``inner_steps`` steps of at most the largest batch)
and screens the capped figures with the outlier rule above, so no delta takes more than a
bounded share of a round.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from speedtronic_callbacks.diloco.math import StateDict, as_real_fp32

__all__ = [
    "NormHistory",
    "RobustSettings",
    "Screening",
    "Screens",
    "screen",
    "state_norm",
    "work_cap",
    "work_shares",
    "work_unit",
    "work_weights",
]

_MIN_REFERENCE = 3
"""Norms needed (history plus this round) before their median is the reference."""

_Policy = Literal["clip", "reject", "off"]


@dataclass(frozen=True)
class RobustSettings:
    """The outlier rule (see the module docstring)."""

    policy: _Policy = "clip"
    factor: float = 10.0
    window: int = 16

    def __post_init__(self) -> None:
        if self.policy not in ("clip", "reject", "off"):
            raise ValueError(f"outlier_policy must be clip, reject or off, got {self.policy!r}")
        if not self.factor > 1:
            raise ValueError(f"outlier_factor must be > 1, got {self.factor}")
        if self.window < 1:
            raise ValueError(f"outlier_window must be >= 1, got {self.window}")


class NormHistory:
    """The last ``window`` applied pseudo-gradient norms (checkpointed with its owner)."""

    def __init__(self, window: int, norms: Iterable[float] = ()) -> None:
        self.window = window
        self.norms: deque[float] = deque((float(n) for n in norms), maxlen=window)

    def record(self, norms: Iterable[float]) -> None:
        self.norms.extend(float(n) for n in norms if math.isfinite(n))

    def to_list(self) -> list[float]:
        return list(self.norms)

    @classmethod
    def from_state(cls, window: int, value: object) -> NormHistory:
        """Rebuild from ``to_list`` output; ``ValueError`` on anything else."""
        if value is None:
            return cls(window)
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(n, (int, float)) and not isinstance(n, bool) for n in value
        ):
            raise ValueError("diloco state: 'norm_history' must be a list of numbers")
        return cls(window, value)


@dataclass(frozen=True)
class Screening:
    """One round's verdicts: ``factors[i]`` scales pseudo-gradient ``i`` (1: as is, below 1:
    clipped, 0: left out); ``bound`` is the norm limit used (``None``: no limit)."""

    factors: tuple[float, ...]
    bound: float | None

    @property
    def kept(self) -> int:
        return sum(1 for factor in self.factors if factor > 0)

    @property
    def outliers(self) -> tuple[int, ...]:
        return tuple(i for i, factor in enumerate(self.factors) if factor != 1.0)

    def applied_norms(self, norms: Sequence[float]) -> list[float]:
        """The norms as applied (clipped ones at the bound), for ``NormHistory.record``."""
        return [norm * factor for norm, factor in zip(norms, self.factors, strict=True) if factor]


def screen(
    norms: Sequence[float],
    history: NormHistory,
    settings: RobustSettings,
    model_norm: float | None = None,
) -> Screening:
    """Judge one round's pseudo-gradient ``norms`` against ``history`` (which it does not
    change: record ``applied_norms`` once the round is committed). ``model_norm`` is the
    global model's norm, the reference while fewer than ``_MIN_REFERENCE`` norms are known."""
    if settings.policy == "off":
        return Screening(tuple(1.0 for _ in norms), None)
    finite = [norm for norm in norms if math.isfinite(norm)]
    reference = [*history.norms, *finite]
    bound: float | None = None
    if len(reference) >= _MIN_REFERENCE:
        bound = settings.factor * statistics.median(reference)
    elif model_norm is not None and model_norm > 0:
        bound = settings.factor * model_norm
    factors: list[float] = []
    for norm in norms:
        if not math.isfinite(norm):
            factors.append(0.0)
        elif bound is None or norm <= bound:
            factors.append(1.0)
        elif settings.policy == "reject" or bound <= 0:
            factors.append(0.0)
        else:
            factors.append(bound / norm)
    return Screening(tuple(factors), bound)


class Screens:
    """The outlier rule's memory across rounds: one ``NormHistory`` per group of figures
    that are comparable -- the pseudo-gradient norms of one streaming fragment (``"p/P"``;
    ``""``: the whole model), or the work claims in one unit -- and which reference a round
    is judged by. The hub master keeps one for norms and one for work; a collective run one
    for norms, on every rank alike."""

    def __init__(self, settings: RobustSettings) -> None:
        self.settings = settings
        self.histories: dict[str, NormHistory] = {}

    def history(self, group: str) -> NormHistory:
        """The recent applied figures of ``group`` (created empty)."""
        history = self.histories.get(group)
        if history is None:
            history = self.histories[group] = NormHistory(self.settings.window)
        return history

    def judge(
        self,
        group: str,
        values: Sequence[float],
        model_norm: Callable[[], float] | None = None,
    ) -> Screening:
        """``screen`` one round's ``values`` of ``group`` against its history (unchanged:
        ``record`` what was applied once the round is committed). While the history and the
        round hold fewer than ``_MIN_REFERENCE`` figures, ``model_norm()`` -- the norm of the
        global entries the pseudo-gradients move, computed only then -- sets the bound."""
        history = self.history(group)
        reference = None
        if model_norm is not None and len(history.norms) + len(values) < _MIN_REFERENCE:
            reference = model_norm()
        return screen(values, history, self.settings, reference)

    def record(self, group: str, applied: Iterable[float]) -> None:
        """Remember ``group``'s figures as applied (``Screening.applied_norms``)."""
        self.history(group).record(applied)


def work_unit(tokens: Sequence[int], samples: Sequence[int]) -> str | None:
    """What weights a round: ``"tokens"`` when every delta reports tokens, else
    ``"samples"`` when every one reports samples, else ``None`` (equal weights)."""
    for unit, counts in (("tokens", tokens), ("samples", samples)):
        if counts and all(count > 0 for count in counts):
            return unit
    return None


def work_cap(steps: int | None, inner_steps: int | None, per_step: int | None) -> int | None:
    """The most work a delta may claim: ``min(steps, inner_steps) x per_step``, where
    ``steps`` is the length of its step range and ``per_step`` the most one optimizer step
    trains (``None`` when not known: no cap). Either bound alone caps the steps; with
    neither there is no cap."""
    if per_step is None or per_step <= 0:
        return None
    bounds = [value for value in (steps, inner_steps) if value is not None]
    return min(bounds) * per_step if bounds else None


def work_weights(tokens: Sequence[int], samples: Sequence[int]) -> list[float]:
    """``work_i / mean(work)`` by tokens, else samples, else 1 (see the module docstring)."""
    for counts in (tokens, samples):
        if counts and all(count > 0 for count in counts):
            return work_shares(counts)
    return [1.0] * max(len(tokens), len(samples))


def work_shares(figures: Sequence[float]) -> list[float]:
    """Each figure's share of a round's work, ``figure / mean(figures)`` (exactly 1 when
    they are equal, so a round of equal work averages plainly)."""
    mean = sum(figures) / len(figures)
    return [figure / mean for figure in figures]


def state_norm(state: StateDict, keys: Iterable[str] | None = None) -> float:
    """The float64 L2 norm over ``keys`` of ``state`` (default: all), complex entries as
    their real and imaginary parts."""
    total = 0.0
    for key in keys if keys is not None else state:
        tensor = as_real_fp32(state[key].detach().cpu())
        total += float(torch.linalg.vector_norm(tensor, dtype=torch.float64)) ** 2
    return math.sqrt(total)
