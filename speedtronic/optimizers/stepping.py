"""What every ``step`` in this package does around its update: run the closure once, refuse
sparse gradients, and name the offending parameter when something is wrong."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import cast

import torch

__all__ = ["param_label", "reject_sparse_gradients", "run_closure"]


def param_label(group: Mapping[str, object], index: int) -> str:
    """The name of parameter ``index`` of ``group`` (from ``param_names``), else its position."""
    names = group.get("param_names")
    if isinstance(names, list) and index < len(names):
        return str(names[index])
    return f"#{index} of its param group"


def run_closure(closure: Callable[[], float] | None) -> float | None:
    """The loss from ``closure`` (autograd enabled even if ``step`` runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def reject_sparse_gradients(groups: Iterable[Mapping[str, object]]) -> None:
    """Raise ``RuntimeError`` naming the first parameter with a sparse gradient."""
    for group in groups:
        for index, param in enumerate(cast(list[torch.Tensor], group["params"])):
            if param.grad is not None and param.grad.is_sparse:
                algorithm = group.get("algorithm", "this optimizer")
                raise RuntimeError(
                    f"parameter {param_label(group, index)!r} has a sparse gradient; "
                    f"{algorithm} needs dense gradients"
                )
