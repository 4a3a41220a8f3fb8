"""Hugging Face causal language models: ``model.name: hf_causal_lm``, and the adapter that
gives any ``transformers`` causal LM speedtronic's objective.

Speedtronic batches are already next-token aligned: ``labels[:, t]`` is the token that
follows ``input_ids[:, t]`` (``speedtronic.data.collate``). A ``transformers`` causal LM
called with ``labels=`` shifts them once more, so it would learn to predict the token two
ahead -- silently: the loss still falls. ``HFCausalLM`` therefore calls the model without
labels and computes the loss from its logits with the engine's own ``loss_from_logits``
(the reference transformer's loss): labels shifted exactly once, ``-100`` ignored, the mean
over the real labels. A model returned by any registered factory that is a ``transformers``
causal LM is wrapped in it too (``adapt_model``), so ``register_model`` of a raw
``LlamaForCausalLM`` trains on the right objective.

``build_hf_causal_lm`` (the ``hf_causal_lm`` entry point) builds
``AutoModelForCausalLM.from_config`` from ``model.options.config`` -- a mapping with
``model_type``, or a local ``config.json`` (or a directory holding one) -- and optionally
loads ``model.safetensors`` from a local directory (``init_weights_from``). Nothing is ever
downloaded: a string that is not an existing local path (a hub id such as
``meta-llama/Llama-2-7b``) is refused, as are pickle-format weights (``pytorch_model.bin``)
and configs that need ``trust_remote_code``.

``transformers`` and ``safetensors`` (the ``hf`` extra) are imported inside the functions
that need them, never when this module is imported; a missing extra is an ``HFModelError``
naming the ``pip install`` line.
"""

from __future__ import annotations

import difflib
import json
import stat
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Literal, Protocol, cast

import torch
from torch import nn

from speedtronic.data.tokenizer import HF_EXTRA
from speedtronic.errors import ConfigError
from speedtronic.models.loss import loss_from_logits
from speedtronic.optimizers.routing import ROLE_ATTRIBUTE
from speedtronic.util.options import Opt, object_schema

__all__ = [
    "HF_OPTIONS_SCHEMA",
    "HFCausalLM",
    "HFCausalLMOptions",
    "HFModelError",
    "adapt_model",
    "build_hf_causal_lm",
    "is_transformers_model",
    "require_module",
]

_HF_INSTALL_HINT = HF_EXTRA
"""The install line of the ``hf`` extra (one declaration, in ``speedtronic.data.tokenizer``)."""
_CONFIG_NAME = "config.json"
_WEIGHTS_NAME = "model.safetensors"
_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
"""Weight files that ``torch.load`` would unpickle: refused, never opened."""
_MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""A ``config.json`` (or safetensors index) larger than this is refused unread."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_CONFIG_SCHEMA: Mapping[str, object] = {
    "type": ["object", "string"],
    "required": ["model_type"],
    "properties": {"model_type": {"type": "string", "minLength": 1}},
}
"""A mapping with ``model_type`` or a path: more than one type per field can say."""


@dataclass(frozen=True)
class HFCausalLMOptions:
    """The ``model.options`` of ``hf_causal_lm`` (``build_hf_causal_lm``'s keywords)."""

    config: Annotated[
        Mapping[str, object] | str | None,
        Opt(
            "the transformers config: a mapping with model_type (and any config field, e.g. "
            "hidden_size), or the path of a local config.json or of a directory holding one; "
            "default: init_weights_from's config.json",
            schema=_CONFIG_SCHEMA,
        ),
    ] = None
    pretrained: Annotated[
        str | None,
        Opt(
            "a local directory to fine-tune from: a transformers checkpoint (config.json and "
            "model.safetensors) or a speedtronic export; the config and the weights both come "
            "from it (not with config or init_weights_from)",
            schema={"type": "string"},
            min_length=1,
        ),
    ] = None
    init_weights_from: Annotated[
        str | None,
        Opt(
            "a local directory with model.safetensors (or its sharded index) to start from; "
            "pickle-format weights are refused",
            schema={"type": "string"},
            min_length=1,
        ),
    ] = None
    attn_implementation: Annotated[
        Literal["sdpa", "eager", "flash_attention_2"], Opt("transformers' attention kernel")
    ] = "sdpa"
    extra_config_keys: Annotated[
        tuple[str, ...],
        Opt(
            "config keys that are not fields of the config class but that a custom config "
            "class reads; any other unknown key is an error (a typo such as hiden_size would "
            "build the model without it)",
            items={"minLength": 1},
            extra={"uniqueItems": True},
        ),
    ] = ()
    dtype: Annotated[
        Literal["bfloat16", "float32"],
        Opt(
            "the parameters' dtype (a config.json's own dtype is not used; mixed precision is "
            "the precision: section)"
        ),
    ] = "float32"


HF_OPTIONS_SCHEMA: Mapping[str, object] = object_schema(
    HFCausalLMOptions,
    extra={"description": "A transformers causal LM built from a config (never downloaded)."},
)
"""The ``model.options`` of ``hf_causal_lm``, derived from ``HFCausalLMOptions``."""


class HFModelError(ConfigError):
    """An ``hf_causal_lm`` model cannot be built as configured (or the ``hf`` extra is
    missing): a user mistake, reported like any configuration error (exit 2)."""


def require_module(name: str, purpose: str) -> ModuleType:
    """Import ``name`` (part of the ``hf`` extra), or ``HFModelError`` with the install line."""
    try:
        return __import__(name, fromlist=["_"])
    except ImportError as exc:
        raise HFModelError(
            f"{purpose} needs {name.split('.')[0]}, part of the hf extra: "
            f"{_HF_INSTALL_HINT} ({exc})"
        ) from None


# -- recognising transformers models without importing transformers ------------------------


def _mro_names(model: object) -> set[tuple[str, str]]:
    return {(cls.__module__.split(".")[0], cls.__name__) for cls in type(model).__mro__}


def is_transformers_model(model: object) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (read from its class's MRO,
    so the check imports nothing)."""
    return ("transformers", "PreTrainedModel") in _mro_names(model)


def _is_transformers_causal_lm(model: object) -> bool:
    """Whether ``model`` is one of the causal LMs ``AutoModelForCausalLM`` builds: a model
    whose ``labels`` are shifted inside its forward."""
    if not is_transformers_model(model):
        return False
    # transformers is imported already: an instance of its class exists.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known: set[str] = set()
    for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        known.update((names,) if isinstance(names, str) else names)
    return any(cls.__name__ in known for cls in type(model).__mro__)


# -- the adapter ----------------------------------------------------------------------------


class _TransformersModel(Protocol):
    """The part of ``transformers.PreTrainedModel`` speedtronic calls (typed here: the
    ``hf`` extra ships no stubs speedtronic's own type check could rely on)."""

    def __call__(self, **inputs: object) -> object: ...
    def get_input_embeddings(self) -> nn.Module: ...
    def get_output_embeddings(self) -> nn.Module | None: ...
    def save_pretrained(self, save_directory: str, **options: object) -> None: ...


def transformers_api(model: nn.Module) -> _TransformersModel:
    """``model`` (a ``transformers`` model, ``is_transformers_model``) as its typed API."""
    return cast(_TransformersModel, model)


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM trained on speedtronic's next-token-aligned batches.

    ``forward(input_ids, labels=None, attention_mask=None, position_ids=None)`` returns
    ``{"logits"}`` and, with labels, ``{"loss"}`` computed from the logits with the labels
    as given (they are not shifted again); ``-100`` is ignored; ``attention_mask`` and
    ``position_ids`` (packed documents) go to the model. The
    wrapped model is ``.hf`` (its weights are ``hf.``-prefixed in a speedtronic
    checkpoint; ``speedtronic export`` writes the model's own layout). Its input embedding
    and output head are marked for AdamW whatever their names (Muon routing).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not is_transformers_model(model):
            raise TypeError(f"HFCausalLM wraps a transformers model, got {type(model).__name__}")
        self.hf = model
        api = transformers_api(model)
        for module in (api.get_input_embeddings(), api.get_output_embeddings()):
            if isinstance(module, nn.Module):
                setattr(module, ROLE_ATTRIBUTE, "adamw")

    @property
    def vocab_size(self) -> int:
        """The number of token ids the model embeds (its input embedding's rows)."""
        return int(self.get_input_embeddings().num_embeddings)

    def get_input_embeddings(self) -> nn.Embedding:
        return cast(nn.Embedding, transformers_api(self.hf).get_input_embeddings())

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        # No labels into the model: it would shift them a second time (module docstring).
        # ``position_ids`` restarting per packed document (and no ``attention_mask``):
        # transformers then masks attention block-causally per document itself.
        if position_ids is not None and attention_mask is not None:
            # transformers looks for packed documents only without an attention_mask: with
            # one it would attend across them. A mask of no padding says nothing: drop it.
            if not bool(attention_mask.all()):
                raise ValueError(
                    "hf_causal_lm: packed documents (position_ids) in a padded batch "
                    "(attention_mask): transformers would attend across the documents"
                )
            attention_mask = None
        inputs: dict[str, object] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        output = self.hf(**inputs, use_cache=False)
        # A ModelOutput (``.logits``), or a tuple when the config sets return_dict=False.
        logits = getattr(output, "logits", None)
        result = {"logits": cast(torch.Tensor, output[0] if logits is None else logits)}
        if labels is not None:
            result["loss"] = loss_from_logits(result["logits"], labels)
        return result

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """The model's own activation checkpointing (non-reentrant), on or off; the
        ``gradient_checkpointing`` callback calls this."""
        if enabled and not getattr(self.hf, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(self.hf).__name__} does not support gradient checkpointing")
        # transformers 5 calls the switch activation_checkpointing_*, 4.x gradient_*; both
        # take the checkpoint() keyword arguments first.
        action = "enable" if enabled else "disable"
        switch = getattr(self.hf, f"activation_checkpointing_{action}", None) or getattr(
            self.hf, f"gradient_checkpointing_{action}"
        )
        if enabled:
            switch({"use_reentrant": False})
        else:
            switch()


def adapt_model(model: nn.Module) -> nn.Module:
    """``model`` as the loop should train it on speedtronic batches: a ``transformers``
    causal LM wrapped in ``HFCausalLM`` (so its labels are shifted once), anything else
    as it is."""
    if isinstance(model, HFCausalLM) or not _is_transformers_causal_lm(model):
        return model
    return HFCausalLM(model)


# -- the builder ----------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict[str, object]:
    try:
        found = path.stat()
        if not stat.S_ISREG(found.st_mode):  # a FIFO would block the read forever
            raise HFModelError(f"{what}: {path} is not a regular file")
        size = found.st_size
        if size > _MAX_CONFIG_BYTES:
            raise HFModelError(f"{what}: {path} is {size} bytes, more than a config holds")
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFModelError(f"{what}: cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise HFModelError(f"{what}: {path} does not hold a JSON object")
    return value


def _local_path(value: str, what: str) -> Path:
    """``value`` as an existing local path, or ``HFModelError`` (never a hub lookup)."""
    path = Path(value).expanduser()
    if not path.exists():
        raise HFModelError(
            f"{what}: {value!r} is not a local file or directory. hf_causal_lm never "
            "downloads (a Hugging Face Hub id is refused): fetch the files yourself and "
            "name the local directory or config.json"
        )
    return path


def _config_file(value: str, what: str) -> Path:
    path = _local_path(value, what)
    if path.is_dir():
        path = path / _CONFIG_NAME
        if not path.is_file():
            raise HFModelError(f"{what}: {value!r} is a directory without {_CONFIG_NAME}")
    return path


def _config_fields(
    config: Mapping[str, object] | str | None, init_weights_from: str | None
) -> tuple[dict[str, object], str]:
    """The config's fields and where they came from (for messages)."""
    if isinstance(config, Mapping):
        return dict(config), "model.options.config"
    if isinstance(config, str):
        return _read_json(_config_file(config, "model.options.config"), "model.options.config"), (
            f"model.options.config ({config})"
        )
    if init_weights_from is not None:
        where = "model.options.init_weights_from"
        return _read_json(_config_file(init_weights_from, where), where), (
            f"{where} ({init_weights_from}/{_CONFIG_NAME})"
        )
    raise HFModelError(
        "model.options.config: hf_causal_lm needs a config (a mapping with model_type, or a "
        "local config.json) or model.options.init_weights_from"
    )


def _check_fields(fields: dict[str, object], where: str) -> str:
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise HFModelError(f"{where}: needs model_type (a string such as 'llama')")
    if "auto_map" in fields:
        raise HFModelError(
            f"{where}: the config names custom code (auto_map), which needs "
            "trust_remote_code; speedtronic never runs code from a model's files"
        )
    for legacy in ("torch_dtype", "dtype"):
        fields.pop(legacy, None)  # the dtype option decides (HF_OPTIONS_SCHEMA)
    return model_type


def _check_model_type(transformers: ModuleType, model_type: str, where: str) -> None:
    """An unknown model_type named with a few near matches (transformers' own message
    lists every type it knows: kilobytes on one line)."""
    known = sorted(str(name) for name in transformers.CONFIG_MAPPING.keys())  # noqa: SIM118
    if model_type in known:
        return
    near = difflib.get_close_matches(model_type, known, n=4, cutoff=0.6)
    hint = (
        f"near matches: {', '.join(near)}"
        if near
        else f"transformers {transformers.__version__} knows {len(known)} types, none close"
    )
    shown = model_type if len(model_type) <= 40 else f"{model_type[:40]}..."
    raise HFModelError(f"{where}: model_type {shown!r} is not a transformers model type ({hint})")


def _known_fields(cls: type) -> list[str]:
    """The fields a config class declares: its ``__init__`` parameters and the keys of a
    default instance's ``to_dict`` (the candidates of a did-you-mean)."""
    import inspect

    defaults = cls().to_dict()  # a transformers config class: every field has a default
    parameters = inspect.signature(cls).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return sorted(set(defaults) | named)


def _check_unknown_fields(
    config: object, fields: Mapping[str, object], where: str, extra: Sequence[str], strict: bool
) -> None:
    """transformers keeps any unknown key as a plain attribute, so a typo'd field
    (``hiden_size``) would build a model of the default width: an ``HFModelError`` with the
    closest field, unless the key is in ``extra_config_keys`` (a custom config class that
    reads it). ``strict=False`` (a checkpoint's own config.json) only warns."""
    cls = type(config)
    declared = _known_fields(cls)
    # Also known: the class's own attributes and properties (older spellings such as
    # rope_scaling) and its aliases (gpt2's n_embd); a key the config consumed (rope_theta
    # into rope_parameters) leaves no attribute behind.
    known = set(declared) | set(dir(cls)) | set(getattr(cls, "attribute_map", {})) | set(extra)
    unknown = sorted(key for key in fields if key not in known and hasattr(config, key))
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, declared, n=1, cutoff=0.75)
        hints.append(f"{key} (did you mean {close[0]!r}?)" if close else key)
    what = "is not a" if len(unknown) == 1 else "are not"
    plural = "field" if len(unknown) == 1 else "fields"
    message = f"{where}: {', '.join(hints)} {what} {cls.__name__} {plural}"
    if not strict:
        warnings.warn(
            f"{message}; transformers keeps it as a plain attribute", UserWarning, stacklevel=4
        )
        return
    raise HFModelError(
        f"{message}: transformers would keep it as a plain attribute and build the model "
        "without it; fix the key, or list it in model.options.extra_config_keys if a custom "
        "config class reads it"
    )


def _positions(config: object) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _check_sizes(config: object, vocab_size: object, block_size: object, where: str) -> None:
    """model.vocab_size / max_seq_len size the data; they must fit the transformers model."""
    model_vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and model_vocab != vocab_size:
        raise HFModelError(
            f"model.vocab_size: {vocab_size} but {where} has vocab_size {model_vocab}; they "
            "name the same vocabulary (the data's token ids are below model.vocab_size): set "
            f"model.vocab_size: {model_vocab}, or leave vocab_size out of a config mapping"
        )
    positions = _positions(config)
    if isinstance(block_size, int) and positions is not None and block_size > positions:
        raise HFModelError(
            f"model.max_seq_len: {block_size} is longer than the {positions} positions of "
            f"{where} (max_position_embeddings)"
        )


def _transformers_config(
    config: Mapping[str, object] | str | None,
    init_weights_from: str | None,
    vocab_size: object,
    block_size: object,
    extra_config_keys: Sequence[str] = (),
) -> object:
    fields, where = _config_fields(config, init_weights_from)
    model_type = _check_fields(fields, where)
    if isinstance(config, Mapping) and "vocab_size" not in fields and isinstance(vocab_size, int):
        fields["vocab_size"] = vocab_size
    transformers = require_module("transformers", "model.name: hf_causal_lm")
    _check_model_type(transformers, model_type, where)
    try:
        built = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise HFModelError(f"{where}: transformers refuses it: {exc}") from None
    strict = config is not None  # a checkpoint's own config.json only warns
    _check_unknown_fields(built, fields, where, extra_config_keys, strict)
    _check_sizes(built, vocab_size, block_size, where)
    return built


def _from_config(config: object, attn_implementation: str, dtype: torch.dtype) -> nn.Module:
    transformers = require_module("transformers", "model.name: hf_causal_lm")
    # transformers 5 calls the dtype argument ``dtype``, 4.x ``torch_dtype``.
    major = int(str(transformers.__version__).split(".")[0])
    dtype_arg = {"dtype" if major >= 5 else "torch_dtype": dtype}
    try:
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, **dtype_arg
        )
    except ValueError as exc:  # not a causal LM type, an unavailable attention kernel
        raise HFModelError(f"model.options: transformers cannot build it: {exc}") from None
    return cast(nn.Module, model)


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of ``directory`` (one file or a sharded index), or
    ``HFModelError``; pickle-format weights are refused without being opened."""
    where = "model.options.init_weights_from"
    single = directory / _WEIGHTS_NAME
    index = directory / _WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index, where).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFModelError(f"{where}: {index} has no weight_map")
        names = sorted({str(name) for name in weight_map.values()})
        files = [directory / name for name in names]
        for file in files:
            if file.parent != directory or not file.is_file():
                raise HFModelError(f"{where}: {index} names {file.name}, which is not there")
        return files
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_WEIGHT_SUFFIXES)
    if pickled:
        raise HFModelError(
            f"{where}: {directory} holds only pickle-format weights ({', '.join(pickled)}), "
            "which are never loaded (unpickling can run code); convert them to "
            f"{_WEIGHTS_NAME} first"
        )
    raise HFModelError(f"{where}: {directory} has no {_WEIGHTS_NAME}")


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """Each parameter name that shares its tensor with an earlier name -> that name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _load_safetensors_weights(
    model: nn.Module, directory: Path, where: str = "model.options.init_weights_from"
) -> None:
    """Load ``directory``'s safetensors weights into ``model`` (keys as ``save_pretrained``
    writes them). A tied weight may be saved under one of its names only; every other
    missing or unexpected key is an ``HFModelError`` naming it (and ``where``, the option
    that named the directory)."""
    files = _weight_files(directory)
    safetensors_torch = require_module("safetensors.torch", where)
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in files:
        try:
            tensors = safetensors_torch.load_file(str(file), device="cpu")
        except Exception as exc:  # safetensors' own error types vary by version
            raise HFModelError(f"{where}: cannot read {file}: {exc}") from None
        state.update(tensors)
        origin.update(dict.fromkeys(tensors, file))
    aliases = _tied_aliases(model)
    for alias, source in aliases.items():
        if alias not in state and source in state:
            state[alias], origin[alias] = state[source], origin[source]
        elif source not in state and alias in state:
            state[source], origin[source] = state[alias], origin[alias]
    own = model.state_dict()
    missing = sorted(key for key in own if key not in state)
    unexpected = sorted(key for key in state if key not in own)
    shapes = sorted(
        f"{key} {tuple(state[key].shape)} vs {tuple(own[key].shape)}"
        for key in own
        if key in state and state[key].shape != own[key].shape
    )
    problems = [
        f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", shapes))
        if keys
    ]
    if problems:
        raise HFModelError(
            f"{where}: the weights in {directory} do not fit the model ({'; '.join(problems)})"
        )
    _refuse_non_float(own, state, origin, where)
    model.load_state_dict(state)


def _refuse_non_float(
    own: Mapping[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
    origin: Mapping[str, Path],
    where: str,
) -> None:
    """``load_state_dict`` would convert an int64 or bool tensor into a float parameter
    without a word (ids or a mask saved under a weight's name): ``HFModelError`` naming
    the first such tensor and its file instead."""
    for key, target in own.items():
        found = state[key]
        if target.is_floating_point() and not found.is_floating_point():
            have, want = (str(t.dtype).removeprefix("torch.") for t in (found, target))
            raise HFModelError(
                f"{where}: tensor {key} in {origin[key]} is {have}, not floating point, for "
                f"the {want} parameter of that name"
            )


def _on_meta(model: nn.Module) -> bool:
    return any(param.is_meta for param in model.parameters())


def build_hf_causal_lm(
    *,
    config: Mapping[str, object] | str | None = None,
    init_weights_from: str | None = None,
    pretrained: str | None = None,
    attn_implementation: str = HFCausalLMOptions.attn_implementation,
    dtype: str = HFCausalLMOptions.dtype,
    extra_config_keys: Sequence[str] = HFCausalLMOptions.extra_config_keys,
    vocab_size: object = None,
    block_size: object = None,
    **reference_fields: object,
) -> HFCausalLM:
    """The ``hf_causal_lm`` model (module docstring): ``AutoModelForCausalLM.from_config``
    wrapped in ``HFCausalLM``.

    ``vocab_size`` and ``block_size`` are ``model.vocab_size`` and ``model.max_seq_len``: a
    config mapping without ``vocab_size`` takes ``model.vocab_size``; a config that states
    another one, or fewer positions than ``max_seq_len``, is an ``HFModelError``. The
    reference transformer's other fields (``n_layer``, ``d_model``, ...) do not apply: the
    architecture is the config's.
    """
    del reference_fields
    if pretrained is not None:
        if config is not None or init_weights_from is not None:
            raise HFModelError(
                "model.options.pretrained names the config and the weights: leave "
                "model.options.config and init_weights_from out"
            )
        init_weights_from = pretrained
    if dtype not in DTYPES:
        raise HFModelError(f"model.options.dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    weights = (
        _local_path(init_weights_from, "model.options.init_weights_from")
        if init_weights_from is not None
        else None
    )
    if weights is not None and not weights.is_dir():
        raise HFModelError(
            f"model.options.init_weights_from: {init_weights_from!r} is not a directory"
        )
    built = _transformers_config(
        config, init_weights_from, vocab_size, block_size, tuple(extra_config_keys)
    )
    model = _from_config(built, attn_implementation, DTYPES[dtype])
    if weights is not None:
        files = _weight_files(weights)  # checked even on meta (speedtronic validate)
        if not _on_meta(model) and files:
            where = "model.options." + ("pretrained" if pretrained else "init_weights_from")
            _load_safetensors_weights(model, weights, where)
    return HFCausalLM(model)


# The registry reads a factory's ``options_schema`` attribute (speedtronic.models.registry).
build_hf_causal_lm.options_schema = HF_OPTIONS_SCHEMA  # type: ignore[attr-defined]  # see above
