"""Optimizers: AdamW, Muon (with Muon+), the Muon/AdamW hybrid, the cautious wrapper,
declared parameter routing and the learning-rate schedule.

``build_optimizer`` is what the runtime calls. With ``optimizer.name: adamw`` every trainable
parameter goes to one ``torch.optim.AdamW``. With ``muon`` the parameters are *routed*: hidden
2-D weight matrices go to Muon, everything else (embeddings, output heads, norm gains, biases,
scalars) to an auxiliary AdamW, and both live in one ``HybridOptimizer`` whose ``state_dict``
and param groups behave like any other optimizer's (LR schedulers drive both branches).

Routing is a list of declared rules, checked in this order: the user's ``optimizer.routing``
rules (first match wins), a module's ``_speedtronic_optimizer_role`` attribute (the nearest
enclosing module that sets one), then ``DEFAULT_RULES``. ``describe_routing`` returns the
"which parameter goes where and why" table that ``speedtronic validate`` prints.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal, Protocol, TypeAlias, cast, overload

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from speedtronic.precision import supports_fused_adamw

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_RULES",
    "ROLE_ATTRIBUTE",
    "AdamWOptions",
    "CautiousOptimizer",
    "DefaultRule",
    "HybridOptimizer",
    "Muon",
    "MuonOptions",
    "OptimizerSettings",
    "ParameterFacts",
    "ParameterRouting",
    "RoutingRow",
    "RoutingRule",
    "RoutingRuleSettings",
    "SchedulerSettings",
    "build_optimizer",
    "build_scheduler",
    "describe_routing",
    "format_routing_table",
    "lr_multiplier",
    "newton_schulz",
    "ns_work_dtype",
    "post_polar_normalize",
    "route_parameters",
]

NamedParameter: TypeAlias = tuple[str, nn.Parameter]
ParamsInput: TypeAlias = (
    Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, object]]
)
"""What an optimizer constructor accepts: tensors, (name, tensor) pairs or param groups."""

Route = Literal["muon", "adamw"]
Assignment = Literal["muon", "adamw", "frozen"]
LrScale = Literal["original", "rms"]
PostPolarMode = Literal["none", "row", "col", "row_col", "col_row"]
NsDtype = Literal["auto", "float32", "bfloat16", "float64"]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""The quintic Newton–Schulz polynomial (a, b, c) from the Muon reference implementation."""

ROLE_ATTRIBUTE = "_speedtronic_optimizer_role"
"""Set this attribute on a module to ``"muon"`` or ``"adamw"`` to route its parameters (and
those of its submodules that do not set one themselves)."""

_LR_SCALES = ("original", "rms")
_POST_POLAR_MODES = ("none", "row", "col", "row_col", "col_row")
_NS_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


# ---------------------------------------------------------------------------------------
# Settings: what this module reads from the config sections (typed structurally so the
# config dataclasses and tests' simple objects both fit).
# ---------------------------------------------------------------------------------------


class RoutingRuleSettings(Protocol):
    """One ``optimizer.routing`` entry: route matching parameters ``to`` muon or adamw."""

    @property
    def to(self) -> str: ...

    @property
    def name(self) -> str | None: ...

    @property
    def module(self) -> str | None: ...

    @property
    def ndim(self) -> int | None: ...


class OptimizerSettings(Protocol):
    """The ``optimizer`` config section (the attributes ``build_optimizer`` reads)."""

    @property
    def name(self) -> str: ...

    @property
    def lr(self) -> float: ...

    @property
    def betas(self) -> Sequence[float]: ...

    @property
    def eps(self) -> float: ...

    @property
    def weight_decay(self) -> float: ...

    @property
    def fused(self) -> bool | None: ...

    @property
    def muon_plus(self) -> bool: ...

    @property
    def muon_plus_mode(self) -> str: ...

    @property
    def cautious(self) -> bool: ...

    @property
    def cautious_rescale(self) -> bool: ...

    @property
    def muon_momentum(self) -> float: ...

    @property
    def muon_nesterov(self) -> bool: ...

    @property
    def muon_ns_steps(self) -> int: ...

    @property
    def muon_ns_coefficients(self) -> Sequence[float]: ...

    @property
    def muon_norm_eps(self) -> float: ...

    @property
    def muon_lr(self) -> float | None: ...

    @property
    def muon_lr_scale(self) -> str: ...

    @property
    def muon_weight_decay(self) -> float | None: ...

    @property
    def routing(self) -> Sequence[RoutingRuleSettings]: ...


class SchedulerSettings(Protocol):
    """The ``scheduler`` config section (the horizon is passed to ``build_scheduler``)."""

    @property
    def name(self) -> str: ...

    @property
    def warmup_steps(self) -> int: ...

    @property
    def min_lr_ratio(self) -> float: ...


# ---------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterFacts:
    """What routing rules look at: every name a (possibly tied) parameter is reachable by,
    the class name of the module owning it under each name, its shape and dtype."""

    names: tuple[str, ...]
    owner_classes: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def name(self) -> str:
        """The primary name (the first registration, as ``model.named_parameters()``)."""
        return self.names[0]

    @property
    def components(self) -> frozenset[str]:
        """Every dotted component of every name (``transformer.wte.weight`` -> wte, ...)."""
        return frozenset(part for name in self.names for part in name.split("."))


@dataclass(frozen=True)
class RoutingRule:
    """A declared routing rule. Unset criteria match anything; set ones must all match.

    ``name`` is an ``fnmatch`` glob on the dotted parameter name (any alias of a tied
    weight), ``module`` a glob on the owning module's class name (case-insensitive),
    ``ndim`` the exact number of dimensions.
    """

    to: Route
    name: str | None = None
    module: str | None = None
    ndim: int | None = None

    def matches(self, facts: ParameterFacts) -> bool:
        if self.ndim is not None and len(facts.shape) != self.ndim:
            return False
        if self.name is not None and not any(fnmatchcase(n, self.name) for n in facts.names):
            return False
        if self.module is not None:
            pattern = self.module.lower()
            if not any(fnmatchcase(c.lower(), pattern) for c in facts.owner_classes):
                return False
        return True

    def describe(self) -> str:
        parts = [
            f"{key}={value!r}"
            for key, value in (("name", self.name), ("module", self.module), ("ndim", self.ndim))
            if value is not None
        ]
        return ", ".join(parts) or "any parameter"

    @classmethod
    def from_settings(cls, rule: RoutingRuleSettings) -> RoutingRule:
        target = rule.to.strip().lower()
        if target not in ("muon", "adamw"):
            raise ValueError(f"routing rule 'to' must be 'muon' or 'adamw', got {rule.to!r}")
        return cls(to=cast(Route, target), name=rule.name, module=rule.module, ndim=rule.ndim)


@dataclass(frozen=True)
class DefaultRule:
    """One of the built-in routing rules, applied after user rules and module roles."""

    label: str
    to: Route
    description: str
    applies: Callable[[ParameterFacts], bool]


_EMBEDDING_COMPONENTS = frozenset({"wte", "wpe"})
_HEAD_COMPONENTS = frozenset({"lm_head", "head", "classifier", "score"})


def _is_embedding_name(facts: ParameterFacts) -> bool:
    return any("embed" in part or part in _EMBEDDING_COMPONENTS for part in facts.components)


def _is_head_name(facts: ParameterFacts) -> bool:
    # ``output`` only at the top level (Llama's ``output`` head): deeper ``output`` modules
    # are usually hidden projections (attention ``output``, BERT's ``layer.N.output``).
    top_level_output = any(name.split(".")[0] == "output" for name in facts.names)
    return top_level_output or bool(facts.components & _HEAD_COMPONENTS)


DEFAULT_RULES: tuple[DefaultRule, ...] = (
    DefaultRule(
        "not-a-matrix",
        "adamw",
        "not 2-D (scalar, vector, conv filter)",
        lambda f: len(f.shape) != 2,
    ),
    DefaultRule(
        "not-real-float",
        "adamw",
        "not a real floating-point tensor",
        lambda f: not f.dtype.is_floating_point,
    ),
    DefaultRule("bias", "adamw", "bias", lambda f: any(n.endswith("bias") for n in f.names)),
    DefaultRule(
        "embedding-module",
        "adamw",
        "embedding module",
        lambda f: any("embedding" in c.lower() for c in f.owner_classes),
    ),
    DefaultRule(
        "norm-module",
        "adamw",
        "normalisation module",
        lambda f: any("norm" in c.lower() for c in f.owner_classes),
    ),
    DefaultRule(
        "embedding-name",
        "adamw",
        "embedding by name (*embed*, wte, wpe)",
        _is_embedding_name,
    ),
    DefaultRule(
        "head-name",
        "adamw",
        "output head by name (lm_head, head, classifier, score, top-level output)",
        _is_head_name,
    ),
    DefaultRule(
        "vector-shaped",
        "adamw",
        "1xN or Nx1 matrix (a vector in disguise)",
        lambda f: min(f.shape) < 2,
    ),
    DefaultRule(
        "hidden-matrix",
        "muon",
        "hidden 2-D matrix",
        lambda f: True,
    ),
)
"""The built-in routing policy, first match wins. Muon gets hidden 2-D matrices, including
bare 2-D ``nn.Parameter``s that no ``nn.Linear`` owns; everything else goes to AdamW."""


@dataclass(frozen=True)
class RoutingRow:
    """One line of the routing table: where a parameter goes and which rule sent it there.
    ``aliases`` lists the other names of a tied parameter (it is optimised once)."""

    name: str
    shape: tuple[int, ...]
    optimizer: Assignment
    reason: str
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParameterRouting:
    """Every trainable parameter exactly once, in ``muon`` or ``adamw``; frozen ones in
    ``skipped``; ``rows`` explains each decision."""

    muon: tuple[NamedParameter, ...]
    adamw: tuple[NamedParameter, ...]
    skipped: tuple[NamedParameter, ...]
    rows: tuple[RoutingRow, ...]


@dataclass
class _Entry:
    param: nn.Parameter
    names: list[str]
    owners: list[nn.Module]


def _collect_parameters(model: nn.Module) -> list[_Entry]:
    """Each distinct parameter once (by identity), with every name and owner it has, in
    ``named_parameters`` order so the primary name is the usual one."""
    entries: dict[int, _Entry] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for local, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{module_name}.{local}" if module_name else local
            entry = entries.setdefault(id(param), _Entry(param, [], []))
            if full not in entry.names:
                entry.names.append(full)
                entry.owners.append(module)
    return list(entries.values())


def _module_role(model: nn.Module, modules: Mapping[str, nn.Module], name: str) -> str | None:
    """The role declared by the nearest enclosing module of parameter ``name``, as a
    ``"<path>=<role>"`` description, or ``None``."""
    parts = name.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        path = ".".join(parts[:depth])
        module = modules.get(path, model if not path else None)
        if module is None:
            continue
        role = getattr(module, ROLE_ATTRIBUTE, None)
        if role is None:
            continue
        if role not in ("muon", "adamw"):
            where = path or "<root module>"
            raise ValueError(
                f"{where}.{ROLE_ATTRIBUTE} = {role!r}; expected 'muon', 'adamw' or None"
            )
        return f"{path or '<root>'}={role}"
    return None


def _muon_ineligibility(facts: ParameterFacts) -> str | None:
    if not facts.dtype.is_floating_point:
        return "Muon needs a real floating-point tensor"
    if len(facts.shape) != 2:
        return f"Muon needs a 2-D matrix (this is {len(facts.shape)}-D)"
    return None


def _resolve(to: Route, why: str, facts: ParameterFacts) -> tuple[Route, str]:
    if to == "muon":
        problem = _muon_ineligibility(facts)
        if problem is not None:
            return "adamw", f"{why}; but {problem}, so AdamW"
    return to, why


def _decide(
    facts: ParameterFacts, rules: Sequence[RoutingRule], role: str | None
) -> tuple[Route, str]:
    for index, rule in enumerate(rules):
        if rule.matches(facts):
            return _resolve(rule.to, f"optimizer.routing[{index}] ({rule.describe()})", facts)
    if role is not None:
        path, target = role.rsplit("=", 1)
        return _resolve(cast(Route, target), f"module role: {path}.{ROLE_ATTRIBUTE}", facts)
    for default in DEFAULT_RULES:
        if default.applies(facts):
            return default.to, f"default: {default.description}"
    raise AssertionError("the last default rule matches every parameter")


def route_parameters(
    model: nn.Module,
    rules: Sequence[RoutingRule | RoutingRuleSettings] = (),
    *,
    optimizer: str = "muon",
) -> ParameterRouting:
    """Assign every trainable parameter of ``model`` to Muon or AdamW, exactly once.

    With ``optimizer="adamw"`` everything trainable goes to AdamW (routing only matters for
    the hybrid). Tied parameters are routed once, under their first name.
    """
    declared = [r if isinstance(r, RoutingRule) else RoutingRule.from_settings(r) for r in rules]
    modules = dict(model.named_modules(remove_duplicate=False))
    muon: list[NamedParameter] = []
    adamw: list[NamedParameter] = []
    skipped: list[NamedParameter] = []
    rows: list[RoutingRow] = []
    for entry in _collect_parameters(model):
        facts = ParameterFacts(
            names=tuple(entry.names),
            owner_classes=tuple(type(owner).__name__ for owner in entry.owners),
            shape=tuple(entry.param.shape),
            dtype=entry.param.dtype,
            requires_grad=entry.param.requires_grad,
        )
        target: Assignment
        if not entry.param.requires_grad:
            target, why = "frozen", "requires_grad=False: not optimised"
        elif optimizer == "adamw":
            target, why = "adamw", "optimizer.name is adamw: AdamW trains every parameter"
        else:
            role = _module_role(model, modules, facts.name)
            target, why = _decide(facts, declared, role)
        bucket = {"muon": muon, "adamw": adamw, "frozen": skipped}[target]
        bucket.append((facts.name, entry.param))
        rows.append(RoutingRow(facts.name, facts.shape, target, why, facts.names[1:]))
    return ParameterRouting(tuple(muon), tuple(adamw), tuple(skipped), tuple(rows))


def describe_routing(model: nn.Module, settings: OptimizerSettings) -> list[RoutingRow]:
    """The routing table for ``model`` under ``settings`` (what ``validate`` prints)."""
    name = settings.name.strip().lower()
    return list(route_parameters(model, settings.routing, optimizer=name).rows)


def format_routing_table(rows: Sequence[RoutingRow]) -> str:
    """A fixed-width text table of ``rows`` followed by a per-optimizer summary."""
    header = ("parameter", "shape", "optimizer", "rule")
    lines = [
        (
            row.name + "".join(f" (= {alias})" for alias in row.aliases),
            "x".join(str(d) for d in row.shape) or "scalar",
            row.optimizer,
            row.reason,
        )
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(3)]

    def render(cells: Sequence[str]) -> str:
        padded = [cells[i].ljust(widths[i]) for i in range(3)]
        return "  ".join([*padded, cells[3]]).rstrip()

    out = [render(header), render(["-" * w for w in (*widths, 4)])]
    out.extend(render(cells) for cells in lines)
    summary = []
    for kind in ("muon", "adamw", "frozen"):
        chosen = [row for row in rows if row.optimizer == kind]
        if chosen:
            values = sum(row.numel for row in chosen)
            summary.append(f"{kind}: {len(chosen)} tensors, {values:,} values")
    out.append("; ".join(summary) if summary else "no parameters")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# Newton–Schulz orthogonalisation and Muon+
# ---------------------------------------------------------------------------------------


def _cuda_bf16_supported() -> bool:
    try:
        return bool(torch.cuda.is_bf16_supported())
    except (RuntimeError, AssertionError):
        return False


@functools.cache
def _cpu_bf16_gemm_supported() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX); elsewhere
    bf16 GEMMs are emulated and slower than fp32."""
    for probe_name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        probe = getattr(torch.cpu, probe_name, None)  # private probes: absent in some builds
        if callable(probe):
            try:
                if probe():
                    return True
            except RuntimeError:
                continue
    return False


def ns_work_dtype(device: torch.device, input_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The precision ``ns_dtype="auto"`` runs Newton–Schulz in on ``device``.

    bf16 where the hardware multiplies bf16 natively (CUDA with bf16 support; x86 CPUs with
    AVX512-BF16 or AMX), since NS only needs a rough polar factor and bf16 GEMMs are about
    twice as fast there; float32 everywhere else (emulated bf16 would be slower); float64
    input stays float64 (tests and analysis).
    """
    if input_dtype == torch.float64:
        return torch.float64
    native = (
        _cuda_bf16_supported()
        if device.type == "cuda"
        else (device.type == "cpu" and _cpu_bf16_gemm_supported())
    )
    return torch.bfloat16 if native else torch.float32


def _work_dtype(tensor: torch.Tensor, requested: torch.dtype | None) -> torch.dtype:
    return requested if requested is not None else ns_work_dtype(tensor.device, tensor.dtype)


def _poly_step(x: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """One quintic step ``X <- aX + (bA + cA²)X`` with ``A = XXᵀ``, on 2-D or batched X."""
    gram = x @ x.mT
    if x.ndim == 2:
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        return torch.addmm(x, poly, x, beta=a)
    poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    return torch.baddbmm(x, poly, x, beta=a)


def _orthogonalize_wide(
    x: torch.Tensor, steps: int, coefficients: Sequence[float], eps: float
) -> torch.Tensor:
    """NS on wide matrices (rows <= cols, so the Gram matrix is the small side)."""
    norm = torch.linalg.matrix_norm(x, keepdim=True).clamp_min(eps)
    x = x / norm  # Frobenius norm 1 bounds the spectral norm by 1, inside NS's basin
    a, b, c = coefficients
    for _ in range(steps):
        x = _poly_step(x, a, b, c)
    return x


def _newton_schulz_unchecked(
    matrix: torch.Tensor,
    steps: int,
    coefficients: Sequence[float],
    eps: float,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    work = _work_dtype(matrix, dtype)
    tall = matrix.size(-2) > matrix.size(-1)
    try:
        x = matrix.detach().to(work)
        x = _orthogonalize_wide(x.mT if tall else x, steps, coefficients, eps)
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError):
        # A device without low-precision GEMMs for this dtype: redo it in float32.
        if work == torch.float32:
            raise
        x = _orthogonalize_wide(
            (matrix.mT if tall else matrix).detach().float(), steps, coefficients, eps
        )
    return x.mT if tall else x


def _check_coefficients(coefficients: Sequence[float]) -> None:
    if len(coefficients) != 3:
        raise ValueError(f"Newton–Schulz needs 3 coefficients (a, b, c), got {coefficients!r}")


def newton_schulz(
    matrix: torch.Tensor,
    steps: int = 5,
    *,
    coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximately orthogonalise ``matrix`` (its polar factor ``UVᵀ``), without changing it.

    Frobenius-normalises, transposes tall matrices so the Gram matrix is the small side, then
    runs ``steps`` iterations of ``X <- aX + (bXXᵀ + c(XXᵀ)²)X``. The default quintic pushes
    singular values into roughly [0.7, 1.2] rather than exactly 1 (faster, and good enough
    for Muon). Works on a 2-D matrix or a batch ``(..., rows, cols)``. The result is in the
    working dtype: ``dtype`` if given, else ``ns_work_dtype(matrix.device, matrix.dtype)``.
    A zero matrix gives zeros.
    """
    if matrix.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(matrix.shape)}")
    if not matrix.dtype.is_floating_point:
        raise TypeError(f"newton_schulz needs a real floating-point matrix, got {matrix.dtype}")
    if steps < 1:
        raise ValueError(f"newton_schulz steps must be >= 1, got {steps}")
    if eps <= 0:
        raise ValueError(f"newton_schulz eps must be > 0, got {eps}")
    _check_coefficients(coefficients)
    return _newton_schulz_unchecked(matrix, steps, coefficients, eps, dtype)


def post_polar_normalize(
    update: torch.Tensor, *, mode: str = "row_col", eps: float = 1e-8
) -> torch.Tensor:
    """Muon+: normalise an orthogonalised update along rows and/or columns.

    ``row_col`` divides every row by its L2 norm, then every column (the result has unit
    columns); ``col_row`` does columns first, then rows (unit rows). ``row`` / ``col`` do one
    pass, ``none`` nothing. Half-precision input is normalised in float32 and cast back.
    """
    if mode not in _POST_POLAR_MODES:
        raise ValueError(f"post_polar_normalize mode must be one of {_POST_POLAR_MODES}")
    if update.ndim < 2:
        raise ValueError(f"post_polar_normalize needs a matrix, got {tuple(update.shape)}")
    if eps <= 0:
        raise ValueError(f"post_polar_normalize eps must be > 0, got {eps}")
    low_precision = update.dtype in (torch.float16, torch.bfloat16)
    work = update.float() if low_precision else update
    passes = {"none": (), "row": (-1,), "col": (-2,), "row_col": (-1, -2), "col_row": (-2, -1)}
    for dim in passes[mode]:  # dim -1 reduces along a row, i.e. normalises rows
        work = work / torch.sqrt(work.square().sum(dim=dim, keepdim=True) + eps)
    return work.to(update.dtype) if low_precision else work


# ---------------------------------------------------------------------------------------
# Muon
# ---------------------------------------------------------------------------------------


def _param_label(group: Mapping[str, object], index: int) -> str:
    names = group.get("param_names")
    if isinstance(names, list) and index < len(names):
        return str(names[index])
    return f"#{index} of its param group"


def _run_closure(closure: Callable[[], float] | None) -> float | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _reject_sparse_gradients(groups: Iterable[Mapping[str, object]]) -> None:
    for group in groups:
        for index, param in enumerate(cast(list[torch.Tensor], group["params"])):
            if param.grad is not None and param.grad.is_sparse:
                algorithm = group.get("algorithm", "this optimizer")
                raise RuntimeError(
                    f"parameter {_param_label(group, index)!r} has a sparse gradient; "
                    f"{algorithm} needs dense gradients"
                )


def _shape_lr_scale(shape: torch.Size, mode: str) -> float:
    rows, cols = shape[0], shape[1]
    if mode == "rms":
        # Moonlight: an orthogonal update has RMS ~1/sqrt(max(r, c)); this makes it 0.2,
        # about AdamW's update RMS, so AdamW's lr and weight decay carry over.
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def _is_tall(matrix: torch.Tensor) -> bool:
    return matrix.size(-2) > matrix.size(-1)


def _as_wide(matrix: torch.Tensor) -> torch.Tensor:
    return matrix.mT if _is_tall(matrix) else matrix


def _orthogonalize_all(
    directions: Sequence[torch.Tensor], group: Mapping[str, object]
) -> list[torch.Tensor]:
    """NS for every direction; matrices of equal (oriented) shape run as one batched GEMM
    chain, which removes most per-matrix overhead on small models."""
    steps = cast(int, group["ns_steps"])
    coefficients = cast(Sequence[float], group["ns_coefficients"])
    eps = cast(float, group["ns_eps"])
    requested = _NS_DTYPES[cast(str, group["ns_dtype"])]
    buckets: dict[tuple[int, int, torch.device, torch.dtype], list[int]] = {}
    for index, d in enumerate(directions):
        rows, cols = d.shape
        key = (min(rows, cols), max(rows, cols), d.device, d.dtype)
        buckets.setdefault(key, []).append(index)
    results: list[torch.Tensor | None] = [None] * len(directions)
    for indices in buckets.values():
        wide = [_as_wide(directions[i]) for i in indices]
        batch = wide[0] if len(wide) == 1 else torch.stack(wide)
        ortho = _newton_schulz_unchecked(batch, steps, coefficients, eps, requested)
        outputs = [ortho] if len(wide) == 1 else list(ortho.unbind(0))
        for i, out in zip(indices, outputs, strict=True):
            results[i] = out.mT if _is_tall(directions[i]) else out
    return [r for r in results if r is not None]


def _muon_plus(update: torch.Tensor, mode: str, eps: float) -> torch.Tensor:
    """Muon+ normalisation, rescaled to the Frobenius norm of an exact semi-orthogonal
    matrix (sqrt(min(rows, cols))) so ``lr`` and the shape scaling mean the same with and
    without Muon+ and in both modes."""
    # In float32 even after a bf16 NS: rounding back to bf16 would undo the balancing.
    low_precision = update.dtype in (torch.float16, torch.bfloat16)
    normalised = post_polar_normalize(
        update.float() if low_precision else update, mode=mode, eps=eps
    )
    target = math.sqrt(min(update.shape))
    norm: torch.Tensor = torch.linalg.matrix_norm(normalised).clamp_min(eps)
    return normalised * (norm.reciprocal() * target)


def _check_muon_param(param: torch.Tensor, label: str) -> None:
    if param.ndim != 2:
        raise ValueError(
            f"Muon parameter {label!r} has shape {tuple(param.shape)}; Muon only optimises "
            "2-D matrices (route it to AdamW)"
        )
    if not param.dtype.is_floating_point:
        raise ValueError(f"Muon parameter {label!r} is {param.dtype}; Muon needs real floats")


class Muon(torch.optim.Optimizer):
    """Muon: momentum, then Newton–Schulz orthogonalisation of each 2-D update.

    Per matrix W (r×c) with gradient G and buffer B (kept in W's dtype):
    ``B <- μB + (1-μ)G``; direction ``D = (1-μ)G + μB`` (Nesterov) or ``B``;
    ``U = NS(D)`` (optionally Muon+ normalised); ``W <- W(1 - lr·wd) - lr·s·U`` with
    ``s = sqrt(max(1, r/c))`` (``lr_scale="original"``) or ``0.2·sqrt(max(r, c))``
    (``"rms"``, RMS-matched to AdamW). Weight decay uses the unscaled lr, as
    ``torch.optim.Muon`` does. This is the same update as ``torch.optim.Muon`` (which
    we compare against in tests and benchmarks) plus Muon+, configurable NS precision and
    batched NS for equal shapes.
    """

    def __init__(
        self,
        params: ParamsInput,
        lr: float = 0.02,
        momentum: float = 0.95,
        *,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
        ns_eps: float = 1e-7,
        ns_dtype: NsDtype = "auto",
        weight_decay: float = 0.0,
        lr_scale: LrScale = "original",
        muon_plus: bool = False,
        muon_plus_mode: PostPolarMode = "row_col",
        norm_eps: float = 1e-8,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"Muon ns_steps must be >= 1, got {ns_steps}")
        _check_coefficients(ns_coefficients)
        if ns_eps <= 0 or norm_eps <= 0:
            raise ValueError("Muon ns_eps and norm_eps must be > 0")
        if weight_decay < 0:
            raise ValueError(f"Muon weight_decay must be >= 0, got {weight_decay}")
        if lr_scale not in _LR_SCALES:
            raise ValueError(f"Muon lr_scale must be one of {_LR_SCALES}, got {lr_scale!r}")
        if muon_plus_mode not in _POST_POLAR_MODES:
            raise ValueError(f"Muon muon_plus_mode must be one of {_POST_POLAR_MODES}")
        if ns_dtype not in _NS_DTYPES:
            raise ValueError(f"Muon ns_dtype must be one of {tuple(_NS_DTYPES)}")
        defaults: dict[str, object] = {
            "algorithm": "muon",
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_coefficients": tuple(float(c) for c in ns_coefficients),
            "ns_eps": ns_eps,
            "ns_dtype": ns_dtype,
            "weight_decay": weight_decay,
            "lr_scale": lr_scale,
            "muon_plus": muon_plus,
            "muon_plus_mode": muon_plus_mode,
            "norm_eps": norm_eps,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, object]) -> None:
        super().add_param_group(param_group)
        for index, param in enumerate(cast(list[torch.Tensor], param_group["params"])):
            _check_muon_param(param, _param_label(param_group, index))

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon update of every matrix with a gradient; ``closure`` runs once."""
        loss = _run_closure(closure)
        _reject_sparse_gradients(self.param_groups)
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, object]) -> None:
        params = [p for p in cast(list[torch.Tensor], group["params"]) if p.grad is not None]
        if not params:
            return
        grads = [cast(torch.Tensor, p.grad) for p in params]
        buffers = [self._momentum_buffer(p) for p in params]
        momentum = cast(float, group["momentum"])
        torch._foreach_lerp_(buffers, grads, 1.0 - momentum)
        directions = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        updates = _orthogonalize_all(directions, group)
        if group["muon_plus"]:
            mode, eps = cast(str, group["muon_plus_mode"]), cast(float, group["norm_eps"])
            updates = [_muon_plus(u, mode, eps) for u in updates]
        lr, decay = cast(float, group["lr"]), cast(float, group["weight_decay"])
        if decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * decay)
        scale_mode = cast(str, group["lr_scale"])
        for param, update in zip(params, updates, strict=True):
            if update.dtype != param.dtype:
                update = update.to(param.dtype)
            param.add_(update, alpha=-lr * _shape_lr_scale(param.shape, scale_mode))

    def _momentum_buffer(self, param: torch.Tensor) -> torch.Tensor:
        state = cast(dict[str, torch.Tensor], self.state[param])
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


# ---------------------------------------------------------------------------------------
# Hybrid (Muon + auxiliary AdamW in one optimizer object)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MuonOptions:
    """Hyper-parameters of the Muon branch of a ``HybridOptimizer``."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS
    ns_eps: float = 1e-7
    ns_dtype: NsDtype = "auto"
    weight_decay: float = 0.0
    lr_scale: LrScale = "original"
    muon_plus: bool = False
    muon_plus_mode: PostPolarMode = "row_col"
    norm_eps: float = 1e-8


@dataclass(frozen=True)
class AdamWOptions:
    """Hyper-parameters of an AdamW (plain, or the hybrid's auxiliary branch).
    ``fused=True`` tries fused AdamW and falls back to the regular one if it cannot be built."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    fused: bool = False


def _make_muon(params: Sequence[NamedParameter], options: MuonOptions) -> Muon:
    return Muon(
        list(params),
        lr=options.lr,
        momentum=options.momentum,
        nesterov=options.nesterov,
        ns_steps=options.ns_steps,
        ns_coefficients=options.ns_coefficients,
        ns_eps=options.ns_eps,
        ns_dtype=options.ns_dtype,
        weight_decay=options.weight_decay,
        lr_scale=options.lr_scale,
        muon_plus=options.muon_plus,
        muon_plus_mode=options.muon_plus_mode,
        norm_eps=options.norm_eps,
    )


def _make_adamw(params: Sequence[NamedParameter], options: AdamWOptions) -> torch.optim.AdamW:
    def build(fused: bool | None) -> torch.optim.AdamW:
        # A fresh group each try: construction mutates the group dict.
        group: dict[str, object] = {"params": list(params), "algorithm": "adamw"}
        return torch.optim.AdamW(
            [group],
            lr=options.lr,
            betas=options.betas,
            eps=options.eps,
            weight_decay=options.weight_decay,
            fused=fused,
        )

    if options.fused:
        try:
            return build(True)
        except (TypeError, RuntimeError, ValueError):
            pass  # e.g. parameters on a device without a fused kernel: same maths, unfused
    return build(None)


class HybridOptimizer(torch.optim.Optimizer):
    """Muon for ``muon_params`` and AdamW for ``adamw_params``, as one optimizer.

    Its ``param_groups`` are the Muon group (``algorithm: "muon"``) then the AdamW group
    (``algorithm: "adamw"``); a scheduler that scales ``group["lr"]`` drives both branches.
    ``state`` holds both branches' per-parameter state (Muon ``momentum_buffer``, AdamW
    ``step``/``exp_avg``/``exp_avg_sq``), so ``state_dict`` / ``load_state_dict`` round-trip
    the whole optimizer and ``state.clear()`` resets both. Internally a ``Muon`` and a
    ``torch.optim.AdamW`` step the groups; they share this object's group dicts and state.
    """

    def __init__(
        self,
        muon_params: Sequence[NamedParameter],
        adamw_params: Sequence[NamedParameter],
        *,
        muon: MuonOptions | None = None,
        adamw: AdamWOptions | None = None,
    ) -> None:
        if not muon_params and not adamw_params:
            raise ValueError("HybridOptimizer needs at least one parameter")
        self._muon = _make_muon(muon_params, muon or MuonOptions()) if muon_params else None
        self._adamw = _make_adamw(adamw_params, adamw or AdamWOptions()) if adamw_params else None
        groups = [g for child in self._children() for g in child.param_groups]
        super().__init__(groups, {"algorithm": "hybrid"})
        self._bind_children()

    def _children(self) -> list[torch.optim.Optimizer]:
        return [child for child in (self._muon, self._adamw) if child is not None]

    def _bind_children(self) -> None:
        """Point the branches at this object's groups and state again (after a load, or after
        someone replaced ``state`` instead of clearing it)."""
        for algorithm, child in (("muon", self._muon), ("adamw", self._adamw)):
            if child is not None:
                child.param_groups = [g for g in self.param_groups if g["algorithm"] == algorithm]
                child.state = self.state

    def add_param_group(self, param_group: dict[str, object]) -> None:
        """Add a group with ``algorithm`` "muon" or "adamw"; missing options come from that
        branch's defaults."""
        algorithm = param_group.get("algorithm")
        child = {"muon": self._muon, "adamw": self._adamw}.get(str(algorithm))
        if child is None:
            raise ValueError(
                f"a HybridOptimizer param group needs algorithm 'muon' or 'adamw' matching an "
                f"existing branch, got {algorithm!r}"
            )
        for key, value in child.defaults.items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)
        if algorithm == "muon":
            for index, param in enumerate(cast(list[torch.Tensor], param_group["params"])):
                _check_muon_param(param, _param_label(param_group, index))
        if hasattr(self, "state"):
            self._bind_children()

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Run ``closure`` once, then the Muon step, then the AdamW step."""
        loss = _run_closure(closure)
        self._bind_children()
        _reject_sparse_gradients(self.param_groups)
        for child in self._children():
            child.step()
        return loss

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        super().load_state_dict(dict(state_dict))
        self._bind_children()


# ---------------------------------------------------------------------------------------
# Cautious wrapper
# ---------------------------------------------------------------------------------------


class CautiousOptimizer(torch.optim.Optimizer):
    """Wrap any optimizer so that update coordinates whose sign disagrees with the gradient
    are not applied (Liang et al., "Cautious Optimizers").

    After the wrapped optimizer steps, each coordinate whose applied change does not point
    along ``-grad`` is put back to its old value. With ``rescale=True`` the kept updates are
    multiplied by ``numel / (kept + 1)`` per tensor, the paper's normalisation. The change
    observed includes decoupled weight decay, so decay is masked too; the wrapped optimizer's
    moments advance as usual. ``param_groups``, ``state`` and ``defaults`` are the wrapped
    optimizer's own objects, and ``state_dict`` is its state dict.
    """

    def __init__(self, base: torch.optim.Optimizer, *, rescale: bool = False) -> None:
        self.base = base
        self.rescale = rescale
        self._wrapping = False
        super().__init__(base.param_groups, base.defaults)
        self._share_base()
        self._wrapping = True

    def _share_base(self) -> None:
        self.param_groups = self.base.param_groups
        self.state = self.base.state
        self.defaults = self.base.defaults

    def add_param_group(self, param_group: dict[str, object]) -> None:
        if self._wrapping:
            self.base.add_param_group(param_group)
            self._share_base()
        else:
            super().add_param_group(param_group)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Run ``closure`` once, step the wrapped optimizer, then mask its update."""
        loss = _run_closure(closure)
        # Someone may have replaced (not cleared) our state or groups: the base uses ours.
        self.base.param_groups = self.param_groups
        self.base.state = self.state
        with torch.no_grad():
            tracked = [
                (p, p.detach().clone(), p.grad)
                for group in self.param_groups
                for p in cast(list[torch.Tensor], group["params"])
                if p.grad is not None
            ]
            self.base.step()
            for param, old, grad in tracked:
                self._mask(param, old, grad)
        return loss

    def _mask(self, param: torch.Tensor, old: torch.Tensor, grad: torch.Tensor) -> None:
        descent = old - param  # points along +grad where the update agrees with the gradient
        keep = descent * grad.to(descent.dtype) > 0
        if self.rescale:
            alpha = keep.numel() / (int(keep.sum()) + 1)
            param.copy_(torch.where(keep, old - descent * alpha, old))
        else:
            param.copy_(torch.where(keep, param, old))  # exact: kept entries are untouched

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        self.base.load_state_dict(dict(state_dict))
        self._share_base()


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------


def _muon_options(settings: OptimizerSettings) -> MuonOptions:
    coefficients = tuple(float(c) for c in settings.muon_ns_coefficients)
    _check_coefficients(coefficients)
    lr_scale = settings.muon_lr_scale.strip().lower()
    if lr_scale not in _LR_SCALES:
        raise ValueError(f"optimizer.muon_lr_scale must be one of {_LR_SCALES}")
    mode = settings.muon_plus_mode.strip().lower()
    if mode not in ("row_col", "col_row"):
        raise ValueError("optimizer.muon_plus_mode must be 'row_col' or 'col_row'")
    decay = settings.muon_weight_decay
    return MuonOptions(
        lr=settings.muon_lr if settings.muon_lr is not None else settings.lr,
        momentum=settings.muon_momentum,
        nesterov=settings.muon_nesterov,
        ns_steps=settings.muon_ns_steps,
        ns_coefficients=cast(tuple[float, float, float], coefficients),
        weight_decay=decay if decay is not None else settings.weight_decay,
        lr_scale=cast(LrScale, lr_scale),
        muon_plus=settings.muon_plus,
        muon_plus_mode=cast(PostPolarMode, mode),
        norm_eps=settings.muon_norm_eps,
    )


def _adamw_options(settings: OptimizerSettings, device: torch.device) -> AdamWOptions:
    betas = tuple(float(b) for b in settings.betas)
    if len(betas) != 2:
        raise ValueError(f"optimizer.betas needs exactly two values, got {settings.betas!r}")
    fused = settings.fused if settings.fused is not None else supports_fused_adamw(device)
    return AdamWOptions(
        lr=settings.lr,
        betas=(betas[0], betas[1]),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        fused=fused,
    )


def build_optimizer(
    model: nn.Module, settings: OptimizerSettings, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer the ``optimizer`` section describes, for ``model`` on ``device``.

    ``adamw``: one ``torch.optim.AdamW`` over every trainable parameter (fused where the
    device supports it, unless ``fused`` says otherwise). ``muon``: a ``HybridOptimizer``
    over the routed parameters. ``cautious`` wraps either in ``CautiousOptimizer``.
    """
    name = settings.name.strip().lower()
    if name not in ("adamw", "muon"):
        raise ValueError(f"optimizer.name must be 'adamw' or 'muon', got {settings.name!r}")
    if settings.muon_plus and name != "muon":
        raise ValueError("optimizer.muon_plus needs optimizer.name: muon")
    routing = route_parameters(model, settings.routing, optimizer=name)
    if not routing.muon and not routing.adamw:
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    adamw = _adamw_options(settings, device)
    optimizer: torch.optim.Optimizer
    if name == "adamw":
        optimizer = _make_adamw(routing.adamw, adamw)
    else:
        if not routing.muon:
            warnings.warn(
                "optimizer.name is muon but no parameter was routed to Muon (see "
                "`speedtronic validate`); training with AdamW only",
                stacklevel=2,
            )
        optimizer = HybridOptimizer(
            routing.muon, routing.adamw, muon=_muon_options(settings), adamw=adamw
        )
    if settings.cautious:
        optimizer = CautiousOptimizer(optimizer, rescale=settings.cautious_rescale)
    return optimizer


def lr_multiplier(
    step: int, *, schedule: str, warmup_steps: int, max_steps: int, min_lr_ratio: float
) -> float:
    """The factor applied to each group's base lr at scheduler step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps``, then ``constant`` (1.0) or ``cosine`` from 1
    down to ``min_lr_ratio`` over ``max_steps - warmup_steps`` steps (held there after).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return max(1e-8, (step + 1) / warmup_steps)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, settings: SchedulerSettings, max_steps: int
) -> LambdaLR:
    """A ``LambdaLR`` over every param group (both hybrid branches) for a run whose schedule
    ends at ``max_steps`` (the caller resolves ``scheduler.max_steps`` vs ``run.max_steps``).

    The schedule is a plain function of the config, so it is not stored in the scheduler's
    state dict: on resume the step counter comes from the checkpoint and the shape from the
    (possibly edited) config.
    """
    schedule = settings.name.strip().lower()
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"scheduler.name must be 'cosine' or 'constant', got {settings.name!r}")
    if settings.warmup_steps < 0 or max_steps <= 0:
        raise ValueError("scheduler warmup_steps must be >= 0 and max_steps > 0")
    if not 0.0 <= settings.min_lr_ratio <= 1.0:
        raise ValueError(f"scheduler.min_lr_ratio must be in [0, 1], got {settings.min_lr_ratio}")
    warmup, floor = settings.warmup_steps, settings.min_lr_ratio

    def multiplier(step: int) -> float:
        return lr_multiplier(
            step, schedule=schedule, warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=floor
        )

    return LambdaLR(optimizer, multiplier)
