"""A per-module summary of a model: parameters, trainable parameters and dtypes of each
top-level child, for the console start output and ``speedtronic validate``.

Counting reads only shapes, so it works on a model built on the ``meta`` device. A
parameter shared by several children (tied embeddings) is counted once, under the first
child that holds it, so the rows add up to the total.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["format_model_summary", "parameter_count", "summarize_model"]


@dataclass(frozen=True)
class _ModuleSummary:
    """One row: a top-level child (or the model's own direct parameters, ``name`` "(own)")."""

    name: str
    kind: str
    parameters: int
    trainable: int
    dtypes: tuple[str, ...]


def _row(name: str, kind: str, params: Iterable[nn.Parameter]) -> _ModuleSummary:
    listed = list(params)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in listed})
    return _ModuleSummary(
        name=name,
        kind=kind,
        parameters=sum(p.numel() for p in listed),
        trainable=sum(p.numel() for p in listed if p.requires_grad),
        dtypes=tuple(dtypes),
    )


def summarize_model(model: nn.Module) -> list[_ModuleSummary]:
    """One row per top-level child in definition order, then a ``total`` row."""
    seen: set[int] = set()

    def fresh(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        found = []
        for param in params:
            if id(param) not in seen:
                seen.add(id(param))
                found.append(param)
        return found

    rows = [
        _row(name, type(child).__name__, fresh(child.parameters()))
        for name, child in model.named_children()
    ]
    own = fresh(model.parameters(recurse=False))
    if own:
        rows.append(_row("(own)", type(model).__name__, own))
    # parameters() yields each tensor once, shared ones included
    rows.append(_row("total", type(model).__name__, model.parameters()))
    return rows


def _dtype_text(dtypes: Sequence[str]) -> str:
    return "+".join(dtypes) if dtypes else "-"


def format_model_summary(rows: Sequence[_ModuleSummary]) -> str:
    """A plain text table (no trailing newline)."""
    header = ("module", "type", "params", "trainable", "dtype")
    table = [header] + [
        (r.name, r.kind, f"{r.parameters:,}", f"{r.trainable:,}", _dtype_text(r.dtypes))
        for r in rows
    ]
    widths = [max(len(line[col]) for line in table) for col in range(len(header))]
    right = {2, 3}
    lines = [
        "  ".join(
            cell.rjust(widths[col]) if col in right else cell.ljust(widths[col])
            for col, cell in enumerate(line)
        ).rstrip()
        for line in table
    ]
    return "\n".join(lines)


def parameter_count(model: nn.Module) -> int:
    """Every parameter element of ``model``, shared tensors once."""
    return sum(p.numel() for p in model.parameters())
