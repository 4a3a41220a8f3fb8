"""The ``data:`` section and a mixture's sources."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, cast

from speedtronic.config import declare
from speedtronic.config.declare import Opt
from speedtronic.config.section_base import (
    SEED_MAX,
    STEPS_MAX,
    JSONValue,
    Section,
    redacted_repr,
)


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
class DataConfig(Section):
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
        int | Literal["auto"],
        Opt(
            "samples per forward/backward; `auto`: start at `target_batch_size` (no "
            "accumulation) and, on running out of device memory, halve it and double the "
            "accumulation, keeping the global batch (see "
            "[out-of-memory recovery](scale-out.md#out-of-memory-recovery))",
            schema={
                "anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1, "maximum": 2**20}]
            },
            type_text="int ≥ 1 or `auto`",
        ),
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
    def micro_batch(self) -> int:
        """The micro-batch the run starts with: ``micro_batch_size``, or with ``auto`` the
        whole ``target_batch_size`` (1 while it is unset)."""
        if self.micro_batch_size == "auto":
            return self.target_batch_size or 1
        return self.micro_batch_size

    @property
    def accumulation_steps(self) -> int:
        """Microbatches per optimizer step (1 while ``target_batch_size`` is unset)."""
        if self.target_batch_size is None:
            return 1
        return self.target_batch_size // self.micro_batch

    def __repr__(self) -> str:
        return redacted_repr(self)
