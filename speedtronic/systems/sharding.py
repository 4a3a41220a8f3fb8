"""FSDP2: a model's parameters, gradients and optimizer state sharded across ranks.

``parallel.strategy: fsdp`` under torchrun applies ``torch.distributed.fsdp.fully_shard``
over a one-dimensional ``DeviceMesh`` of the data-parallel ranks:

* **Wrap policy.** Each *block* becomes one FSDP unit (its parameters are gathered for its
  forward and backward only), then the root takes the rest (embeddings, the head, norms).
  A model names its blocks with a ``shard_blocks()`` method returning the modules; without
  one the blocks are the children of every ``nn.ModuleList`` of the model that is not itself
  inside another ``nn.ModuleList`` (the reference transformer's ``transformer.h``). A model
  with no blocks is refused (``ShardingError``): sharding it as one unit would gather the
  whole model for every forward pass, which saves nothing.
* **Same start on every rank.** Rank 0's parameters and buffers are broadcast before
  sharding, as DDP does at construction, so every process may initialise differently.
* **Optimizer.** ``fully_shard`` replaces each parameter by a sharded one (a ``DTensor``);
  an optimizer built over the model beforehand is pointed at the new parameters by name.
  It must not hold state yet (sharding happens when the ``Trainer`` is built, before a
  resume loads any).
* **Accumulation.** ``set_requires_gradient_sync(False)`` on every microbatch but the last:
  gradients accumulate unsharded on each rank and are reduce-scattered once per step.
* **Clipping.** ``clip_grad_norm_`` over the sharded gradients computes the global norm
  (``global_grad_norm`` returns it as a plain tensor, the same on every rank).
* **Mixed precision** (CUDA only): with bf16/fp16 the parameters are gathered in that dtype
  and gradients reduced in fp32 (``MixedPrecisionPolicy``). Written, not tested here.

One process (no torchrun, or a world of one) is one shard: the model is left unwrapped and
trains as it would without ``parallel:``; checkpoints are still written in the sharded
(DCP) layout, so they resume on any number of ranks. See docs/scale-out.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from speedtronic.systems.distributed import SameOnEveryRankError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ShardingError",
    "find_shard_blocks",
    "global_grad_norm",
    "gradient_sync_on_final",
    "replace_optimizer_parameters",
    "reshard_model",
    "shard_model",
]

logger = logging.getLogger("speedtronic.sharding")

_SHARD_BLOCKS_METHOD = "shard_blocks"
"""The method by which a model names its FSDP units (returns an iterable of modules)."""


class ShardingError(SameOnEveryRankError, ValueError):
    """The model (or its optimizer) cannot be sharded; the message says why and what to do
    (every rank raises it alike: the CLI prints it once, exit 2)."""


def find_shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units, by the wrap policy (module docstring).

    ``ShardingError`` when the model declares something that is not one of its submodules,
    or has no blocks at all."""
    name = type(model).__name__
    declared = getattr(model, _SHARD_BLOCKS_METHOD, None)
    if callable(declared):
        own = {id(module) for module in model.modules() if module is not model}
        blocks = []
        for index, block in enumerate(cast(Callable[[], Iterable[object]], declared)()):
            if not isinstance(block, nn.Module) or id(block) not in own:
                raise ShardingError(
                    f"parallel.strategy fsdp: {name}.{_SHARD_BLOCKS_METHOD}() item {index} is "
                    f"not a submodule of the model ({type(block).__name__})"
                )
            blocks.append(block)
    else:
        blocks = _outermost_module_list_children(model)
    if not blocks:
        raise ShardingError(
            f"parallel.strategy fsdp: model {name} has no shardable blocks. Hold its "
            f"repeated layers in an nn.ModuleList, or give it a {_SHARD_BLOCKS_METHOD}() "
            "method returning the modules to shard one by one; or use parallel.strategy ddp"
        )
    return blocks


def _outermost_module_list_children(model: nn.Module) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    pending: list[nn.Module] = [model]
    while pending:
        module = pending.pop(0)
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(child.children())
            else:
                pending.append(child)
    return blocks


def replace_optimizer_parameters(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module
) -> None:
    """Point ``optimizer`` at ``model``'s current parameters: ``old_names`` maps the id of
    each parameter it was built over to its name in the model."""
    if any(optimizer.state.values()):
        raise ShardingError(
            "parallel.strategy fsdp: the optimizer already holds state; shard the model "
            "(build the Trainer) before the optimizer takes a step or loads a state"
        )
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        params = cast(list[torch.Tensor], group["params"])
        replaced: list[torch.Tensor] = []
        for param in params:
            name = old_names.get(id(param))
            if name is None or name not in current:
                raise ShardingError(
                    "parallel.strategy fsdp: the optimizer updates a tensor that is not a "
                    "parameter of the model; FSDP can only shard the model's own parameters"
                )
            replaced.append(current[name])
        group["params"] = replaced


def _broadcast_from_rank_zero(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Rank 0's parameters and buffers of ``module`` on every rank (DDP does the same),
    except those already sharded (whose values were broadcast before sharding)."""
    from torch.distributed.tensor import DTensor

    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor.data, src=source, group=group)


def shard_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply FSDP2 to ``model`` in place over ``group`` (``None``: the world) and point
    ``optimizer`` at the sharded parameters. Returns the root FSDP module (``model``).
    ``mesh``: shard over this one-dimensional mesh instead (the data dimension of a
    tensor-parallel run's mesh, ``speedtronic.systems.tensor_parallel``).

    Block by block: each block is moved to ``device``, given rank 0's values and sharded
    before the next one moves, so the device never holds more than one whole block (plus
    the root's own parameters) of a model that exists whole only in host memory."""
    from torch.distributed import device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = find_shard_blocks(model)
    old_names = {id(param): name for name, param in model.named_parameters()}
    if mesh is not None:
        pass  # tensor parallelism's data dimension
    elif group is None:
        mesh = device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    else:
        mesh = device_mesh.DeviceMesh.from_group(group, device.type)
    policy = MixedPrecisionPolicy()
    if param_dtype is not None and device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        block.to(device)
        _broadcast_from_rank_zero(block, group)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    model.to(device)  # the root's own parameters (the blocks' shards are there already)
    _broadcast_from_rank_zero(model, group)
    # The root's parameters are needed again right at the start of backward (the head).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    replace_optimizer_parameters(optimizer, old_names, model)
    logger.info(
        "FSDP: %d blocks and the root of %s sharded over %d ranks",
        len(blocks),
        type(model).__name__,
        mesh.size(),
    )
    return model


def gradient_sync_on_final(
    root: nn.Module,
) -> Callable[[bool], contextlib.AbstractContextManager[object]]:
    """A ``ForwardPath.grad_sync_context`` for FSDP: no reduce-scatter on the non-final
    microbatches (gradients accumulate unsharded), one on the last."""
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(root, FSDPModule)
    fsdp_root = root
    state = {"sync": True}

    def context(final: bool) -> contextlib.AbstractContextManager[object]:
        if state["sync"] != final:
            fsdp_root.set_requires_gradient_sync(final)
            state["sync"] = final
        return contextlib.nullcontext()

    return context


def reshard_model(model: nn.Module) -> None:
    """Free every gathered (unsharded) parameter of an FSDP ``model``, so that its next
    forward gathers the shards as they are now. The root keeps its parameters gathered
    after a forward (for the backward that follows in training); an evaluation, whose
    forward no backward follows, must not leave them -- nor use them when the shards were
    written in place since (weights swapped in for an evaluation)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def global_grad_norm(norm: torch.Tensor) -> torch.Tensor:
    """The total norm ``clip_grad_norm_`` returned, as a plain tensor: over sharded
    gradients it is a ``DTensor`` whose full value is the global norm."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm
