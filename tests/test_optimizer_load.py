"""Loading an optimizer's state is linear in the number of parameters and restores exactly
what torch's own ``load_state_dict`` restores (``speedtronic.state.optimizer_load``)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from speedtronic.optimizers import HybridOptimizer
from speedtronic.state.optimizer_load import IndexedIds, load_optimizer_state


class CountedId(int):
    """A parameter id that counts the equality tests made against it."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        CountedId.comparisons += 1
        return int(self) == other

    def __hash__(self) -> int:
        return int.__hash__(self)


def _stepped(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()


def _params(count: int, shape: tuple[int, ...] = (2,)) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(shape)) for _ in range(count)]


def _with_counted_ids(state: dict[str, object]) -> dict[str, object]:
    """The same state with every parameter id a fresh ``CountedId`` (as a checkpoint read
    from disk has: equal ids, not identical objects)."""
    counted = copy.deepcopy(state)
    counted["state"] = {CountedId(k): v for k, v in state["state"].items()}  # type: ignore[attr-defined]  # torch's layout
    for group in counted["param_groups"]:  # type: ignore[attr-defined]  # torch's layout
        group["params"] = [CountedId(i) for i in group["params"]]
    return counted


def _comparisons_of(load: Callable[[torch.optim.Optimizer, dict[str, object]], None]) -> int:
    """Equality tests made on parameter ids while ``load`` loads a 600-parameter state."""
    params = _params(600)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    _stepped(params, optimizer)
    saved = _with_counted_ids(optimizer.state_dict())
    CountedId.comparisons = 0
    load(torch.optim.AdamW(_params(600), lr=1e-3), saved)
    return CountedId.comparisons


def test_a_load_asks_each_id_a_constant_number_of_questions() -> None:
    # torch's plain load makes ~n^2/2 comparisons per state tensor here (over 500,000)
    assert _comparisons_of(load_optimizer_state) <= 20 * 600


def test_torch_alone_is_quadratic_which_is_why_the_loader_exists() -> None:
    assert _comparisons_of(lambda optimizer, saved: optimizer.load_state_dict(saved)) > 100 * 600


@pytest.mark.parametrize("kind", ["adamw", "hybrid"])
def test_the_restored_state_equals_torchs_own_load(kind: str) -> None:
    def build() -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        params = _params(3, (4, 4)) + _params(2, (4,))
        if kind == "adamw":
            groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
            return params, torch.optim.AdamW(groups, lr=1e-3)
        named = [(f"p{index}", param) for index, param in enumerate(params)]
        return params, HybridOptimizer(named[:3], named[3:])

    params, optimizer = build()
    for _ in range(3):
        _stepped(params, optimizer)
    saved = optimizer.state_dict()
    snapshot = copy.deepcopy(saved)
    _, ours = build()
    _, torchs = build()
    load_optimizer_state(ours, saved)
    torchs.load_state_dict(copy.deepcopy(saved))
    for a, b in zip(_leaves(saved), _leaves(snapshot), strict=True):  # the caller's is kept
        assert type(a) is type(b)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    ours_state, torchs_state = ours.state_dict(), torchs.state_dict()
    assert ours_state["param_groups"] == torchs_state["param_groups"]
    assert all(type(group["params"]) is list for group in ours.param_groups)
    for a, b in zip(_leaves(ours_state["state"]), _leaves(torchs_state["state"]), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _leaves(value: object) -> list[object]:
    if isinstance(value, dict):
        return [leaf for key in sorted(value, key=str) for leaf in _leaves(value[key])]
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def test_indexed_ids_behave_as_the_list_they_hold() -> None:
    ids = IndexedIds([3, 1, 2])
    assert list(ids) == [3, 1, 2] and len(ids) == 3 and ids == [3, 1, 2]
    assert 2 in ids and 5 not in ids and [1] not in ids
    copied = copy.deepcopy(ids)
    assert type(copied) is IndexedIds and 1 in copied and list(copied) == [3, 1, 2]
