"""Muon: momentum, then Newton–Schulz orthogonalisation of each 2-D update (optionally with
the Muon+ normalisation), scaled by the matrix shape."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal, TypeAlias, cast, overload

import torch

from speedtronic.optimizers.orthogonalize import (
    DEFAULT_NS_COEFFICIENTS,
    NS_DTYPES,
    POST_POLAR_MODES,
    NsDtype,
    PostPolarMode,
    check_coefficients,
    is_low_precision,
    orthogonalize_many,
    post_polar_normalize,
)
from speedtronic.optimizers.stepping import param_label, reject_sparse_gradients, run_closure

__all__ = [
    "LR_SCALES",
    "LrScale",
    "Muon",
    "ParamsInput",
    "check_muon_group",
    "muon_ineligibility",
]

ParamsInput: TypeAlias = (
    Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, object]]
)
"""What an optimizer constructor accepts: tensors, (name, tensor) pairs or param groups."""

LrScale = Literal["original", "rms"]
LR_SCALES = ("original", "rms")


def muon_ineligibility(shape: Sequence[int], dtype: torch.dtype) -> str | None:
    """Why a tensor of ``shape`` and ``dtype`` cannot be a Muon parameter, or ``None``."""
    if len(shape) != 2:
        return f"Muon needs a 2-D matrix (this is {len(shape)}-D)"
    if not dtype.is_floating_point:
        return "Muon needs a real floating-point tensor"
    return None


def check_muon_group(group: Mapping[str, object]) -> None:
    """Raise ``ValueError`` naming the first parameter of ``group`` Muon cannot optimise."""
    for index, param in enumerate(cast(list[torch.Tensor], group["params"])):
        problem = muon_ineligibility(param.shape, param.dtype)
        if problem is not None:
            raise ValueError(
                f"Muon parameter {param_label(group, index)!r} ({tuple(param.shape)}, "
                f"{param.dtype}): {problem}; route it to AdamW"
            )


def _shape_lr_scale(shape: torch.Size, mode: str) -> float:
    rows, cols = shape[0], shape[1]
    if mode == "rms":
        # Moonlight: an orthogonal update has RMS ~1/sqrt(max(r, c)); this makes it 0.2,
        # about AdamW's update RMS, so AdamW's lr and weight decay carry over.
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def _muon_plus(update: torch.Tensor, mode: str, eps: float) -> torch.Tensor:
    """Muon+ normalisation, rescaled to the Frobenius norm of an exact semi-orthogonal
    matrix (sqrt(min(rows, cols))) so ``lr`` and the shape scaling mean the same with and
    without Muon+ and in both modes."""
    # In float32 even after a bf16 NS: rounding back to bf16 would undo the balancing.
    work = update.float() if is_low_precision(update) else update
    normalised = post_polar_normalize(work, mode=mode, eps=eps)
    target = math.sqrt(min(update.shape))
    norm: torch.Tensor = torch.linalg.matrix_norm(normalised).clamp_min(eps)
    return normalised * (norm.reciprocal() * target)


def _check_hyperparameters(
    *,
    lr: float,
    momentum: float,
    ns_steps: int,
    ns_coefficients: Sequence[float],
    ns_eps: float,
    ns_dtype: str,
    weight_decay: float,
    lr_scale: str,
    muon_plus_mode: str,
    norm_eps: float,
) -> None:
    if lr < 0:
        raise ValueError(f"Muon lr must be >= 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
    if ns_steps < 1:
        raise ValueError(f"Muon ns_steps must be >= 1, got {ns_steps}")
    check_coefficients(ns_coefficients)
    if ns_eps <= 0 or norm_eps <= 0:
        raise ValueError("Muon ns_eps and norm_eps must be > 0")
    if weight_decay < 0:
        raise ValueError(f"Muon weight_decay must be >= 0, got {weight_decay}")
    if lr_scale not in LR_SCALES:
        raise ValueError(f"Muon lr_scale must be one of {LR_SCALES}, got {lr_scale!r}")
    if muon_plus_mode not in POST_POLAR_MODES:
        raise ValueError(f"Muon muon_plus_mode must be one of {POST_POLAR_MODES}")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"Muon ns_dtype must be one of {tuple(NS_DTYPES)}")


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
        _check_hyperparameters(
            lr=lr,
            momentum=momentum,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_eps=ns_eps,
            ns_dtype=ns_dtype,
            weight_decay=weight_decay,
            lr_scale=lr_scale,
            muon_plus_mode=muon_plus_mode,
            norm_eps=norm_eps,
        )
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
        check_muon_group(param_group)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon update of every matrix with a gradient; ``closure`` runs once."""
        loss = run_closure(closure)
        reject_sparse_gradients(self.param_groups)
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, object]) -> None:
        params = [p for p in cast(list[torch.Tensor], group["params"]) if p.grad is not None]
        if not params:
            return
        directions = self._momentum_directions(params, group)
        updates = orthogonalize_many(
            directions,
            cast(int, group["ns_steps"]),
            cast(Sequence[float], group["ns_coefficients"]),
            cast(float, group["ns_eps"]),
            NS_DTYPES[cast(str, group["ns_dtype"])],
        )
        if group["muon_plus"]:
            mode, eps = cast(str, group["muon_plus_mode"]), cast(float, group["norm_eps"])
            updates = [_muon_plus(u, mode, eps) for u in updates]
        self._apply(params, updates, group)

    def _momentum_directions(
        self, params: list[torch.Tensor], group: dict[str, object]
    ) -> list[torch.Tensor]:
        """Advance the momentum buffers; the directions to orthogonalise (Nesterov or not)."""
        grads = [cast(torch.Tensor, p.grad) for p in params]
        buffers = [self._momentum_buffer(p) for p in params]
        momentum = cast(float, group["momentum"])
        torch._foreach_lerp_(buffers, grads, 1.0 - momentum)
        if group["nesterov"]:
            return list(torch._foreach_lerp(grads, buffers, momentum))
        return buffers

    @staticmethod
    def _apply(
        params: list[torch.Tensor], updates: list[torch.Tensor], group: dict[str, object]
    ) -> None:
        """Decoupled weight decay (unscaled lr), then the shape-scaled update."""
        lr, decay = cast(float, group["lr"]), cast(float, group["weight_decay"])
        if decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * decay)
        scale_mode = cast(str, group["lr_scale"])
        for param, update in zip(params, updates, strict=True):
            # add_ converts a bf16 update on the fly: no full-size copy in param's dtype.
            param.add_(update, alpha=-lr * _shape_lr_scale(param.shape, scale_mode))

    def _momentum_buffer(self, param: torch.Tensor) -> torch.Tensor:
        state = cast(dict[str, torch.Tensor], self.state[param])
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state["momentum_buffer"]
