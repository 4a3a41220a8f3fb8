"""The ``int8`` codec: each value ``round(x / scale)`` in ``[-127, 127]``, one byte, with
one float32 scale ``max|x| / 127`` per block (1.0625 bytes per value). Error per value of
a block whose largest magnitude is ``m``: at most ``m / 254``."""

from __future__ import annotations

from typing import ClassVar

import torch

from speedtronic_callbacks.diloco.codec import BlockCodec

__all__ = ["Int8Codec"]


class Int8Codec(BlockCodec):
    name: ClassVar[str] = "int8"
    top: ClassVar[float] = 127.0

    def code_bytes(self, numel: int) -> int:
        return numel

    def quantise(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp_(-self.top, self.top).to(torch.int8).view(torch.uint8)

    def dequantise(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        del numel  # one code per value
        return codes.view(torch.int8).to(torch.float32)
