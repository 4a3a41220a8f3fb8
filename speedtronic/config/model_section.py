"""The ``model:`` section and its adapters (``model.adapters.lora``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from speedtronic.config.declare import Opt
from speedtronic.config.section_base import JSONValue, PluginKeysAsAttributes, Section


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class LoraAdapterConfig:
    """LoRA adapters through peft: only they train and are checkpointed."""

    r: Annotated[int, Opt("rank of the low-rank update", minimum=1, maximum=65536)] = 8
    alpha: Annotated[
        float,
        Opt(
            "scale: the update is multiplied by `alpha / r`",
            exclusive_minimum=0,
            maximum=1_000_000,
        ),
    ] = 16.0
    dropout: Annotated[
        float, Opt("dropout on the adapters' input", minimum=0, exclusive_maximum=1)
    ] = 0.0
    targets: Annotated[
        list[str],
        Opt(
            "names of the Linear modules to adapt (the last part of their path, e.g. `q_proj`)",
            extra={"minItems": 1},
            items={"minLength": 1},
        ),
    ] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
        }


@dataclass(frozen=True)
class AdaptersConfig:
    """Parameter-efficient fine-tuning: adapters on a frozen base model."""

    lora: Annotated[
        LoraAdapterConfig | None,
        Opt("LoRA adapters (docs/adapters-and-generation.md); `null`: none"),
    ] = None

    def to_dict(self) -> dict[str, JSONValue]:
        return {"lora": None if self.lora is None else self.lora.to_dict()}


@dataclass(eq=False)  # equality includes the plugin keys (the mixin's)
class ModelConfig(PluginKeysAsAttributes, Section):
    """``model:`` -- the registered model name, reference-transformer dimensions and free-form
    ``options`` for the factory (plugins may add 2.0 keys, readable as attributes:
    ``model.gradient_checkpointing``)."""

    section_name: ClassVar[str] = "model"
    section_doc: ClassVar[str] = (
        "Model selection, reference-transformer dimensions and free-form options for other models."
    )

    name: Annotated[
        str,
        Opt(
            "a registered model (`register_model`, the `speedtronic.models` entry points, or "
            "`imports:`); `gpt` is an alias of the reference transformer",
            min_length=1,
        ),
    ] = "reference_transformer"
    vocab_size: Annotated[
        int, Opt("also the default of `data.vocab_size`", minimum=1, maximum=2**24)
    ] = 512
    max_seq_len: Annotated[
        int,
        Opt(
            "context length; passed to factories as `block_size`; the default of `data.block_size`",
            minimum=1,
            maximum=2**24,
        ),
    ] = 128
    n_layer: Annotated[int, Opt("transformer blocks", minimum=1, maximum=2**16)] = 4
    n_head: Annotated[int, Opt("must divide `d_model`", minimum=1, maximum=2**16)] = 8
    n_kv_head: Annotated[
        int | None,
        Opt(
            "key/value heads (grouped-query attention); must divide `n_head`",
            minimum=1,
            maximum=2**16,
            default_text="`null` → `n_head`",
        ),
    ] = None
    d_model: Annotated[int, Opt("model width", minimum=1, maximum=2**20)] = 256
    d_ff: Annotated[
        int | None,
        Opt(
            "feed-forward width",
            minimum=1,
            maximum=2**22,
            default_text="`null` → `4 * d_model`",
        ),
    ] = None
    dropout: Annotated[float, Opt("dropout probability", minimum=0, exclusive_maximum=1)] = 0.0
    tie_weights: Annotated[bool, Opt("share the token embedding and the output head")] = True
    rope_base: Annotated[float, Opt("rotary embedding base", exclusive_minimum=0, maximum=1e12)] = (
        10000.0
    )
    options: Annotated[
        dict[str, JSONValue],
        Opt(
            "keyword arguments for the model factory beside the standard fields (they win "
            "over a standard field of the same name); values must be JSON values; checked "
            "against the factory's `options_schema` when it declares one. The reference "
            "transformer takes `document_attention` (docs/fine-tuning.md)"
        ),
    ] = field(default_factory=dict)
    adapters: Annotated[
        AdaptersConfig | None,
        Opt(
            "adapters trained on the frozen model: `{lora: {r, alpha, dropout, targets}}`; "
            "`null`: the whole model trains"
        ),
    ] = None

    def __post_build__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None and _is_int(self.d_model):
            self.d_ff = 4 * self.d_model
