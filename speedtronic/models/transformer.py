"""The reference transformer: a small decoder-only language model (RoPE, GQA, SwiGLU, RMSNorm).

It is the model ``model.name: reference_transformer`` (alias ``gpt``) builds, and the model
the smoke config, the benchmarks and the tests train. Everything here is plain PyTorch; the
trainer treats it like any user model.

Attention-mask policy (the hot path must not sync the host with the device):

* no ``attention_mask`` -> ``scaled_dot_product_attention(is_causal=True)``, the fast kernel;
* a mask on the CPU -> it is checked with ``mask.all()`` (free: no device involved); an
  all-True mask takes the fast path;
* a mask on an accelerator -> it is trusted to contain padding and a dense boolean
  ``(B, 1, T, T)`` mask (key padding AND causality) is built once per forward and shared by
  every layer. Checking it would cost a host sync per step; speedtronic's own collator only
  emits ``attention_mask`` when a batch really was padded, so fixed-length data never pays.

Every query may attend to itself even when its own position is padding, so left-padded rows
never produce NaN (those positions carry label -100 and do not reach the loss).

Packed documents (``data.document_mask``): ``position_ids`` that restart at 0 where a
document starts (``speedtronic.data.documents``) make attention block-causal -- a token
attends to the earlier tokens of its own document only, one boolean ``(B, 1, T, T)`` mask
built per forward and shared by every layer (or a flex_attention ``BlockMask``:
``model.options.document_attention``, ``speedtronic.models.document_attention``) -- and the
rotary positions restart with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from speedtronic.models.document_attention import (
    OPTIONS_SCHEMA,
    ReferenceTransformerOptions,
    check_kernel,
    flex_attend,
    flex_block_mask,
    uses_flex,
)
from speedtronic.models.loss import loss_from_logits

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "GPT",
    "CausalSelfAttention",
    "GPTConfig",
    "GPTModel",
    "RMSNorm",
    "ReferenceModel",
    "ReferenceTransformer",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "apply_rope",
    "build_reference_transformer",
]

_INIT_STD = 0.02
"""Standard deviation of the normal init of every Linear and Embedding weight."""


def _require_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a ``ReferenceTransformer``. ``n_kv_head`` and ``d_ff`` default from the others:
    after construction ``n_kv_head`` is ``n_head`` and ``d_ff`` is ``4 * d_model`` when unset."""

    vocab_size: int = 512
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int | None = None
    d_model: int = 256
    d_ff: int | None = None
    dropout: float = 0.0
    tie_weights: bool = True
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            _require_int(name, getattr(self, name))
        _require_int("n_kv_head", self.n_kv_head, allow_none=True)
        _require_int("d_ff", self.d_ff, allow_none=True)
        # Frozen dataclass: fill the derived defaults once, here.
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"n_head must be divisible by n_kv_head (n_head={self.n_head}, "
                f"n_kv_head={self.kv_heads})"
            )
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model must be divisible by n_head (d_model={self.d_model}, "
                f"n_head={self.n_head})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head dimension d_model / n_head = {self.head_dim} must be even for RoPE"
            )
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise ValueError(f"dropout must be a number, got {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must satisfy 0 <= dropout < 1, got {dropout}")
        if not isinstance(self.tie_weights, bool):
            raise ValueError(f"tie_weights must be a bool, got {self.tie_weights!r}")
        base = self.rope_base
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
            raise ValueError(f"rope_base must be a positive number, got {base!r}")
        if not math.isfinite(base):
            raise ValueError(f"rope_base must be finite, got {base!r}")

    @property
    def kv_heads(self) -> int:
        """``n_kv_head`` after defaulting (always an int)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ff_dim(self) -> int:
        """``d_ff`` after defaulting (always an int)."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def swiglu_hidden(self) -> int:
        """SwiGLU width: ``int(2 * d_ff / 3)`` rounded up to a multiple of ``n_head`` (the
        2/3 keeps the parameter count of a plain ``d_ff`` MLP with three matrices)."""
        hidden = int(2 * self.ff_dim / 3)
        return -(-hidden // self.n_head) * self.n_head


TransformerConfig = GPTConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm: statistics in float32, result in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary position embeddings, shaped ``(1, 1, T, head_dim)``.

    The tables are cached for the longest length asked so far on one device and dtype;
    shorter requests are views of it, so the per-step cost is a slice.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"RoPE head_dim must be a positive even number, got {head_dim}")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._cache
        if (
            cache is None
            or cache[0].shape[2] < seq_len
            or cache[0].device != device
            or cache[0].dtype != dtype
        ):
            cache = self._build(seq_len, device, dtype)
            self._cache = cache
        cos, sin = cache
        return cos[:, :, :seq_len], sin[:, :, :seq_len]

    def _build(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Built outside inference mode: a cache first filled under torch.inference_mode()
        # would otherwise hold inference tensors that a later training step cannot save.
        with torch.inference_mode(False), torch.no_grad():
            positions = torch.arange(seq_len, device=device, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq.to(device=device, dtype=torch.float32))
            angles = torch.cat((freqs, freqs), dim=-1)[None, None]
            return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, D)`` by the tables (rotate-half convention)."""
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """The keys and values of the positions already decoded, one preallocated pair of
    ``(B, n_kv_head, capacity, head_dim)`` buffers per layer, for incremental decoding
    (``ReferenceTransformer.forward_cached``). ``length`` positions are filled."""

    def __init__(
        self,
        config: GPTConfig,
        batch: int,
        capacity: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (batch, config.kv_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.values = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)
        ]
        self.capacity = capacity
        self.length = 0

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` of the new positions after the filled ones; the layer's keys and
        values up to them. ``length`` advances once every layer has appended
        (``advance``)."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, positions: int) -> None:
        self.length += positions


def _cached_mask(new: int, past: int, device: torch.device) -> torch.Tensor | None:
    """The boolean mask of ``new`` queries over ``past + new`` keys (None: no mask needed,
    a single query sees every key)."""
    if new == 1:
        return None
    keys = torch.arange(past + new, device=device)
    queries = torch.arange(past, past + new, device=device)
    return keys[None, :] <= queries[:, None]


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with grouped K/V heads (GQA) and RoPE."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        self.dropout = float(config.dropout)
        kv_width = self.n_kv_head * self.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, kv_width, bias=False)
        self.v_proj = nn.Linear(config.d_model, kv_width, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """``mask``: None for plain causal attention, else a boolean ``(B, 1, T, T)`` mask
        (True = may attend) that already includes causality, or a flex ``BlockMask``."""
        batch, seq, width = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        repeats = self.n_head // self.n_kv_head
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        if mask is not None and not isinstance(mask, torch.Tensor):  # packed documents
            y = flex_attend(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=mask is None,
            )
        # -1, not width: under tensor parallelism this rank holds 1/T of the heads.
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return cast(torch.Tensor, self.resid_dropout(self.o_proj(y)))

    def forward_cached(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        """Attention of the new positions ``x`` over the cached ones and themselves (no
        dropout: decoding runs in eval mode); ``cos``/``sin`` are the new positions' rows."""
        batch, seq, width = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        past = cache.length
        k, v = cache.append(layer, apply_rope(k, cos, sin), v)
        q = apply_rope(q, cos, sin)
        repeats = self.n_head // self.n_kv_head
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = _cached_mask(seq, past, x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return cast(torch.Tensor, self.o_proj(y))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, bias-free, width ``config.swiglu_hidden``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.swiglu_hidden
        self.gate_proj = nn.Linear(config.d_model, hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``.

    With ``gradient_checkpointing`` set, the block keeps only its input during the forward
    and recomputes the rest in backward (non-reentrant checkpoint; dropout masks are
    reproduced because the checkpoint restores the RNG state).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.norm2 = RMSNorm(config.d_model)
        self.mlp = SwiGLU(config)
        self.mlp_dropout = nn.Dropout(config.dropout)
        self.gradient_checkpointing = False

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        if self.gradient_checkpointing and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(
                self._body, x, cos, sin, mask, use_reentrant=False
            )
            return cast(torch.Tensor, out)
        return self._body(x, cos, sin, mask)

    def _body(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | None,
    ) -> torch.Tensor:
        attended: torch.Tensor = x + self.attn(self.norm1(x), cos, sin, mask)
        mixed: torch.Tensor = self.mlp_dropout(self.mlp(self.norm2(attended)))
        return attended + mixed

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        """The block on the new positions only, attending through ``cache`` (decoding)."""
        attended: torch.Tensor = x + self.attn.forward_cached(self.norm1(x), cos, sin, cache, layer)
        return attended + cast(torch.Tensor, self.mlp(self.norm2(attended)))


def _document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` positions restarting per document -> boolean ``(B, 1, T, T)``: causal and
    within the query's document (a document starts where the position is 0)."""
    seq = position_ids.shape[1]
    documents = (position_ids == 0).cumsum(dim=1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


def _dense_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` key-validity mask -> boolean ``(B, 1, T, T)``: causal AND valid key, plus
    the diagonal so that no query row is empty (an empty row would make softmax NaN)."""
    seq = attention_mask.shape[1]
    device = attention_mask.device
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(seq, dtype=torch.bool, device=device)
    keys = attention_mask.to(torch.bool)[:, None, None, :]
    return (causal & keys) | diagonal


class ReferenceTransformer(nn.Module):
    """Decoder-only transformer; keyword arguments are the ``GPTConfig`` fields, plus
    ``max_seq_len`` as another name for ``block_size`` and ``document_attention`` (its one
    ``model.options`` key). An unknown keyword is a TypeError."""

    options_schema: ClassVar[Mapping[str, object]] = OPTIONS_SCHEMA

    def __init__(
        self,
        *,
        vocab_size: int = GPTConfig.vocab_size,
        block_size: int | None = None,
        max_seq_len: int | None = None,
        n_layer: int = GPTConfig.n_layer,
        n_head: int = GPTConfig.n_head,
        n_kv_head: int | None = None,
        d_model: int = GPTConfig.d_model,
        d_ff: int | None = None,
        dropout: float = GPTConfig.dropout,
        tie_weights: bool = GPTConfig.tie_weights,
        rope_base: float = GPTConfig.rope_base,
        document_attention: str = ReferenceTransformerOptions.document_attention,
    ) -> None:
        super().__init__()
        if block_size is not None and max_seq_len is not None and block_size != max_seq_len:
            raise ValueError(
                f"block_size={block_size} and max_seq_len={max_seq_len} name the same "
                "setting; give one of them"
            )
        context = block_size if block_size is not None else max_seq_len
        config = GPTConfig(
            vocab_size=vocab_size,
            block_size=GPTConfig.block_size if context is None else context,
            n_layer=n_layer,
            n_head=n_head,
            n_kv_head=n_kv_head,
            d_model=d_model,
            d_ff=d_ff,
            dropout=dropout,
            tie_weights=tie_weights,
            rope_base=rope_base,
        )
        self.config = config
        self.document_attention = check_kernel(document_attention, config.dropout)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.d_model),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer)),
                "ln_f": RMSNorm(config.d_model),
            }
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_base)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # The hybrid (Muon) optimizer routes modules marked "adamw" away from Muon even
        # when they are 2-D Linear layers; the output head is such a matrix.
        setattr(self.lm_head, "_speedtronic_optimizer_role", "adamw")  # noqa: B010
        self.apply(self._init_weights)
        if config.tie_weights:
            self.lm_head.weight = self.token_embedding.weight

    @classmethod
    def from_config(cls, config: GPTConfig) -> ReferenceTransformer:
        """Build from a ``GPTConfig`` object."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def token_embedding(self) -> nn.Embedding:
        return cast(nn.Embedding, self.transformer["wte"])

    @property
    def blocks(self) -> list[TransformerBlock]:
        layers = cast(nn.ModuleList, self.transformer["h"])
        return [cast(TransformerBlock, block) for block in layers]

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Turn activation checkpointing on or off for every block."""
        for block in self.blocks:
            block.gradient_checkpointing = bool(enabled)

    def num_parameters(self, *, trainable_only: bool = False) -> int:
        """Distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Approximate training FLOPs per token (forward + backward), for MFU.

        ``6 * N`` for the matrix multiplies, where N counts the weights used in a matmul
        (every Linear including the output head; the embedding lookup and norms are not
        matmuls), plus ``12 * n_layer * d_model * seq_len`` for attention scores and the
        weighted sum (the PaLM convention, which does not halve for causality).
        ``seq_len`` defaults to ``block_size``.
        """
        length = self.config.block_size if seq_len is None else seq_len
        if length <= 0:
            raise ValueError(f"seq_len must be positive, got {length}")
        matmul_weights = sum(
            module.weight.numel() for module in self.modules() if isinstance(module, nn.Linear)
        )
        attention = 12 * self.config.n_layer * self.config.d_model * length
        return 6 * matmul_weights + attention

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Logits ``(B, T, vocab)``; with ``labels`` also the causal LM ``loss``.

        Labels of the same length as ``input_ids`` are already next-token aligned (no shift);
        labels one shorter use ``logits[:, :-1]``; ``-100`` is ignored; an all-ignored batch
        gives a differentiable zero. ``position_ids`` that restart at each packed document
        make attention block-causal and restart the rotary positions (module docstring).
        """
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be 2-D (batch, seq), got shape {tuple(input_ids.shape)}"
            )
        seq = input_ids.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds model block size {self.config.block_size}"
            )
        padding = self._attention_mask(input_ids, attention_mask)
        mask: torch.Tensor | BlockMask | None = padding
        x: torch.Tensor = self.transformer["drop"](self.token_embedding(input_ids))
        table = seq if position_ids is None else self.config.block_size
        cos, sin = self.rotary(table, x.device, x.dtype)
        if position_ids is not None:
            flex = uses_flex(self.document_attention, x.device, self.config.dropout)
            mask, cos, sin = _documents(input_ids, position_ids, padding, cos, sin, flex)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        logits: torch.Tensor = self.lm_head(self.transformer["ln_f"](x))
        output = {"logits": logits}
        if labels is not None:
            output["loss"] = loss_from_logits(logits, labels)
        return output

    def new_kv_cache(
        self, batch: int, capacity: int | None = None, *, dtype: torch.dtype | None = None
    ) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``capacity`` positions (default
        ``block_size``), on the model's device."""
        size = self.config.block_size if capacity is None else capacity
        if not 0 < size <= self.config.block_size:
            raise ValueError(f"cache capacity {size} must be in 1..{self.config.block_size}")
        weight = self.token_embedding.weight
        return KVCache(self.config, batch, size, device=weight.device, dtype=dtype or weight.dtype)

    def forward_cached(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of the new tokens ``input_ids`` that follow the
        ``cache.length`` positions already in ``cache``, which then holds them too.

        The incremental-decoding path of ``generate``: the training ``forward`` is not
        involved (its numerics are untouched), no mask, no dropout, no labels."""
        seq = input_ids.shape[1]
        end = cache.length + seq
        if end > cache.capacity:
            raise ValueError(f"{end} positions exceed the cache capacity {cache.capacity}")
        x: torch.Tensor = self.token_embedding(input_ids)
        cos, sin = self.rotary(end, x.device, x.dtype)
        cos, sin = cos[:, :, cache.length : end], sin[:, :, cache.length : end]
        for layer, block in enumerate(self.blocks):
            x = block.forward_cached(x, cos, sin, cache, layer)
        cache.advance(seq)
        return cast(torch.Tensor, self.lm_head(self.transformer["ln_f"](x)))

    @staticmethod
    def _attention_mask(
        input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The dense mask for SDPA, or None for the ``is_causal`` fast path (module docs)."""
        if attention_mask is None:
            return None
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                f"input_ids shape {tuple(input_ids.shape)}"
            )
        if attention_mask.device.type == "cpu" and bool(attention_mask.all()):
            return None
        return _dense_causal_mask(attention_mask)


def _documents(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    flex: bool,
) -> tuple[torch.Tensor | BlockMask, torch.Tensor, torch.Tensor]:
    """The block-causal mask (with the padding ``mask``, if any; a ``BlockMask`` with
    ``flex``) and the rotary tables at ``position_ids`` (``(B, 1, T, D)``)."""
    if position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} does not match input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    tables = cos[0, 0][position_ids][:, None], sin[0, 0][position_ids][:, None]
    if flex:
        return flex_block_mask((position_ids == 0).cumsum(dim=1), mask), *tables
    blocks = _document_mask(position_ids)
    # ``mask`` already holds causality and its diagonal: AND keeps both masks' limits.
    combined = blocks if mask is None else blocks & mask
    return combined, *tables


GPT = ReferenceTransformer
Transformer = ReferenceTransformer
ReferenceModel = ReferenceTransformer
GPTModel = ReferenceTransformer


build_reference_transformer = ReferenceTransformer
"""Model-registry entry point (``reference_transformer`` and ``gpt``): the class itself, so
it takes exactly the standard model fields and any other keyword is a TypeError."""
