"""The kernel of the reference transformer's block-causal document mask: SDPA or
``flex_attention``.

With ``position_ids`` that restart per packed document (``data.document_mask``) a token
attends to the earlier tokens of its own document only. ``model.options.document_attention``
chooses how:

* ``sdpa``: one boolean ``(B, 1, T, T)`` mask through ``scaled_dot_product_attention`` (any
  device, dropout included);
* ``flex``: a ``BlockMask`` through ``torch.nn.attention.flex_attention``, which skips the
  blocks of the score matrix that the mask empties (the cross-document ones), compiled on
  CUDA. This torch runs it on CUDA; on the CPU only its forward runs (no backward: training
  there is a ``ConfigError``, exit 2), unfused, and it has no dropout;
* ``auto`` (default): ``flex`` on a CUDA device when the model has no dropout, ``sdpa``
  otherwise.

Plain causal attention (no ``position_ids``) is ``sdpa(is_causal=True)`` whatever the choice.
Both kernels compute the same attention: the outputs agree to float tolerance
(``tests/test_document_attention.py``).
"""

from __future__ import annotations

import functools
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, cast

import torch

from speedtronic.errors import ConfigError
from speedtronic.util.options import Opt, object_schema

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "KERNELS",
    "OPTIONS_SCHEMA",
    "ReferenceTransformerOptions",
    "check_kernel",
    "flex_attend",
    "flex_block_mask",
    "uses_flex",
]

_DocumentAttention = Literal["auto", "sdpa", "flex"]
KERNELS: tuple[_DocumentAttention, ...] = typing.get_args(_DocumentAttention)


@dataclass(frozen=True)
class ReferenceTransformerOptions:
    """The ``model.options`` of the reference transformer (``ReferenceTransformer``'s keyword
    beside the standard fields)."""

    document_attention: Annotated[
        _DocumentAttention,
        Opt(
            "the kernel of the block-causal mask of packed documents (data.document_mask): "
            "sdpa (a boolean mask), flex (flex_attention: CUDA for training, no dropout) or "
            "auto (flex on CUDA without dropout, else sdpa)"
        ),
    ] = "auto"


OPTIONS_SCHEMA: Mapping[str, object] = object_schema(
    ReferenceTransformerOptions, extra={"description": "The reference transformer's options."}
)
"""The ``model.options`` of the reference transformer (``speedtronic.models.registry``),
derived from ``ReferenceTransformerOptions``."""


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def check_kernel(choice: str, dropout: float) -> _DocumentAttention:
    """The model's choice, checked when it is built."""
    if choice not in KERNELS:
        raise ConfigError(
            f"model.options.document_attention must be one of {', '.join(KERNELS)}, got {choice!r}"
        )
    if choice == "flex" and not flex_available():
        raise ConfigError(
            f"model.options.document_attention: flex needs torch.nn.attention.flex_attention, "
            f"which torch {torch.__version__} does not have; use sdpa"
        )
    if choice == "flex" and dropout > 0:
        raise ConfigError(
            f"model.options.document_attention: flex has no attention dropout (model.dropout "
            f"is {dropout}); use sdpa, or dropout 0"
        )
    return choice


def uses_flex(choice: _DocumentAttention, device: torch.device, dropout: float) -> bool:
    """Whether this forward's document mask goes through flex_attention."""
    if choice == "auto":
        return device.type == "cuda" and dropout == 0 and flex_available()
    return choice == "flex"


def flex_block_mask(documents: torch.Tensor, padding: torch.Tensor | None) -> BlockMask:
    """The ``BlockMask`` of ``(B, T)`` document numbers: causal, within the query's
    document, and (with the dense padding mask ``(B, 1, T, T)``, which holds causality and
    the diagonal) only where ``padding`` allows."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = documents.shape

    def same_document(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        allowed = (q >= kv) & (documents[b, q] == documents[b, kv])
        return allowed if padding is None else allowed & padding[b, 0, q, kv]

    return create_block_mask(same_document, batch, None, seq, seq, device=documents.device)


def flex_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask
) -> torch.Tensor:
    """``flex_attention`` of ``(B, H, T, D)`` queries, keys and values under ``block_mask``:
    compiled on CUDA; elsewhere eager and forward-only (a ``ConfigError`` for a backward
    this torch cannot take)."""
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, block_mask=block_mask)
    if q.requires_grad:
        raise ConfigError(
            f"model.options.document_attention: flex cannot train on {q.device.type} "
            f"(torch {torch.__version__} has no flex_attention backward there); use sdpa or "
            "auto, or train on CUDA"
        )
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # unfused off CUDA, as documented: no warning per layer
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return cast(Callable[..., torch.Tensor], torch.compile(flex_attention, dynamic=False))
