"""The gradient-checkpointing callback and the original ``set_gradient_checkpointing`` helper."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import cast

import jsonschema
import pytest
import torch
from torch import nn

from speedtronic import Trainer
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import FitContext, TeardownContext
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.module_utils import set_gradient_checkpointing
from speedtronic_callbacks.gradient_checkpointing import CheckpointedForward, GradientCheckpointing

FIT = FitContext(start_step=0, target_step=1)
TEARDOWN = TeardownContext(step=1, error=None)


def fake_trainer(model: nn.Module) -> Trainer:
    """The callback only reads ``trainer.model``."""
    return cast(Trainer, SimpleNamespace(model=model))


def loss_and_grads(
    model: nn.Module, batch: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # same dropout masks in both runs
    out = (
        model(batch[:, :-1], labels=batch[:, 1:])
        if isinstance(model, ReferenceTransformer)
        else model(batch)
    )
    loss = out["loss"] if isinstance(out, dict) else out.pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same(
    first: tuple[torch.Tensor, list[torch.Tensor]], second: tuple[torch.Tensor, list[torch.Tensor]]
) -> None:
    assert torch.allclose(first[0], second[0], rtol=0, atol=1e-6)
    assert len(first[1]) == len(second[1]) > 0
    for a, b in zip(first[1], second[1], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


# -- a model without the hook ---------------------------------------------------------------


class Counted(nn.Module):
    """Counts forward calls: a checkpointed region runs its forward again in backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = Counted(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(self.inner(x))


class PlainNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x)


def test_model_without_hook_gets_wrapped_modules_with_same_loss_and_grads() -> None:
    torch.manual_seed(0)
    model = PlainNet()
    batch = torch.randn(4, 8)
    baseline = loss_and_grads(model, batch)
    calls_without = model.blocks[0].inner.calls

    callback = GradientCheckpointing(modules=["Block"])
    callback.on_setup(fake_trainer(model), FIT)
    assert not callback.uses_model_hook
    assert callback.wrapped_modules == list(model.blocks)
    assert isinstance(model.blocks[0].forward, CheckpointedForward)
    checkpointed = loss_and_grads(model, batch)
    assert_same(baseline, checkpointed)
    # Forward once, then recomputed during backward.
    assert model.blocks[0].inner.calls - calls_without == 2

    callback.on_teardown(fake_trainer(model), TEARDOWN)
    assert "forward" not in model.blocks[0].__dict__
    before = model.blocks[0].inner.calls
    assert_same(baseline, loss_and_grads(model, batch))
    assert model.blocks[0].inner.calls - before == 1


def test_nested_matches_are_wrapped_once_and_no_grad_runs_plainly() -> None:
    model = PlainNet()
    callback = GradientCheckpointing(modules=["Block", "Counted"])
    callback.apply(model)
    assert callback.wrapped_modules == list(model.blocks)  # Counted sits inside a Block
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert model.blocks[0].inner.calls == 1
    callback.remove()


def test_reference_model_uses_its_own_hook_with_same_loss_and_grads() -> None:
    torch.manual_seed(0)
    model = ReferenceTransformer(
        vocab_size=64,
        block_size=16,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        d_ff=64,
        dropout=0.1,
    )
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    baseline = loss_and_grads(model, batch)

    callback = GradientCheckpointing()
    callback.on_setup(fake_trainer(model), FIT)
    assert callback.uses_model_hook
    assert all(block.gradient_checkpointing for block in model.blocks)
    assert_same(baseline, loss_and_grads(model, batch))

    callback.on_teardown(fake_trainer(model), TEARDOWN)
    assert not any(block.gradient_checkpointing for block in model.blocks)


def test_reference_model_hook_wins_over_modules_with_a_warning() -> None:
    model = ReferenceTransformer(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=16)
    with pytest.warns(UserWarning, match="modules.*ignored"):
        GradientCheckpointing(modules=["SwiGLU"]).apply(model)
    assert model.blocks[0].gradient_checkpointing


def test_warns_and_never_fails_when_checkpointing_is_impossible() -> None:
    model = PlainNet()
    with pytest.warns(UserWarning, match="gradient_checkpointing callback: .*no set_gradient"):
        GradientCheckpointing().on_setup(fake_trainer(model), FIT)
    with pytest.warns(UserWarning, match="no submodule .*'Missing'"):
        GradientCheckpointing(modules=["Missing"]).on_setup(fake_trainer(model), FIT)

    class BrokenHook(PlainNet):
        def set_gradient_checkpointing(self, enabled: bool = True) -> None:
            raise RuntimeError("not supported")

    broken = BrokenHook()
    with pytest.warns(UserWarning, match="failed: not supported"):
        callback = GradientCheckpointing(modules=["Block"])
        callback.apply(broken)
    assert callback.wrapped_modules == list(broken.blocks)  # fell back to wrapping


def test_disabled_callback_does_nothing() -> None:
    model = PlainNet()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradientCheckpointing(modules=["Block"], enabled=False).on_setup(fake_trainer(model), FIT)
    assert "forward" not in model.blocks[0].__dict__


def test_plugin_metadata_and_options_schema() -> None:
    assert GradientCheckpointing.plugin_name == "gradient_checkpointing"
    schema = GradientCheckpointing.options_schema
    jsonschema.validate({"modules": ["TransformerBlock"], "enabled": True}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"module": ["typo"]}, schema)
    built = GradientCheckpointing(**{"modules": ["Block"]})
    assert built.modules == ("Block",) and built.enabled


# -- the original helper ----------------------------------------------------------------------


def test_set_gradient_checkpointing_helper_keeps_raising_for_models_without_hook() -> None:
    with pytest.raises(AttributeError, match="set_gradient_checkpointing"):
        set_gradient_checkpointing(nn.Linear(2, 2))
    model = ReferenceTransformer(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=16)
    assert set_gradient_checkpointing(model) is model
    assert all(block.gradient_checkpointing for block in model.blocks)
    set_gradient_checkpointing(model, enabled=False)
    assert not any(block.gradient_checkpointing for block in model.blocks)


def test_callback_in_a_real_fit_changes_nothing_but_memory() -> None:
    def fit(callbacks: list[Callback]) -> tuple[list[object], ReferenceTransformer]:
        torch.manual_seed(0)
        model = ReferenceTransformer(
            vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.1
        )
        generator = torch.Generator().manual_seed(1)
        batches = [
            {
                "input_ids": torch.randint(0, 32, (2, 8), generator=generator),
                "labels": torch.randint(0, 32, (2, 8), generator=generator),
            }
            for _ in range(3)
        ]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = Trainer(model, optimizer, batches, device="cpu", callbacks=callbacks, max_steps=3)
        result = trainer.fit()
        return [record["loss"] for record in result.metrics], model

    seen: list[bool] = []

    class Spy(GradientCheckpointing):
        def on_fit_start(self, trainer: Trainer, ctx: FitContext) -> None:
            seen.extend(block.gradient_checkpointing for block in trainer.model.blocks)

    plain_losses, plain = fit([])
    checkpointed_losses, checkpointed = fit([Spy()])
    assert seen == [True, True]  # on during the fit
    assert checkpointed_losses == pytest.approx(plain_losses, abs=1e-6)
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert not any(block.gradient_checkpointing for block in checkpointed.blocks)  # torn down
