"""The log-likelihood of continuations: what multiple-choice tasks and the lm-evaluation-
harness adapter ask of a model.

``score_continuations`` runs ``(prompt ids, continuation ids)`` pairs through any causal LM
returning ``{"logits"}`` (or ``.logits``) and returns, for each, the summed log-probability
of the continuation's tokens after the prompt and whether each of them was the model's most
likely token (greedy). Pairs are sorted by length and run in batches of ``batch_size``,
right-padded: with causal attention the padding after a sequence cannot change its logits,
so no mask is needed, and ``n`` pairs cost ``ceil(n / batch_size)`` forward passes. The last
token is only predicted, so ``context + 1`` tokens fit; a prompt too long for the model's
``context`` loses its oldest tokens. The model runs in eval mode
under ``inference_mode`` (and the run's autocast), and its mode is restored.

Ranks of an FSDP-sharded model gather each unit's shards together in every forward pass, so
they must run the same number of passes whatever their share of the pairs: with
``lockstep`` (their ``DistributedContext``) the ranks agree on the largest count first (one
all-reduce, before any pass) and a rank with fewer batches then runs one-token passes until
it has made as many.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from speedtronic.systems.distributed import DistributedContext
    from speedtronic.systems.precision import PrecisionPlan

__all__ = ["Continuation", "LikelihoodError", "score_continuations"]


class LikelihoodError(ValueError):
    """A pair that cannot be scored (the message names it by its ``label``)."""


@dataclass(frozen=True)
class Continuation:
    """A prompt and the continuation to score after it; ``label`` names it in errors."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    label: str = "a continuation"


@dataclass(frozen=True)
class _Scored:
    logprob: float
    greedy: bool


def _fit(item: Continuation, context: int | None) -> tuple[list[int], int]:
    """The ids to run (the prompt cut from the left to fit) and where the continuation
    starts."""
    if not item.tokens:
        raise LikelihoodError(f"{item.label} is empty")
    ids = [*item.prompt, *item.tokens]
    # The last token is only predicted, never an input: ``context + 1`` ids fit.
    if context is not None and len(ids) - 1 > context:
        if len(item.tokens) > context:
            raise LikelihoodError(
                f"{item.label} alone is longer than the model's context of {context} tokens"
            )
        ids = ids[len(ids) - context - 1 :]
    start = len(ids) - len(item.tokens)
    if start == 0:
        raise LikelihoodError(
            f"{item.label} has an empty prompt: its first token has nothing to be predicted from"
        )
    return ids, start


def _batches(order: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(order), size):
        yield order[start : start + size]


def _score_batch(
    model: nn.Module, fitted: Sequence[tuple[list[int], int]], device: torch.device
) -> list[_Scored]:
    width = max(len(ids) for ids, _ in fitted) - 1
    padded = torch.zeros((len(fitted), width), dtype=torch.long)
    for i, (ids, _) in enumerate(fitted):
        padded[i, : len(ids) - 1] = torch.tensor(ids[:-1], dtype=torch.long)
    output = model(padded.to(device))
    logits = output["logits"] if isinstance(output, Mapping) else output.logits
    sums, greedy = [], []
    for i, (ids, start) in enumerate(fitted):
        # Position t predicts token t + 1: the continuation is read from start - 1.
        rows = logits[i, start - 1 : len(ids) - 1].float().log_softmax(dim=-1)
        targets = torch.tensor(ids[start:], device=rows.device)
        sums.append(rows.gather(1, targets[:, None]).sum())
        greedy.append((rows.argmax(dim=-1) == targets).all())
    values = torch.stack(sums).tolist()
    flags = torch.stack(greedy).tolist()
    return [_Scored(float(v), bool(g)) for v, g in zip(values, flags, strict=True)]


def _passes_to_match(passes: int, lockstep: DistributedContext | None, device: torch.device) -> int:
    """How many more passes this rank makes to match the rank that makes the most."""
    if lockstep is None or lockstep.world_size <= 1:
        return 0
    import torch.distributed as dist

    most = torch.tensor([passes], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item()) - passes


def score_continuations(
    model: nn.Module,
    items: Sequence[Continuation],
    *,
    device: torch.device,
    batch_size: int = 16,
    context: int | None = None,
    precision: PrecisionPlan | None = None,
    lockstep: DistributedContext | None = None,
) -> tuple[list[_Scored], int]:
    """Each item's score, in the order given, and the number of forward passes made
    (module docstring; ``lockstep``: as many passes as the other ranks make).
    ``LikelihoodError`` for an item that cannot be scored."""
    from speedtronic.systems.precision import autocast_context

    if batch_size < 1:
        raise LikelihoodError(f"batch_size must be positive, got {batch_size}")
    fitted = [_fit(item, context) for item in items]
    order = sorted(range(len(items)), key=lambda i: -len(fitted[i][0]))
    scores: list[_Scored | None] = [None] * len(items)
    passes = 0
    autocast = (
        autocast_context(precision, device)
        if precision is not None and precision.autocast_enabled
        else contextlib.nullcontext()
    )
    # Agreed before any pass: a collective between passes would meet another rank's gather.
    padding = _passes_to_match(-(-len(order) // batch_size), lockstep, device)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast:
            for batch in _batches(order, batch_size):
                for index, scored in zip(
                    batch, _score_batch(model, [fitted[i] for i in batch], device), strict=True
                ):
                    scores[index] = scored
                passes += 1
            for _ in range(padding):
                model(torch.zeros((1, 1), dtype=torch.long, device=device))
                passes += 1
    finally:
        model.train(was_training)
    return [score for score in scores if score is not None], passes
