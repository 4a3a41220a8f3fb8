"""Newton–Schulz orthogonalisation (Muon's approximate polar factor), the precision it runs
in, and the Muon+ post-polar normalisation."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import torch

__all__ = [
    "CPU_BF16_MIN_SIDE",
    "DEFAULT_NS_COEFFICIENTS",
    "NS_DTYPES",
    "POST_POLAR_MODES",
    "NsDtype",
    "PostPolarMode",
    "check_coefficients",
    "is_low_precision",
    "newton_schulz",
    "ns_work_dtype",
    "orthogonalize_many",
    "post_polar_normalize",
]

PostPolarMode = Literal["none", "row", "col", "row_col", "col_row"]
NsDtype = Literal["auto", "float32", "bfloat16", "float64"]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""The quintic Newton–Schulz polynomial (a, b, c) from the Muon reference implementation."""

POST_POLAR_MODES = ("none", "row", "col", "row_col", "col_row")
NS_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}

CPU_BF16_MIN_SIDE = 128
"""On CPUs with native bf16 GEMMs, ``auto`` uses bf16 only for matrices whose smaller side is
at least this: below it bf16's per-call overhead outweighs its faster arithmetic."""

_BATCH_MAX_ELEMENTS = 128 * 256
"""Equal-shaped matrices up to this size are orthogonalised as one batch (fewer, larger
calls); bigger ones are compute-bound and run one by one (measured: batching them is not
faster on CPU)."""

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# -- precision ------------------------------------------------------------------------------


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


def ns_work_dtype(
    device: torch.device,
    input_dtype: torch.dtype = torch.float32,
    shape: Sequence[int] | None = None,
) -> torch.dtype:
    """The precision ``ns_dtype="auto"`` runs Newton–Schulz in, for a matrix of ``shape``
    (its last two dims) on ``device``.

    NS only needs a rough polar factor, so bf16 is used wherever it is faster: on CUDA
    devices with bf16 support, and on CPUs that multiply bf16 natively (AVX512-BF16 or AMX)
    for matrices whose smaller side is at least ``CPU_BF16_MIN_SIDE``. Everything else runs
    in float32 (emulated bf16 is slower, and small bf16 GEMMs are overhead-bound); float64
    input stays float64 (tests and analysis).
    """
    if input_dtype == torch.float64:
        return torch.float64
    if device.type == "cuda":
        return torch.bfloat16 if _cuda_bf16_supported() else torch.float32
    if device.type != "cpu" or not _cpu_bf16_gemm_supported():
        return torch.float32
    large = shape is None or min(shape[-2:]) >= CPU_BF16_MIN_SIDE
    return torch.bfloat16 if large else torch.float32


def _work_dtype(tensor: torch.Tensor, requested: torch.dtype | None) -> torch.dtype:
    if requested is not None:
        return requested
    return ns_work_dtype(tensor.device, tensor.dtype, tuple(tensor.shape))


# -- the iteration --------------------------------------------------------------------------


def _is_tall(matrix: torch.Tensor) -> bool:
    """More rows than columns (in the last two dims)."""
    return matrix.size(-2) > matrix.size(-1)


def _as_wide(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` transposed if it is tall, so its Gram matrix ``XXᵀ`` is the small side."""
    return matrix.mT if _is_tall(matrix) else matrix


def check_coefficients(coefficients: Sequence[float]) -> None:
    if len(coefficients) != 3:
        raise ValueError(f"Newton–Schulz needs 3 coefficients (a, b, c), got {coefficients!r}")


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
    wide = _as_wide(matrix).detach()
    try:
        x = _orthogonalize_wide(wide.to(work), steps, coefficients, eps)
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError):
        # A device without low-precision GEMMs for this dtype: redo it in float32.
        if work == torch.float32:
            raise
        x = _orthogonalize_wide(wide.float(), steps, coefficients, eps)
    return x.mT if _is_tall(matrix) else x


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
    working dtype: ``dtype`` if given, else ``ns_work_dtype(device, dtype, shape)``.
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
    check_coefficients(coefficients)
    return _newton_schulz_unchecked(matrix, steps, coefficients, eps, dtype)


def _batch_key(index: int, matrix: torch.Tensor) -> tuple[int, int, torch.device, torch.dtype]:
    rows, cols = matrix.shape
    if rows * cols > _BATCH_MAX_ELEMENTS:
        return (index, -1, matrix.device, matrix.dtype)  # a batch of its own
    return (min(rows, cols), max(rows, cols), matrix.device, matrix.dtype)


def orthogonalize_many(
    matrices: Sequence[torch.Tensor],
    steps: int,
    coefficients: Sequence[float],
    eps: float,
    dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    """``newton_schulz`` of every 2-D matrix (arguments already validated). Small matrices of
    equal (oriented) shape run as one batched GEMM chain, which removes most per-matrix
    overhead on small models."""
    batches: dict[tuple[int, int, torch.device, torch.dtype], list[int]] = {}
    for index, matrix in enumerate(matrices):
        batches.setdefault(_batch_key(index, matrix), []).append(index)
    results: list[torch.Tensor | None] = [None] * len(matrices)
    for indices in batches.values():
        wide = [_as_wide(matrices[i]) for i in indices]
        batch = wide[0] if len(wide) == 1 else torch.stack(wide)
        ortho = _newton_schulz_unchecked(batch, steps, coefficients, eps, dtype)
        outputs = [ortho] if len(wide) == 1 else list(ortho.unbind(0))
        for i, out in zip(indices, outputs, strict=True):
            results[i] = out.mT if _is_tall(matrices[i]) else out
    return [r for r in results if r is not None]


# -- Muon+ ----------------------------------------------------------------------------------


def is_low_precision(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _LOW_PRECISION


def post_polar_normalize(
    update: torch.Tensor, *, mode: str = "row_col", eps: float = 1e-8
) -> torch.Tensor:
    """Muon+: normalise an orthogonalised update along rows and/or columns.

    ``row_col`` divides every row by its L2 norm, then every column (the result has unit
    columns); ``col_row`` does columns first, then rows (unit rows). ``row`` / ``col`` do one
    pass, ``none`` nothing. Half-precision input is normalised in float32 and cast back.
    """
    if mode not in POST_POLAR_MODES:
        raise ValueError(f"post_polar_normalize mode must be one of {POST_POLAR_MODES}")
    if update.ndim < 2:
        raise ValueError(f"post_polar_normalize needs a matrix, got {tuple(update.shape)}")
    if eps <= 0:
        raise ValueError(f"post_polar_normalize eps must be > 0, got {eps}")
    low_precision = is_low_precision(update)
    work = update.float() if low_precision else update
    passes = {"none": (), "row": (-1,), "col": (-2,), "row_col": (-1, -2), "col_row": (-2, -1)}
    for dim in passes[mode]:  # dim -1 reduces along a row, i.e. normalises rows
        work = work / torch.sqrt(work.square().sum(dim=dim, keepdim=True) + eps)
    return work.to(update.dtype) if low_precision else work
