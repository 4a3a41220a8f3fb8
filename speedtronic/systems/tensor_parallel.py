"""Tensor parallelism composed with FSDP2 on a two-dimensional ``DeviceMesh``.

``parallel: {strategy: fsdp, tensor: T}`` under torchrun with ``W`` ranks builds the mesh
``(data, tensor) = (W / T, T)`` (``init_device_mesh``; rank ``r`` is data rank ``r // T``,
tensor rank ``r % T``), applies the model family's *plan* -- ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` styles -- over the
``tensor`` dimension, then FSDP2 (``speedtronic.systems.sharding``) over the ``data``
dimension. Every parameter ends up a ``DTensor`` on the whole mesh, so one
``clip_grad_norm_`` computes the global norm and DCP checkpoints reshard across layouts.

*Plans belong to model families.* ``register_tensor_parallel_plan(family, plan)`` fills the
registry; a model's family is its ``tensor_parallel_family`` attribute when it has one, the
``model_type`` of a wrapped ``transformers`` model (``"llama"``), else its class name. The
registry and its types live in ``speedtronic.systems.tensor_parallel_registry`` (re-exported
here); the built-in plans (``speedtronic.systems.tensor_parallel_plans``, which register
themselves there when imported, as this module does) cover the reference
transformer and Llama-family ``hf_causal_lm`` models. A family without a plan, a degree
that does not divide the world size, the heads or the hidden size is a
``TensorParallelError`` (exit 2 from the CLI) naming the numbers.

The ranks of one tensor group hold the same batch: data is sharded by *data* rank only
(``data_parallel_share``), and gradients are averaged over the ``data`` dimension.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from speedtronic.systems import tensor_parallel_plans  # noqa: F401  # registers the built-ins
from speedtronic.systems.sharding import replace_optimizer_parameters
from speedtronic.systems.tensor_parallel_registry import (
    TensorParallelError,
    TensorParallelPlan,
    model_family,
    register_tensor_parallel_plan,
    registered_families,
    registered_plan,
    require_divisible,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "TensorParallelError",
    "TensorParallelPlan",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "data_parallel_share",
    "model_family",
    "register_tensor_parallel_plan",
    "require_divisible",
    "tensor_parallel_plan",
]

logger = logging.getLogger("speedtronic.tensor_parallel")


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    """The registered plan of ``model``'s family; ``TensorParallelError`` naming it if none."""
    family = model_family(model)
    plan = registered_plan(family)
    if plan is None:
        known = ", ".join(registered_families())
        raise TensorParallelError(
            f"parallel.tensor: model family {family!r} has no tensor-parallel plan (plans "
            f"exist for: {known}); register one with speedtronic.systems.tensor_parallel."
            "register_tensor_parallel_plan, or set parallel.tensor: 1"
        )
    return plan


def check_tensor_parallel(model: nn.Module, degree: int, world_size: int | None = None) -> None:
    """Every check of ``parallel.tensor: degree`` for ``model`` (and, when known, the world
    size) before anything is split: ``TensorParallelError`` naming what does not fit."""
    if world_size is not None:
        require_divisible("the world size (number of ranks)", world_size, degree)
    tensor_parallel_plan(model).check(model, degree)


def data_parallel_share(rank: int, world_size: int, degree: int) -> tuple[int, int]:
    """``(data rank, data ranks)`` of global ``rank``: the ranks of one tensor group (``T``
    consecutive ranks) read the same data. ``TensorParallelError`` when ``degree`` does not
    divide ``world_size``: the data is the first thing split by it, so the refusal comes
    here, before anything is built."""
    if world_size > 1:
        require_divisible("the world size (number of ranks)", world_size, degree)
    return rank // degree, max(world_size // degree, 1)


def _refuse_whole_matrix_optimizers(optimizer: torch.optim.Optimizer) -> None:
    """``TensorParallelError`` for Muon (alone or in the hybrid optimizer, whose Muon group
    says ``algorithm: muon``): its Newton-Schulz step orthogonalizes each whole matrix, and a
    tensor-parallel rank holds a slice of it (the config rule refuses it at ``validate``;
    this catches an optimizer built in Python)."""
    muon = type(optimizer).__name__ == "Muon" or any(
        group.get("algorithm") == "muon" for group in optimizer.param_groups
    )
    if muon:
        raise TensorParallelError(
            "parallel.tensor: Muon's Newton-Schulz step needs each whole weight matrix and a "
            "tensor-parallel rank holds a slice of it (gathering it is not implemented); "
            "use AdamW, or parallel.tensor: 1 with strategy ddp"
        )


def _broadcast_whole_model(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank before anything is split, as DDP does
    at construction (each rank may have initialised differently)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def apply_tensor_parallel(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, degree: int
) -> DeviceMesh:
    """Build the ``(data, tensor)`` mesh of the world, give ``model`` rank 0's values,
    apply its family's plan over the ``tensor`` dimension (in place, on ``device``) and
    point ``optimizer`` at the split parameters. Returns the ``data`` sub-mesh for FSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    _refuse_whole_matrix_optimizers(optimizer)
    world_size = dist.get_world_size()
    check_tensor_parallel(model, degree, world_size)
    plan = tensor_parallel_plan(model)
    old_names = {id(param): name for name, param in model.named_parameters()}
    mesh = init_device_mesh(
        device.type, (world_size // degree, degree), mesh_dim_names=("data", "tensor")
    )
    model.to(device)
    _broadcast_whole_model(model)
    plan.apply(model, mesh["tensor"])
    plain = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if plain:
        raise TensorParallelError(
            f"parallel.tensor: the plan of model family {model_family(model)!r} left "
            f"{len(plain)} parameter(s) unsplit and not replicated, e.g. {plain[0]!r}: a plan "
            "must turn every parameter into a DTensor on the tensor mesh (Replicate for "
            "those it does not split)"
        )
    replace_optimizer_parameters(optimizer, old_names, model)
    logger.info(
        "tensor parallel: %s split over %d tensor ranks x %d data ranks",
        type(model).__name__,
        degree,
        world_size // degree,
    )
    return mesh["data"]
