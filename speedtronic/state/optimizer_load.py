"""Loading an optimizer's state in time linear in the number of parameters.

torch's ``Optimizer.load_state_dict`` finds each saved state tensor's parameter group by
asking ``param_id in group["params"]`` -- a list -- once per tensor (``step``, ``exp_avg``,
``exp_avg_sq`` of every parameter), so a load is quadratic in the number of parameters: a
model with tens of thousands of parameter tensors spends seconds there (figures in
docs/performance.md, "Loading a training state"). Handing it the saved groups with their
``params`` as a list that answers ``in`` from a set keeps every other use of the list
(length, order, iteration, copying) as it was; the optimizer's own groups never see it,
since torch puts this run's parameters back into every group.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

import torch

__all__ = ["load_optimizer_state"]


class IndexedIds(list[Hashable]):
    """A saved param group's parameter ids, with constant-time membership."""

    __slots__ = ("_members",)

    def __init__(self, ids: Iterable[Hashable] = ()) -> None:
        super().__init__(ids)
        self._members = frozenset(self)

    def __contains__(self, item: object) -> bool:
        try:
            return item in self._members
        except TypeError:  # an unhashable probe: answer as a list would
            return any(member == item for member in self)


def _indexed_group(group: object) -> object:
    if not isinstance(group, Mapping):
        return group
    params = group.get("params")
    if not isinstance(params, list) or isinstance(params, IndexedIds):
        return group
    try:
        indexed = IndexedIds(params)
    except TypeError:  # unhashable ids: not torch's layout, leave it to torch as it is
        return group
    return {**group, "params": indexed}


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, object]) -> None:
    """``optimizer.load_state_dict(saved)``, linear in the number of parameters; ``saved``
    itself is not changed."""
    groups = saved.get("param_groups")
    if isinstance(groups, list):
        saved = {**saved, "param_groups": [_indexed_group(group) for group in groups]}
    optimizer.load_state_dict(dict(saved))
