"""LoRA adapters through ``peft``: ``model.adapters.lora``.

``apply_lora`` injects peft's LoRA layers into the named ``Linear`` modules of a built model
(``peft.inject_adapter_in_model``: the model keeps its class, so the reference transformer
and ``HFCausalLM`` work as before) and freezes everything else. Then only the adapter
weights train, and only they are checkpointed: the model's ``state_dict()`` holds the LoRA
matrices and ``adapter_base_sha256``, a fingerprint of the frozen base weights, and loading
such a state dict needs no base weight. The base comes from where it always comes from --
the seeded initialisation, ``model.options.pretrained`` -- so a resume rebuilds the same
base and continues bit for bit; a checkpoint whose fingerprint is not the model's base (an
adapter trained on other weights) is refused.

``write_adapter`` writes the adapters as a ``peft`` directory (``adapter_config.json`` and
``adapter_model.safetensors``, module names as in the exported model: the reference
transformer's as Llama's), which ``peft.PeftModel.from_pretrained`` loads onto the exported
base. ``merge_lora`` folds the adapters into the base weights and removes the LoRA layers,
leaving the plain model that ``speedtronic export`` writes.

``peft`` is part of the ``hf`` extra; it is imported only when adapters are configured.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from speedtronic.models.hf import HFCausalLM, HFModelError, require_module
from speedtronic.state.training_state import TrainingStateError

__all__ = [
    "FINGERPRINT",
    "AdapterError",
    "apply_lora",
    "has_lora",
    "lora_state",
    "merge_lora",
    "write_adapter",
]

FINGERPRINT = "adapter_base_sha256"
"""The buffer (and state-dict key) holding the sha256 of the frozen base weights."""
_ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MARK = "_speedtronic_lora"
_HANDLES = "_speedtronic_lora_hooks"
_BASE = "_speedtronic_lora_base"
_WHERE = "model.adapters.lora"


class AdapterError(HFModelError):
    """Adapters cannot be applied as configured (exit 2)."""


class _LoraOptions(Protocol):
    """The ``model.adapters.lora`` fields."""

    r: int
    alpha: float
    dropout: float
    targets: Sequence[str]


@dataclass(frozen=True)
class _LoraSettings:
    """LoRA's settings, as ``apply_lora`` records them on the model."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @classmethod
    def of(cls, options: _LoraOptions) -> _LoraSettings:
        return cls(options.r, float(options.alpha), float(options.dropout), tuple(options.targets))


def _linear_names(model: nn.Module) -> list[str]:
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    )


def _check_targets(model: nn.Module, targets: Sequence[str]) -> None:
    names = _linear_names(model)
    unknown = [target for target in targets if target not in names]
    if not targets or unknown:
        verb = "matches" if len(unknown) == 1 else "match"
        what = f"{', '.join(unknown)} {verb} no module" if unknown else "is empty"
        raise AdapterError(
            f"{_WHERE}.targets: {what}; the model's Linear modules are: {', '.join(names)}"
        )


def _fingerprint(model: nn.Module) -> torch.Tensor:
    """sha256 of the frozen weights (names, dtypes and bytes); zeros on the meta device."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.requires_grad:
            continue
        if param.is_meta:
            return torch.zeros(32, dtype=torch.uint8)
        digest.update(f"{name}:{param.dtype}:{tuple(param.shape)}".encode())
        flat = param.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
        digest.update(flat.numpy().tobytes())
    return torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8).clone()


def has_lora(model: nn.Module) -> bool:
    """Whether ``apply_lora`` adapted ``model``."""
    return isinstance(getattr(model, _MARK, None), _LoraSettings)


def _frozen_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the base: frozen parameters under every name (a tied head too)
    and the buffers, which the model's construction gives."""
    params = model.named_parameters(remove_duplicate=False)
    frozen = {name for name, param in params if not param.requires_grad}
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    return frozen | (buffers - {FINGERPRINT})


def _install_state_hooks(model: nn.Module, frozen: set[str]) -> None:
    def drop_frozen(
        module: nn.Module, state: dict[str, object], prefix: str, metadata: object
    ) -> None:
        for key in [key for key in state if key.removeprefix(prefix) in frozen]:
            del state[key]

    def check_base(
        module: nn.Module,
        state: Mapping[str, torch.Tensor],
        prefix: str,
        *args: object,
    ) -> None:
        saved = state.get(prefix + FINGERPRINT)
        # The fingerprint taken at apply_lora, not the buffer: a sharded (DCP) load writes
        # the saved tensors into the model's own, the buffer included, before this runs.
        own = cast(torch.Tensor, getattr(module, _BASE))
        meta = bool(own.is_meta) or not bool(own.any())
        if saved is not None and not meta and not torch.equal(saved.cpu(), own.cpu()):
            raise TrainingStateError(
                "the adapter checkpoint was trained on other base weights than this model's "
                f"({FINGERPRINT} differs): resume it with the model.options.pretrained and "
                "model settings it was trained with"
            )

    def allow_missing_base(module: nn.Module, incompatible: object) -> None:
        missing = cast(list[str], getattr(incompatible, "missing_keys"))  # noqa: B009
        missing[:] = [key for key in missing if key not in frozen]

    # torch leaves these registrations unannotated: typed here through a Callable cast.
    register = cast(
        Callable[[Callable[..., None]], RemovableHandle],
        model.register_state_dict_post_hook,
    )
    pre = cast(
        Callable[[Callable[..., None]], RemovableHandle],
        model.register_load_state_dict_pre_hook,
    )
    post = cast(
        Callable[[Callable[..., None]], RemovableHandle],
        model.register_load_state_dict_post_hook,
    )
    handles = [register(drop_frozen), pre(check_base), post(allow_missing_base)]
    setattr(model, _HANDLES, handles)


def apply_lora(model: nn.Module, options: _LoraOptions) -> nn.Module:
    """``model`` with LoRA layers on its ``targets`` (module docstring); ``AdapterError``
    for targets that match no ``Linear`` module (naming those that exist)."""
    settings = _LoraSettings.of(options)
    _check_targets(model, settings.targets)
    peft = require_module("peft", _WHERE)
    config = peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
    )
    peft.inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    fingerprint = _fingerprint(model)
    model.register_buffer(FINGERPRINT, fingerprint)
    setattr(model, _BASE, fingerprint.clone())
    _install_state_hooks(model, _frozen_keys(model))
    setattr(model, _MARK, settings)
    return model


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights by parameter name (``...q_proj.lora_A.default.weight``)."""
    return {name: param.detach() for name, param in model.named_parameters() if "lora_" in name}


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    tuners = require_module("peft.tuners.lora", _WHERE)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, tuners.LoraLayer)]


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold the adapters into their base weights and put the plain ``Linear`` layers back
    (in place); the result has no LoRA layers, hooks aside its state dict is the model's."""
    for name, layer in _lora_layers(model):
        merge = cast(Callable[[], None], getattr(layer, "merge"))  # noqa: B009 - peft, untyped
        base = cast(Callable[[], nn.Module], getattr(layer, "get_base_layer"))  # noqa: B009
        merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, base())
    for handle in getattr(model, _HANDLES, []):
        handle.remove()
    for attribute in (_HANDLES, _MARK, _BASE, FINGERPRINT):
        if hasattr(model, attribute):
            delattr(model, attribute)
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def _settings(model: nn.Module) -> _LoraSettings:
    settings = getattr(model, _MARK, None)
    if not isinstance(settings, _LoraSettings):
        raise AdapterError("the model has no LoRA adapters (model.adapters.lora)")
    return settings


def write_adapter(
    model: nn.Module,
    directory: Path,
    rename: Callable[[str], str],
    base: str | None = None,
) -> list[str]:
    """Write ``model``'s adapters into ``directory`` as ``peft`` saves them: each module
    path renamed by ``rename`` (to the exported model's), keys
    ``base_model.model.<module>.lora_A.weight``. ``base`` is recorded as
    ``base_model_name_or_path``. Returns the files written."""
    settings = _settings(model)
    peft = require_module("peft", _WHERE)
    safetensors_torch = require_module("safetensors.torch", "export --adapter")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in lora_state(model).items():
        module, _, tail = name.partition(".lora_")
        kind, _, _ = tail.partition(".")  # A / B (the adapter name "default" follows)
        key = f"base_model.model.{rename(module)}.lora_{kind}.weight"
        tensors[key] = tensor.to("cpu").contiguous().clone()
    config = peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=sorted(settings.targets),
        base_model_name_or_path=base,
        task_type="CAUSAL_LM",
    )
    config.save_pretrained(str(directory))
    safetensors_torch.save_file(tensors, str(directory / _ADAPTER_WEIGHTS))
    json.loads((directory / _ADAPTER_CONFIG).read_text(encoding="utf-8"))  # written whole
    return [_ADAPTER_CONFIG, _ADAPTER_WEIGHTS]


def hf_module_name(model: nn.Module) -> Callable[[str], str]:
    """The renaming of ``write_adapter`` for an ``HFCausalLM`` (its ``hf.`` prefix off)."""
    if not isinstance(model, HFCausalLM):
        raise AdapterError(f"{type(model).__name__} is not a transformers model")
    return lambda name: name.removeprefix("hf.")
