"""The reference transformer: config rules, structure, loss contract, attention paths."""

from __future__ import annotations

import math
from typing import TypedDict

import pytest
import torch
import torch.nn.functional as F

from speedtronic.models.transformer import (
    GPT,
    CausalSelfAttention,
    GPTConfig,
    GPTModel,
    ReferenceModel,
    ReferenceTransformer,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    Transformer,
    TransformerConfig,
    apply_rope,
    build_reference_transformer,
)


class Shape(TypedDict, total=False):
    """Keyword arguments of ReferenceTransformer, typed for the tests."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_ff: int
    dropout: float
    tie_weights: bool
    rope_base: float


SMOKE: Shape = {
    "vocab_size": 128,
    "block_size": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 64,
    "d_ff": 128,
}
TINY: Shape = {
    "vocab_size": 32,
    "block_size": 8,
    "n_layer": 1,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 32,
    "d_ff": 64,
}


def shape(base: Shape, **overrides: int | float | bool) -> Shape:
    merged = Shape(**base)
    merged.update(overrides)  # type: ignore[typeddict-item]  # keys are checked at the call
    return merged


def tiny_model(**overrides: int | float | bool) -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(**shape(TINY, **overrides))


# --- config -------------------------------------------------------------------------


def test_config_dimensions() -> None:
    config = GPTConfig(d_model=32, n_head=4)
    assert config.d_ff == 128
    assert config.n_kv_head == 4
    assert config.head_dim == 8
    assert TransformerConfig is GPTConfig


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vocab_size": 0},
        {"n_layer": -1},
        {"n_head": 8, "n_kv_head": 3},
        {"d_model": 30, "n_head": 4},
        {"d_model": 36, "n_head": 4},  # head_dim 9 is odd: RoPE needs it even
        {"dropout": 1.0},
        {"dropout": -0.1},
        {"rope_base": 0.0},
        {"block_size": True},
        {"d_ff": 0},
    ],
)
def test_config_rejects_invalid_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GPTConfig(**kwargs)  # type: ignore[arg-type]  # deliberately bad values


def test_swiglu_hidden_rounds_up_to_a_multiple_of_the_head_count() -> None:
    assert GPTConfig(d_model=64, n_head=4, d_ff=128).swiglu_hidden == 88
    assert GPTConfig(d_model=256, n_head=8, d_ff=768).swiglu_hidden == 512
    mlp = SwiGLU(GPTConfig(d_model=64, n_head=4, d_ff=128))
    assert mlp.gate_proj.out_features == 88
    assert mlp.up_proj.bias is None and mlp.down_proj.bias is None


# --- construction -------------------------------------------------------------------


def test_smoke_model_has_exactly_66880_parameters() -> None:
    model = ReferenceTransformer(**SMOKE)
    assert model.num_parameters() == 66_880
    assert sum(p.numel() for p in model.parameters()) == 66_880
    assert all(
        module.bias is None for module in model.modules() if isinstance(module, torch.nn.Linear)
    )


def test_reference_transformer_weight_tying_and_checkpoint_hook() -> None:
    model = tiny_model()
    assert model.lm_head.weight is model.transformer["wte"].weight
    assert len(model.blocks) == 1
    assert model.lm_head.bias is None
    model.set_gradient_checkpointing(True)
    assert all(block.gradient_checkpointing for block in model.blocks)
    model.set_gradient_checkpointing(False)
    assert not any(block.gradient_checkpointing for block in model.blocks)


def test_untied_weights_are_separate() -> None:
    model = tiny_model(tie_weights=False)
    assert model.lm_head.weight is not model.transformer["wte"].weight
    assert model.num_parameters() == tiny_model().num_parameters() + 32 * 32


def test_keywords_aliases_and_unknown_names() -> None:
    assert ReferenceTransformer(**shape(TINY, block_size=16)).config.block_size == 16
    aliased = ReferenceTransformer(vocab_size=32, max_seq_len=16, n_head=4, d_model=32)
    assert aliased.config.block_size == 16
    with pytest.raises(TypeError):
        ReferenceTransformer(**TINY, not_a_field=1)  # type: ignore[call-arg]  # on purpose
    with pytest.raises(ValueError, match="same setting"):
        ReferenceTransformer(vocab_size=32, block_size=8, max_seq_len=16)
    for alias in (GPT, Transformer, ReferenceModel, GPTModel):
        assert alias is ReferenceTransformer


def test_factory_forwards_every_standard_field() -> None:
    fields = shape(TINY, dropout=0.1, tie_weights=False, rope_base=500.0)
    model = build_reference_transformer(**fields)
    assert model.config == GPTConfig(**fields)
    with pytest.raises(TypeError):
        build_reference_transformer(gradient_checkpointing=True)  # type: ignore[call-arg]


def test_from_config_round_trip() -> None:
    config = GPTConfig(**TINY)
    assert ReferenceTransformer.from_config(config).config == config


def test_weights_are_initialised_with_std_002() -> None:
    torch.manual_seed(0)
    model = ReferenceTransformer(vocab_size=512, d_model=256, n_layer=1, n_head=8)
    weight = model.blocks[0].mlp.up_proj.weight
    assert abs(weight.std().item() - 0.02) < 1e-3
    assert abs(weight.mean().item()) < 1e-3
    assert torch.equal(model.blocks[0].norm1.weight, torch.ones(256))


def test_flops_per_token_counts_matmuls_and_attention() -> None:
    model = ReferenceTransformer(**SMOKE)
    matmul_weights = 66_880 - 2 * 2 * 64 - 64  # every parameter except the norm weights
    assert model.flops_per_token() == 6 * matmul_weights + 12 * 2 * 64 * 32
    assert model.flops_per_token(16) == 6 * matmul_weights + 12 * 2 * 64 * 16
    untied = ReferenceTransformer(**shape(SMOKE, tie_weights=False))
    assert untied.flops_per_token() == model.flops_per_token()  # lookup is not a matmul


# --- forward and loss ---------------------------------------------------------------


def test_reference_transformer_forward_and_loss() -> None:
    model = tiny_model()
    ids = torch.randint(0, 32, (2, 8))
    labels = torch.randint(0, 32, (2, 8))
    output = model(ids, labels=labels)
    assert output["logits"].shape == (2, 8, 32)
    assert output["loss"].dim() == 0
    output["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())


def test_same_length_labels_are_not_shifted_again() -> None:
    model = tiny_model()
    ids = torch.randint(0, 32, (2, 8))
    labels = torch.randint(0, 32, (2, 8))
    output = model(ids, labels=labels)
    expected = F.cross_entropy(output["logits"].reshape(-1, 32), labels.reshape(-1))
    assert torch.allclose(output["loss"], expected, atol=1e-6)


def test_one_shorter_labels_use_all_but_the_last_position() -> None:
    model = tiny_model()
    ids = torch.randint(0, 32, (2, 8))
    output = model(ids, labels=ids[:, 1:])
    expected = F.cross_entropy(output["logits"][:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))
    assert torch.allclose(output["loss"], expected, atol=1e-6)
    with pytest.raises(TypeError):
        model(ids, labels=ids[:, 3:])


def test_ignored_labels_and_an_all_ignored_batch() -> None:
    model = tiny_model()
    ids = torch.randint(0, 32, (2, 8))
    labels = ids.clone()
    labels[:, :4] = -100
    output = model(ids, labels=labels)
    logits = output["logits"][:, 4:].reshape(-1, 32)
    assert torch.allclose(output["loss"], F.cross_entropy(logits, ids[:, 4:].reshape(-1)))
    ignored = model(ids, labels=torch.full_like(ids, -100))["loss"]
    assert ignored.item() == 0.0 and not torch.isnan(ignored)
    ignored.backward()  # differentiable zero: gradients exist and are zero
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_input_validation() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="exceeds model block size"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask shape"):
        model(torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 7))


def test_model_is_causal() -> None:
    model = tiny_model().eval()
    ids = torch.randint(0, 32, (1, 8))
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % 32
    before, after = model(ids)["logits"], model(changed)["logits"]
    assert torch.allclose(before[:, :5], after[:, :5], atol=1e-6)
    assert not torch.allclose(before[:, 5:], after[:, 5:])


# --- attention mask paths -------------------------------------------------------------


def test_all_true_mask_takes_the_same_path_as_no_mask() -> None:
    model = tiny_model().eval()
    ids = torch.randint(0, 32, (2, 8))
    plain = model(ids)["logits"]
    masked = model(ids, attention_mask=torch.ones(2, 8, dtype=torch.bool))["logits"]
    assert torch.equal(plain, masked)
    assert ReferenceTransformer._attention_mask(ids, torch.ones(2, 8, dtype=torch.bool)) is None


def test_right_padding_leaves_real_positions_unchanged() -> None:
    model = tiny_model().eval()
    short = torch.randint(0, 32, (1, 5))
    padded = torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    alone = model(short)["logits"]
    batched = model(padded, attention_mask=mask)["logits"]
    assert torch.allclose(alone, batched[:, :5], atol=1e-5)


def test_left_padding_gives_finite_logits_and_correct_real_positions() -> None:
    model = tiny_model().eval()
    short = torch.randint(0, 32, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 5])
    logits = model(padded, attention_mask=mask)["logits"]
    assert torch.isfinite(logits).all()
    # RoPE is relative, so the real tokens see the same thing as without padding.
    assert torch.allclose(model(short)["logits"], logits[:, 3:], atol=1e-5)


# --- components -----------------------------------------------------------------------


def test_rmsnorm_normalises_in_float32_and_keeps_dtype() -> None:
    norm = RMSNorm(4)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    expected = x / torch.sqrt((x**2).mean() + 1e-5)
    assert torch.allclose(norm(x), expected)
    assert norm(x.to(torch.bfloat16)).dtype == torch.float32  # weight is float32
    norm_bf16 = RMSNorm(4).to(torch.bfloat16)
    assert norm_bf16(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_rotary_cache_and_rotation() -> None:
    rotary = RotaryEmbedding(8)
    cos, sin = rotary(6, torch.device("cpu"), torch.float32)
    assert cos.shape == sin.shape == (1, 1, 6, 8)
    assert torch.allclose(cos[0, 0, 0], torch.ones(8))  # position 0: no rotation
    cached = rotary._cache
    short_cos, _ = rotary(4, torch.device("cpu"), torch.float32)
    assert rotary._cache is cached and torch.equal(short_cos, cos[:, :, :4])
    rotary(4, torch.device("cpu"), torch.float64)
    assert rotary._cache is not cached  # a new dtype rebuilds
    x = torch.randn(2, 3, 6, 8)
    rotated = apply_rope(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation
    with pytest.raises(ValueError):
        RotaryEmbedding(7)


def test_rotary_cache_built_in_inference_mode_is_usable_for_training() -> None:
    model = tiny_model()
    ids = torch.randint(0, 32, (1, 8))
    with torch.inference_mode():
        model(ids)
    model(ids, labels=ids)["loss"].backward()


def test_grouped_query_attention_shapes() -> None:
    attention = CausalSelfAttention(GPTConfig(d_model=256, n_head=8, n_kv_head=2))
    assert attention.head_dim == 32
    assert attention.q_proj.out_features == 256
    assert attention.k_proj.out_features == attention.v_proj.out_features == 64
    assert attention.n_head // attention.n_kv_head == 4


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    ids = torch.randint(0, 32, (2, 8))
    grads = []
    for enabled in (False, True):
        model = tiny_model(n_layer=2, dropout=0.1)
        model.set_gradient_checkpointing(enabled)
        torch.manual_seed(1)  # same dropout masks in both runs
        model(ids, labels=ids)["loss"].backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))


def test_training_reduces_the_loss() -> None:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 32, (4, 8))
    first = last = math.inf
    for step in range(30):
        loss = model(ids[:, :-1], labels=ids[:, 1:])["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    assert last < first * 0.5
