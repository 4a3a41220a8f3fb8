"""The model registry (original API): ``register_model``, ``build_model``, ``ModelRegistry``.

The process-global instance is ``registry`` here and ``speedtronic.registry`` at the top
level. This module is named ``model_registry`` so that no module shares the instance's name:
a submodule ``speedtronic.registry`` would replace the package attribute once imported.

Built-in models (``reference_transformer``, ``gpt``, ``hf_causal_lm``) and third-party ones
are declared as entry points in the ``speedtronic.models`` group and load lazily on first
use.

A factory receives the standard ``model:`` fields and the free-form ``model.options`` as
keyword arguments. It may declare a JSON Schema of its options -- an ``options_schema``
attribute (a class attribute of a model class, a function attribute), or
``register_model(name, options_schema=...)`` -- which ``model.options`` is validated against
with the rest of the config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, overload

from torch import nn

from speedtronic.plugins import MODEL_GROUP, PluginRegistry

ModelFactory = Callable[..., nn.Module]
"""A callable returning a model; it receives the standard fields as keyword arguments."""


class ModelSettings(Protocol):
    """The ``model`` config section fields forwarded to every factory."""

    name: str
    vocab_size: int
    max_seq_len: int
    n_layer: int
    n_head: int
    n_kv_head: int | None
    d_model: int
    d_ff: int | None
    dropout: float
    tie_weights: bool
    rope_base: float


class ModelRegistry(PluginRegistry[ModelFactory]):
    """Name -> model factory. ``register`` works as a decorator or a direct call."""

    def __init__(self) -> None:
        super().__init__("model", MODEL_GROUP)
        self._options_schemas: dict[str, Mapping[str, object]] = {}

    @overload
    def register(
        self,
        name: str,
        factory: None = None,
        *,
        options_schema: Mapping[str, object] | None = None,
    ) -> Callable[[ModelFactory], ModelFactory]: ...

    @overload
    def register(
        self,
        name: str,
        factory: ModelFactory,
        *,
        options_schema: Mapping[str, object] | None = None,
    ) -> ModelFactory: ...

    def register(
        self,
        name: str,
        factory: ModelFactory | None = None,
        *,
        options_schema: Mapping[str, object] | None = None,
    ) -> ModelFactory | Callable[[ModelFactory], ModelFactory]:
        """Register ``factory`` under ``name`` (without it: a decorator); ``options_schema``
        is the JSON Schema of its ``model.options``."""
        if options_schema is None:
            self._options_schemas.pop(name, None)
        else:
            self._options_schemas[name] = options_schema
        return super().register(name, factory)

    def options_schema(self, name: str) -> Mapping[str, object] | None:
        """The JSON Schema ``model.options`` of ``name`` must match, when it declares one."""
        if name in self._options_schemas:
            return self._options_schemas[name]
        declared = getattr(self.get(name), "options_schema", None)
        return declared if isinstance(declared, Mapping) else None

    def build(self, name: str, **kwargs: object) -> nn.Module:
        """The model factory ``name`` returns. A ``transformers`` causal LM comes back
        wrapped in ``HFCausalLM``: speedtronic's labels are already next-token aligned, and
        the raw model would shift them again (``speedtronic.models.hf``)."""
        model = self.get(name)(**kwargs)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model factory {name!r} returned {type(model).__name__}, not an nn.Module"
            )
        from speedtronic.models.hf import adapt_model  # imports no transformers itself

        return adapt_model(model)


registry = ModelRegistry()
"""The process-global model registry."""


@overload
def register_model(
    name: str, factory: None = None, *, options_schema: Mapping[str, object] | None = None
) -> Callable[[ModelFactory], ModelFactory]: ...


@overload
def register_model(
    name: str, factory: ModelFactory, *, options_schema: Mapping[str, object] | None = None
) -> ModelFactory: ...


def register_model(
    name: str,
    factory: ModelFactory | None = None,
    *,
    options_schema: Mapping[str, object] | None = None,
) -> ModelFactory | Callable[[ModelFactory], ModelFactory]:
    """Register a model factory on the global registry (decorator or direct call);
    ``options_schema`` is the JSON Schema of its ``model.options``."""
    return registry.register(name, factory, options_schema=options_schema)


def standard_model_fields(config: ModelSettings) -> dict[str, object]:
    """The fields every factory receives (custom factories should accept ``**kwargs``);
    ``build_model`` adds ``model.options``."""
    return {
        "vocab_size": config.vocab_size,
        "block_size": config.max_seq_len,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_kv_head": config.n_kv_head,
        "d_model": config.d_model,
        "d_ff": config.d_ff,
        "dropout": config.dropout,
        "tie_weights": config.tie_weights,
        "rope_base": config.rope_base,
    }


def build_model(config: ModelSettings, **overrides: object) -> nn.Module:
    """Build ``config.name`` from the global registry with the standard fields and
    ``config.options`` (which win over a standard field of the same name), with the
    adapters of ``config.adapters`` (``speedtronic.models.adapters``)."""
    options = dict(getattr(config, "options", None) or {})
    model = registry.build(config.name, **{**standard_model_fields(config), **options, **overrides})
    lora = getattr(getattr(config, "adapters", None), "lora", None)
    if lora is not None:
        from speedtronic.models.adapters import apply_lora  # imports peft only when asked

        model = apply_lora(model, lora)
    return model
