"""AdamW options and construction, with the fused-kernel fallback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speedtronic.optimizers.routing import NamedParameter

__all__ = ["AdamWOptions", "make_adamw"]


@dataclass(frozen=True)
class AdamWOptions:
    """Hyper-parameters of an AdamW (plain, or the hybrid's auxiliary branch).
    ``fused=True`` tries fused AdamW and falls back to the regular one if it cannot be built."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    fused: bool = False
    decay_norms_and_biases: bool = True
    """``False``: 1-D and scalar parameters (biases, normalisation gains) get their own
    group with weight decay 0 (``optimizer.decay_norms_and_biases``)."""


def _groups(params: Sequence[NamedParameter], options: AdamWOptions) -> list[dict[str, object]]:
    """One group, or -- without decay on norms and biases -- the matrices, then the 1-D and
    scalar parameters with weight decay 0 (an empty group is left out)."""
    if options.decay_norms_and_biases:
        return [{"params": list(params), "algorithm": "adamw"}]
    matrices = [item for item in params if item[1].ndim >= 2]
    vectors = [item for item in params if item[1].ndim < 2]
    groups: list[dict[str, object]] = []
    if matrices:
        groups.append({"params": matrices, "algorithm": "adamw"})
    if vectors:
        groups.append({"params": vectors, "algorithm": "adamw", "weight_decay": 0.0})
    return groups


def _adamw(
    params: Sequence[NamedParameter], options: AdamWOptions, fused: bool | None
) -> torch.optim.AdamW:
    # Fresh groups each try: construction mutates the group dicts.
    return torch.optim.AdamW(
        _groups(params, options),
        lr=options.lr,
        betas=options.betas,
        eps=options.eps,
        weight_decay=options.weight_decay,
        fused=fused,
    )


def make_adamw(params: Sequence[NamedParameter], options: AdamWOptions) -> torch.optim.AdamW:
    """One ``torch.optim.AdamW`` group (``algorithm: "adamw"``) over ``params``; fused when
    ``options.fused`` asks for it and it can be built, else the regular implementation."""
    if options.fused:
        try:
            return _adamw(params, options, fused=True)
        except (TypeError, RuntimeError, ValueError):
            pass  # e.g. parameters on a device without a fused kernel: same maths, unfused
    return _adamw(params, options, fused=None)
