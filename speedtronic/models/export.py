"""Weights out: a trained model as a Hugging Face directory (``config.json`` +
``model.safetensors``) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

* an ``hf_causal_lm`` model (``HFCausalLM``) -- or a bare ``transformers`` model -- is written
  by its own ``save_pretrained`` (safetensors);
* the reference transformer is written as the equivalent ``LlamaForCausalLM``: the same
  pre-norm blocks with RMSNorm, rotate-half RoPE with the same ``rope_base``, grouped K/V
  heads (speedtronic repeats each K/V head for consecutive query heads, as Llama does), a
  bias-free SwiGLU MLP and an optionally tied head. The weights only change names -- no
  q/k permutation is needed, both use the rotate-half convention -- so its logits equal
  speedtronic's (to float rounding). Anything the reference model holds that Llama has no
  place for (a module of another class, an extra parameter such as a QK-norm, a bias,
  norms with different eps) is an ``ExportError`` naming it. Dropout is a training-time
  setting: the attention-probability dropout becomes ``attention_dropout``; the residual
  and embedding dropout have no Llama field (a warning says so; inference is unaffected).

With the run's tokens (``speedtronic.models.export_tokens``): its ``tokenizer.json`` and a
``tokenizer_config.json`` (``AutoTokenizer.from_pretrained`` loads the directory), and its
end-of-document id (beginning-of-text when known) in ``config.json`` and
``generation_config.json``, checked against the model's ``vocab_size``.

Weights holding a NaN or an infinity are refused, naming the tensor (``_check_finite``),
unless ``allow_nonfinite``: a diverged run's export would load and generate garbage.

The directory is written as a unit, with a record of its files, and only where
``speedtronic.models.export_target`` allows: never where a live run writes, never through a
link, and over an existing directory only with ``overwrite`` and only over an earlier
export. ``transformers`` and ``safetensors`` are imported inside the functions (the ``hf``
extra).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from speedtronic.data.text import DataSourceError
from speedtronic.models.adapters import AdapterError, has_lora, hf_module_name, write_adapter
from speedtronic.models.export_target import (
    EXPORT_RECORD,
    ExportError,
    check_export_target,
    install_export,
)
from speedtronic.models.export_tokens import (
    RunTokens,
    TokenIdError,
    run_tokens,
    set_token_ids,
    write_tokenizer,
)
from speedtronic.models.hf import (
    HFCausalLM,
    is_transformers_model,
    require_module,
    transformers_api,
)
from speedtronic.models.transformer import (
    CausalSelfAttention,
    ReferenceTransformer,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    TransformerBlock,
)

__all__ = [
    "EXPORT_RECORD",
    "ExportError",
    "ExportResult",
    "check_export_target",
    "export_model",
    "export_tokens",
    "tokenizer_file",
]

_LLAMA_ARCHITECTURE = "LlamaForCausalLM"


@dataclass(frozen=True)
class ExportResult:
    """What ``export_model`` wrote: the directory, its files and the architecture."""

    output: Path
    files: tuple[str, ...]
    architecture: str


# -- the weights' values ------------------------------------------------------------------


def _check_finite(tensors: Mapping[str, torch.Tensor], *, allow_nonfinite: bool) -> None:
    """``ExportError`` naming the first floating-point tensor that holds a NaN or an
    infinity (and how many more do), unless ``allow_nonfinite``."""
    if allow_nonfinite:
        return
    bad: list[tuple[str, int, int, int]] = []
    for name, tensor in tensors.items():
        if tensor.is_floating_point() or tensor.is_complex():
            nans, infs = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            if nans or infs:
                bad.append((name, nans, infs, tensor.numel()))
    if bad:
        name, nans, infs, count = bad[0]
        more = f" ({len(bad) - 1} more tensors too)" if len(bad) > 1 else ""
        raise ExportError(
            f"cannot export non-finite weights: tensor {name} holds {nans} NaN and {infs} "
            f"infinite values of {count}{more}; pass --allow-nonfinite to write them anyway"
        )


# -- the reference transformer as Llama -------------------------------------------------------


def _refuse(where: str, what: str) -> ExportError:
    return ExportError(
        f"cannot export the reference transformer as {_LLAMA_ARCHITECTURE}: {where} {what}, "
        "which LlamaForCausalLM has no equivalent for"
    )


def _expect(module: object, cls: type, where: str) -> None:
    if type(module) is not cls:
        raise _refuse(where, f"is {type(module).__name__}, not the reference's {cls.__name__}")


def _llama_names(model: ReferenceTransformer) -> Iterator[tuple[str, str]]:
    """(reference parameter name, Llama parameter name) for every weight, checking that
    each module is the reference's own class."""
    yield "transformer.wte.weight", "model.embed_tokens.weight"
    for index, block in enumerate(model.blocks):
        where = f"transformer.h.{index}"
        _expect(block, TransformerBlock, where)
        _expect(block.attn, CausalSelfAttention, f"{where}.attn")
        _expect(block.mlp, SwiGLU, f"{where}.mlp")
        for norm, llama in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")):
            _expect(getattr(block, norm), RMSNorm, f"{where}.{norm}")
            yield f"{where}.{norm}.weight", f"model.layers.{index}.{llama}.weight"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{where}.attn.{proj}.weight", f"model.layers.{index}.self_attn.{proj}.weight"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"{where}.mlp.{proj}.weight", f"model.layers.{index}.mlp.{proj}.weight"
    _expect(model.transformer["ln_f"], RMSNorm, "transformer.ln_f")
    _expect(model.rotary, RotaryEmbedding, "rotary")
    yield "transformer.ln_f.weight", "model.norm.weight"
    if not model.config.tie_weights:
        yield "lm_head.weight", "lm_head.weight"


def _norm_eps(model: ReferenceTransformer) -> float:
    values = {
        name: module.eps for name, module in model.named_modules() if isinstance(module, RMSNorm)
    }
    if len(set(values.values())) > 1:
        found = ", ".join(f"{name}={eps}" for name, eps in sorted(values.items()))
        raise _refuse("its RMSNorm layers", f"use different eps ({found})")
    return float(next(iter(values.values())))


def _check_reference(model: ReferenceTransformer) -> None:
    if type(model).forward is not ReferenceTransformer.forward:
        raise _refuse(type(model).__name__, "has its own forward")
    tied = model.lm_head.weight is model.token_embedding.weight
    if tied != model.config.tie_weights:
        raise _refuse("lm_head.weight", f"is {'' if tied else 'not '}tied against tie_weights")


def _llama_weights(model: ReferenceTransformer) -> dict[str, torch.Tensor]:
    """The reference transformer's weights under ``LlamaForCausalLM``'s names (a tied head
    once, as ``model.embed_tokens.weight``); ``ExportError`` naming any weight or module
    that has no Llama place."""
    _check_reference(model)
    state = model.state_dict()
    names = dict(_llama_names(model))
    tied_alias = {"lm_head.weight"} if model.config.tie_weights else set()
    extra = sorted(key for key in state if key not in names and key not in tied_alias)
    if extra:
        raise _refuse(", ".join(extra[:5]), "has no Llama name")
    return {llama: state[name].detach().to("cpu").contiguous() for name, llama in names.items()}


def _reference_llama_config(model: ReferenceTransformer) -> dict[str, object]:
    """The ``LlamaConfig`` fields of the reference transformer's architecture."""
    config = model.config
    if config.dropout > 0:
        warnings.warn(
            f"model.dropout {config.dropout}: Llama has attention_dropout only; the reference's "
            "residual and embedding dropout are not carried into the export (inference is the "
            "same; fine-tuning the export trains without them)",
            UserWarning,
            stacklevel=3,
        )
    return {
        "architectures": [_LLAMA_ARCHITECTURE],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.swiglu_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": _norm_eps(model),
        "rope_theta": float(config.rope_base),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": float(config.dropout),
        "tie_word_embeddings": config.tie_weights,
        # The token ids speedtronic's data uses are its own: Llama's defaults (1 and 2) would
        # make generation stop on an ordinary token.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _write_llama(model: ReferenceTransformer, directory: Path, *, allow_nonfinite: bool) -> str:
    weights = _llama_weights(model)
    _check_finite(weights, allow_nonfinite=allow_nonfinite)
    fields = _reference_llama_config(model)
    transformers = require_module("transformers", "speedtronic export")
    safetensors_torch = require_module("safetensors.torch", "speedtronic export")
    transformers.LlamaConfig(**fields).save_pretrained(str(directory))
    safetensors_torch.save_file(
        weights, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    return _LLAMA_ARCHITECTURE


# -- transformers models ------------------------------------------------------------------------


def _write_transformers(model: nn.Module, directory: Path, *, allow_nonfinite: bool) -> str:
    transformers = require_module("transformers", "speedtronic export")
    _check_finite(model.state_dict(), allow_nonfinite=allow_nonfinite)
    major = int(str(transformers.__version__).split(".")[0])
    # safetensors is the only format of transformers 5; 4.x is asked for it explicitly.
    options = {} if major >= 5 else {"safe_serialization": True}
    progress = transformers.utils.logging
    shown = progress.is_progress_bar_enabled()
    progress.disable_progress_bar()  # the CLI prints one line, not transformers' bars
    try:
        transformers_api(model).save_pretrained(str(directory), **options)
    finally:
        if shown:
            progress.enable_progress_bar()
    if not any(directory.glob("model*.safetensors")):
        raise ExportError(f"{type(model).__name__}.save_pretrained wrote no safetensors file")
    return type(model).__name__


def _write_adapter(model: nn.Module, directory: Path) -> str:
    """The model's LoRA adapters as a peft directory, named as the exported model's
    modules (``speedtronic.models.adapters.write_adapter``)."""
    if isinstance(model, ReferenceTransformer):
        names = {
            ref.removesuffix(".weight"): llama.removesuffix(".weight")
            for ref, llama in _llama_names(model)
        }

        def rename(name: str) -> str:
            return names.get(name, name)

    else:
        rename = hf_module_name(model)  # type: ignore[assignment]  # same signature
    try:
        write_adapter(model, directory, rename)
    except AdapterError as exc:
        raise ExportError(f"--adapter: {exc}") from None
    return "LoRA adapter"


def _write_model(model: nn.Module, directory: Path, *, allow_nonfinite: bool) -> str:
    if isinstance(model, HFCausalLM):
        return _write_transformers(model.hf, directory, allow_nonfinite=allow_nonfinite)
    if is_transformers_model(model):
        return _write_transformers(model, directory, allow_nonfinite=allow_nonfinite)
    if isinstance(model, ReferenceTransformer):
        return _write_llama(model, directory, allow_nonfinite=allow_nonfinite)
    raise ExportError(
        f"cannot export a {type(model).__name__}: speedtronic export writes hf_causal_lm "
        "models and the reference transformer (as LlamaForCausalLM)"
    )


def export_model(
    model: nn.Module,
    output: Path,
    *,
    overwrite: bool = False,
    tokenizer: Path | RunTokens | None = None,
    allow_nonfinite: bool = False,
    adapter: bool = False,
) -> ExportResult:
    """Write ``model`` into ``output`` as a Hugging Face directory (module docstring). With
    the run's tokens (``export_tokens``; a plain path: a tokenizer file and nothing else
    known), its ``tokenizer.json`` and ``tokenizer_config.json`` go beside the weights
    and its end-of-document / beginning-of-text ids into ``config.json``. ``ExportError``
    (nothing written, ``output`` untouched) when ``output`` cannot receive an export
    (``check_export_target``), when the model has no Hugging Face form, holds NaN or
    infinite weights (unless ``allow_nonfinite``), or when the run's tokens do not fit it.
    With ``adapter`` only the model's LoRA adapters are written, as a peft directory; a
    model with adapters exports only so (or merged, ``merge_lora`` first)."""
    shown = Path(output).expanduser()
    target = check_export_target(shown, overwrite=overwrite)
    if not adapter and has_lora(model):
        raise ExportError(
            "the model has LoRA adapters: export them with --adapter (a peft adapter "
            "directory) or the adapted model with --merge (the adapters merged into its weights)"
        )
    tokens = RunTokens(file=tokenizer) if isinstance(tokenizer, Path) else tokenizer
    if tokens is not None and tokens.file is not None and not tokens.file.is_file():
        raise ExportError(f"the run's tokenizer {tokens.file} is not a file")

    def fill(staging: Path) -> str:
        if adapter:
            return _write_adapter(model, staging)
        architecture = _write_model(model, staging, allow_nonfinite=allow_nonfinite)
        if tokens is not None:
            _write_tokens(staging, tokens)
        return architecture

    architecture, files = install_export(target, shown, fill, overwrite=overwrite)
    return ExportResult(shown, files, architecture)


def _write_tokens(directory: Path, tokens: RunTokens) -> None:
    fields = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    vocab, length = fields.get("vocab_size"), fields.get("max_position_embeddings")
    try:
        if isinstance(vocab, int):
            set_token_ids(directory, tokens, vocab)
        write_tokenizer(directory, tokens, max_length=length if isinstance(length, int) else None)
    except (TokenIdError, DataSourceError) as exc:
        raise ExportError(str(exc)) from None


# -- the run's tokenizer --------------------------------------------------------------------


def export_tokens(data: Mapping[str, object]) -> RunTokens:
    """The run's tokens (``speedtronic.models.export_tokens.run_tokens``) from its resolved
    ``data`` section; ``ExportError`` for a tokenizer that cannot be used."""
    try:
        return run_tokens(data)
    except (TokenIdError, DataSourceError) as exc:
        raise ExportError(str(exc)) from None


def tokenizer_file(data: Mapping[str, object]) -> Path | None:
    """The tokenizer file a run's ``data`` section used, to copy beside the weights
    (``export_tokens``'s ``file``): ``data.tokenizer`` when it is a file (the byte
    tokenizer has none), else the ``tokenizer.json`` of the ``data.tokens`` shard
    directory or of the sources of a ``data.mixture``."""
    return export_tokens(data).file
