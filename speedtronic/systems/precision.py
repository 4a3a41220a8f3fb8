"""Devices and precision plans: which dtype autocast uses and whether a grad scaler runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class PrecisionSettings(Protocol):
    """What a precision plan is resolved from (the ``precision`` config section)."""

    @property
    def mode(self) -> str: ...

    @property
    def dtype(self) -> str | None: ...


@dataclass(frozen=True)
class PrecisionPlan:
    """How forward passes run: ``mode`` is the resolved bf16/fp16/fp32."""

    mode: str
    dtype: torch.dtype
    use_scaler: bool
    autocast_enabled: bool
    device_type: str

    @property
    def is_mixed_precision(self) -> bool:
        return self.mode in ("bf16", "fp16")


def resolve_device(requested: str | torch.device | None = "auto") -> torch.device:
    """``auto`` -> CUDA, then MPS, then CPU. An unavailable explicit device is an error."""
    if isinstance(requested, torch.device):
        return requested
    name = (requested or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.split(":", 1)[0] == "meta":
        raise RuntimeError(f"device {requested!r} holds no data: a run cannot train on it")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {requested!r} requested but CUDA is not available")
    if name.startswith("mps") and not torch.backends.mps.is_available():
        raise RuntimeError(f"device {requested!r} requested but MPS is not available")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise RuntimeError(f"unknown device {requested!r}: {exc}") from exc


def _requested_mode(settings: PrecisionSettings | None) -> str:
    if settings is None:
        return "auto"
    mode = (settings.mode or "auto").lower()
    if mode == "auto" and settings.dtype:
        return settings.dtype.lower()
    return mode


def _cuda_bf16_supported() -> bool:
    try:
        return bool(torch.cuda.is_bf16_supported())
    except (RuntimeError, AssertionError):
        return False


def resolve_precision(settings: PrecisionSettings | None, device: torch.device) -> PrecisionPlan:
    """The precision plan for ``device`` (see docs/precision table)."""
    requested = _requested_mode(settings)
    kind = device.type
    mode = "fp32"
    if kind == "cuda":
        if requested == "auto":
            mode = "bf16" if _cuda_bf16_supported() else "fp16"
        elif requested == "bf16":
            mode = "bf16" if _cuda_bf16_supported() else "fp32"
        elif requested == "fp16":
            mode = "fp16"
    elif kind == "cpu" and requested == "bf16":
        mode = "bf16"  # CPU autocast supports bf16; fp16 on CPU falls back to fp32
    return PrecisionPlan(
        mode=mode,
        dtype=_DTYPES[mode],
        use_scaler=(kind == "cuda" and mode == "fp16"),
        autocast_enabled=mode != "fp32",
        device_type=kind,
    )


def autocast_context(
    plan: PrecisionPlan, device: torch.device | None = None
) -> contextlib.AbstractContextManager[object]:
    """An autocast region for the plan (a no-op context for fp32)."""
    if not plan.autocast_enabled:
        return contextlib.nullcontext()  # the cheapest no-op: this runs every microbatch
    device_type = device.type if device is not None else plan.device_type
    return torch.autocast(device_type=device_type, dtype=plan.dtype)


def make_grad_scaler(plan: PrecisionPlan) -> torch.amp.GradScaler | None:
    """A grad scaler for CUDA fp16, else ``None``."""
    if not plan.use_scaler:
        return None
    return torch.amp.GradScaler("cuda")


def supports_fused_adamw(device: torch.device) -> bool:
    """Whether a fused AdamW can be constructed and stepped on ``device``."""
    if device.type != "cuda":
        return False
    try:
        probe = nn.Parameter(torch.zeros(1, device=device))
        probe.grad = torch.zeros_like(probe)
        torch.optim.AdamW([probe], fused=True).step()
    except (TypeError, RuntimeError, ValueError):
        return False
    return True
