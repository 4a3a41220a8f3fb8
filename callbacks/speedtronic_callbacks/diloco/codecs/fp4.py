"""The ``fp4`` codec: each value the nearest of the 16 e2m1 numbers
``{0, 0.5, 1, 1.5, 2, 3, 4, 6} x {+, -}`` times its block's float32 scale ``max|x| / 6``
(ties go to the smaller magnitude), as a 4-bit code (sign bit, then the 2-bit exponent and
1-bit mantissa of e2m1), two codes per byte (the first value in the low nibble; an odd count
pads the last high nibble with zero): 0.5625 bytes per value with the scales, 1/7.1 of
fp32. Error per value ``x`` of a block whose largest magnitude is ``m``: at most
``max(m / 24, |x| / 4)`` (the e2m1 grid's half-gaps: 0.25 up to 2, 0.5 up to 4, 1 up to 6,
in units of ``m / 6``)."""

from __future__ import annotations

from typing import ClassVar

import torch

from speedtronic_callbacks.diloco.codec import BlockCodec

__all__ = ["E2M1_VALUES", "FP4Codec"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative e2m1 numbers; a value's index here is its 3-bit e2m1 code."""

_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_E2M1_MIDPOINTS = (_E2M1[1:] + _E2M1[:-1]) / 2


class FP4Codec(BlockCodec):
    name: ClassVar[str] = "fp4"
    top: ClassVar[float] = 6.0

    def code_bytes(self, numel: int) -> int:
        return -(-numel // 2)

    def quantise(self, scaled: torch.Tensor) -> torch.Tensor:
        magnitude = torch.bucketize(scaled.abs().clamp_(max=self.top), _E2M1_MIDPOINTS)
        nibbles = magnitude.to(torch.uint8) | (scaled < 0).to(torch.uint8) << 3
        if scaled.numel() % 2:
            nibbles = torch.cat([nibbles, torch.zeros(1, dtype=torch.uint8)])
        pairs = nibbles.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def dequantise(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)[:numel]
        magnitude = _E2M1[(nibbles & 0x07).long()]
        return torch.where((nibbles & 0x08).bool(), -magnitude, magnitude)
