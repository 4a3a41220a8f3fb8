"""Opt-in torch.compile: it trains like eager, falls back when the compiler fails, and never
re-runs a genuine model error."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo import exc as dynamo_exc

from speedtronic import Trainer


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.linear(x), y)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=gen)
    return [(x[i : i + 4], x[i : i + 4].sum(1, keepdim=True)) for i in range(0, 16, 4)]


def fit(compile: bool) -> tuple[float | None, Regression]:
    torch.manual_seed(0)
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    result = Trainer(model, opt, data(), max_steps=3, compile=compile).fit()
    return result.final_loss, model


def test_compiled_training_matches_eager() -> None:
    eager_loss, eager_model = fit(compile=False)
    compiled_loss, compiled_model = fit(compile=True)
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    assert torch.allclose(eager_model.linear.weight, compiled_model.linear.weight, atol=1e-6)


class FailingCompiled(nn.Module):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.calls = 0

    def forward(self, *args: object) -> torch.Tensor:
        self.calls += 1
        raise self.error


def test_compiler_failure_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = FailingCompiled(dynamo_exc.Unsupported("graph break we cannot handle"))
    monkeypatch.setattr(torch, "compile", lambda model: broken)
    with pytest.warns(RuntimeWarning, match="continuing in eager mode"):
        loss, _ = fit(compile=True)
    eager_loss, _ = fit(compile=False)
    assert loss == eager_loss
    assert broken.calls == 1  # never tried again after the fallback


def test_model_error_through_the_compiler_is_not_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = FailingCompiled(dynamo_exc.TorchRuntimeError("shape mismatch in the model"))
    monkeypatch.setattr(torch, "compile", lambda model: broken)
    with pytest.raises(dynamo_exc.TorchRuntimeError, match="shape mismatch"):
        fit(compile=True)
    assert broken.calls == 1
