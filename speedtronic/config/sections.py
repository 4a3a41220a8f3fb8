"""Typed configuration: one dataclass per core ``run.yaml`` section plus the ``SpeedtronicConfig``
root -- and the declaration of every core key.

Each field is the one declaration of its key (``speedtronic.config.declare``): its type,
default, bounds and doc. The core part of the run schema (``core_schema_document``), the
defaults, the case-insensitive keys and the root shorthands the loader rewrites, and the
tables of ``docs/configuration.md`` are all derived from these fields.

Plugins own their 2.0 keys (``PluginSpec.sections``): keys a plugin adds to a core section are
kept beside the section's fields (``section.extensions``; ``logging`` and ``distributed`` also
read them as attributes, ``cfg.logging.console``), and top-level keys only plugins declare are
kept on the root (``cfg.plugin_keys``; read as attributes too, ``cfg.checkpoint.every_steps``,
through ``SectionView``). These views are plain data: new code reads a plugin's options
instead.

One pass each: a mapping, file or text is normalised once (``loading.normalise``), validated
once against the composed schema and the cross-field rules (``schema.config_errors``), and
then built into these objects without being checked again (``declare.build``). A section or
root built directly from Python goes through the same pipeline, once, on construction; after
mutating fields call ``validate()``. Errors are collected and raised together as
``ConfigError``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, TypeAlias, TypeVar, cast

import yaml
from typing_extensions import Self

from speedtronic.config import declare
from speedtronic.config.declare import Opt
from speedtronic.config.loading import (
    REDACTED,
    apply_overrides,
    fold_value,
    looks_like_text,
    normalise,
    read_file,
    read_source,
)
from speedtronic.config.schema import (
    ConfigError,
    config_errors,
    import_errors,
    plugin_root_keys,
    plugin_section_keys,
    root_default,
    schema_defaults,
)
from speedtronic.state.atomic_io import atomic_write_text

JSONValue: TypeAlias = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]
"""A value that JSON (and YAML) can represent."""

SECRET_KEYS = frozenset({"token", "secret", "password", "hmac_key", "api_key"})
"""Keys whose values are secrets wherever they appear (case-insensitive)."""

STEPS_MAX = 10**12
"""The bound of every step count (``run.max_steps``, ``eval.every_steps``, ...): 10^12 steps."""
SEED_MAX = 2**32 - 1
"""The bound of a seed: what NumPy accepts."""


def redact_secrets(value: JSONValue) -> JSONValue:
    """A copy of ``value`` with every non-empty secret (``SECRET_KEYS``) replaced by
    ``"<redacted>"``, at any depth (distributed.token, callback options, ...)."""
    if isinstance(value, dict):
        return {
            key: (
                REDACTED
                if key.lower() in SECRET_KEYS and item not in (None, "")
                else redact_secrets(item)
            )
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact_secrets(item) for item in value]
    return value


def _jsonable(value: object) -> JSONValue:
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        return _jsonable(to_dict())
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, os.PathLike):
        return str(os.fspath(value))
    # Scalars pass through; anything else is left for validation to report by path.
    return cast(JSONValue, value)


# -- sections -----------------------------------------------------------------------------


@dataclass
class _Section:
    """Shared behaviour of the section dataclasses: extensions, construction from Python."""

    section_name: ClassVar[str] = ""
    section_doc: ClassVar[str] = ""
    """The section's description in the run schema."""
    bare_value: ClassVar[str | None] = None
    """The key a section written as a bare value means (``optimizer: muon`` is
    ``{name: muon}``)."""

    @property
    def extensions(self) -> dict[str, JSONValue]:
        """Keys that installed plugins add to this section (``PluginSpec.sections``)."""
        extensions = self.__dict__.get("_extensions")
        if extensions is None:
            extensions = {
                key: cast(JSONValue, schema_defaults(self.section_name).get(key))
                for key in plugin_section_keys(self.section_name)
            }
            self.__dict__["_extensions"] = extensions
        return cast("dict[str, JSONValue]", extensions)

    def __post_init__(self) -> None:
        """Built from Python: lossless coercion (``lr=1`` -> ``1.0``), case folding, the
        derived defaults, then this section's one validation pass."""
        for item in declare.declared(type(self)):
            value = declare.coerce(item.hint, getattr(self, item.name))
            if item.opt.fold is not None and isinstance(value, str):
                value = fold_value(item.opt.fold, value)
            object.__setattr__(self, item.name, value)
        self.__post_build__()
        errors = config_errors({self.section_name: self.to_dict()})
        if errors:
            raise ConfigError(errors)

    def __post_build__(self) -> None:
        """Derive defaults that depend on other keys of the section (also run by
        ``declare.build``, which builds a section from validated data)."""

    def to_dict(self) -> dict[str, JSONValue]:
        """The section as JSON-compatible data, keys in declaration order (the fields, then
        the keys plugins add)."""
        values = {
            item.name: _jsonable(getattr(self, item.name)) for item in dataclasses.fields(self)
        }
        values.update((key, _jsonable(value)) for key, value in self.extensions.items())
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, object] | None = None) -> Self:
        """Validate ``values`` as this section (shorthands and case folding included)."""
        data, errors = normalise({cls.section_name: {} if values is None else values})
        errors.extend(config_errors(data))
        if errors:
            raise ConfigError(errors)
        return cls._from_valid(_as_mapping(data.get(cls.section_name)))

    @classmethod
    def _from_valid(cls, values: Mapping[str, object]) -> Self:
        """The section from validated values (its fields, then the keys plugins add)."""
        names = _field_names(cls)
        section = declare.build(cls, {k: v for k, v in values.items() if k in names})
        section.extensions.update(
            (key, cast(JSONValue, value)) for key, value in values.items() if key not in names
        )
        return section

    def _stated(self) -> dict[str, JSONValue]:
        """What this section states: ``to_dict()`` without the fields that hold their
        declared default (a dataclass cannot tell a default from one given explicitly)."""
        values = self.to_dict()
        for item in declare.declared(type(self)):
            if item.has_default and values.get(item.name) == declare.to_json(item.default()):
                del values[item.name]
        return values


class _PluginKeysAsAttributes:
    """Read (and set) the keys plugins add to a section as attributes: ``logging.console``.
    Typed as plain JSON values; a plugin's own options are the typed way in."""

    extensions: dict[str, JSONValue]
    if TYPE_CHECKING:  # provided by _Section, which comes after this mixin

        def to_dict(self) -> dict[str, JSONValue]: ...

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _PluginKeysAsAttributes)
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, like the other sections

    def __getattr__(self, name: str) -> JSONValue:
        extensions = self.__dict__.get("_extensions")
        if extensions is None and not name.startswith("_"):
            extensions = self.extensions
        if isinstance(extensions, dict) and name in extensions:
            return cast(JSONValue, extensions[name])
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        if name in _field_names(type(self)) or name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in self.extensions:
            self.extensions[name] = cast(JSONValue, value)
        else:
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}")


def _field_names(cls: type) -> frozenset[str]:
    return frozenset(item.name for item in dataclasses.fields(cls))


def _as_mapping(value: object) -> Mapping[str, object]:
    return cast("Mapping[str, object]", value) if isinstance(value, Mapping) else {}


def _redacted_repr(section: object) -> str:
    """A section's repr with its free-form mappings redacted: ``dataset_options`` may hold
    credentials, and are never printed."""
    values = ", ".join(
        f"{item.name}={_redacted(getattr(section, item.name))!r}"
        for item in dataclasses.fields(cast("type", type(section)))
    )
    return f"{type(section).__name__}({values})"


def _redacted(value: object) -> object:
    return redact_secrets(cast(JSONValue, value)) if isinstance(value, dict) else value


@dataclass
class RunConfig(_Section):
    """``run:`` -- identity, seed, device and the training target."""

    section_name: ClassVar[str] = "run"
    section_doc: ClassVar[str] = "Run identity, seed, device and training target."

    name: Annotated[str, Opt("non-empty; a label, not a path", min_length=1, shorthand=True)] = (
        "speedtronic-run"
    )
    seed: Annotated[
        int,
        Opt(
            "seeds Python, NumPy and torch; the default of `data.seed`",
            minimum=0,
            maximum=SEED_MAX,
            type_text="int 0 … 2³²−1",
            shorthand=True,
        ),
    ] = 1234
    device: Annotated[
        str,
        Opt(
            "`auto` = CUDA, then MPS, then CPU; or a torch device (`cpu`, `cuda`, `cuda:1`, "
            "`mps`); an explicit device that is not available is an error when the run is built",
            min_length=1,
            shorthand=True,
        ),
    ] = "auto"
    max_steps: Annotated[
        int,
        Opt(
            "absolute target of global optimizer steps (a resumed run continues up to it); "
            "`data.max_steps` wins when set",
            minimum=1,
            maximum=STEPS_MAX,
            shorthand=True,
        ),
    ] = 1000
    max_epochs: Annotated[
        int | None,
        Opt(
            "also stop after this many passes over the data, whichever of "
            "`max_steps`/`max_epochs` comes first (see [training "
            "target](#training-target---max-steps-and-the-lr-schedule))",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None
    output_dir: Annotated[
        str,
        Opt(
            "the run directory: `config.yaml`, `metrics.jsonl`, `checkpoints/`; the base of "
            "every relative path a plugin writes",
            min_length=1,
            shorthand=True,
        ),
    ] = "runs"
    log_every: Annotated[
        int | None,
        Opt(
            "legacy spelling of `logging.every_steps`, copied there; giving both with "
            "different values is an error",
            minimum=1,
            maximum=STEPS_MAX,
            shorthand=True,
            fills="logging.every_steps",
        ),
    ] = None
    threads: Annotated[
        int | Literal["auto"],
        Opt(
            "CPU threads torch uses (`torch.set_num_threads`); `auto` is 1 for a model under "
            "20M parameters trained on the CPU, torch's default otherwise, on CUDA/MPS, and "
            "whenever `OMP_NUM_THREADS` is set (see "
            "[performance](performance.md#cpu-threads--runthreads)); the start line says what "
            "was chosen, e.g. `threads 1 (auto)`",
            schema={
                "anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1, "maximum": 4096}]
            },
            type_text="`auto` or int ≥ 1",
        ),
    ] = "auto"
    stop_grace_s: Annotated[
        float | None,
        Opt(
            "seconds: how long a requested stop (SIGTERM, Ctrl-C, a callback's `request_stop`) "
            "waits for a batch the data loader does not deliver; then the fit gives up on it "
            "and exits 1, keeping the last completed step's checkpoint (see "
            "[checkpointing](checkpointing.md))",
            exclusive_minimum=0,
            maximum=86400,
            default_text="`null` (10 s, `Trainer.stop_grace_s`)",
        ),
    ] = None


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
class ModelConfig(_PluginKeysAsAttributes, _Section):
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
            "transformer takes none"
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class MixtureSource:
    """One source of the mixture."""

    tokens: Annotated[
        str,
        Opt("Directory of token shards written by speedtronic prepare.", min_length=1),
    ]
    weight: Annotated[
        float,
        Opt(
            "Relative share of the samples (weights are normalised).",
            exclusive_minimum=0,
            maximum=1_000_000,
        ),
    ] = 1.0

    def to_dict(self) -> dict[str, JSONValue]:
        return {"tokens": self.tokens, "weight": self.weight}

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> MixtureSource | Mapping[str, object]:
        """The source, or ``values`` unchanged when they do not fit (validation reports it)."""
        return cast("MixtureSource | Mapping[str, object]", declare.coerce(cls, values))


@dataclass(repr=False)
class DataConfig(_Section):
    """``data:`` -- the data source and batching (``target = K * micro``)."""

    section_name: ClassVar[str] = "data"
    section_doc: ClassVar[str] = "Training data source and batching."

    text_path: Annotated[
        str | None,
        Opt(
            "UTF-8 text file streamed through `tokenizer` (default: the byte tokenizer); "
            "relative to the working directory",
            min_length=1,
        ),
    ] = None
    tokens: Annotated[
        str | None,
        Opt(
            "a directory of token shards written by `speedtronic prepare` (`index.json`), read "
            "through `np.memmap`; trains on its training shards, `eval:` reads its held-out "
            "shards. An fsspec URL (`s3://bucket/shards/`, `file://`, ...) is read through "
            "a local cache (`shard_cache`)",
            min_length=1,
        ),
    ] = None
    mixture: Annotated[
        list[MixtureSource],
        Opt(
            "token-shard directories mixed by `weight` (> 0, default 1, normalised): each "
            "epoch draws from each source in proportion; always shuffled",
            extra={"maxItems": 1024},
            type_text="list of `{tokens, weight}`",
        ),
    ] = field(default_factory=list)
    tokenizer: Annotated[
        str | None,
        Opt(
            "a `tokenizer.json` (Hugging Face `tokenizers`, the `hf` extra) for `text_path` "
            "and `eval.text_path`, or `bytes`; `null`: the byte tokenizer. With "
            "`tokens`/`mixture` the shards must come from this tokenizer (sha256)",
            min_length=1,
        ),
    ] = None
    verify_shards: Annotated[
        bool,
        Opt(
            "check every token shard's sha256 against `index.json` when the data is built "
            "(about 1 s per GB); `false` checks sizes only"
        ),
    ] = True
    document_mask: Annotated[
        bool,
        Opt(
            "token shards and mixtures: attention stays within each document of a window "
            "(block-causal at the end-of-document ids) and positions restart at each "
            "document; the batches carry `position_ids`"
        ),
    ] = False
    storage_options: Annotated[
        dict[str, JSONValue],
        Opt(
            "fsspec storage options for a `tokens` URL (for `s3://`: `endpoint_url`, "
            "`client_kwargs`, ...); secret-named keys are redacted (see [secrets](#secrets))"
        ),
    ] = field(default_factory=dict)
    shard_cache: Annotated[
        str | None,
        Opt(
            "the local cache directory of shards read from a `tokens` URL, shared by the "
            "ranks of a node",
            min_length=1,
            default_text="`null` → `$XDG_CACHE_HOME/speedtronic/shards`",
        ),
    ] = None
    shard_cache_bytes: Annotated[
        int,
        Opt(
            "the most bytes of shards the cache keeps (least recently used evicted); at "
            "least a few shards",
            minimum=1,
            maximum=2**60,
        ),
    ] = 16 << 30
    shard_prefetch: Annotated[
        int,
        Opt(
            "shards of a `tokens` URL downloaded ahead of the order in the background (0: "
            "none, each is fetched when first read)",
            minimum=0,
            maximum=1024,
        ),
    ] = 4
    dataset: Annotated[
        str | None,
        Opt(
            "a registered dataset name (`register_dataset`, the `speedtronic.datasets` entry "
            "points, or `imports:`); built in: `synthetic`, `learnable`, `text`. A name "
            "ending in `.pt`, `.pth`, `.pkl` or `.pickle` is a config error, and any other "
            "name that looks like a file is refused when the data is built: pickled dataset "
            "files are never loaded",
            min_length=1,
        ),
    ] = None
    dataset_options: Annotated[
        dict[str, JSONValue],
        Opt(
            "passed to the dataset factory as `DatasetRequest.options`; values must be JSON "
            "values; secret-named keys are redacted (see [secrets](#secrets))"
        ),
    ] = field(default_factory=dict)
    collate: Annotated[
        str,
        Opt(
            "how items become a batch: `auto` (the dataset's own collate when it declares "
            "one, else `collate_batch`: causal LM records padded, other mappings and tuples "
            "stacked field by field), `causal`, `default` (torch's `default_collate`), or a "
            "name registered with `register_collate` (see "
            "[collators](models-and-data.md#collators))",
            min_length=1,
        ),
    ] = "auto"
    synthetic: Annotated[
        bool,
        Opt("fall back to synthetic tokens when neither `text_path` nor `dataset` is set"),
    ] = True
    synthetic_kind: Annotated[
        Literal["uniform", "learnable"],
        Opt(
            "random tokens (floor `ln(vocab)`), or a Markov language with a known entropy floor",
            fold="lower",
        ),
    ] = "uniform"
    num_tokens: Annotated[
        int,
        Opt(
            "despite the name, the number of **samples** (each `block_size` tokens) of the "
            "synthetic data, and `DatasetRequest.num_samples` for registered datasets",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = 100000
    vocab_size: Annotated[
        int | None,
        Opt(
            "token ids the data source draws from; at most `model.vocab_size` (a larger value "
            "is an error)",
            minimum=1,
            maximum=2**24,
            default_text="`null` → `model.vocab_size`",
        ),
    ] = None
    block_size: Annotated[
        int | None,
        Opt(
            "tokens per sample",
            minimum=1,
            maximum=2**24,
            default_text="`null` → `model.max_seq_len`",
        ),
    ] = None
    micro_batch_size: Annotated[
        int, Opt("samples per forward/backward", minimum=1, maximum=2**20)
    ] = 1
    target_batch_size: Annotated[
        int | None,
        Opt(
            "samples per optimizer step; a multiple of (and ≥) `micro_batch_size`; `K = target "
            "/ micro` microbatches are accumulated (null: no accumulation)",
            minimum=1,
            maximum=2**30,
            default_text="`null` → `micro_batch_size`",
        ),
    ] = None
    num_workers: Annotated[
        int,
        Opt("DataLoader worker processes (kept alive between epochs)", minimum=0, maximum=1024),
    ] = 0
    prefetch_factor: Annotated[
        int | None,
        Opt(
            "batches prefetched per worker; ignored without workers",
            minimum=1,
            maximum=1024,
            default_text="`null` → `2`",
        ),
    ] = None
    pin_memory: Annotated[
        bool | None, Opt("pin host memory", default_text="`null` → on for CUDA")
    ] = None
    shuffle: Annotated[
        bool | None,
        Opt(
            "per-epoch permutation seeded by `(data.seed, epoch)`; map-style data only "
            "(ignored with a warning for a streaming source); `false` is an error with "
            "`mixture`",
            default_text="`null` → on for `tokens` and `mixture`, off otherwise",
        ),
    ] = None
    drop_last: Annotated[bool, Opt("drop an epoch's last incomplete batch")] = True
    seed: Annotated[
        int | None,
        Opt(
            "seeds the data order and the synthetic data",
            minimum=0,
            maximum=SEED_MAX,
            type_text="int 0 … 2³²−1 or null",
            default_text="`null` → `run.seed`",
        ),
    ] = None
    max_steps: Annotated[
        int | None,
        Opt(
            "training target that overrides `run.max_steps` when set",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None

    @property
    def accumulation_steps(self) -> int:
        """Microbatches per optimizer step (1 while ``target_batch_size`` is unset)."""
        if self.target_batch_size is None:
            return 1
        return self.target_batch_size // self.micro_batch_size

    def __repr__(self) -> str:
        return _redacted_repr(self)


@dataclass(repr=False)
class EvalConfig(_Section):
    """``eval:`` -- evaluation on a held-out set: how often, how much, and from where (no
    data option: the training source's held-out split, see ``docs/evaluation.md``)."""

    section_name: ClassVar[str] = "eval"
    section_doc: ClassVar[str] = (
        "Evaluation on a held-out set during training (and for `speedtronic evaluate`)."
    )

    every_steps: Annotated[
        int | None,
        Opt(
            "evaluate every N global steps and on the final step; `null`: no evaluation "
            "during training. A `monitor: eval/...` (checkpoint, early stopping) needs it",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None
    max_batches: Annotated[
        int | None,
        Opt(
            "batches per evaluation, all ranks together (`data.micro_batch_size` samples each; "
            "each rank reads its share); `null`: the whole "
            "held-out set",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None
    fraction: Annotated[
        float,
        Opt(
            "the tail of a training text file kept out of training as the held-out set (only "
            "while `every_steps` is set and no other held-out source is named); token shards "
            "fix their split at `speedtronic prepare --eval-fraction` instead",
            exclusive_minimum=0,
            maximum=0.5,
        ),
    ] = 0.05
    text_path: Annotated[
        str | None,
        Opt("a UTF-8 file to evaluate on instead (through `data.tokenizer`)", min_length=1),
    ] = None
    dataset: Annotated[
        str | None,
        Opt("a registered dataset to evaluate on instead (not with `text_path`)", min_length=1),
    ] = None
    dataset_options: Annotated[
        dict[str, JSONValue],
        Opt("options of the `eval.dataset` factory (`DatasetRequest.options`)"),
    ] = field(default_factory=dict)
    tasks: Annotated[
        list[EvalTaskSource],
        Opt(
            "multiple-choice tasks scored with the held-out set on every evaluation "
            "(`eval/<name>/acc`, `eval/<name>/acc_norm`); needs a run on text",
            extra={"maxItems": 64},
            type_text="list of `{path, name, shots, seed, max_rows, batch_size}`",
        ),
    ] = field(default_factory=list)

    def __repr__(self) -> str:
        return _redacted_repr(self)


@dataclass(frozen=True)
class EvalTaskSource:
    """One multiple-choice task scored on evaluation steps (docs/evaluation.md)."""

    path: Annotated[
        str,
        Opt("a local JSONL file of `{context, choices, answer}` rows", min_length=1),
    ]
    name: Annotated[
        str | None,
        Opt(
            "the metric name, `eval/<name>/acc` and `acc_norm`; default: the file's stem",
            min_length=1,
            pattern=r"^[A-Za-z0-9_.-]+$",
        ),
    ] = None
    shots: Annotated[
        int, Opt("examples from the same file asked before each row", minimum=0, maximum=64)
    ] = 0
    seed: Annotated[int, Opt("seeds the choice of the examples", minimum=0, maximum=2**32 - 1)] = 0
    max_rows: Annotated[
        int | None, Opt("score the first N rows; `null`: all", minimum=1, maximum=STEPS_MAX)
    ] = None
    batch_size: Annotated[
        int, Opt("sequences (one per choice) per forward pass", minimum=1, maximum=4096)
    ] = 16

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "path": self.path,
            "name": self.name,
            "shots": self.shots,
            "seed": self.seed,
            "max_rows": self.max_rows,
            "batch_size": self.batch_size,
        }


@dataclass(frozen=True)
class RoutingRule:
    """Send matching parameters to one optimizer. Rules are tried in order; the first match
    wins; unmatched parameters follow the built-in heuristic.

    Every given criterion must match; a rule with none matches everything. This is the
    config record only: ``speedtronic.optimizers.RoutingRule`` does the matching.
    """

    to: Annotated[Literal["muon", "adamw"], Opt("Target optimizer.")]
    name: Annotated[
        str | None,
        Opt(
            "Glob matched against the full parameter name (e.g. 'blocks.*.attn.*').",
            schema={"type": "string"},
            min_length=1,
        ),
    ] = None
    module: Annotated[
        str | None,
        Opt(
            "Class name of the module that owns the parameter (e.g. 'Linear').",
            schema={"type": "string"},
            min_length=1,
        ),
    ] = None
    ndim: Annotated[
        int | None,
        Opt(
            "Number of dimensions of the parameter.",
            schema={"type": "integer"},
            minimum=0,
            maximum=64,
        ),
    ] = None

    def to_dict(self) -> dict[str, JSONValue]:
        """The rule as config data (unset criteria omitted)."""
        values: dict[str, JSONValue] = {"to": self.to}
        for key in ("name", "module", "ndim"):
            value = getattr(self, key)
            if value is not None:
                values[key] = value
        return values

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> RoutingRule | Mapping[str, object]:
        """The rule, or ``values`` unchanged when they do not fit (validation reports it)."""
        return cast("RoutingRule | Mapping[str, object]", declare.coerce(cls, values))


@dataclass
class OptimizerConfig(_Section):
    """``optimizer:`` -- AdamW, or hybrid Muon (matrices) + AdamW (the rest); optionally
    cautious. ``muon_lr``/``muon_weight_decay`` default to ``lr``/``weight_decay``."""

    section_name: ClassVar[str] = "optimizer"
    bare_value: ClassVar[str | None] = "name"
    section_doc: ClassVar[str] = (
        "Optimizer: AdamW or hybrid Muon/AdamW, optionally cautious. A bare string "
        "(optimizer: muon) is a shorthand for {name: muon}."
    )

    name: Annotated[
        Literal["adamw", "muon"],
        Opt("`muon`: hidden matrices with Muon, everything else with AdamW", fold="lower"),
    ] = "adamw"
    lr: Annotated[
        float,
        Opt(
            "AdamW learning rate; also Muon's unless `muon_lr` is set",
            exclusive_minimum=0,
            maximum=1000,
            default_text="`3e-4`",
        ),
    ] = 3e-4
    betas: Annotated[
        tuple[float, float],
        Opt(
            "AdamW betas",
            items={"minimum": 0, "exclusiveMaximum": 1},
            type_text="two numbers in [0, 1)",
        ),
    ] = (0.9, 0.95)
    eps: Annotated[
        float,
        Opt(
            "AdamW epsilon",
            exclusive_minimum=0,
            maximum=1,
            type_text="number > 0",
            default_text="`1e-8`",
        ),
    ] = 1e-8
    weight_decay: Annotated[
        float,
        Opt(
            "decoupled weight decay; also Muon's unless `muon_weight_decay` is set",
            minimum=0,
            maximum=1000,
        ),
    ] = 0.1
    fused: Annotated[bool | None, Opt("fused AdamW; `null` probes support on CUDA")] = None
    grad_clip: Annotated[
        float | None,
        Opt("clip the global gradient norm (after unscaling)", exclusive_minimum=0, maximum=1e9),
    ] = None
    muon_plus: Annotated[
        bool,
        Opt(
            "normalise Muon updates after orthogonalisation (Muon+); requires `name: muon`",
            shorthand=True,
        ),
    ] = False
    muon_plus_mode: Annotated[
        Literal["row_col", "col_row"], Opt("order of the Muon+ normalisation", fold="lower")
    ] = "row_col"
    cautious: Annotated[
        bool,
        Opt("mask update entries whose sign disagrees with the gradient", shorthand=True),
    ] = False
    cautious_rescale: Annotated[
        bool, Opt("rescale cautious updates by the fraction of entries kept")
    ] = False
    muon_momentum: Annotated[float, Opt("Muon momentum", minimum=0, exclusive_maximum=1)] = 0.95
    muon_nesterov: Annotated[bool, Opt("Nesterov momentum for Muon")] = True
    muon_ns_steps: Annotated[int, Opt("Newton–Schulz iterations", minimum=1, maximum=100)] = 5
    muon_ns_coefficients: Annotated[
        tuple[float, float, float],
        Opt(
            "quintic Newton–Schulz coefficients (a, b, c)",
            items={"minimum": -1000, "maximum": 1000},
        ),
    ] = (3.4445, -4.775, 2.0315)
    muon_norm_eps: Annotated[
        float,
        Opt(
            "epsilon of the Muon+ normalisation",
            exclusive_minimum=0,
            maximum=1,
            type_text="number > 0",
            default_text="`1e-8`",
        ),
    ] = 1e-8
    muon_lr: Annotated[
        float | None,
        Opt(
            "learning rate of the Muon group",
            exclusive_minimum=0,
            maximum=1000,
            default_text="`null` → `lr`",
        ),
    ] = None
    muon_lr_scale: Annotated[
        Literal["original", "rms"],
        Opt(
            "`rms` scales Muon updates to AdamW's update RMS (so `lr` means the same for both "
            "branches); `original` is √max(1, rows/cols) (set `muon_lr` explicitly, e.g. 0.02)",
            fold="lower",
        ),
    ] = "rms"
    muon_weight_decay: Annotated[
        float | None,
        Opt(
            "weight decay of the Muon group",
            minimum=0,
            maximum=1000,
            default_text="`null` → `weight_decay`",
        ),
    ] = None
    decay_norms_and_biases: Annotated[
        bool | None,
        Opt(
            "`false`: 1-D and scalar parameters (biases, norm gains) get weight decay 0 in "
            "AdamW; see [optimizers](optimizers.md#weight-decay-on-norms-and-biases)",
            default_text="`null` → `true`, or a callback's proposal",
        ),
    ] = None
    """``null``: ``true`` unless a callback of the run proposes otherwise
    (``Callback.optimizer_decay_norms_and_biases``)."""
    routing: Annotated[
        list[RoutingRule],
        Opt(
            "with `name: muon` only: `{to: muon|adamw, name: <glob>, module: <class name>, "
            "ndim: <int>}`; every criterion given must match, the first matching rule wins, "
            "unmatched parameters follow the heuristic; a rule sending `ndim` ≠ 2 to `muon` "
            "is an error",
            type_text="list of rules",
        ),
    ] = field(default_factory=list)

    @property
    def resolved_muon_lr(self) -> float:
        """The Muon group's learning rate (``muon_lr``, else ``lr``)."""
        return self.lr if self.muon_lr is None else self.muon_lr

    @property
    def resolved_muon_weight_decay(self) -> float:
        """The Muon group's weight decay (``muon_weight_decay``, else ``weight_decay``)."""
        return self.weight_decay if self.muon_weight_decay is None else self.muon_weight_decay


@dataclass
class SchedulerConfig(_Section):
    """``scheduler:`` -- warmup then cosine or constant. ``max_steps: None`` follows the
    training target; read the resolved horizon from ``SpeedtronicConfig.scheduler_steps``."""

    section_name: ClassVar[str] = "scheduler"
    section_doc: ClassVar[str] = "Learning-rate schedule, advanced once per optimizer step."

    name: Annotated[
        Literal["cosine", "constant"],
        Opt(
            "`cosine` decays from 1 to `min_lr_ratio` at the horizon and holds there; "
            "`constant` stays at 1",
            fold="lower",
        ),
    ] = "cosine"
    warmup_steps: Annotated[
        int,
        Opt(
            "linear warmup steps (the 2.0 default); `validate` and `fit` warn when it covers "
            "more than half of the schedule's horizon (below; `--max-steps` does not change "
            "it) — scale it with the schedule (about 10% of its steps)",
            minimum=0,
            maximum=STEPS_MAX,
        ),
    ] = 100
    max_steps: Annotated[
        int | None,
        Opt(
            "the horizon. Absent or `null`: the training target (`data.max_steps`, else "
            "`run.max_steps`). A value you give is used as given, never overwritten — "
            "including `1000`",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None
    min_lr_ratio: Annotated[
        float, Opt("cosine floor as a fraction of `lr`", minimum=0, maximum=1)
    ] = 0.1


@dataclass
class PrecisionConfig(_Section):
    """``precision:`` -- ``auto`` or a forced bf16/fp16/fp32 mode."""

    section_name: ClassVar[str] = "precision"
    bare_value: ClassVar[str | None] = "mode"
    section_doc: ClassVar[str] = (
        "Numeric precision. A bare string (precision: bf16) is a shorthand for {mode: bf16}."
    )

    mode: Annotated[
        Literal["auto", "bf16", "fp16", "fp32"],
        Opt(
            "`auto`: bf16 on CUDA that supports it, else fp16 (with a grad scaler); fp32 on "
            "CPU and MPS. Forced `bf16` falls back to fp32 on CUDA without bf16 and on MPS; "
            "forced `fp16` is fp32 off CUDA",
            fold="lower",
        ),
    ] = "auto"
    dtype: Annotated[
        Literal["bf16", "fp16", "fp32"] | None,
        Opt(
            "with `mode: auto`, the mode to request instead (the same fallbacks apply)",
            fold="lower",
        ),
    ] = None


@dataclass(eq=False)  # equality includes the plugin keys (the mixin's)
class LoggingConfig(_PluginKeysAsAttributes, _Section):
    """``logging:`` -- log level and file, and the metric cadence. Sink plugins add their
    2.0 switches (``console``, ``jsonl``, ``json_file``), readable as attributes."""

    section_name: ClassVar[str] = "logging"
    section_doc: ClassVar[str] = (
        "Logging and metric cadence. Plugins add their own keys (the 2.0 default-sink "
        "switches come from the sink plugins)."
    )

    level: Annotated[
        str,
        Opt(
            "any case; the level of the `speedtronic` Python loggers (checkpoint, resume, "
            "shape and plugin messages)",
            extra={"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
            fold="upper",
            type_text="`DEBUG` | `INFO` | `WARNING` | `ERROR` | `CRITICAL`",
        ),
    ] = "INFO"
    file: Annotated[
        str | None,
        Opt(
            "the text log file of the default console sink: its lines go there (relative to "
            "`run.output_dir`) instead of the terminal",
            min_length=1,
        ),
    ] = None
    every_steps: Annotated[
        int,
        Opt(
            "metric cadence: a record is due every N global steps (and at the last step)",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = 1


@dataclass(eq=False)  # equality includes the plugin keys (the mixin's)
class DistributedConfig(_PluginKeysAsAttributes, _Section):
    """``distributed:`` -- settings of torch.distributed runs (``timeout_s``, the per-step
    collective timeout). Plugins add their 2.0 keys, readable as attributes."""

    section_name: ClassVar[str] = "distributed"
    section_doc: ClassVar[str] = (
        "Settings of torch.distributed runs (torchrun). Plugins add their own keys to this section."
    )

    timeout_s: Annotated[
        float,
        Opt(
            "`torch.distributed` collective timeout, seconds",
            exclusive_minimum=0,
            maximum=30 * 86400,
        ),
    ] = 1800.0


@dataclass
class ParallelConfig(_Section):
    """``parallel:`` -- how a multi-rank run splits the model: ``ddp`` (every rank holds
    the whole model and optimizer state) or ``fsdp`` (FSDP2: parameters, gradients and
    optimizer state sharded across the ranks; see docs/scale-out.md)."""

    section_name: ClassVar[str] = "parallel"
    section_doc: ClassVar[str] = (
        "How a multi-rank (torchrun) run splits the model across ranks: ddp replicates it, "
        "fsdp shards parameters, gradients and optimizer state (FSDP2)."
    )

    strategy: Annotated[
        Literal["ddp", "fsdp"],
        Opt(
            "any case. `ddp`: every rank holds the whole model and optimizer state "
            "(`DistributedDataParallel`). `fsdp`: FSDP2 (`fully_shard`) shards parameters, "
            "gradients and optimizer state across the ranks, and checkpoints are sharded (DCP) "
            "directories that resume on another number of ranks",
            fold="lower",
        ),
    ] = "ddp"
    reshard_after_forward: Annotated[
        bool,
        Opt(
            "`fsdp`: free each block's gathered parameters after its forward pass (less "
            "memory; backward gathers them again)"
        ),
    ] = True


@dataclass
class ShapeValidationConfig(_Section):
    """``shape_validation:`` -- startup warnings about unaligned shapes (never errors)."""

    section_name: ClassVar[str] = "shape_validation"
    section_doc: ClassVar[str] = (
        "Startup warnings about tensor-core-unfriendly shapes (never errors)."
    )

    enabled: Annotated[bool, Opt("check shapes at startup")] = True
    alignment: Annotated[
        int | Literal["auto", "none"],
        Opt(
            "`auto`: 8 on CUDA with bf16/fp16, no checks elsewhere; `none`: no checks; `null` "
            "means `auto`",
            schema={
                "type": ["integer", "string"],
                "minimum": 1,
                "maximum": 4096,
                "if": {"type": "string"},
                "then": {"enum": ["auto", "none"]},
            },
            fold="lower",
            type_text="int ≥ 1, `auto` or `none`",
        ),
    ] = "auto"
    check_batch: Annotated[bool, Opt("`data.micro_batch_size`")] = True
    check_sequence: Annotated[
        bool, Opt("`data.block_size` and `micro_batch_size * block_size`")
    ] = True
    check_model: Annotated[bool, Opt("model GEMM dimensions")] = True
    check_vocab: Annotated[bool, Opt("`model.vocab_size`")] = False
    warn_on_cpu: Annotated[bool, Opt("also warn on CPU/MPS when an explicit alignment is set")] = (
        False
    )

    def __post_build__(self) -> None:
        if self.alignment is None:  # the original treated null as auto
            self.alignment = "auto"


@dataclass
class CallbackSpec:
    """One ``callbacks:`` entry: the plugin name and its (validated) options."""

    name: str
    options: dict[str, JSONValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "name" in self.options:
            raise ConfigError(
                f"callbacks: option 'name' of {self.name!r} clashes with the plugin name"
            )

    def to_dict(self) -> dict[str, JSONValue]:
        """The entry as written in config: ``{name: ..., **options}``."""
        return {"name": self.name, **self.options}

    @classmethod
    def from_dict(cls, entry: Mapping[str, object]) -> CallbackSpec:
        """An entry ``{name: ..., **options}`` (already validated)."""
        options = {key: value for key, value in entry.items() if key != "name"}
        return cls(name=str(entry["name"]), options=cast("dict[str, JSONValue]", options))

    def __repr__(self) -> str:
        return f"CallbackSpec(name={self.name!r}, options={redact_secrets(self.options)!r})"


_SECTION_TYPES: dict[str, type[_Section]] = {
    "run": RunConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "eval": EvalConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "precision": PrecisionConfig,
    "logging": LoggingConfig,
    "distributed": DistributedConfig,
    "parallel": ParallelConfig,
    "shape_validation": ShapeValidationConfig,
}


SectionType = TypeVar("SectionType", bound=_Section)


def _defaults_of(section_type: type[SectionType]) -> Callable[[], SectionType]:
    """A default factory building the section's defaults as validated data (the declared
    defaults are valid: nothing to check)."""
    return lambda: section_type._from_valid({})


_CALLBACKS_SCHEMA: Mapping[str, object] = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name"],
        "description": "A callback plugin: its registered name plus its options. A bare "
        "string is a shorthand for {name: <string>}.",
        "properties": {
            "name": {
                "type": "string",
                "minLength": 1,
                "description": "Registered callback plugin name.",
            }
        },
    },
}
"""Each entry is checked by its plugin's own options schema, composed in by
``schema.composed_schema``."""


# -- the root -----------------------------------------------------------------------------


@dataclass
class SpeedtronicConfig:
    """A complete, validated run configuration.

    Build it with ``SpeedtronicConfig.load(source, overrides)`` (mapping, YAML/JSON file or
    text, or another config), ``from_dict``/``from_yaml``, or directly. Construction fills
    derived defaults (``data.block_size``/``vocab_size``/``seed``/``target_batch_size``,
    ``logging.every_steps`` from ``run.log_every``, and what plugins derive from their 2.0
    keys) and validates everything once; after mutating fields call ``validate()`` again.
    """

    run: RunConfig = field(default_factory=_defaults_of(RunConfig))
    model: ModelConfig = field(default_factory=_defaults_of(ModelConfig))
    data: DataConfig = field(default_factory=_defaults_of(DataConfig))
    eval: EvalConfig = field(default_factory=_defaults_of(EvalConfig))
    optimizer: OptimizerConfig = field(default_factory=_defaults_of(OptimizerConfig))
    scheduler: SchedulerConfig = field(default_factory=_defaults_of(SchedulerConfig))
    precision: PrecisionConfig = field(default_factory=_defaults_of(PrecisionConfig))
    logging: LoggingConfig = field(default_factory=_defaults_of(LoggingConfig))
    distributed: DistributedConfig = field(default_factory=_defaults_of(DistributedConfig))
    parallel: ParallelConfig = field(default_factory=_defaults_of(ParallelConfig))
    shape_validation: ShapeValidationConfig = field(
        default_factory=_defaults_of(ShapeValidationConfig)
    )
    compile: Annotated[
        bool,
        Opt(
            "`torch.compile` the model; a compiler failure warns and the run continues eagerly",
            schema={
                "type": ["boolean", "object"],
                "properties": {"enabled": {"type": "boolean", "default": False}},
                "additionalProperties": False,
            },
            type_text="bool or `{enabled: bool}`",
        ),
    ] = False
    ooo_backprop: Annotated[
        bool,
        Opt(
            "out-of-order backprop on CUDA stage streams (a no-op on CPU/MPS); see "
            "[systems](systems.md)"
        ),
    ] = False
    ooo_streams: Annotated[
        int, Opt("streams for `ooo_backprop`", minimum=1, maximum=8, type_text="int 1 … 8")
    ] = 4
    callbacks: Annotated[
        list[CallbackSpec],
        Opt("Callback plugins, run in this order.", schema=_CALLBACKS_SCHEMA),
    ] = field(default_factory=list)
    imports: Annotated[
        list[str],
        Opt(
            "Python modules imported before plugins are looked up (they may register models, "
            "datasets, callbacks).",
            items={"minLength": 1},
        ),
    ] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Built from Python: what the objects state goes through the loader's one pass
        (normalised, validated, built) and the result is taken back into them."""
        stated: dict[str, object] = {}
        for name, section_type in _SECTION_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a plain mapping is accepted for a section
                stated[name] = value
            elif isinstance(value, section_type):
                stated[name] = value._stated()
            else:
                raise ConfigError(
                    f"{name}: expected a {section_type.__name__} or a mapping, "
                    f"got {type(value).__name__}"
                )
        stated.update(self.plugin_keys)
        for item in declare.declared(type(self)):
            if item.name not in _SECTION_TYPES:
                stated[item.name] = _jsonable(getattr(self, item.name))
        self._adopt(type(self)._resolve(stated))

    def _adopt(self, resolved: SpeedtronicConfig) -> None:
        """Take the values of ``resolved`` (built from what this config states); sections
        given as objects stay those objects."""
        for name in _SECTION_TYPES:
            section, built = getattr(self, name), getattr(resolved, name)
            if isinstance(section, _Section):
                section.__dict__.update(built.__dict__)
            else:
                object.__setattr__(self, name, built)
        for item in declare.declared(type(self)):
            if item.name not in _SECTION_TYPES:
                object.__setattr__(self, item.name, getattr(resolved, item.name))
        self.__dict__["_plugin_keys"] = resolved.plugin_keys
        self.__dict__["_validated"] = resolved.__dict__.get("_validated")

    # -- keys plugins declare ---------------------------------------------------------

    @property
    def plugin_keys(self) -> dict[str, JSONValue]:
        """Top-level keys only plugins declare (``checkpoint``, ...), as plain data."""
        keys = self.__dict__.get("_plugin_keys")
        if keys is None:
            keys = {key: cast(JSONValue, root_default(key)) for key in plugin_root_keys()}
            self.__dict__["_plugin_keys"] = keys
        return cast("dict[str, JSONValue]", keys)

    def __getattr__(self, name: str) -> SectionView | JSONValue:
        """A top-level key a plugin declares: a ``SectionView`` of a section, else the
        value (``cfg.checkpoint.every_steps``, ``cfg.gradient_checkpointing``)."""
        if name.startswith("_"):
            raise AttributeError(name)
        keys = self.plugin_keys
        if name not in keys:
            raise AttributeError(f"SpeedtronicConfig has no section {name!r}")
        value = keys[name]
        return SectionView(name, value) if isinstance(value, dict) else value

    def __setattr__(self, name: str, value: object) -> None:
        if name in _field_names(type(self)) or name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in self.plugin_keys:
            self.plugin_keys[name] = _jsonable(value)
        else:
            raise AttributeError(f"SpeedtronicConfig has no section {name!r}")

    def __eq__(self, other: object) -> bool:
        """Equal when every setting is, the keys plugins declare included."""
        if not isinstance(other, SpeedtronicConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __getstate__(self) -> dict[str, object]:
        """A copy (or another process) validates again: ``ensure_valid`` trusts only what
        was validated here, where the config's ``imports:`` were imported."""
        state = dict(self.__dict__)
        state.pop("_validated", None)
        return state

    def _derive_defaults(self) -> None:
        """The defaults that follow other sections (after validation: the values they
        follow have the same bounds)."""
        if self.data.block_size is None:
            self.data.block_size = self.model.max_seq_len
        if self.data.target_batch_size is None:
            self.data.target_batch_size = self.data.micro_batch_size
        if self.data.vocab_size is None:
            self.data.vocab_size = self.model.vocab_size
        if self.data.seed is None:
            self.data.seed = self.run.seed

    # -- derived values ---------------------------------------------------------------

    @property
    def accumulation_steps(self) -> int:
        """Microbatches per optimizer step (``data.target_batch_size // micro_batch_size``)."""
        return self.data.accumulation_steps

    @property
    def target_steps(self) -> int:
        """The absolute global-step target: ``data.max_steps`` when set, else ``run.max_steps``."""
        return self.run.max_steps if self.data.max_steps is None else self.data.max_steps

    @property
    def scheduler_steps(self) -> int:
        """The LR-schedule horizon: an explicit ``scheduler.max_steps``, else the target."""
        explicit = self.scheduler.max_steps
        return self.target_steps if explicit is None else explicit

    # -- validation and serialisation -------------------------------------------------

    def validate(self) -> SpeedtronicConfig:
        """Check the whole configuration (imports, plugins, schema, cross-field rules);
        raise ``ConfigError`` with every problem. Returns ``self``."""
        data = self.to_dict()
        errors = config_errors(data)
        if errors:
            raise ConfigError(errors)
        self.__dict__["_validated"] = data
        return self

    def ensure_valid(self) -> SpeedtronicConfig:
        """``validate()``, unless nothing changed since this config was last validated
        (built, loaded or ``validate()``d): what the composition root calls, so a config is
        checked once however many builders it passes through. Returns ``self``."""
        if self.__dict__.get("_validated") != self.to_dict():
            self.validate()
        return self

    def to_dict(self, *, redact_secrets: bool = False) -> dict[str, JSONValue]:
        """JSON-compatible data in canonical layout (loads back to an equal config)."""
        values: dict[str, JSONValue] = {
            name: getattr(self, name).to_dict() for name in _SECTION_TYPES
        }
        values.update(copy.deepcopy(self.plugin_keys))
        values["compile"] = self.compile
        values["ooo_backprop"] = self.ooo_backprop
        values["ooo_streams"] = self.ooo_streams
        values["callbacks"] = [spec.to_dict() for spec in self.callbacks]
        values["imports"] = list(self.imports)
        if redact_secrets:
            redacted = _redact(values)
            assert isinstance(redacted, dict)
            return redacted
        return values

    def to_yaml(self, *, redact_secrets: bool = False) -> str:
        """The configuration as YAML (sections in canonical order)."""
        return yaml.safe_dump(
            self.to_dict(redact_secrets=redact_secrets), sort_keys=False, allow_unicode=True
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the configuration, secrets always redacted, atomically: YAML for
        ``.yaml``/``.yml``, JSON otherwise. Returns the path."""
        path = Path(path)
        if path.suffix.lower() in (".yaml", ".yml"):
            text = self.to_yaml(redact_secrets=True)
        else:
            text = json.dumps(self.to_dict(redact_secrets=True), indent=2) + "\n"
        atomic_write_text(path, text)
        return path

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, object] | None = None) -> SpeedtronicConfig:
        """Validate a mapping (shorthands allowed) and build the typed configuration."""
        return cls._resolve(values)

    @classmethod
    def _resolve(cls, raw: object) -> SpeedtronicConfig:
        """The one pass: import the ``imports:`` (a plugin they register rewrites its own
        keys too), normalise (``loading.normalise``), validate once, build."""
        errors = import_errors(raw.get("imports") if isinstance(raw, Mapping) else None)
        data, conflicts = normalise(raw)
        errors.extend(conflicts)
        errors.extend(config_errors(data, imported=True))
        if errors:
            raise ConfigError(errors)
        return cls._build(data)

    @classmethod
    def _build(cls, data: Mapping[str, object]) -> SpeedtronicConfig:
        """The typed configuration of validated, normalised data (nothing is checked)."""
        config = cls.__new__(cls)
        for name, section_type in _SECTION_TYPES.items():
            object.__setattr__(config, name, section_type._from_valid(_as_mapping(data.get(name))))
        compile_value = data.get("compile", False)
        if isinstance(compile_value, Mapping):
            compile_value = compile_value.get("enabled", False)
        object.__setattr__(config, "compile", compile_value is True)
        object.__setattr__(config, "ooo_backprop", data.get("ooo_backprop", False) is True)
        object.__setattr__(config, "ooo_streams", data.get("ooo_streams", 4))
        callbacks = [
            CallbackSpec.from_dict(_as_mapping(entry)) for entry in _as_list(data.get("callbacks"))
        ]
        object.__setattr__(config, "callbacks", callbacks)
        object.__setattr__(
            config, "imports", [str(module) for module in _as_list(data.get("imports"))]
        )
        config.plugin_keys.update(
            (key, _jsonable(data[key])) for key in list(config.plugin_keys) if key in data
        )
        config._derive_defaults()
        config.__dict__["_validated"] = config.to_dict()
        return config

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SpeedtronicConfig:
        """Load a YAML file (an empty file means all defaults)."""
        raw = read_file(path, yaml_only=True)
        return _with_source(lambda: cls.from_dict(raw), str(path))

    @classmethod
    def load(cls, source: ConfigSource = None, overrides: Sequence[str] = ()) -> SpeedtronicConfig:
        """Load from a mapping, a YAML/JSON file path, YAML/JSON text or a config object,
        then apply ``key.path=value`` overrides (before validation)."""
        if isinstance(overrides, str):
            overrides = [overrides]
        if isinstance(source, SpeedtronicConfig):
            if not overrides:
                return source.ensure_valid()
            data = apply_overrides(source.to_dict(), overrides)
            return cls.from_dict(data)
        origin: str | None = None
        if isinstance(source, os.PathLike) or (
            isinstance(source, str) and not looks_like_text(source)
        ):
            origin = str(os.fspath(source))
        data = apply_overrides(read_source(source), overrides)
        return _with_source(lambda: cls.from_dict(data), origin)


class SectionView:
    """Attribute access to a section only plugins declare (``cfg.checkpoint.every_steps``):
    a live view of the plain data in ``SpeedtronicConfig.plugin_keys``. Setting a key
    changes the config; call ``validate()`` afterwards, as for any change."""

    def __init__(self, name: str, values: dict[str, JSONValue]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, key: str) -> JSONValue:
        values: dict[str, JSONValue] = self.__dict__["_values"]
        if key not in values:
            raise AttributeError(f"{self.__dict__['_name']} has no setting {key!r}")
        return values[key]

    def __setattr__(self, key: str, value: object) -> None:
        values: dict[str, JSONValue] = self.__dict__["_values"]
        if key not in values:
            raise AttributeError(f"{self.__dict__['_name']} has no setting {key!r}")
        values[key] = _jsonable(value)

    def to_dict(self) -> dict[str, JSONValue]:
        """The section as plain data (a copy)."""
        return copy.deepcopy(self.__dict__["_values"])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SectionView):
            return self.to_dict() == other.to_dict()
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass sections

    def __repr__(self) -> str:
        values = redact_secrets(self.__dict__["_values"])
        return f"SectionView({self.__dict__['_name']!r}, {values!r})"


ConfigSource: TypeAlias = Mapping[str, object] | str | os.PathLike[str] | SpeedtronicConfig | None
"""What ``load_config`` accepts."""

Config = SpeedtronicConfig
"""Alias kept from the original API."""


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def _redact(values: dict[str, JSONValue]) -> JSONValue:
    return redact_secrets(values)


def _with_source(build: Callable[[], SpeedtronicConfig], origin: str | None) -> SpeedtronicConfig:
    """Run ``build``; a ``ConfigError`` names the file it came from."""
    try:
        return build()
    except ConfigError as exc:
        if origin is None or exc.source is not None:
            raise
        raise ConfigError(exc.errors, source=origin) from None


def load_config(source: ConfigSource = None, overrides: Sequence[str] = ()) -> SpeedtronicConfig:
    """``SpeedtronicConfig.load``: a mapping, YAML/JSON file or text, or a config object,
    with ``key.path=value`` overrides applied before validation."""
    return SpeedtronicConfig.load(source, overrides)


def load_yaml_config(path: str | os.PathLike[str]) -> SpeedtronicConfig:
    """``SpeedtronicConfig.from_yaml``."""
    return SpeedtronicConfig.from_yaml(path)


# -- what the declarations give the loader and the schema ---------------------------------


@dataclass(frozen=True)
class CoreKeys:
    """What the loader reads from the core's declarations (``Opt.shorthand``, ``Opt.fold``,
    ``Opt.fills``)."""

    shorthands: Mapping[str, str]
    """Root key -> the section it is a shorthand of (``max_steps`` -> ``run``)."""
    folds: Mapping[tuple[str, str], declare.Fold]
    """``(section, key)`` of the case-insensitive enumerated strings, and how they fold."""
    fills: Mapping[tuple[str, str], tuple[str, str]]
    """``(section, key)`` -> the key it fills when that is not given (``run.log_every`` ->
    ``logging.every_steps``)."""
    bare_values: Mapping[str, str]
    """Section -> the key a bare value means (``_Section.bare_value``)."""


def core_keys() -> CoreKeys:
    """The loader's tables, from the section declarations."""
    return _CORE_KEYS


def _core_keys() -> CoreKeys:
    shorthands: dict[str, str] = {}
    folds: dict[tuple[str, str], declare.Fold] = {}
    fills: dict[tuple[str, str], tuple[str, str]] = {}
    for name, section_type in _SECTION_TYPES.items():
        for item in declare.documented(section_type):
            if item.opt.shorthand:
                shorthands[item.name] = name
            if item.opt.fold is not None:
                folds[(name, item.name)] = item.opt.fold
            if item.opt.fills is not None:
                section, _, key = item.opt.fills.partition(".")
                fills[(name, item.name)] = (section, key)
    bare_values = {
        name: section_type.bare_value
        for name, section_type in _SECTION_TYPES.items()
        if section_type.bare_value is not None
    }
    return CoreKeys(shorthands, folds, fills, bare_values)


_CORE_KEYS = _core_keys()


def core_schema_document(*, dialect: str, schema_id: str) -> dict[str, object]:
    """The core's part of the run schema, from the declarations: each section a closed
    object of its declared keys, then the root flags, ``callbacks`` and ``imports``."""
    properties: dict[str, object] = {
        "$schema": {"type": "string", "description": "Schema reference for editors; ignored."}
    }
    for name, section_type in _SECTION_TYPES.items():
        properties[name] = {
            "title": name,
            "description": section_type.section_doc,
            **declare.object_schema(section_type),
        }
    for item in declare.declared(SpeedtronicConfig):
        if item.name not in _SECTION_TYPES:
            properties[item.name] = declare.property_schema(item)
    shorthands = ", ".join(_CORE_KEYS.shorthands)
    return {
        "$schema": dialect,
        "$id": schema_id,
        "title": "speedtronic run configuration",
        "description": f"A speedtronic run.yaml. Root shorthands ({shorthands}, and section "
        "aliases that plugins declare) are accepted by the loader and rewritten before "
        "validation.",
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }
