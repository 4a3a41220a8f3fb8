"""The built-in tensor-parallel plans: the reference transformer and Llama-family models.

Both follow Megatron's split of a block: the attention's q/k/v projections and the MLP's
gate/up projections are split by output features (``ColwiseParallel``: each tensor rank
holds ``1/T`` of the heads and of the MLP's hidden units), the attention's output and the
MLP's down projection by input features (``RowwiseParallel``: one all-reduce or
reduce-scatter per sub-layer). The embedding is split by vocabulary rows and the output head
by vocabulary columns, gathered back to whole logits so the loss is the usual one.

* **Reference transformer** (family ``ReferenceTransformer``): with sequence parallelism.
  Between sub-layers the residual stream is split along the sequence
  (``LocalSequenceParallel`` norms), gathered for attention and the MLP and
  reduce-scattered after them, so the norms' activations cost ``1/T`` per rank. Each
  attention module is told its local head counts. Tied input and output embeddings stay
  tied (both are split by vocabulary rows).
* **Llama family** (``hf_causal_lm``, ``model_type: llama``): plain tensor parallelism; the
  norms are replicated (``ReplicateParallel``), because transformers derives positions and
  the causal mask from the embedding output's length, which must stay whole.

Collectives: the attention and MLP modules get their input as one replicated ``DTensor``
(``PrepareModuleInput`` without ``use_local_output``), so the gradients of the q/k/v (or
gate/up) projections' shared input are summed as ``Partial`` DTensors and reduced once per
sub-layer in backward, not once per projection. Norms run on plain local tensors (see
``ReplicateParallel``): in eager mode each DTensor op pays a dispatch that costs more than
a norm's arithmetic on small activations.

Register either for another family with the same structure::

    register_tensor_parallel_plan("mistral", LLAMA_PLAN)
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from speedtronic.systems.tensor_parallel_registry import (
    TensorParallelPlan,
    register_tensor_parallel_plan,
    require_divisible,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["LLAMA_PLAN", "LocalSequenceParallel", "ReplicateParallel"]


def _replicate_parameters(module: nn.Module, mesh: DeviceMesh) -> None:
    """Each parameter of ``module`` itself a ``Replicate`` DTensor on ``mesh``."""
    from torch.distributed.tensor import DTensor, Replicate

    for param_name, param in list(module.named_parameters(recurse=False)):
        replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
        module.register_parameter(param_name, nn.Parameter(replicated, param.requires_grad))


def _swap_in_local(
    grad_placement: Placement, stash: dict[str, torch.Tensor], module: nn.Module, args: object
) -> None:
    """Forward pre-hook: the module's DTensor parameters replaced by their local tensors
    (differentiable: the gradient flows back to the DTensor as ``grad_placement``)."""
    from torch.distributed.tensor import DTensor

    for name, param in module._parameters.items():
        if isinstance(param, DTensor):
            stash[name] = param
            local = param.to_local(grad_placements=(grad_placement,))
            module._parameters[name] = local  # restored by _swap_back


def _swap_back(
    stash: dict[str, torch.Tensor], module: nn.Module, args: object, output: object
) -> None:
    """Forward hook (also after an exception): the DTensor parameters back in place."""
    for name, param in stash.items():
        module._parameters[name] = cast(nn.Parameter, param)
    stash.clear()


def _local_style(grad_placement: Placement) -> ParallelStyle:
    from torch.distributed.tensor.parallel import ParallelStyle

    class _LocalParameters(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            _replicate_parameters(module, device_mesh)
            stash: dict[str, torch.Tensor] = {}
            module.register_forward_pre_hook(partial(_swap_in_local, grad_placement, stash))
            module.register_forward_hook(partial(_swap_back, stash), always_call=True)
            return module

    return _LocalParameters()


def ReplicateParallel() -> ParallelStyle:  # noqa: N802  # reads as the torch styles it sits among
    """A parallel style that splits nothing, for the modules of a plan that are not split
    (norms) and see whole activations: the module's parameters become ``Replicate``
    DTensors on the tensor mesh (every rank holds them whole, so every parameter lives on
    the mesh for FSDP, clipping and checkpoints), while its forward runs on plain tensors
    -- plain inputs, the parameters' local tensors, a plain output -- without DTensor's
    per-op dispatch. Every rank computes the same, so the gradient is ``Replicate``."""
    from torch.distributed.tensor import Replicate

    return _local_style(Replicate())


def LocalSequenceParallel() -> ParallelStyle:  # noqa: N802  # reads as the torch styles
    """Sequence parallelism for an elementwise-over-positions module (a norm) whose input is
    already this rank's plain shard of the sequence: the parameters become ``Replicate``
    DTensors and the forward runs on plain tensors, as with ``ReplicateParallel``, but each
    rank's parameter gradient covers only its positions, so it is ``Partial`` (summed over
    the tensor ranks when FSDP reduces it). Same math as torch's ``SequenceParallel``
    without a DTensor dispatch per op of the norm."""
    from torch.distributed.tensor import Partial

    return _local_style(Partial())


# -- the reference transformer -----------------------------------------------------------


def _size(owner: object, name: str) -> int:
    """An integer shape attribute of a model's config (duck-typed: no model import)."""
    value = getattr(owner, name)
    assert isinstance(value, int), f"{name} is {value!r}"
    return value


def _module(owner: object, name: str) -> nn.Module:
    value = getattr(owner, name)
    assert isinstance(value, nn.Module), f"{name} is {type(value).__name__}"
    return value


def _reference_check(model: nn.Module, degree: int) -> None:
    config = getattr(model, "config")  # noqa: B009  # a GPTConfig
    require_divisible("model.n_head, the attention heads", _size(config, "n_head"), degree)
    require_divisible("model.n_kv_head, the key/value heads", _size(config, "kv_heads"), degree)
    require_divisible("the MLP hidden size", _size(config, "swiglu_hidden"), degree)
    require_divisible("model.vocab_size", _size(config, "vocab_size"), degree)


def _reference_apply(model: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    degree = mesh.size()
    transformer = cast(nn.ModuleDict, _module(model, "transformer"))
    head = _module(model, "lm_head")
    embedding = transformer["wte"]
    tied = head.weight is embedding.weight
    for block in cast(nn.ModuleList, transformer["h"]):
        attention = _module(block, "attn")
        for count in ("n_head", "n_kv_head"):  # the heads this rank computes
            setattr(attention, count, _size(attention, count) // degree)
        parallelize_module(
            block,
            mesh,
            {
                "norm1": LocalSequenceParallel(),
                "attn": PrepareModuleInput(  # one all-gather in, one reduce-scatter back
                    input_layouts=(Shard(1), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
                ),
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "norm2": LocalSequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    parallelize_module(
        model,
        mesh,
        {
            "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "transformer.ln_f": LocalSequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    if tied:  # both split by vocabulary rows (Shard(0)): one parameter again
        head.weight = embedding.weight
    model.register_forward_pre_hook(partial(_whole_sequence_shares, degree), with_kwargs=True)


def _whole_sequence_shares(
    degree: int, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    """Sequence parallelism splits the sequence evenly over the tensor ranks: a length it
    does not divide would give ranks unequal shares, which the split cannot represent."""
    ids = args[0] if args else kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] % degree:
        raise ValueError(
            f"parallel.tensor: {degree} does not divide the sequence length ({ids.shape[1]}): "
            "the reference transformer's sequence parallelism splits each sequence evenly "
            f"over the tensor ranks; use sequences (data.block_size) a multiple of {degree}"
        )


_REFERENCE_PLAN = TensorParallelPlan(apply=_reference_apply, check=_reference_check)


# -- Llama-family transformers models ---------------------------------------------------


def _llama_check(model: nn.Module, degree: int) -> None:
    config = getattr(_module(model, "hf"), "config")  # noqa: B009  # transformers' config
    heads = _size(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    assert isinstance(kv_heads, int)
    require_divisible("num_attention_heads, the attention heads", heads, degree)
    require_divisible("num_key_value_heads, the key/value heads", kv_heads, degree)
    require_divisible(
        "intermediate_size, the MLP hidden size", _size(config, "intermediate_size"), degree
    )
    require_divisible("vocab_size", _size(config, "vocab_size"), degree)


def _llama_apply(model: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    causal_lm = _module(model, "hf")
    decoder = _module(causal_lm, "model")
    embedding = _module(decoder, "embed_tokens")
    head = _module(causal_lm, "lm_head")
    tied = head.weight is embedding.weight
    for layer in cast(nn.ModuleList, _module(decoder, "layers")):
        parallelize_module(
            layer,
            mesh,
            {
                "input_layernorm": ReplicateParallel(),
                "self_attn": PrepareModuleInput(  # q, k, v share one all-reduce back
                    input_kwarg_layouts={"hidden_states": Replicate()},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "post_attention_layernorm": ReplicateParallel(),
                "mlp": PrepareModuleInput(  # gate and up share one all-reduce back
                    input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
    parallelize_module(
        causal_lm,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate()
            ),
            "model.norm": ReplicateParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if tied:
        head.weight = embedding.weight


LLAMA_PLAN = TensorParallelPlan(apply=_llama_apply, check=_llama_check)

register_tensor_parallel_plan("ReferenceTransformer", _REFERENCE_PLAN)
register_tensor_parallel_plan("llama", LLAMA_PLAN)
