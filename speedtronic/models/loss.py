"""The causal language-model loss of logits, shared by the models (which compute their own
loss) and the loop (which computes it from a model's ``logits`` and the batch labels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "ModelOutputError", "loss_from_logits"]

IGNORE_INDEX = -100


class ModelOutputError(TypeError):
    """The model returned something the loop cannot turn into a loss."""


def loss_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal LM cross-entropy. Same-length labels are already next-token aligned (no
    shift); labels one shorter than the sequence use ``logits[:, :-1]``."""
    if logits.dim() != 3:
        raise ModelOutputError(
            f"logits must be (batch, seq, vocab), got shape {tuple(logits.shape)}"
        )
    seq = logits.shape[1]
    if labels.shape[-1] == seq - 1:
        logits = logits[:, :-1]
    elif labels.shape[-1] != seq:
        raise ModelOutputError(
            f"labels of shape {tuple(labels.shape)} do not match logits {tuple(logits.shape)}"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    # Sum over valid positions divided by their count (at least 1): the mean loss, and a
    # differentiable zero (not NaN) when every label is ignored.
    total = F.cross_entropy(
        flat_logits.float(), flat_labels, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    count = (flat_labels != IGNORE_INDEX).sum().clamp(min=1)
    return total / count
