"""Startup shape checks: warn (never fail) when batch, sequence or GEMM dimensions are not
multiples of what the device's fast kernels like.

Tensor cores on CUDA run bf16/fp16 GEMMs fastest when the dimensions are multiples of 8, so
that is the automatic alignment there; every other device/precision gets no automatic
alignment (nothing to gain), and an explicit alignment on CPU/MPS only warns with
``warn_on_cpu: true``. ``alignment: none`` turns the checks off (the original treated it like
``auto``). Findings never change the config, the model or memory use.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from speedtronic.systems.precision import PrecisionPlan

__all__ = [
    "CUDA_MIXED_PRECISION_ALIGNMENT",
    "ShapeConfig",
    "ShapeDataSettings",
    "ShapeModelSettings",
    "ShapeProfile",
    "ShapeReport",
    "ShapeValidationSettings",
    "ShapeWarning",
    "WarningLogger",
    "resolve_shape_profile",
    "validate_startup_shapes",
]

CUDA_MIXED_PRECISION_ALIGNMENT = 8
"""Tensor-core friendly multiple for bf16/fp16 GEMM dimensions."""

_LOGGER = logging.getLogger("speedtronic.shapes")


class ShapeValidationSettings(Protocol):
    """The ``shape_validation`` config section."""

    @property
    def enabled(self) -> bool: ...

    @property
    def alignment(self) -> int | str | None: ...

    @property
    def check_batch(self) -> bool: ...

    @property
    def check_sequence(self) -> bool: ...

    @property
    def check_model(self) -> bool: ...

    @property
    def check_vocab(self) -> bool: ...

    @property
    def warn_on_cpu(self) -> bool: ...


class ShapeDataSettings(Protocol):
    """The ``data`` fields the checks read."""

    @property
    def micro_batch(self) -> int: ...

    @property
    def target_batch_size(self) -> int | None: ...

    @property
    def block_size(self) -> int | None: ...


class ShapeModelSettings(Protocol):
    """The ``model`` fields the checks read."""

    @property
    def vocab_size(self) -> int: ...


class ShapeConfig(Protocol):
    """A run config as far as shape validation is concerned."""

    @property
    def shape_validation(self) -> ShapeValidationSettings: ...

    @property
    def data(self) -> ShapeDataSettings: ...

    @property
    def model(self) -> ShapeModelSettings: ...


class WarningLogger(Protocol):
    """Anything with ``warning(message)``: a ``logging.Logger`` works."""

    def warning(self, msg: str, /) -> object: ...


@dataclass(frozen=True)
class ShapeProfile:
    """The alignment in force and why (``source``: explicit, cuda-mixed-precision,
    device-default or disabled). ``alignment`` is ``None`` when nothing is checked."""

    device_type: str
    precision: str
    alignment: int | None
    source: str


@dataclass(frozen=True)
class ShapeWarning:
    """One misaligned value. ``suggested`` is the next aligned value, or ``None`` when no
    aligned value would fit (a micro batch that could not divide the target batch)."""

    code: str
    field: str
    value: int
    suggested: int | None
    alignment: int
    reason: str

    def message(self) -> str:
        hint = f"consider {self.suggested}" if self.suggested is not None else "no aligned fit"
        return (
            f"shape warning: {self.field}={self.value} is not a multiple of {self.alignment}; "
            f"{hint} ({self.reason})"
        )


@dataclass(frozen=True)
class ShapeReport:
    """What ``validate_startup_shapes`` found."""

    profile: ShapeProfile
    warnings: tuple[ShapeWarning, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "device_type": self.profile.device_type,
            "precision": self.profile.precision,
            "alignment": self.profile.alignment,
            "source": self.profile.source,
            "warning_count": len(self.warnings),
        }


def _precision_mode(precision: PrecisionPlan | str) -> str:
    return precision if isinstance(precision, str) else precision.mode


def resolve_shape_profile(
    device: torch.device, precision: PrecisionPlan | str, requested: int | str | None = "auto"
) -> ShapeProfile:
    """The alignment for ``device`` and ``precision`` (a plan or its mode, e.g. ``"bf16"``).

    An integer is used as given; ``"none"`` disables the checks; ``"auto"`` (or ``None``)
    means 8 on CUDA with bf16/fp16 and nothing elsewhere.
    """
    mode = _precision_mode(precision)
    if isinstance(requested, bool):
        raise ValueError("shape alignment must be an integer, 'auto' or 'none', not a bool")
    if isinstance(requested, int):
        if requested <= 0:
            raise ValueError(f"shape alignment must be positive, got {requested}")
        return ShapeProfile(device.type, mode, requested, "explicit")
    choice = (requested or "auto").strip().lower()
    if choice == "none":
        return ShapeProfile(device.type, mode, None, "disabled")
    if choice != "auto":
        raise ValueError(f"shape alignment must be an integer, 'auto' or 'none', got {requested!r}")
    if device.type == "cuda" and mode in ("bf16", "fp16"):
        return ShapeProfile(
            device.type, mode, CUDA_MIXED_PRECISION_ALIGNMENT, "cuda-mixed-precision"
        )
    return ShapeProfile(device.type, mode, None, "device-default")


def _round_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _check(
    code: str, field: str, value: int | None, alignment: int, reason: str, suggested: int | None
) -> Iterator[ShapeWarning]:
    if value is not None and value > 0 and value % alignment != 0:
        yield ShapeWarning(code, field, value, suggested, alignment, reason)


def _micro_batch_suggestion(micro: int, target: int, alignment: int) -> int | None:
    """The smallest aligned micro batch >= ``micro`` that still divides the target batch."""
    candidate = _round_up(micro, alignment)
    while candidate <= target:
        if target % candidate == 0:
            return candidate
        candidate += alignment
    return None


def _batch_warnings(data: ShapeDataSettings, alignment: int) -> Iterator[ShapeWarning]:
    micro, target = data.micro_batch, data.target_batch_size
    # Without a target batch (no accumulation) any aligned micro batch works.
    suggestion = (
        _micro_batch_suggestion(micro, target, alignment)
        if target is not None and target > 0
        else _round_up(micro, alignment)
    )
    yield from _check(
        "batch_alignment",
        "data.micro_batch_size",
        micro,
        alignment,
        "GEMMs over the batch dimension are usually faster at aligned sizes",
        suggestion,
    )


def _sequence_warnings(data: ShapeDataSettings, alignment: int) -> Iterator[ShapeWarning]:
    block = data.block_size
    yield from _check(
        "sequence_alignment",
        "data.block_size",
        block,
        alignment,
        "attention and GEMM kernels tile the sequence dimension",
        _round_up(block, alignment) if block else None,
    )
    if block:
        tokens = data.micro_batch * block
        yield from _check(
            "token_alignment",
            "micro_batch_size*block_size",
            tokens,
            alignment,
            "the flattened token dimension feeds every projection GEMM",
            _round_up(tokens, alignment),
        )


def _declared_model_dims(model: nn.Module) -> Mapping[str, int] | None:
    hook = getattr(model, "speedtronic_shape_metadata", None)
    if not callable(hook):
        return None
    try:
        declared = hook()
    except Exception:  # a broken optional hook must not stop startup: introspect instead
        return None
    if not isinstance(declared, Mapping):
        return None
    return {
        str(k): v for k, v in declared.items() if isinstance(v, int) and not isinstance(v, bool)
    }


def _introspected_model_dims(model: nn.Module) -> Iterator[tuple[str, int]]:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            yield "linear.in_features", module.in_features
            yield "linear.out_features", module.out_features
        elif isinstance(module, nn.Embedding):
            yield "embedding.embedding_dim", module.embedding_dim
        elif isinstance(module, nn.Conv2d):
            yield "conv2d.in_channels", module.in_channels
            yield "conv2d.out_channels", module.out_channels


def _model_warnings(model: nn.Module, alignment: int) -> Iterator[ShapeWarning]:
    declared = _declared_model_dims(model)
    dims = (
        ((f"model.{k}", v) for k, v in declared.items())
        if declared is not None
        else _introspected_model_dims(model)
    )
    for field, value in dims:
        yield from _check(
            "model_alignment",
            field,
            value,
            alignment,
            "tensor-core GEMMs want aligned feature dimensions",
            _round_up(value, alignment),
        )


def _vocab_warnings(vocab: int | None, alignment: int) -> Iterator[ShapeWarning]:
    yield from _check(
        "vocab_alignment",
        "model.vocab_size",
        vocab,
        alignment,
        "the output projection GEMM is sized by the vocabulary",
        _round_up(vocab, alignment) if vocab else None,
    )


def _model_vocab(model: nn.Module, config: ShapeConfig) -> int | None:
    value = getattr(model, "vocab_size", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return config.model.vocab_size


def validate_startup_shapes(
    config: ShapeConfig,
    model: nn.Module,
    device: torch.device,
    precision: PrecisionPlan | str,
    logger: WarningLogger | None = None,
) -> ShapeReport:
    """Check the run's shapes against the device's preferred alignment; warn, never raise.

    Each finding is logged through ``logger`` (default: the ``speedtronic.shapes`` logger)
    once, de-duplicated by (field, value, alignment), and returned in the report.
    """
    settings = config.shape_validation
    profile = resolve_shape_profile(device, precision, settings.alignment)
    alignment = profile.alignment
    if not settings.enabled or alignment is None:
        return ShapeReport(profile)
    if device.type in ("cpu", "mps") and not settings.warn_on_cpu:
        return ShapeReport(profile)
    found: list[ShapeWarning] = []
    if settings.check_batch:
        found.extend(_batch_warnings(config.data, alignment))
    if settings.check_sequence:
        found.extend(_sequence_warnings(config.data, alignment))
    if settings.check_model:
        found.extend(_model_warnings(model, alignment))
    if settings.check_vocab:
        found.extend(_vocab_warnings(_model_vocab(model, config), alignment))
    unique: dict[tuple[str, int, int], ShapeWarning] = {}
    for warning in found:
        unique.setdefault((warning.field, warning.value, warning.alignment), warning)
    sink = logger if logger is not None else _LOGGER
    for warning in unique.values():
        sink.warning(warning.message())
    return ShapeReport(profile, tuple(unique.values()))
