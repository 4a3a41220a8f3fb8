"""The registry of tensor-parallel plans, keyed by model family, and the types a plan uses.

A third module so that the plans (``speedtronic.systems.tensor_parallel_plans``) and the
machinery that applies them (``speedtronic.systems.tensor_parallel``) both import it and
neither imports the other's importer: the plans register themselves here, the machinery
looks them up here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from speedtronic.systems.sharding import ShardingError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "TensorParallelError",
    "TensorParallelPlan",
    "model_family",
    "register_tensor_parallel_plan",
    "registered_families",
    "registered_plan",
    "require_divisible",
]

_FAMILY_ATTRIBUTE = "tensor_parallel_family"
"""A model (class) attribute naming its family in the plan registry."""


class TensorParallelError(ShardingError):
    """``parallel.tensor`` cannot be applied to this model or world (the message says why);
    every rank raises it alike, the CLI prints it once and exits 2."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """How one model family is split over the ``tensor`` mesh dimension.

    ``check(model, degree)`` raises ``TensorParallelError`` when ``degree`` does not fit
    the model's shapes (heads, hidden sizes); it runs at ``validate`` on a meta-device model
    and again before the split. ``apply(model, mesh)`` parallelizes ``model`` in place over
    the one-dimensional tensor ``mesh`` (``parallelize_module``), leaving every parameter a
    ``DTensor`` on it (a parameter left plain is refused: it would have no place on the
    two-dimensional mesh that FSDP and gradient clipping work on)."""

    apply: Callable[[nn.Module, DeviceMesh], None]
    check: Callable[[nn.Module, int], None]


_PLANS: dict[str, TensorParallelPlan] = {}


def register_tensor_parallel_plan(family: str, plan: TensorParallelPlan) -> None:
    """Make ``plan`` the tensor-parallel plan of models of ``family`` (replacing any)."""
    _PLANS[family] = plan


def registered_plan(family: str) -> TensorParallelPlan | None:
    """The plan registered for ``family``, if any."""
    return _PLANS.get(family)


def registered_families() -> list[str]:
    """The families that have a plan, sorted."""
    return sorted(_PLANS)


def model_family(model: nn.Module) -> str:
    """The registry key of ``model``: its ``tensor_parallel_family`` attribute when it has
    one, the ``model_type`` of a wrapped ``transformers`` model (``"llama"``), else its
    class name."""
    declared = getattr(model, _FAMILY_ATTRIBUTE, None)
    if isinstance(declared, str):
        return declared
    wrapped = getattr(model, "hf", None)  # an hf_causal_lm model: the transformers model_type
    model_type = getattr(getattr(wrapped, "config", None), "model_type", None)
    if isinstance(wrapped, nn.Module) and isinstance(model_type, str):
        return model_type
    return type(model).__name__


def require_divisible(what: str, size: int, degree: int) -> None:
    """``TensorParallelError`` unless ``degree`` divides ``size`` (``what`` names it)."""
    if size % degree:
        raise TensorParallelError(
            f"parallel.tensor: {degree} does not divide {what} ({size}); choose a tensor "
            f"degree that divides {size}"
        )
