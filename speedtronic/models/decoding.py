"""One-token decoding steps of the reference transformer with few Python operations.

After the prompt (``ReferenceTransformer.forward_cached``), ``generate`` runs one position
per new token. At that size the step's time is the framework's, not the arithmetic's:
module calls, attribute look-ups, the RoPE table rebuilt per call, K/V heads repeated
for grouped-query attention. ``_LeanDecoder`` runs the same computation from weights it
looked up once:

* q, k and v in one matrix product (their weights concatenated once), gate and up too;
* RoPE applied to q and k together, as one product with a precomputed rotation matrix per
  position (``x * cos + rotate_half(x) * sin`` is ``x @ R``, ``R = diag(cos) + P diag(sin)``
  with ``P`` the signed half swap) when the matrices of the cache's capacity fit in
  ``ROTATION_BUDGET`` elements, else elementwise from the precomputed rows;
* grouped-query attention without repeating the cache: a single query of each group of
  ``n_head / n_kv_head`` heads is laid out as that many queries of one K/V head, which all
  see every cached position (a single new position needs no mask);
* K/V written in place into the preallocated ``KVCache``;
* nothing read back to the host.

Its logits equal ``forward_cached``'s up to float rounding (matrix products of other
shapes); greedy decoding gives the same tokens (tests/test_generation.py). It applies only
to a plain model -- every projection an ``nn.Linear`` without bias, nothing wrapped (a
LoRA-adapted model keeps ``forward_cached``, which runs the adapters): ``lean_decoder``
returns ``None`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speedtronic.models.transformer import KVCache, ReferenceTransformer, RMSNorm

__all__ = ["ROTATION_BUDGET", "lean_decoder"]

ROTATION_BUDGET = 1 << 22
"""Elements of the per-position rotation matrices (capacity x head_dim^2) at most."""


@dataclass(frozen=True)
class _Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _plain(module: nn.Module) -> torch.Tensor | None:
    """The weight of a bias-free ``nn.Linear`` (exactly that class), else ``None``."""
    if type(module) is not nn.Linear or module.bias is not None:
        return None
    return module.weight


def _norm(module: nn.Module) -> torch.Tensor | None:
    return module.weight if type(module) is RMSNorm else None


class _LeanDecoder:
    """One-token steps of ``model`` through ``cache`` (module docstring)."""

    def __init__(self, model: ReferenceTransformer, layers: list[_Layer], cache: KVCache) -> None:
        config = model.config
        self.cache = cache
        self.layers = layers
        self.embedding = model.token_embedding.weight
        final = model.transformer["ln_f"]
        if not isinstance(final, RMSNorm):
            raise TypeError(f"the final norm is {type(final).__name__}, not RMSNorm")
        self.final_norm = final.weight
        self.head = model.lm_head.weight
        self.eps = float(final.eps)
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.group = config.n_head // config.kv_heads
        self.q_width = config.n_head * config.head_dim
        self.kv_width = config.kv_heads * config.head_dim
        self.qk_width = self.q_width + self.kv_width
        self.hidden = config.swiglu_hidden
        weight = self.embedding
        cos, sin = model.rotary(cache.capacity, weight.device, weight.dtype)
        # (capacity, 1, head_dim): row p broadcasts over (B, heads, head_dim).
        self.cos: torch.Tensor = cos[0, 0, :, None, :].contiguous()
        self.sin: torch.Tensor = sin[0, 0, :, None, :].contiguous()
        self.half = config.head_dim // 2
        dim = config.head_dim
        self.rotation: torch.Tensor | None = None
        if cache.capacity * dim * dim <= ROTATION_BUDGET:
            swap = torch.zeros((dim, dim), dtype=weight.dtype, device=weight.device)
            index = torch.arange(self.half, device=weight.device)
            swap[index + self.half, index] = -1.0  # out[:half] = -x[half:]
            swap[index, index + self.half] = 1.0  # out[half:] = x[:half]
            # R[p] = diag(cos_p) + P diag(sin_p): x @ R[p] = x * cos_p + (x @ P) * sin_p.
            self.rotation = torch.diag_embed(self.cos[:, 0]) + swap * self.sin[:, 0, None, :]

    def _rope(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """``x`` ``(B, heads, head_dim)`` rotated to ``position``."""
        if self.rotation is not None:
            return torch.matmul(x, self.rotation[position])
        first, second = x[..., : self.half], x[..., self.half :]
        rotated = torch.cat((-second, first), dim=-1)
        return x * self.cos[position] + rotated * self.sin[position]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """The next-token logits ``(B, vocab)`` after ``token`` ``(B, 1)``, which the cache
        then holds."""
        cache, eps = self.cache, self.eps
        position = cache.length
        end = position + 1
        batch = token.shape[0]
        x = F.embedding(token, self.embedding)  # (B, 1, D)
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.norm1, eps)
            qkv = F.linear(h, layer.qkv)
            qk = qkv[:, 0, : self.qk_width].view(batch, -1, self.head_dim)
            rotated = self._rope(qk, position)
            # Queries as (B, kv_heads, group, head_dim): each K/V head's group of heads
            # (head h reads K/V head h // group, as the cache-free path repeats them).
            q = rotated[:, : self.n_head].reshape(batch, self.n_kv_head, self.group, self.head_dim)
            keys, values = cache.keys[index], cache.values[index]
            keys[:, :, position] = rotated[:, self.n_head :]
            values[:, :, position] = qkv[:, 0, self.qk_width :].view(batch, -1, self.head_dim)
            y = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end])
            x = x + F.linear(y.reshape(batch, 1, self.q_width), layer.o)
            h = F.rms_norm(x, (x.shape[-1],), layer.norm2, eps)
            gate_up = F.linear(h, layer.gate_up)
            gated = F.silu(gate_up[..., : self.hidden]) * gate_up[..., self.hidden :]
            x = x + F.linear(gated, layer.down)
        cache.advance(1)
        x = F.rms_norm(x, (x.shape[-1],), self.final_norm, eps)
        return F.linear(x[:, -1], self.head)


def lean_decoder(model: ReferenceTransformer, cache: KVCache) -> _LeanDecoder | None:
    """A ``_LeanDecoder`` of ``model`` when every module it reads is the plain one, else
    ``None`` (the caller keeps ``forward_cached``)."""
    if type(model.transformer["ln_f"]) is not RMSNorm or _plain(model.lm_head) is None:
        return None
    if type(model.transformer["wte"]) is not nn.Embedding:
        return None
    layers = []
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        weights = [
            _plain(module)
            for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
            + (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ]
        norm1, norm2 = _norm(block.norm1), _norm(block.norm2)
        if norm1 is None or norm2 is None or any(w is None for w in weights):
            return None
        q, k, v, o, gate, up, down = (w for w in weights if w is not None)
        layers.append(_Layer(norm1, torch.cat((q, k, v)), o, norm2, torch.cat((gate, up)), down))
    return _LeanDecoder(model, layers, cache)
