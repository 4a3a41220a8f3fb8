"""The record the loop builds in one call (``MetricRecord.of``) is the record a ``set`` per
key builds: the same keys in the same order, the same values, tensors read as float32."""

from __future__ import annotations

import math

import torch

from speedtronic import Trainer
from speedtronic.engine.metrics import MetricRecord, MetricValue


def test_a_record_built_in_one_call_reads_as_one_set_key_by_key() -> None:
    weight = torch.tensor(1.1, dtype=torch.float64, requires_grad=True)
    tensors = {
        "loss": weight * 3,  # autograd history kept by ``of``, cut off by ``set``
        "grad_norm": torch.tensor(0.1, dtype=torch.bfloat16),
    }
    plain: dict[str, MetricValue] = {"step": 7, "lr": 1e-3, "steps_per_sec": 1 / 3, "tag": "x"}
    key_by_key = MetricRecord(7)
    for key, value in [*tensors.items(), *plain.items()]:
        if key != "step":
            key_by_key.set(key, value)
    at_once = MetricRecord.of(7, dict(plain), dict(tensors))
    assert at_once.step == 7 and list(at_once.keys()) == list(plain) + list(tensors)
    assert at_once.values() == key_by_key.values()
    assert list(at_once.values()) == list(key_by_key.values())  # tensors last, in order
    assert at_once.values()["loss"] == float(torch.tensor(3.3, dtype=torch.float64).float())
    at_once.set("loss", 2.0)  # a plain value replaces a tensor, as in a set record
    assert at_once.get("loss") == 2.0 and at_once.get("grad_norm") == key_by_key.get("grad_norm")


def test_a_single_tensor_reads_as_float32_and_several_as_before() -> None:
    for tensors in (
        {"loss": torch.tensor(math.pi, dtype=torch.float64)},
        {"loss": torch.tensor(math.pi, dtype=torch.float64), "b": torch.tensor([2.5])},
    ):
        record = MetricRecord.of(1, {"step": 1}, dict(tensors))
        assert record.values()["loss"] == float(torch.tensor(math.pi).float().item())
        assert all(type(value) in (int, float) for value in record.values().values())


def test_the_loop_record_keeps_its_key_order_with_several_learning_rates() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(
        [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1
    )
    batches = [(torch.ones(3, 2), torch.zeros(3, 1))] * 2

    class Mse(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.inner(x), y)

    result = Trainer(Mse(), optimizer, batches, device="cpu", max_steps=2, metrics_every=1).fit()
    assert [list(record) for record in result.metrics] == [
        [
            "step",
            "lr",
            "lr/group1",
            "steps_per_sec",
            "samples_per_sec",
            "tokens_per_sec",
            "samples",
            "tokens",
            "micro_batches",
            "elapsed_s",
            "loss",
        ]
    ] * 2
    assert [(r["step"], r["lr"], r["lr/group1"], r["samples"]) for r in result.metrics] == [
        (1, 0.1, 0.5, 3),
        (2, 0.1, 0.5, 6),
    ]


def test_a_finished_mapping_does_not_change_under_its_reader() -> None:
    """``finished`` hands out the record's own values (no copy); a ``set`` after it copies
    first, so what a sink was given stays as it was."""
    record = MetricRecord.of(3, {"step": 3, "lr": 0.1}, {"loss": torch.tensor(2.0)})
    seen = record.finished()
    assert record.finished() is seen and dict(seen) == {"step": 3, "lr": 0.1, "loss": 2.0}
    owned = record.values()
    assert owned == seen and owned is not seen
    record.set("lr", 0.2)
    record.set("extra", torch.tensor(1.5))
    record.set("loss", torch.tensor(4.0))
    assert dict(seen) == {"step": 3, "lr": 0.1, "loss": 2.0}
    assert record.values() == {"step": 3, "lr": 0.2, "extra": 1.5, "loss": 4.0}
    assert record.finished() is not seen
