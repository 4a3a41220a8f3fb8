"""Data for training: tokenizers, datasets, collators, resumable batch streams, the loader.

* ``text`` -- ``CharTokenizer``, the tokenizer protocol, ``TextFileTokenDataset``;
* ``synthetic`` -- ``SyntheticTokenDataset`` (uniform) and ``LearnableLanguageDataset``
  (a Markov language with a known entropy floor);
* ``collate`` -- ``collate_causal``, ``collate_batch``, ``register_collate``,
  ``batch_size_and_tokens``;
* ``stream`` -- ``ResumableSampler``, ``BatchStream``, ``infinite_batches``;
* ``loader`` -- ``build_dataloader`` and the dataset registry.
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
    build_dataloader,
    dataset_registry,
    register_dataset,
    resolve_collate,
    resolve_dataset,
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

__all__ = [
    "DEFAULT_DATA_SEED",
    "EMPTY_SOURCE_MESSAGE",
    "IGNORE_INDEX",
    "SYNTHETIC_KINDS",
    "BatchStream",
    "CharTokenizer",
    "CollateFn",
    "DataSettings",
    "DataSourceError",
    "DatasetFactory",
    "DatasetRequest",
    "EpochLimitReached",
    "LearnableLanguageDataset",
    "ResumableSampler",
    "SupportsEncode",
    "SyntheticTokenDataset",
    "TextFileTokenDataset",
    "Tokenizer",
    "batch_size_and_tokens",
    "build_dataloader",
    "collate_batch",
    "collate_causal",
    "collate_registry",
    "dataset_registry",
    "encode_text",
    "infinite_batches",
    "register_collate",
    "register_dataset",
    "resolve_collate",
    "resolve_dataset",
]
