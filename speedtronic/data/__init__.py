"""Data for training: tokenizers, datasets, collators, resumable batch streams, the loader.

* ``text`` -- ``CharTokenizer``, the tokenizer protocol, ``TextFileTokenDataset``;
* ``synthetic`` -- ``SyntheticTokenDataset`` (uniform) and ``LearnableLanguageDataset``
  (a Markov language with a known entropy floor);
* ``collate`` -- ``collate_causal``, ``collate_batch``, ``register_collate``,
  ``batch_size_and_tokens``;
* ``stream`` -- ``ResumableSampler``, ``BatchStream``, ``infinite_batches``;
* ``loader`` -- ``build_dataloader`` and the dataset registry;
* ``shards`` -- the token-shard format (``index.json``, ``read_manifest``, ``verify_shards``);
* ``windows`` -- ``TokenWindowDataset`` and ``WindowSampler`` (``data.tokens``);
* ``mixture`` -- ``MixtureDataset`` (``data.mixture``);
* ``tokenizer`` -- ``load_tokenizer`` (a ``tokenizer.json`` or the byte tokenizer);
* ``corpus``, ``prepare`` -- ``speedtronic prepare`` (imported on use).
"""

from __future__ import annotations

from speedtronic.data.collate import (
    IGNORE_INDEX,
    CollateFn,
    batch_size_and_tokens,
    collate_batch,
    collate_causal,
    collate_registry,
    register_collate,
)
from speedtronic.data.loader import (
    DEFAULT_DATA_SEED,
    SYNTHETIC_KINDS,
    DatasetFactory,
    DatasetRequest,
    DataSettings,
    ProvidesSampler,
    build_dataloader,
    dataset_registry,
    has_held_out_split,
    register_dataset,
    resolve_collate,
    resolve_dataset,
)
from speedtronic.data.mixture import MixtureDataset, MixtureSampler, open_mixture
from speedtronic.data.shards import (
    ManifestError,
    ShardError,
    TokenManifest,
    check_vocab_fits,
    read_manifest,
    verify_shards,
)
from speedtronic.data.stream import (
    EMPTY_SOURCE_MESSAGE,
    BatchStream,
    EpochLimitReached,
    ResumableSampler,
    infinite_batches,
)
from speedtronic.data.synthetic import LearnableLanguageDataset, SyntheticTokenDataset
from speedtronic.data.text import (
    CharTokenizer,
    DataSourceError,
    SupportsEncode,
    TextFileTokenDataset,
    Tokenizer,
    encode_text,
)
from speedtronic.data.tokenizer import MissingExtraError, load_tokenizer
from speedtronic.data.windows import TokenWindowDataset, WindowSampler, open_token_dataset

__all__ = [
    "BatchStream",
    "CharTokenizer",
    "CollateFn",
    "DEFAULT_DATA_SEED",
    "DataSettings",
    "DataSourceError",
    "DatasetFactory",
    "DatasetRequest",
    "EMPTY_SOURCE_MESSAGE",
    "EpochLimitReached",
    "IGNORE_INDEX",
    "LearnableLanguageDataset",
    "ManifestError",
    "MissingExtraError",
    "MixtureDataset",
    "MixtureSampler",
    "ProvidesSampler",
    "ResumableSampler",
    "SYNTHETIC_KINDS",
    "ShardError",
    "SupportsEncode",
    "SyntheticTokenDataset",
    "TextFileTokenDataset",
    "TokenManifest",
    "TokenWindowDataset",
    "Tokenizer",
    "WindowSampler",
    "batch_size_and_tokens",
    "build_dataloader",
    "check_vocab_fits",
    "collate_batch",
    "collate_causal",
    "collate_registry",
    "dataset_registry",
    "encode_text",
    "has_held_out_split",
    "infinite_batches",
    "load_tokenizer",
    "open_mixture",
    "open_token_dataset",
    "read_manifest",
    "register_collate",
    "register_dataset",
    "resolve_collate",
    "resolve_dataset",
    "verify_shards",
]
