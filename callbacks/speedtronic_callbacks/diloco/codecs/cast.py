"""The cast codecs: ``fp32`` (exact), ``bf16`` and ``fp16`` (2 bytes per value)."""

from __future__ import annotations

from typing import ClassVar

import torch

from speedtronic_callbacks.diloco.codec import CastCodec

__all__ = ["BF16Codec", "FP16Codec", "FP32Codec"]

_FP16_MAX = 65504.0


class FP32Codec(CastCodec):
    """float32: exact (``none`` is ``compression``'s name for it)."""

    name: ClassVar[str] = "fp32"
    aliases: ClassVar[tuple[str, ...]] = ("none",)
    lossy: ClassVar[bool] = False
    dtype: ClassVar[torch.dtype] = torch.float32


class BF16Codec(CastCodec):
    """bfloat16: float32's range, 8 bits of mantissa."""

    name: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16


class FP16Codec(CastCodec):
    """float16; a delta with values beyond its range is sent in float32 instead of
    overflowing to Inf."""

    name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16
    falls_back: ClassVar[bool] = True

    def send_dtype(self, tensors: list[torch.Tensor]) -> torch.dtype:
        if any(bool(t.abs().max() > _FP16_MAX) for t in tensors if t.numel()):
            return torch.float32
        return self.dtype
