"""The loss is the mean over the loss-bearing tokens of the whole optimizer step.

Gradients of one step on unevenly masked sequences are those of the global token mean for
accumulation K in {1, 4} on one rank and on two real ranks (processes over gloo), and equal
token counts keep the arithmetic of ``loss / K`` bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from forked import Forked
from loss_tokens_worker import LENGTH, LOSS_TOKENS, global_batch, model, one_step
from test_distributed import free_port, rank_env

from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import OptimizerStepContext
from speedtronic.engine.loss_tokens import loss_token_count, step_weights
from speedtronic.engine.settings import TrainerSettings
from speedtronic.engine.trainer import Trainer


def reference_grads() -> dict[str, torch.Tensor]:
    """The gradient of the mean cross-entropy over every loss-bearing token, by hand."""
    net = model()
    batch = global_batch()
    logits = net(batch["input_ids"])["logits"]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
    )
    loss.backward()  # type: ignore[no-untyped-call]
    return {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}


def assert_grads(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_mean_of_microbatch_means_is_not_the_token_mean() -> None:
    # The counts are uneven enough that the old averaging gives another gradient.
    batch = global_batch()
    net = model()
    halves = [
        net(batch["input_ids"][i : i + 4], batch["labels"][i : i + 4])["loss"] for i in (0, 4)
    ]
    ((halves[0] + halves[1]) / 2).backward()  # type: ignore[no-untyped-call]
    expected = reference_grads()
    name = next(iter(expected))
    grad = dict(net.named_parameters())[name].grad
    assert grad is not None and not torch.allclose(grad, expected[name], rtol=1e-3)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_one_rank_gradients_are_the_token_mean(tmp_path: Path, accumulation: int) -> None:
    assert one_step(str(tmp_path), accumulation) == 0
    found = torch.load(tmp_path / "rank0.pt", weights_only=True)["grads"]
    assert_grads(found, reference_grads())


@pytest.mark.parametrize("accumulation", [1, 4])
def test_two_rank_gradients_are_the_token_mean(
    tmp_path: Path, forked: Forked, accumulation: int
) -> None:
    port = free_port()
    children = [
        forked.start(one_step, str(tmp_path), accumulation, env=rank_env(rank, 2, port))
        for rank in (0, 1)
    ]
    try:
        codes = [child.wait(timeout=90) for child in children]
    finally:
        for child in children:
            child.kill()
    assert codes == [0, 0], children[0].output[-3000:] + children[1].output[-3000:]
    expected = reference_grads()
    for rank in (0, 1):
        found = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)["grads"]
        assert_grads(found, expected)


def test_equal_counts_divide_by_the_integer_k() -> None:
    batches = [{"labels": torch.zeros(2, 5, dtype=torch.long)} for _ in range(3)]
    weights = step_weights(batches, 1, None)
    assert weights is not None and weights.uniform
    assert weights.divisors == [3, 3, 3] and all(type(d) is int for d in weights.divisors)
    uneven = step_weights(
        [{"labels": torch.tensor([[1, -100]])}, {"labels": torch.ones(1, 2)}], 1, None
    )
    assert uneven is None  # float labels have no token count: loss / K as before
    counts = [{"labels": torch.tensor([[1, -100, -100]])}, {"labels": torch.tensor([[1, 2, 3]])}]
    # another rank holds 6; the sum stays a tensor (never read on the host: no device sync)
    weights = step_weights(counts, 2, lambda local: torch.tensor(local + 6))
    assert weights is not None and all(isinstance(d, torch.Tensor) for d in weights.divisors)
    assert [float(d) for d in weights.divisors] == pytest.approx([10 / 2, 10 / 6], rel=1e-7)
    even = step_weights(counts[1:] * 2, 2, lambda local: torch.tensor(2 * local))
    assert even is not None and [float(d) for d in even.divisors] == [2.0, 2.0]  # exactly K
    assert loss_token_count({"labels": torch.tensor([[-100, 4]])}) == 1
    assert sum(LOSS_TOKENS) > 0


class _OwnLoss(torch.nn.Module):
    """A user model that takes its own loss, undefined (0 / 0) on a microbatch whose labels
    are all ``-100``: ``F.cross_entropy`` (mean, ``ignore_index``: a NaN loss), returned
    with the logits; or a hand-written masked mean (NaN gradients too), returned alone in a
    tuple (no other output reaches the parameters)."""

    def __init__(self, hand_written: bool) -> None:
        super().__init__()
        self.net = model()
        self.hand_written = hand_written

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> object:
        logits = self.net(input_ids)["logits"]
        if not self.hand_written:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            return {"loss": loss, "logits": logits}
        mask = labels != -100
        picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (-(picked * mask).sum() / mask.sum(),)


def _own_loss(net: _OwnLoss, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    output = net(**batch)
    loss = output[0] if isinstance(output, tuple) else output["loss"]  # type: ignore[index]
    assert isinstance(loss, torch.Tensor)
    return loss


@pytest.mark.parametrize("hand_written", [False, True], ids=["cross_entropy", "masked_mean"])
def test_a_microbatch_without_loss_bearing_tokens_contributes_zero(hand_written: bool) -> None:
    torch.set_num_threads(1)
    batch = global_batch()
    empty = {"input_ids": batch["input_ids"][:2], "labels": torch.full((2, LENGTH), -100)}
    full = {key: value[2:4] for key, value in batch.items()}
    net, expected = _OwnLoss(hand_written), _OwnLoss(hand_written)
    assert torch.isnan(_own_loss(net, empty))  # what the model's own mean gives
    reference = _own_loss(expected, full)
    reference.backward()  # type: ignore[no-untyped-call]
    seen: list[float] = []

    class Grads(Callback):
        def on_before_optimizer_step(self, trainer: object, ctx: OptimizerStepContext) -> None:
            seen.append(float(ctx.loss))
            pairs = zip(net.named_parameters(), expected.parameters(), strict=True)
            for (name, param), want in pairs:
                assert param.grad is not None and want.grad is not None
                torch.testing.assert_close(param.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)

    trainer = Trainer(
        net,
        torch.optim.AdamW(net.parameters(), lr=1e-2),
        [empty, full],
        callbacks=[Grads()],
        max_steps=1,
        settings=TrainerSettings(accumulation_steps=2),
    )
    trainer.fit()
    assert seen == [pytest.approx(float(reference.detach()))]  # the empty microbatch weighs nothing
    assert all(torch.isfinite(param).all() for param in net.parameters())
