"""One outer round, written once for both modes: ``OuterRound`` is the component the hub
master (``master``) and the collective exchange (``collective_exchange``) each hold, and
the round runs through it the same way in both:

1. **collect** -- one ``Contribution`` per pseudo-gradient (its norm, staleness and work
   figure): the master's are the hub files it validated (``master_intake``), the
   collective's the numbers every replica all-gathers;
2. **judge** (``OuterRound.judge``) -- screen the norms of one streaming fragment
   (``""``: the whole model) against *that fragment's* history (a fragment's norm is not
   comparable with another's or the model's); while the history is short, the norm of the
   global's entries of that fragment bounds them (``aggregation.Screens``). The verdict is
   each contribution's ``clip`` (1: as is, below 1: clipped, 0: left out);
3. **weigh** (``OuterRound.weights``) -- each contribution's coefficient from its clip,
   its work share and its staleness, by the round's ``_Weighting`` policy;
4. **combine** -- the transport's own part: the master averages the hub deltas by key
   (``fragments.aggregate_by_key``), the replicas all-reduce (or all-gather the packed
   codes of a block codec);
5. **apply** -- the outer Nesterov step (``math.NesterovOuterOptimizer``):
   ``OuterRound.stepped`` moves *copies* of the master's published global and momentum (a
   failed publication leaves the master unchanged), ``OuterRound.step`` moves the
   collective baseline and momentum in place (there is nothing to publish);
6. **report** -- ``OuterRound.record`` remembers the norms as applied in the fragment's
   history once the round is committed (the master: after its publication; a replica:
   at once, every rank alike).

The two weighting policies differ by what the transport does with a left-out
pseudo-gradient, not by arithmetic (both average the kept ones, weighted by clip times
work share):

- ``KeptAverage`` (hub): a left-out delta is dropped from the round before combining and
  the combiner divides by the number of deltas kept, so a kept one weighs
  ``staleness_weight x share x clip`` -- stale hub deltas count less;
- ``ReplicaAverage`` (collective): every replica takes part in the collective whatever
  its verdict (a left-out one sends zeros), the all-reduce divides by the number of
  replicas, so the kept ones are rescaled by ``replicas / kept``; replicas of one job are
  never stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from speedtronic_callbacks.diloco.aggregation import (
    NormHistory,
    RobustSettings,
    Screening,
    Screens,
    screen,
    state_norm,
    work_weights,
)
from speedtronic_callbacks.diloco.math import NesterovOuterOptimizer, StateDict, staleness_weight

__all__ = [
    "Contribution",
    "KeptAverage",
    "OuterRound",
    "ReplicaAverage",
    "replica_coefficients",
    "share_by_work",
]


@dataclass
class Contribution:
    """One pseudo-gradient's figures on its way through a round."""

    norm: float
    staleness: int = 0
    """Outer steps the contribution's base is behind (always 0 for replicas of one job)."""
    clip: float = 1.0
    """The judge's factor: 1 applied as it came, below 1 clipped, 0 left out."""
    work: float = 0.0
    """The work figure its share comes from (0: the round is not weighted by work)."""
    share: float = 1.0
    """``work / mean(work)`` over the round's kept contributions (1: not weighted by work)."""


class _Weighting(Protocol):
    """How a round's contributions become the coefficients the transport combines with."""

    @property
    def name(self) -> str: ...

    def weights(self, contributions: Sequence[Contribution]) -> list[float]: ...


@dataclass(frozen=True)
class KeptAverage:
    """Hub mode: the contributions are the kept deltas only (the combiner divides by their
    number); each weighs ``staleness_weight(staleness, staleness_power) x share x clip``."""

    staleness_power: float

    @property
    def name(self) -> str:
        return "kept_average"

    def weights(self, contributions: Sequence[Contribution]) -> list[float]:
        power = self.staleness_power
        return [staleness_weight(c.staleness, power) * c.share * c.clip for c in contributions]


@dataclass(frozen=True)
class ReplicaAverage:
    """Collective mode: every replica's contribution, left-out ones included (clip 0: a
    zero coefficient); the all-reduce divides by the replica count, so ``share x clip`` of
    the kept ones is rescaled by ``count / kept`` (leaving one out averages the others;
    all zeros when none is kept)."""

    @property
    def name(self) -> str:
        return "replica_average"

    def weights(self, contributions: Sequence[Contribution]) -> list[float]:
        count = len(contributions)
        kept = [i for i, c in enumerate(contributions) if c.clip > 0]
        coefficients = [0.0] * count
        if not kept:
            return coefficients
        rescale = count / len(kept)
        for index in kept:
            coefficient = contributions[index].share * contributions[index].clip
            coefficients[index] = coefficient * rescale if rescale != 1.0 else coefficient
        return coefficients


class OuterRound:
    """A round's judge, weights and outer step (see the module docstring), with the norm
    history per fragment (``norms``) and the outer optimizer (``optimizer``: its
    hyper-parameters, and in collective mode its momentum) that persist across rounds."""

    def __init__(
        self,
        robust: RobustSettings,
        weighting: _Weighting,
        *,
        lr: float,
        momentum: float,
    ) -> None:
        self.norms = Screens(robust)
        """The recent applied pseudo-gradient norms, per fragment (checkpointed by the
        owner)."""
        self.weighting = weighting
        self.optimizer = NesterovOuterOptimizer(lr, momentum)

    def history(self, fragment: str) -> NormHistory:
        return self.norms.history(fragment)

    def judge(
        self,
        fragment: str,
        contributions: Sequence[Contribution],
        global_state: StateDict,
        keys: Iterable[str] | None,
    ) -> Screening:
        """Screen ``fragment``'s contributions against its own history and set their
        ``clip``; the global's norm over ``keys`` (the fragment's entries; ``None``: all)
        is computed only while that history is too short to trust its median. The history
        is unchanged (``record`` once the round is committed)."""
        norms = [c.norm for c in contributions]
        screening = self.norms.judge(fragment, norms, partial(state_norm, global_state, keys))
        for contribution, factor in zip(contributions, screening.factors, strict=True):
            contribution.clip = factor
        return screening

    def weights(self, contributions: Sequence[Contribution]) -> list[float]:
        """The coefficients the transport combines the contributions with."""
        return self.weighting.weights(contributions)

    def record(self, fragment: str, applied_norms: Iterable[float]) -> None:
        """Remember ``fragment``'s norms as applied (clipped ones at the bound)."""
        self.norms.record(fragment, applied_norms)

    def step(self, global_state: MutableMapping[str, torch.Tensor], combined: StateDict) -> None:
        """The outer step in place: ``global_state`` and ``optimizer``'s momentum move."""
        self.optimizer.step(global_state, combined)

    def stepped(
        self,
        global_state: Mapping[str, torch.Tensor],
        momentum: Mapping[str, torch.Tensor],
        combined: StateDict,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The outer step on copies: the new global (entries ``combined`` does not touch
        are shared, not copied) and momentum; the arguments and ``optimizer`` stay."""
        new_global = dict(global_state)
        for key in combined:
            new_global[key] = global_state[key].clone()
        optimizer = NesterovOuterOptimizer(self.optimizer.lr, self.optimizer.momentum)
        optimizer.buffers = {key: value.clone() for key, value in momentum.items()}
        optimizer.step(new_global, combined)
        return new_global, optimizer.buffers


def _replica_weights(
    screening: Screening, tokens: Sequence[int], samples: Sequence[int], *, weight_by_work: bool
) -> list[float]:
    """Collective mode's coefficients (``ReplicaAverage``): the screening factors times
    the work shares of the kept replicas (by tokens, else samples, else equal), rescaled by
    ``count / kept``."""
    contributions = [Contribution(norm=0.0, clip=factor) for factor in screening.factors]
    if weight_by_work:
        share_by_work(contributions, tokens, samples)
    return ReplicaAverage().weights(contributions)


def share_by_work(
    contributions: Sequence[Contribution], tokens: Sequence[int], samples: Sequence[int]
) -> None:
    """Set the kept contributions' ``share`` from the work each reports: its tokens over
    the kept ones' mean, else samples, else 1 (``aggregation.work_weights``). The work
    figures are trusted as they are (the replicas' own counters; the hub master caps and
    screens its deltas' claims first)."""
    kept = [i for i, c in enumerate(contributions) if c.clip > 0]
    if not kept:
        return
    shares = work_weights([tokens[i] for i in kept], [samples[i] for i in kept])
    for index, share in zip(kept, shares, strict=True):
        contributions[index].share = share


def replica_coefficients(
    norms: Sequence[float],
    tokens: Sequence[int],
    samples: Sequence[int],
    history: NormHistory,
    settings: RobustSettings,
    *,
    weight_by_work: bool,
    model_norm: float | None = None,
) -> tuple[list[float], Screening]:
    """``_replica_weights`` of this round's ``screen`` (``history`` is not changed)."""
    screening = screen(norms, history, settings, model_norm)
    return _replica_weights(screening, tokens, samples, weight_by_work=weight_by_work), screening
