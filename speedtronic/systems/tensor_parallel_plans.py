"""The built-in tensor-parallel plans: the reference transformer and Llama-family models.

Both follow Megatron's split of a block: the attention's q/k/v projections and the MLP's
gate/up projections are split by output features (``ColwiseParallel``: each tensor rank
holds ``1/T`` of the heads and of the MLP's hidden units), the attention's output and the
MLP's down projection by input features (``RowwiseParallel``: one all-reduce or
reduce-scatter per sub-layer). The embedding is split by vocabulary rows and the output head
by vocabulary columns, gathered back to whole logits so the loss is the usual one.

* **Reference transformer** (family ``ReferenceTransformer``): with sequence parallelism.
  Between sub-layers the residual stream is split along the sequence (``SequenceParallel``
  norms), gathered for attention and the MLP and reduce-scattered after them, so the norms'
  activations cost ``1/T`` per rank. Each attention module is told its local head counts.
  Tied input and output embeddings stay tied (both are split by vocabulary rows).
* **Llama family** (``hf_causal_lm``, ``model_type: llama``): plain tensor parallelism; the
  norms are replicated (``ReplicateParallel``), because transformers derives positions and
  the causal mask from the embedding output's length, which must stay whole.

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
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["LLAMA_PLAN", "REFERENCE_PLAN", "ReplicateParallel"]


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    for param_name, param in list(module.named_parameters(recurse=False)):
        replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
        module.register_parameter(param_name, nn.Parameter(replicated, param.requires_grad))


def _replicated_inputs(module: nn.Module, inputs: tuple[object, ...], mesh: DeviceMesh) -> object:
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(
        DTensor.from_local(item, mesh, [Replicate()], run_check=False)
        if isinstance(item, torch.Tensor) and not isinstance(item, DTensor)
        else item
        for item in inputs
    )


def _local_output(module: nn.Module, output: object, mesh: DeviceMesh) -> object:
    from torch.distributed.tensor import DTensor

    return output.to_local() if isinstance(output, DTensor) else output


def _replicate_style() -> type[ParallelStyle]:
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class _ReplicateParallel(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            return distribute_module(
                module,
                device_mesh,
                _replicate_parameters,
                _replicated_inputs,  # type: ignore[arg-type]  # torch types it loosely
                _local_output,  # type: ignore[arg-type]  # torch types it loosely
            )

    return _ReplicateParallel


def ReplicateParallel() -> ParallelStyle:  # noqa: N802  # reads as the torch styles it sits among
    """A parallel style that splits nothing: the module's parameters become ``Replicate``
    DTensors on the tensor mesh (every rank holds them whole and computes the same), its
    tensor inputs are taken as replicated and its output handed back as a plain tensor. For
    the modules of a plan that are not split (norms), so every parameter lives on the mesh."""
    return _replicate_style()()


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
        SequenceParallel,
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
                "norm1": SequenceParallel(use_local_output=True),
                "attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
                    use_local_output=True,
                ),
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "norm2": SequenceParallel(use_local_output=True),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
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
            "transformer.ln_f": SequenceParallel(use_local_output=True),
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


REFERENCE_PLAN = TensorParallelPlan(apply=_reference_apply, check=_reference_check)


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
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "post_attention_layernorm": ReplicateParallel(),
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

register_tensor_parallel_plan("ReferenceTransformer", REFERENCE_PLAN)
register_tensor_parallel_plan("llama", LLAMA_PLAN)
