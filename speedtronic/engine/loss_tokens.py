"""One loss normalisation: the mean over the loss-bearing tokens of the whole optimizer step.

A model's loss is the mean over its microbatch's loss-bearing labels (the ones that are not
``-100``). Averaging those means (``loss / K`` per microbatch, then DDP's average over the
ranks) weights a token of a microbatch with few loss-bearing labels more than one of a full
microbatch -- the "mean of means" that packed or masked (SFT) data gets wrong. Instead each
microbatch's loss is divided by ``N / (c * W)``: ``c`` its loss-bearing labels, ``N`` those of
the whole step (every microbatch of every rank that averages gradients with this one), ``W``
those ranks. Summed over the microbatches and averaged by DDP, the gradient is then that of
the mean over all ``N`` tokens.

The counts are known before the first forward pass: the loop takes the step's ``K`` batches
at its start, counts their labels on the host (before they move to the device: no device
sync) and, across ranks, all-reduces the sum once per step -- a tensor that stays on the
device: the divisions read it there, so the host never waits for the collective.

When every microbatch has the same count (``N == K * c * W``: plain pretraining windows,
synthetic data) the divisor is the integer ``K`` itself, so the arithmetic -- and every
gradient -- is bitwise the one of ``loss / K``. A batch without integer labels (a regression
target, a model that takes no labels) has no count: such a step keeps ``loss / K``.

A microbatch without a loss-bearing label contributes nothing, whatever its model computes:
a model's own mean over no token is 0 / 0 (``F.cross_entropy`` gives a NaN loss, a
hand-written masked mean NaN gradients too), so its loss is not backpropagated at all. A zero
is, through the model's other outputs (the logits: the same graph, so DDP and FSDP see every
parameter they expect) or, when it returns the loss alone, through the trainable parameters;
the loss it reports is 0 (it weighs nothing in the step's mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from speedtronic.engine.batch import IGNORE_INDEX, batch_labels

__all__ = [
    "NOTHING_TO_LEARN",
    "StepWeights",
    "loss_token_count",
    "nothing_to_learn",
    "step_weights",
]

_CountReducer = Callable[[int], torch.Tensor]
"""Sums a rank's count over the ranks that average gradients with it, as a tensor on the
collective device: never read on the host, so the step does not wait for the device."""

NOTHING_TO_LEARN = math.inf
"""The divisor of a microbatch without a loss-bearing label (compared by identity)."""

Divisor = int | float | torch.Tensor
"""A microbatch loss's divisor: the integer ``K``, ``inf`` (nothing to learn), or, across
ranks, ``N / (c * W)`` with ``N`` still on the device."""


def loss_token_count(batch: object) -> int | None:
    """The loss-bearing labels of ``batch`` (not ``-100``), or None without integer labels."""
    labels = batch_labels(batch)
    if labels is None or labels.is_floating_point() or labels.is_complex():
        return None
    return int((labels != IGNORE_INDEX).sum())


class StepWeights:
    """The divisor of each microbatch's loss in one step (``divisors``), and whether this
    rank's microbatches all hold as many loss-bearing tokens (``uniform``)."""

    __slots__ = ("counts", "divisors", "local_total", "uniform")

    def __init__(
        self, counts: Sequence[int], divisors: Sequence[Divisor], local_total: int
    ) -> None:
        self.counts = counts
        self.divisors = divisors
        self.local_total = local_total
        self.uniform = all(count == counts[0] for count in counts)

    def mean(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's mean loss over its loss-bearing tokens, from the microbatches'
        (detached) mean losses."""
        weighted = losses[0] * self.counts[0]
        for loss, count in zip(losses[1:], self.counts[1:], strict=True):
            weighted = weighted + loss * count
        return weighted / max(1, self.local_total)


def step_weights(
    batches: Sequence[object], ranks: int, reduce: _CountReducer | None
) -> StepWeights | None:
    """The step's weights (module docstring), or None when a batch has no labels to count
    (the loop then divides by ``K``). ``reduce`` sums over the ``ranks`` ranks (None: one)."""
    counts: list[int] = []
    for batch in batches:
        count = loss_token_count(batch)
        if count is None:
            return None
        counts.append(count)
    local = sum(counts)
    k = len(batches)
    if reduce is None or ranks <= 1:
        return StepWeights(counts, [_divisor(count, k, local) for count in counts], local)
    total = reduce(local)  # on the device: read only by the divisions below
    divisors: list[Divisor] = [
        NOTHING_TO_LEARN if count == 0 else total / (count * ranks) for count in counts
    ]  # a count that agrees everywhere gives exactly K: total / (c W) is an integer
    return StepWeights(counts, divisors, local)


def _divisor(count: int, k: int, total: int) -> int | float:
    """One rank's divisor: the integer ``K`` when the counts agree (exactly ``loss / K``),
    ``inf`` for a microbatch with nothing to learn (a zero gradient), else ``N / c``."""
    if count * k == total:
        return k
    if count == 0:
        return NOTHING_TO_LEARN
    return total / count


def nothing_to_learn(
    output: object, loss: torch.Tensor, parameters: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a microbatch without a loss-bearing label (its divisor ``NOTHING_TO_LEARN``): the
    loss to report (0) and a zero to backpropagate instead of the loss (module docstring)."""
    values: Sequence[object] = ()
    if isinstance(output, Mapping):
        values = list(output.values())
    elif isinstance(output, Sequence) and not isinstance(output, str):
        values = output
    others = [
        value
        for value in values
        if isinstance(value, torch.Tensor)
        and value is not loss
        and value.grad_fn is not None
        and value.is_floating_point()
    ]
    reach = others or [p for p in parameters if p.requires_grad]
    zero = torch.stack([value.sum() for value in reach]).sum() * 0.0
    return torch.zeros_like(loss.detach()), zero
