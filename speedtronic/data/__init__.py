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

The package itself imports none of them: each name below loads its module when first asked
for (``from speedtronic.data import BatchStream`` loads ``stream`` alone).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name -> its module. The modules load when a name is first asked for, so that a
# process that uses one part (the engine reads ``stream`` and ``collate``) does not pay for the
# token-shard, mixture and remote-shard readers (and ``filelock``) it never opens.
_EXPORTS: dict[str, str] = {
    "CollateFn": "speedtronic.data.collate",
    "IGNORE_INDEX": "speedtronic.data.collate",
    "batch_size_and_tokens": "speedtronic.data.collate",
    "collate_batch": "speedtronic.data.collate",
    "collate_causal": "speedtronic.data.collate",
    "collate_registry": "speedtronic.data.collate",
    "register_collate": "speedtronic.data.collate",
    "DEFAULT_DATA_SEED": "speedtronic.data.loader",
    "DataSettings": "speedtronic.data.loader",
    "DatasetFactory": "speedtronic.data.loader",
    "DatasetRequest": "speedtronic.data.loader",
    "ProvidesSampler": "speedtronic.data.loader",
    "SYNTHETIC_KINDS": "speedtronic.data.loader",
    "build_dataloader": "speedtronic.data.loader",
    "dataset_registry": "speedtronic.data.loader",
    "has_held_out_split": "speedtronic.data.loader",
    "register_dataset": "speedtronic.data.loader",
    "resolve_collate": "speedtronic.data.loader",
    "resolve_dataset": "speedtronic.data.loader",
    "MixtureDataset": "speedtronic.data.mixture",
    "MixtureSampler": "speedtronic.data.mixture",
    "open_mixture": "speedtronic.data.mixture",
    "ManifestError": "speedtronic.data.shards",
    "ShardError": "speedtronic.data.shards",
    "TokenManifest": "speedtronic.data.shards",
    "check_vocab_fits": "speedtronic.data.shards",
    "read_manifest": "speedtronic.data.shards",
    "verify_shards": "speedtronic.data.shards",
    "BatchStream": "speedtronic.data.stream",
    "EMPTY_SOURCE_MESSAGE": "speedtronic.data.stream",
    "EpochLimitReached": "speedtronic.data.stream",
    "ResumableSampler": "speedtronic.data.stream",
    "infinite_batches": "speedtronic.data.stream",
    "LearnableLanguageDataset": "speedtronic.data.synthetic",
    "SyntheticTokenDataset": "speedtronic.data.synthetic",
    "CharTokenizer": "speedtronic.data.text",
    "DataSourceError": "speedtronic.data.text",
    "SupportsEncode": "speedtronic.data.text",
    "TextFileTokenDataset": "speedtronic.data.text",
    "Tokenizer": "speedtronic.data.text",
    "encode_text": "speedtronic.data.text",
    "MissingExtraError": "speedtronic.data.tokenizer",
    "load_tokenizer": "speedtronic.data.tokenizer",
    "TokenWindowDataset": "speedtronic.data.windows",
    "WindowSampler": "speedtronic.data.windows",
    "open_token_dataset": "speedtronic.data.windows",
}

if TYPE_CHECKING:
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


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        # A submodule by attribute (``speedtronic.data.windows``), as when all of them loaded
        # with the package.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
