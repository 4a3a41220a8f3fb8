"""Document boundaries inside packed windows: ``position_ids`` that restart at each document.

A window of token shards holds the ends of some documents and the starts of others,
separated by the end-of-document id. With ``data.document_mask`` the batches carry
``position_ids``: 0 at the window's first token and at every token that follows an
end-of-document id, counting up from there. That one tensor says everything a model needs:
a document starts where the position is 0, attention stays within a document
(block-causal: the reference transformer builds its mask from it, ``transformers`` detects
packed sequences from it when no ``attention_mask`` is given), and rotary positions restart.

The end-of-document id belongs to the document it ends (its label, the next document's
first token, is still a training target); a window's first token starts a document even
when the document began in an earlier window (the window does not see that beginning).
"""

from __future__ import annotations

import torch

__all__ = ["document_ids", "document_positions"]


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``(B, T)`` int64 positions that restart after every ``eos_id`` of ``input_ids``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    batch, seq = input_ids.shape
    index = torch.arange(seq, dtype=torch.int64).expand(batch, seq)
    starts = torch.zeros((batch, seq), dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    # The index of the latest document start at or before each token (0: the window's).
    first = torch.where(starts, index, 0).cummax(dim=1).values
    return index - first


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)``: the number of the document each token belongs to (a new one where the
    position is 0)."""
    return (position_ids == 0).cumsum(dim=1)
