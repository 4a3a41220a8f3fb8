"""The metric keys of a DiLoCo run's evaluation of its *global* model.

``eval/loss`` and ``eval/ppl`` are always the local model's (every node, every replica). The
global model's held-out numbers go under their own keys, so that a numeric sink can tell the
two apart: the hub master adds them after evaluating each global model it installs, the
collective mode on evaluation steps that end an outer round (see ``docs/evaluation.md``).
"""

from __future__ import annotations

import math

__all__ = ["GLOBAL_EVAL_LOSS", "GLOBAL_EVAL_OUTER_STEP", "GLOBAL_EVAL_PPL", "global_eval_metrics"]

GLOBAL_EVAL_LOSS = "diloco/eval_global/loss"
"""The held-out loss of the global model."""
GLOBAL_EVAL_PPL = "diloco/eval_global/ppl"
"""``exp(diloco/eval_global/loss)``."""
GLOBAL_EVAL_OUTER_STEP = "diloco/eval_global/outer_step"
"""The outer step of the global model that ``diloco/eval_global/loss`` evaluated."""


def global_eval_metrics(loss: float, outer_step: int) -> dict[str, int | float]:
    """The three keys for a global model of ``outer_step`` with held-out loss ``loss``."""
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = math.inf
    return {GLOBAL_EVAL_LOSS: loss, GLOBAL_EVAL_PPL: perplexity, GLOBAL_EVAL_OUTER_STEP: outer_step}
