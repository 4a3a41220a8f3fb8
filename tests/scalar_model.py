"""The one-weight regression model several event tests train: ``((v * x - y) ** 2).mean()``."""

from __future__ import annotations

import torch
from torch import nn


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.v * x - y) ** 2).mean()
