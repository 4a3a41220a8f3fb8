"""Optimizers: Newton–Schulz, Muon(+), routing, the hybrid, the cautious wrapper, builders
and the LR schedule."""

from __future__ import annotations

import io
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pytest
import torch
from torch import nn

from speedtronic.config import SpeedtronicConfig
from speedtronic.config.sections import OptimizerConfig
from speedtronic.engine.callback import Callback
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.optimizers import (
    DEFAULT_NS_COEFFICIENTS,
    ROLE_ATTRIBUTE,
    CautiousOptimizer,
    HybridOptimizer,
    Muon,
    MuonOptions,
    RoutingRule,
    build_optimizer,
    build_scheduler,
    describe_routing,
    format_routing_table,
    lr_multiplier,
    newton_schulz,
    ns_work_dtype,
    orthogonalize,  # patched: its private bf16 probes
    post_polar_normalize,
    route_parameters,
)
from speedtronic.runtime import optimizer_section

# -- settings stand-ins (structurally typed like the config sections) ----------------------


@dataclass(frozen=True)
class Rule:
    to: str
    name: str | None = None
    module: str | None = None
    ndim: int | None = None


@dataclass(frozen=True)
class OptSettings:
    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    fused: bool | None = None
    grad_clip: float | None = None
    muon_plus: bool = False
    muon_plus_mode: str = "row_col"
    cautious: bool = False
    cautious_rescale: bool = False
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS
    muon_norm_eps: float = 1e-8
    muon_lr: float | None = None
    muon_lr_scale: str = "rms"
    muon_weight_decay: float | None = None
    decay_norms_and_biases: bool | None = None
    routing: tuple[Rule, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class SchedSettings:
    name: str = "cosine"
    warmup_steps: int = 2
    max_steps: int = 10
    min_lr_ratio: float = 0.1


CPU = torch.device("cpu")


def reference_model(seed: int = 0) -> ReferenceTransformer:
    torch.manual_seed(seed)
    return ReferenceTransformer(
        vocab_size=64, block_size=16, n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64
    )


def lm_loss(model: nn.Module, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (2, 9), generator=generator)
    out = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss = out["loss"] if isinstance(out, dict) else out
    assert isinstance(loss, torch.Tensor)
    return loss


def trainable_ids(model: nn.Module) -> set[int]:
    return {id(p) for p in model.parameters() if p.requires_grad}


def optimizer_param_ids(optimizer: torch.optim.Optimizer) -> list[int]:
    return [id(p) for group in optimizer.param_groups for p in group["params"]]


# -- Newton–Schulz ------------------------------------------------------------------------


def test_newton_schulz_is_pure_and_finite() -> None:
    matrix = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    original = matrix.clone()
    result = newton_schulz(matrix)
    assert result.shape == (5, 3)
    assert torch.isfinite(result).all()
    assert torch.equal(matrix, original)
    assert result.dtype == ns_work_dtype(CPU, torch.float32, (5, 3)) == torch.float32


def test_ns_precision_policy_follows_native_bf16_support(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(orthogonalize, "_cpu_bf16_gemm_supported", lambda: False)
    assert ns_work_dtype(CPU) == torch.float32
    assert newton_schulz(torch.ones(2, 3)).dtype == torch.float32
    monkeypatch.setattr(orthogonalize, "_cpu_bf16_gemm_supported", lambda: True)
    assert ns_work_dtype(CPU) == torch.bfloat16
    assert ns_work_dtype(CPU, torch.float32, (128, 512)) == torch.bfloat16
    assert ns_work_dtype(CPU, torch.float32, (64, 512)) == torch.float32  # overhead-bound
    assert newton_schulz(torch.ones(130, 128)).dtype == torch.bfloat16
    assert ns_work_dtype(CPU, torch.float64) == torch.float64
    assert ns_work_dtype(torch.device("mps")) == torch.float32
    monkeypatch.setattr(orthogonalize, "_cuda_bf16_supported", lambda: True)
    assert ns_work_dtype(torch.device("cuda")) == torch.bfloat16


def test_newton_schulz_zero_matrix_gives_zeros() -> None:
    result = newton_schulz(torch.zeros(3, 4))
    assert torch.isfinite(result).all()
    assert torch.equal(result, torch.zeros(3, 4))


@pytest.mark.parametrize("shape", [(3, 8), (8, 3), (1, 5), (5, 1)])
def test_newton_schulz_handles_rectangular_matrices(shape: tuple[int, int]) -> None:
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    result = newton_schulz(matrix, steps=4)
    assert result.shape == shape
    assert torch.isfinite(result).all()
    singular = torch.linalg.svdvals(result.double())
    assert singular.max() < 1.5 and singular.min() > 0.5


def _spread_spectrum(rows: int, cols: int, singular: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    left, _ = torch.linalg.qr(torch.randn(rows, rows, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(cols, cols, generator=generator, dtype=torch.float64))
    k = min(rows, cols)
    return left[:, :k] @ torch.diag(singular) @ right[:, :k].T


def test_newton_schulz_pushes_singular_values_toward_one() -> None:
    singular = torch.logspace(-1, 1, 16, dtype=torch.float64)  # 0.1 .. 10
    matrix = _spread_spectrum(24, 16, singular)
    before = torch.linalg.svdvals(matrix / torch.linalg.matrix_norm(matrix))
    after = torch.linalg.svdvals(newton_schulz(matrix))
    assert before.max() / before.min() > 90
    assert after.min() > 0.6 and after.max() < 1.25  # the quintic's band, not exactly 1
    assert (after - 1).abs().max() < (before - 1).abs().max()


def test_newton_schulz_coefficients_are_configurable() -> None:
    # The classic cubic iteration (1.5, -0.5, 0) converges to exactly orthogonal.
    matrix = _spread_spectrum(12, 20, torch.linspace(0.2, 3.0, 12, dtype=torch.float64))
    result = newton_schulz(matrix, steps=40, coefficients=(1.5, -0.5, 0.0))
    assert torch.allclose(torch.linalg.svdvals(result), torch.ones(12, dtype=torch.float64))
    quintic = newton_schulz(matrix, steps=40)
    assert not torch.allclose(quintic, result, atol=1e-3)


def test_newton_schulz_batches_match_single_matrices() -> None:
    batch = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(3))
    together = newton_schulz(batch)
    for index in range(3):
        assert torch.allclose(together[index], newton_schulz(batch[index]), atol=1e-6)


def test_newton_schulz_validates_its_input() -> None:
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.ones(4))
    with pytest.raises(TypeError, match="floating"):
        newton_schulz(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(torch.ones(2, 2), steps=0)
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(torch.ones(2, 2), coefficients=(1.0, 2.0))
    assert newton_schulz(torch.ones(2, 3), dtype=torch.bfloat16).dtype == torch.bfloat16


# -- Muon+ normalisation ------------------------------------------------------------------


def test_post_polar_row_col_gives_unit_columns_and_col_row_unit_rows() -> None:
    update = 10 * torch.randn(4, 3, generator=torch.Generator().manual_seed(4))
    row_col = post_polar_normalize(update, mode="row_col")
    col_row = post_polar_normalize(update, mode="col_row")
    assert torch.isfinite(row_col).all() and torch.isfinite(col_row).all()
    assert torch.allclose(row_col.norm(dim=0), torch.ones(3), atol=1e-4)
    assert torch.allclose(col_row.norm(dim=1), torch.ones(4), atol=1e-4)
    # Each mode ends on a different axis, so the other axis is generally not unit.
    assert not torch.allclose(row_col.norm(dim=1), torch.ones(4), atol=1e-2)
    assert not torch.allclose(col_row.norm(dim=0), torch.ones(3), atol=1e-2)
    assert not torch.allclose(row_col, col_row, atol=1e-3)


def test_post_polar_single_axis_modes_and_errors() -> None:
    update = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(post_polar_normalize(update, mode="row").norm(dim=1), torch.ones(3))
    assert torch.allclose(post_polar_normalize(update, mode="col").norm(dim=0), torch.ones(5))
    assert torch.equal(post_polar_normalize(update, mode="none"), update)
    half = post_polar_normalize(update.bfloat16())
    assert half.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="mode"):
        post_polar_normalize(update, mode="diagonal")


# -- Muon -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("ours", "theirs"), [("original", "original"), ("rms", "match_rms_adamw")])
def test_muon_matches_torch_optim_muon_bit_for_bit(ours: str, theirs: str) -> None:
    # Same maths as torch.optim.Muon (which always runs NS in bf16); with the same NS
    # precision the updates agree exactly, for tall and wide matrices.
    generator = torch.Generator().manual_seed(6)
    shapes = [(16, 8), (8, 24), (8, 24)]
    mine = [nn.Parameter(torch.randn(*s, generator=generator)) for s in shapes]
    reference = [nn.Parameter(p.detach().clone()) for p in mine]
    ours_opt = Muon(mine, lr=0.02, weight_decay=0.1, ns_dtype="bfloat16", lr_scale=ours)  # type: ignore[arg-type]
    torch_opt = torch.optim.Muon(reference, lr=0.02, weight_decay=0.1, adjust_lr_fn=theirs)
    for _ in range(3):
        for a, b in zip(mine, reference, strict=True):
            grad = torch.randn(a.shape, generator=generator)
            a.grad, b.grad = grad.clone(), grad.clone()
        ours_opt.step()
        torch_opt.step()
    for a, b in zip(mine, reference, strict=True):
        assert torch.equal(a, b)


def test_muon_fp32_update_is_close_to_bf16_reference() -> None:
    generator = torch.Generator().manual_seed(7)
    start = torch.randn(12, 20, generator=generator)
    mine, reference = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    grad = torch.randn(12, 20, generator=generator)
    mine.grad, reference.grad = grad.clone(), grad.clone()
    Muon([mine], lr=0.1, ns_dtype="float32").step()
    torch.optim.Muon([reference], lr=0.1, weight_decay=0.0).step()
    change, reference_change = start - mine.detach(), start - reference.detach()
    # bf16 NS carries ~1% relative error; the fp32 update is the same direction.
    error = torch.linalg.matrix_norm(change - reference_change)
    assert error < 0.05 * torch.linalg.matrix_norm(reference_change)


def test_muon_nesterov_momentum_and_lr_scale() -> None:
    param = nn.Parameter(torch.zeros(8, 2))  # tall: original scale sqrt(8/2) = 2
    optimizer = Muon([param], lr=0.5, momentum=0.9, ns_dtype="float32")
    grad = torch.randn(8, 2, generator=torch.Generator().manual_seed(8))
    param.grad = grad
    optimizer.step()
    buffer = optimizer.state[param]["momentum_buffer"]
    assert torch.allclose(buffer, 0.1 * grad)
    direction = grad.lerp(buffer, 0.9)  # Nesterov: (1 - mu) g + mu B
    expected = -0.5 * 2.0 * newton_schulz(direction, dtype=torch.float32)
    assert torch.allclose(param.detach(), expected, atol=1e-6)


def test_muon_decoupled_weight_decay_uses_the_unscaled_lr() -> None:
    param = nn.Parameter(torch.ones(4, 4))
    optimizer = Muon([param], lr=0.1, weight_decay=0.5)
    param.grad = torch.zeros(4, 4)  # zero gradient: only the decay acts
    optimizer.step()
    assert torch.allclose(param.detach(), torch.full((4, 4), 1 - 0.1 * 0.5))


def test_muon_plus_balances_the_update_and_keeps_its_scale() -> None:
    for mode, axis in (("row_col", 0), ("col_row", 1)):
        param = nn.Parameter(torch.zeros(6, 10))
        optimizer = Muon([param], lr=1.0, muon_plus=True, muon_plus_mode=mode)  # type: ignore[arg-type]
        param.grad = torch.randn(6, 10, generator=torch.Generator().manual_seed(9))
        optimizer.step()
        update = -param.detach()
        norms = update.norm(dim=axis)
        assert torch.allclose(norms, norms[0].expand_as(norms), atol=1e-5)
        # Rescaled to the norm of an exact semi-orthogonal 6x10 matrix: sqrt(6).
        assert math.isclose(float(update.norm()), math.sqrt(6), rel_tol=1e-5)


def test_muon_rejects_non_matrix_parameters() -> None:
    with pytest.raises(ValueError, match="'gain'.*2-D"):
        Muon([("gain", nn.Parameter(torch.ones(4)))])
    with pytest.raises(ValueError, match="real"):
        Muon([nn.Parameter(torch.ones(2, 2, dtype=torch.complex64))])


def test_muon_sparse_gradient_is_rejected_naming_the_parameter() -> None:
    param = nn.Parameter(torch.zeros(3, 3))
    optimizer = Muon([("table", param)])
    param.grad = torch.eye(3).to_sparse()
    with pytest.raises(RuntimeError, match="'table'.*sparse"):
        optimizer.step()


# -- routing --------------------------------------------------------------------------------


def test_reference_routing_is_role_aware_and_tied_safe() -> None:
    model = reference_model()
    routing = route_parameters(model)
    assert len(routing.muon) == 7
    assert len(routing.adamw) == 4
    assert all(p.ndim == 2 for _, p in routing.muon)
    muon_names = {name.split(".")[-2] for name, _ in routing.muon}
    assert muon_names == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    tied = model.lm_head.weight
    assert sum(p is tied for _, p in routing.adamw) == 1
    assert not any(p is tied for _, p in routing.muon)
    row = next(r for r in routing.rows if r.name == "transformer.wte.weight")
    assert row.aliases == ("lm_head.weight",) and row.optimizer == "adamw"


def test_every_trainable_parameter_is_routed_exactly_once() -> None:
    model = reference_model()
    model.transformer["ln_f"].weight.requires_grad_(False)
    routing = route_parameters(model)
    routed = [id(p) for _, p in routing.muon + routing.adamw]
    assert len(routed) == len(set(routed))
    assert set(routed) == trainable_ids(model)
    assert [name for name, _ in routing.skipped] == ["transformer.ln_f.weight"]


class Mixer(nn.Module):
    """A custom layer with bare parameters (no nn.Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(6, 4))
        self.row = nn.Parameter(torch.randn(1, 4))
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.mix.T) @ self.mix * self.scale + self.row


def test_bare_2d_parameter_is_routed_to_muon_by_the_hidden_matrix_rule() -> None:
    routing = route_parameters(Mixer())
    assert [name for name, _ in routing.muon] == ["mix"]
    assert {name for name, _ in routing.adamw} == {"row", "scale"}
    reasons = {row.name: row.reason for row in routing.rows}
    assert "hidden 2-D matrix" in reasons["mix"]
    assert "1xN" in reasons["row"]


def test_module_role_attribute_overrides_defaults_and_is_inherited() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    setattr(model[1], ROLE_ATTRIBUTE, "adamw")
    setattr(model[1][1], ROLE_ATTRIBUTE, "muon")  # the nearest declaration wins
    routing = route_parameters(model)
    assert {name for name, _ in routing.muon} == {"0.weight", "1.1.weight"}
    assert "module role: 1._speedtronic_optimizer_role" in next(
        r.reason for r in routing.rows if r.name == "1.0.weight"
    )
    # "muon" on a module still keeps its bias on AdamW, and says why.
    bias_row = next(r for r in routing.rows if r.name == "1.1.bias")
    assert bias_row.optimizer == "adamw" and "Muon needs a 2-D matrix" in bias_row.reason


def test_invalid_module_role_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    setattr(model[0], ROLE_ATTRIBUTE, "sgd")
    with pytest.raises(ValueError, match="0._speedtronic_optimizer_role = 'sgd'"):
        route_parameters(model)


def test_user_rules_come_first_and_first_match_wins() -> None:
    model = reference_model()
    rules = [
        Rule(to="adamw", name="*.attn.*"),
        Rule(to="muon", name="*.attn.q_proj.*"),  # shadowed by the rule above
        Rule(to="muon", module="embedding"),  # case-insensitive class-name glob
    ]
    routing = route_parameters(model, rules)
    muon = {name for name, _ in routing.muon}
    assert not any(".attn." in name for name in muon)
    assert "transformer.wte.weight" in muon  # the user explicitly asked for it
    reasons = {row.name: row.reason for row in routing.rows}
    assert reasons["transformer.h.0.attn.q_proj.weight"].startswith("optimizer.routing[0]")
    assert reasons["transformer.wte.weight"].startswith("optimizer.routing[2]")
    ndim_rule = RoutingRule(to="muon", ndim=1)
    norm_routing = route_parameters(model, [ndim_rule])
    norm_row = next(r for r in norm_routing.rows if r.name == "transformer.ln_f.weight")
    assert norm_row.optimizer == "adamw" and "but Muon needs" in norm_row.reason


def test_config_routing_rules_use_the_optimizers_matching() -> None:
    config = SpeedtronicConfig.load(
        {"optimizer": {"name": "muon", "routing": [{"to": "adamw", "module": "LINEAR", "ndim": 2}]}}
    )
    assert not hasattr(config.optimizer.routing[0], "matches")  # one implementation: ours
    routing = route_parameters(reference_model(), config.optimizer.routing)
    assert routing.muon == ()  # the class-name glob is case-insensitive, as documented
    reasons = {row.reason for row in routing.rows if row.name.endswith("proj.weight")}
    assert reasons == {"optimizer.routing[0] (module='LINEAR', ndim=2)"}


def test_head_and_embedding_names_stay_on_adamw() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Parameter(torch.randn(10, 4))
            self.body = nn.Linear(4, 4)
            self.classifier = nn.Linear(4, 3)
            self.output = nn.Linear(4, 10)

    routing = route_parameters(Net())
    assert [name for name, _ in routing.muon] == ["body.weight"]


def test_routing_table_lists_every_parameter_with_its_rule() -> None:
    model = reference_model()
    rows = describe_routing(model, OptSettings(name="muon"))
    table = format_routing_table(rows)
    assert "transformer.wte.weight (= lm_head.weight)" in table
    assert "muon: 7 tensors" in table and "adamw: 4 tensors" in table
    assert table.count("\n") == len(rows) + 2
    adamw_rows = describe_routing(model, OptSettings(name="adamw"))
    assert {row.optimizer for row in adamw_rows} == {"adamw"}


# -- builders -------------------------------------------------------------------------------


def test_adamw_never_builds_an_empty_optimizer_for_all_linear_model() -> None:
    optimizer = build_optimizer(nn.Linear(4, 3, bias=False), OptSettings(), CPU)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert sum(len(group["params"]) for group in optimizer.param_groups) == 1


def test_plain_adamw_trains_every_parameter_of_the_reference_model() -> None:
    model = reference_model()
    optimizer = build_optimizer(model, OptSettings(name="adamw"), CPU)
    assert sorted(optimizer_param_ids(optimizer)) == sorted(trainable_ids(model))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    lm_loss(model, 0).backward()
    optimizer.step()
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []  # the original skipped every hidden matrix here


def test_norms_and_biases_can_be_left_out_of_weight_decay() -> None:
    model = reference_model()
    everything = build_optimizer(model, OptSettings(), CPU)
    assert len(everything.param_groups) == 1  # the default (null): decay everything, as before
    assert everything.param_groups[0]["weight_decay"] == 0.1
    assert (
        len(build_optimizer(model, OptSettings(decay_norms_and_biases=True), CPU).param_groups) == 1
    )
    split = build_optimizer(model, OptSettings(decay_norms_and_biases=False), CPU)
    matrices, vectors = split.param_groups
    assert matrices["weight_decay"] == 0.1 and vectors["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in matrices["params"])
    assert vectors["params"] and all(p.ndim < 2 for p in vectors["params"])
    assert sorted(optimizer_param_ids(split)) == sorted(trainable_ids(model))
    hybrid = build_optimizer(model, OptSettings(name="muon", decay_norms_and_biases=False), CPU)
    algorithms = [(g["algorithm"], g["weight_decay"]) for g in hybrid.param_groups]
    assert algorithms == [("muon", 0.1), ("adamw", 0.1), ("adamw", 0.0)]
    # A bias with zero gradient is not pulled towards zero when it is not decayed.
    linear = nn.Linear(2, 2)
    with torch.no_grad():
        linear.bias.fill_(1.0)
    optimizer = build_optimizer(
        linear, OptSettings(lr=0.1, weight_decay=0.5, decay_norms_and_biases=False), CPU
    )
    (linear.weight.sum() * 0).backward()
    linear.bias.grad = torch.zeros(2)
    optimizer.step()
    assert torch.equal(linear.bias.detach(), torch.ones(2))


def test_a_callback_proposes_decay_norms_and_biases_when_the_config_leaves_it_null() -> None:
    class Proposes(Callback):
        optimizer_decay_norms_and_biases = False

    section = OptimizerConfig()
    assert optimizer_section(section, [Callback()]).decay_norms_and_biases is None
    assert optimizer_section(section, [Callback(), Proposes()]).decay_norms_and_biases is False
    explicit = replace(section, decay_norms_and_biases=True)
    assert optimizer_section(explicit, [Proposes()]).decay_norms_and_biases is True


def test_muon_build_gives_a_hybrid_with_the_routed_groups() -> None:
    model = reference_model()
    settings = OptSettings(name="muon", lr=2e-3, muon_lr=0.05, muon_weight_decay=0.0)
    optimizer = build_optimizer(model, settings, CPU)
    assert isinstance(optimizer, HybridOptimizer)
    muon_group, adamw_group = optimizer.param_groups
    assert (muon_group["algorithm"], adamw_group["algorithm"]) == ("muon", "adamw")
    assert (len(muon_group["params"]), len(adamw_group["params"])) == (7, 4)
    assert muon_group["lr"] == 0.05 and muon_group["weight_decay"] == 0.0
    assert muon_group["lr_scale"] == "rms"
    assert adamw_group["lr"] == 2e-3 and adamw_group["weight_decay"] == 0.1
    assert adamw_group["fused"] is None  # no fused AdamW probe success on CPU
    defaults = build_optimizer(model, OptSettings(name="muon", lr=2e-3), CPU)
    assert defaults.param_groups[0]["lr"] == 2e-3
    assert defaults.param_groups[0]["weight_decay"] == 0.1


def test_builder_rejects_bad_combinations() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="muon_plus"):
        build_optimizer(model, OptSettings(name="adamw", muon_plus=True), CPU)
    with pytest.raises(ValueError, match="optimizer.name"):
        build_optimizer(model, OptSettings(name="sgd"), CPU)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(frozen, OptSettings(), CPU)


def test_fused_request_falls_back_when_it_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.optim.AdamW

    def no_fused(*args: object, **kwargs: object) -> torch.optim.AdamW:
        if kwargs.get("fused"):
            raise RuntimeError("fused AdamW unavailable")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    optimizer = build_optimizer(nn.Linear(2, 2), OptSettings(fused=True), CPU)
    assert optimizer.param_groups[0]["fused"] is None


def test_muon_with_nothing_to_orthogonalise_warns() -> None:
    with pytest.warns(UserWarning, match="no parameter was routed to Muon"):
        optimizer = build_optimizer(nn.LayerNorm(4), OptSettings(name="muon"), CPU)
    assert [group["algorithm"] for group in optimizer.param_groups] == ["adamw"]


# -- hybrid -----------------------------------------------------------------------------------


def test_hybrid_step_changes_both_branches_and_scheduler_drives_both() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.LayerNorm(6))
    optimizer = build_optimizer(model, OptSettings(name="muon", muon_lr=0.02), CPU)
    assert isinstance(optimizer, HybridOptimizer)
    scheduler = build_scheduler(optimizer, SchedSettings(warmup_steps=4), max_steps=10)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.02 / 4, 1e-3 / 4])
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optimizer.step()
    scheduler.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    linear, norm = model[0].weight, model[1].weight
    assert set(optimizer.state[linear]) == {"momentum_buffer"}
    assert set(optimizer.state[norm]) == {"step", "exp_avg", "exp_avg_sq"}
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.02 / 2, 1e-3 / 2])


def test_hybrid_optimizer_forwards_closure_once() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    calls = []

    def closure() -> float:
        calls.append(1)
        optimizer.zero_grad()
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        return float(loss.detach())

    for build in (
        lambda: build_optimizer(model, OptSettings(name="muon"), CPU),
        lambda: build_optimizer(model, OptSettings(name="muon", cautious=True), CPU),
        lambda: Muon([model[0].weight]),
    ):
        calls.clear()
        optimizer = build()
        result = optimizer.step(closure)
        assert calls == [1]
        assert isinstance(result, float)


def test_hybrid_sparse_gradient_on_adamw_branch_names_the_parameter() -> None:
    embedding = nn.Embedding(5, 3, sparse=True)
    model = nn.Sequential(embedding, nn.Linear(3, 3))
    optimizer = build_optimizer(model, OptSettings(name="muon"), CPU)
    model(torch.tensor([[1, 2]])).sum().backward()
    with pytest.raises(RuntimeError, match="'0.weight' has a sparse gradient"):
        optimizer.step()


def test_hybrid_needs_parameters_and_validates_added_groups() -> None:
    with pytest.raises(ValueError, match="at least one"):
        HybridOptimizer([], [])
    weight = nn.Parameter(torch.ones(3, 3))
    optimizer = HybridOptimizer([("w", weight)], [], muon=MuonOptions(lr=0.1))
    extra = nn.Parameter(torch.ones(2, 4))
    optimizer.add_param_group({"params": [("extra", extra)], "algorithm": "muon"})
    assert optimizer.param_groups[-1]["lr"] == 0.1  # filled from the branch defaults
    with pytest.raises(ValueError, match="algorithm"):
        optimizer.add_param_group({"params": [("b", nn.Parameter(torch.ones(2)))]})
    with pytest.raises(ValueError, match="2-D"):
        optimizer.add_param_group(
            {"params": [("v", nn.Parameter(torch.ones(2)))], "algorithm": "muon"}
        )


def test_state_reset_by_replacing_the_state_dict_still_trains_both_branches() -> None:
    # The trainer's optimizer_reset assigns a fresh ``state``; the branches must follow it.
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4))
    for cautious in (False, True):
        optimizer = build_optimizer(model, OptSettings(name="muon", cautious=cautious), CPU)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.state = defaultdict(dict)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        assert len(optimizer.state) == 3
        assert len(optimizer.state_dict()["state"]) == 3


# -- resume -----------------------------------------------------------------------------------


SETTINGS_UNDER_TEST: dict[str, OptSettings] = {
    "adamw": OptSettings(name="adamw"),
    "muon": OptSettings(name="muon", muon_lr=0.02, muon_lr_scale="original"),
    "muon_plus_cautious": OptSettings(
        name="muon", muon_plus=True, muon_plus_mode="col_row", cautious=True, cautious_rescale=True
    ),
}


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    steps: Sequence[int],
) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = lm_loss(model, step)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("variant", sorted(SETTINGS_UNDER_TEST))
def test_state_dict_round_trip_resumes_bit_exactly(variant: str) -> None:
    settings = SETTINGS_UNDER_TEST[variant]
    schedule = SchedSettings(warmup_steps=2, max_steps=8)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        model = reference_model(seed=1)
        optimizer = build_optimizer(model, settings, CPU)
        return model, optimizer, build_scheduler(optimizer, schedule, schedule.max_steps)

    model, optimizer, scheduler = fresh()
    straight = _train(model, optimizer, scheduler, range(6))
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model, optimizer, scheduler = fresh()
    first = _train(model, optimizer, scheduler, range(3))
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "opt": optimizer.state_dict(),
            "sched": scheduler.state_dict(),
        },
        buffer,
    )
    assert set(optimizer.state_dict()) == {"state", "param_groups"}
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model, optimizer, scheduler = fresh()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["opt"])
    scheduler.load_state_dict(saved["sched"])
    resumed = first + _train(model, optimizer, scheduler, range(3, 6))

    assert resumed == straight
    for key, value in model.state_dict().items():
        assert torch.equal(value, final[key]), key


# -- cautious -------------------------------------------------------------------------------


def test_cautious_wrapper_masks_disagreeing_coordinates() -> None:
    param = nn.Parameter(torch.zeros(2))
    base = torch.optim.SGD([param], lr=1.0, momentum=0.9)
    optimizer = CautiousOptimizer(base)
    param.grad = torch.tensor([1.0, 1.0])
    optimizer.step()  # update -g: agrees everywhere
    assert torch.equal(param.detach(), torch.tensor([-1.0, -1.0]))
    # Momentum 0.9 + grad (-0.5, +1): buffer (0.4, 1.9), SGD moves (-0.4, -1.9).
    # Coordinate 0 moves against -grad, so it is held; coordinate 1 agrees.
    param.grad = torch.tensor([-0.5, 1.0])
    optimizer.step()
    assert torch.equal(param.detach(), torch.tensor([-1.0, -2.9]))
    assert torch.allclose(base.state[param]["momentum_buffer"], torch.tensor([0.4, 1.9]))


def test_cautious_rescale_multiplies_kept_updates() -> None:
    param = nn.Parameter(torch.zeros(4))
    optimizer = CautiousOptimizer(torch.optim.SGD([param], lr=1.0, momentum=0.9), rescale=True)
    param.grad = torch.ones(4)
    optimizer.step()  # all 4 kept: alpha = 4 / 5
    assert torch.allclose(param.detach(), torch.full((4,), -0.8))


def test_cautious_wrapper_is_composable_and_finite() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    for base in (
        torch.optim.AdamW(model.parameters(), lr=0.1),
        Muon([model[0].weight], lr=0.1),
        build_optimizer(model, OptSettings(name="muon", muon_plus=True), CPU),
    ):
        optimizer = CautiousOptimizer(base)
        assert optimizer.param_groups is base.param_groups and optimizer.state is base.state
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            optimizer.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert set(optimizer.state_dict()) == {"state", "param_groups"}
        before = [group["lr"] for group in base.param_groups]
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 0.5)
        assert [group["lr"] for group in base.param_groups] == [0.5 * lr for lr in before]


# -- schedule -------------------------------------------------------------------------------


def test_lr_multiplier_warmup_cosine_and_constant() -> None:
    cosine: Callable[[int], float] = lambda s: lr_multiplier(  # noqa: E731
        s, schedule="cosine", warmup_steps=4, max_steps=14, min_lr_ratio=0.1
    )
    assert [cosine(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cosine(4) == pytest.approx(1.0)
    assert cosine(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert cosine(14) == pytest.approx(0.1) and cosine(100) == pytest.approx(0.1)
    constant = [
        lr_multiplier(s, schedule="constant", warmup_steps=2, max_steps=5, min_lr_ratio=0.1)
        for s in range(6)
    ]
    assert constant == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert lr_multiplier(0, schedule="cosine", warmup_steps=0, max_steps=1, min_lr_ratio=0.0) == 1.0


def test_build_scheduler_validates_and_is_a_lambda_lr() -> None:
    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, SchedSettings(name="constant", warmup_steps=0), 5)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert scheduler.state_dict()["lr_lambdas"] == [None]  # the schedule comes from config
    with pytest.raises(ValueError, match="scheduler.name"):
        build_scheduler(optimizer, SchedSettings(name="linear"), 5)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        build_scheduler(optimizer, replace(SchedSettings(), min_lr_ratio=2.0), 5)


def test_muon_matches_the_per_matrix_formula_for_batched_and_large_shapes() -> None:
    # Small equal shapes are orthogonalised as one batch, large ones one by one; both must
    # give exactly the documented per-matrix update.
    generator = torch.Generator().manual_seed(10)
    shapes = [(8, 12), (12, 8), (8, 12), (130, 260), (130, 260)]
    params = [nn.Parameter(torch.randn(*s, generator=generator)) for s in shapes]
    starts = [p.detach().clone() for p in params]
    grads = [torch.randn(*s, generator=generator) for s in shapes]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    Muon(params, lr=0.1, momentum=0.9, ns_dtype="float32").step()
    for param, start, grad in zip(params, starts, grads, strict=True):
        direction = grad.lerp(0.1 * grad, 0.9)
        scale = math.sqrt(max(1.0, param.shape[0] / param.shape[1]))
        expected = start - 0.1 * scale * newton_schulz(direction, dtype=torch.float32)
        assert torch.allclose(param.detach(), expected, atol=1e-5)


def test_config_default_lr_scale_is_rms_matched() -> None:
    settings = SpeedtronicConfig.load({"optimizer": {"name": "muon"}}).optimizer
    optimizer = build_optimizer(reference_model(), settings, CPU)
    muon_group = optimizer.param_groups[0]
    assert muon_group["algorithm"] == "muon" and muon_group["lr_scale"] == "rms"
    assert muon_group["lr"] == optimizer.param_groups[1]["lr"] == settings.lr


def test_package_reexports_its_public_api() -> None:
    import speedtronic.optimizers as package

    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == []
    assert package.newton_schulz is newton_schulz and callable(package.newton_schulz)


def test_builders_accept_the_config_sections() -> None:
    config = SpeedtronicConfig.load(
        {
            "optimizer": {
                "name": "muon",
                "muon_lr_scale": "rms",
                "routing": [{"to": "adamw", "name": "*.mlp.*"}],
                "cautious": True,
            },
            "scheduler": {"name": "cosine", "warmup_steps": 2, "max_steps": 6},
        }
    )
    model = reference_model()
    optimizer = build_optimizer(model, config.optimizer, CPU)
    assert isinstance(optimizer, CautiousOptimizer)
    assert [len(g["params"]) for g in optimizer.param_groups] == [4, 7]
    scheduler = build_scheduler(optimizer, config.scheduler, config.scheduler_steps)
    lm_loss(model, 0).backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(config.optimizer.lr)
