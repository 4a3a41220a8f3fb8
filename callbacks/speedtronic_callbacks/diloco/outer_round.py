"""What one outer round does in both modes, written once: the hub master (``master``,
``master_intake``) and the collective exchange (``collective``, ``collective_exchange``)
judge a fragment's pseudo-gradients here; the arithmetic they share besides is in
``aggregation`` (screening, work shares), ``fragments`` and ``math`` (the outer step).

A round, per streaming fragment (``""``: the whole model without fragments):

1. ``judge_fragment`` -- screen the round's pseudo-gradient norms against *that
   fragment's* history (a fragment's norm is not comparable with another fragment's or the
   model's); while the history is short, the norm of the global's entries of that fragment
   bounds them (``aggregation.Screens``);
2. the modes combine the kept pseudo-gradients their own way -- the master averages hub
   files by key with staleness and work weights, the replicas all-reduce (or all-gather the
   packed codes of a block codec) -- because what travels and what is trusted differ;
3. the outer Nesterov step (``math.NesterovOuterOptimizer.step``) moves the fragment's
   keys of the global and its momentum in place: the master steps copies of its published
   state (a failed publication leaves it unchanged), the collective exchange its baseline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial

from speedtronic_callbacks.diloco.aggregation import Screening, Screens, state_norm
from speedtronic_callbacks.diloco.math import StateDict

__all__ = ["judge_fragment"]


def judge_fragment(
    screens: Screens,
    fragment: str,
    norms: Sequence[float],
    global_state: StateDict,
    keys: Iterable[str] | None,
) -> Screening:
    """Screen ``fragment``'s pseudo-gradient ``norms`` against its own history; the
    global's norm over ``keys`` (the fragment's entries; ``None``: all) is computed only
    while that history is too short to trust its median. The history is unchanged
    (``Screens.record`` once the round is committed)."""
    return screens.judge(fragment, norms, partial(state_norm, global_state, keys))
