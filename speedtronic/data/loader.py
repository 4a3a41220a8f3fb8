"""``build_dataloader`` and the dataset registry.

Source order (first match wins):

1. the ``dataset=`` argument;
2. ``data.tokens`` -> the training shards of a ``speedtronic prepare`` directory
   (``speedtronic.data.windows``), or ``data.mixture`` -> several of them mixed by weight
   (``speedtronic.data.mixture``); the config allows neither beside another source;
3. ``data.text_path`` -> ``TextFileTokenDataset``, through ``data.tokenizer`` (a
   ``tokenizer.json``) when it is set, else the byte tokenizer;
4. ``data.dataset``: a live ``Dataset`` object (programmatic use), or the name of a dataset
   registered with ``register_dataset`` / the ``speedtronic.datasets`` entry-point group.
   A file path is refused: loading a pickled dataset would run arbitrary code;
5. ``data.synthetic: true`` -> ``SyntheticTokenDataset`` (``synthetic_kind: uniform``) or
   ``LearnableLanguageDataset`` (``learnable``), with ``data.num_tokens`` samples;
6. otherwise a ``DataSourceError``.

Held-out data (``speedtronic.data.held_out``): with ``held_out_fraction`` given (evaluation
is on and takes its held-out set from the training source), a text source trains only on
the part of the file before its held-out tail. Token shards never train on their held-out
shards. A registered dataset declared with ``register_dataset(name, held_out=True)`` is
asked for ``DatasetRequest.part`` ``"train"`` / ``"held_out"`` and builds its own split.

Map-style datasets get a ``ResumableSampler`` seeded with ``data.seed`` (or the sampler the
dataset makes itself, ``ProvidesSampler``: token shards), so the shuffled order is
reproducible and a resumed run continues at the exact sample. ``data.shuffle: null`` takes
the dataset's ``default_shuffle`` (on for token shards), else off. The loader also gets
its own ``torch.Generator``, so starting an epoch never touches the global RNG.

Distributed runs (``rank``/``world_size``): map-style data is sharded by the sampler (each
rank a strided share of the same epoch order); iterable data (the text stream) is wrapped in
``RankShardedIterable`` and its DataLoader workers split each rank's share further. The
``data`` batch sizes are per rank: the global batch is ``world_size`` times larger.

Batches are made by ``data.collate`` (``resolve_collate``): by default the collate the dataset
declares, else ``collate_batch``. The loader is a ``FastLoader`` (``speedtronic.data.fast_loader``):
a ``DataLoader`` whose single-process iterator skips torch's per-batch profiler span.

Worker processes (``data.num_workers``) exit on their own when the training process is gone
(killed by SIGKILL, or by a SIGTERM nobody handles), even while the dataset's code hangs:
each worker watches its parent from a thread (``_exit_with_parent``). torch's own check only
runs between samples, so a worker stuck in ``__getitem__`` would otherwise live forever.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypedDict, runtime_checkable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from speedtronic.data.collate import CollateFn, collate_registry
from speedtronic.data.fast_loader import FastLoader
from speedtronic.data.mixture import open_mixture
from speedtronic.data.remote_shards import (
    RemoteShardOptions,
    is_url,
    open_remote_token_dataset,
)
from speedtronic.data.shards import check_vocab_fits
from speedtronic.data.stream import RankShardedIterable, ResumableSampler
from speedtronic.data.synthetic import LearnableLanguageDataset, SyntheticTokenDataset
from speedtronic.data.text import DataSourceError, TextFileTokenDataset, TextPart, Tokenizer
from speedtronic.data.tokenizer import BYTES, load_tokenizer
from speedtronic.data.windows import open_token_dataset
from speedtronic.plugins import DATASET_GROUP, PluginError, PluginRegistry
from speedtronic.user_warnings import warn

__all__ = [
    "DEFAULT_DATA_SEED",
    "DataSettings",
    "DatasetFactory",
    "DatasetRequest",
    "ProvidesSampler",
    "SYNTHETIC_KINDS",
    "build_dataloader",
    "dataset_registry",
    "has_held_out_split",
    "register_dataset",
    "resolve_collate",
    "resolve_dataset",
    "training_dataset",
    "text_tokenizer",
]

DEFAULT_DATA_SEED = 1234
"""Seed used when ``data.seed`` is None (the config normally fills it from ``run.seed``)."""

SYNTHETIC_KINDS = ("uniform", "learnable")

_PICKLE_SUFFIXES = frozenset({".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt"})


class DataSettings(Protocol):
    """The ``data`` config attributes ``build_dataloader`` reads (read-only)."""

    @property
    def text_path(self) -> str | None: ...
    @property
    def dataset(self) -> object:
        """A registered dataset name (str), a live ``Dataset`` object, or None."""

    @property
    def dataset_options(self) -> Mapping[str, object]:
        """Options handed to a named dataset's factory (``DatasetRequest.options``)."""

    @property
    def synthetic(self) -> bool: ...
    @property
    def synthetic_kind(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def block_size(self) -> int | None: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def prefetch_factor(self) -> int | None: ...
    @property
    def pin_memory(self) -> bool | None: ...
    @property
    def shuffle(self) -> bool | None:
        """``None``: the dataset's ``default_shuffle`` (token shards: on), else off."""

    @property
    def drop_last(self) -> bool: ...
    @property
    def seed(self) -> int | None: ...


@dataclass(frozen=True)
class DatasetRequest:
    """What a dataset factory is asked for. ``options`` are the factory's own settings
    (``data.dataset_options`` in config)."""

    block_size: int
    vocab_size: int | None
    seed: int
    num_samples: int
    options: Mapping[str, object] = field(default_factory=dict)
    part: TextPart = "all"
    """``"all"``; or, for a factory registered with ``held_out=True`` (the built-in ones
    too), ``"train"`` / ``"held_out"``: the training part or the held-out split of the same
    source."""
    held_out_fraction: float = 0.05
    """The share of a text file that is the held-out split (``eval.fraction``)."""


_HELD_OUT_DATASETS: set[str] = set()
"""Registered datasets whose factories build a held-out split (``DatasetRequest.part``)."""


def has_held_out_split(name: str) -> bool:
    """Whether the dataset registered as ``name`` builds its own held-out split."""
    if name in dataset_registry:
        dataset_registry.get(name)  # an entry point's module declares it when imported
    return name in _HELD_OUT_DATASETS


@runtime_checkable
class ProvidesSampler(Protocol):
    """A map-style dataset that makes its own ``ResumableSampler`` (token shards: an order
    that needs no permutation in memory, a mixture's draws)."""

    def make_sampler(
        self, *, shuffle: bool, seed: int, rank: int, world_size: int
    ) -> ResumableSampler: ...


DatasetFactory = Callable[[DatasetRequest], Dataset[object]]
"""Builds a map-style or iterable dataset for a request."""

dataset_registry: PluginRegistry[DatasetFactory] = PluginRegistry("dataset", DATASET_GROUP)
"""Datasets by the name used in ``data.dataset``."""


_DATASET_COLLATES: dict[str, str | CollateFn] = {}
"""The collate each registered dataset declares (``register_dataset(collate=...)``)."""


def register_dataset(
    name: str, *, collate: str | CollateFn | None = None, held_out: bool = False
) -> Callable[[DatasetFactory], DatasetFactory]:
    """Decorator: make ``factory(request) -> Dataset`` usable as ``data.dataset: <name>``.
    ``collate`` is how its items become batches (a ``data.collate`` name or a function),
    used unless the config sets ``data.collate``. ``held_out=True``: the factory builds its
    own held-out split -- it is asked for ``request.part == "train"`` (what to train on
    while evaluation is on) and ``"held_out"`` (what ``eval:`` reads), so no
    ``eval.dataset`` is needed; without it the whole dataset is training data."""
    if collate is None:
        _DATASET_COLLATES.pop(name, None)
    else:
        _DATASET_COLLATES[name] = collate
    if held_out:
        _HELD_OUT_DATASETS.add(name)
    else:
        _HELD_OUT_DATASETS.discard(name)
    return dataset_registry.register(name)


def resolve_collate(choice: str, dataset_name: object = None, dataset: object = None) -> CollateFn:
    """The collate function of a loader: ``data.collate`` when it is not ``auto``, else the
    one the dataset declares (``register_dataset(collate=...)`` or a ``collate_fn``
    attribute of the dataset object), else ``collate_batch``."""
    declared: str | CollateFn | None = None
    if choice == "auto":
        if isinstance(dataset_name, str):
            declared = _DATASET_COLLATES.get(dataset_name)
        if declared is None:
            attribute = getattr(dataset, "collate_fn", None)
            declared = attribute if callable(attribute) else None
    chosen = choice if declared is None else declared
    if callable(chosen):
        return chosen
    try:
        return collate_registry.get(chosen)
    except PluginError as exc:
        raise DataSourceError(f"data.collate: {exc}") from None


def _options(request: DatasetRequest, allowed: frozenset[str], dataset: str) -> None:
    unknown = sorted(set(request.options) - allowed)
    if unknown:
        known = ", ".join(sorted(allowed)) or "none"
        raise DataSourceError(f"dataset {dataset!r}: unknown option(s) {unknown} (known: {known})")


def _required_vocab(request: DatasetRequest, dataset: str) -> int:
    if request.vocab_size is None:
        raise DataSourceError(f"dataset {dataset!r} needs a vocab_size (data.vocab_size)")
    return request.vocab_size


@register_dataset("synthetic", held_out=True)
def _synthetic(request: DatasetRequest) -> Dataset[object]:
    """Uniform random tokens (``SyntheticTokenDataset``); no options."""
    _options(request, frozenset(), "synthetic")
    return SyntheticTokenDataset(
        num_samples=request.num_samples,
        block_size=request.block_size,
        vocab_size=_required_vocab(request, "synthetic"),
        seed=request.seed,
        held_out=request.part == "held_out",
    )


@register_dataset("learnable", held_out=True)
def _learnable(request: DatasetRequest) -> Dataset[object]:
    """The Markov language (``LearnableLanguageDataset``); options ``branching``,
    ``concentration``."""
    _options(request, frozenset({"branching", "concentration"}), "learnable")
    branching = request.options.get("branching")
    concentration = request.options.get("concentration", 1.0)
    if branching is not None and not isinstance(branching, int):
        raise DataSourceError(f"dataset 'learnable': branching must be an int, got {branching!r}")
    if not isinstance(concentration, (int, float)):
        raise DataSourceError(
            f"dataset 'learnable': concentration must be a number, got {concentration!r}"
        )
    return LearnableLanguageDataset(
        num_samples=request.num_samples,
        block_size=request.block_size,
        vocab_size=_required_vocab(request, "learnable"),
        seed=request.seed,
        branching=branching,
        concentration=float(concentration),
        held_out=request.part == "held_out",
    )


@register_dataset("text", held_out=True)
def _text(request: DatasetRequest) -> Dataset[object]:
    """A UTF-8 file through the byte tokenizer; option ``path`` (required)."""
    _options(request, frozenset({"path"}), "text")
    path = request.options.get("path")
    if not isinstance(path, (str, Path)):
        raise DataSourceError("dataset 'text' needs options.path, the UTF-8 file to read")
    vocab = 256 if request.vocab_size is None else request.vocab_size
    return TextFileTokenDataset(
        path,
        request.block_size,
        vocab_size=vocab,
        part=request.part,
        held_out_fraction=request.held_out_fraction,
    )


def _block_size(config: DataSettings) -> int:
    if config.block_size is None:
        raise DataSourceError("data.block_size is not set (it defaults to model.max_seq_len)")
    return config.block_size


def _looks_like_file(name: str) -> bool:
    path = Path(name)
    return path.suffix.lower() in _PICKLE_SUFFIXES or "/" in name or "\\" in name or path.exists()


def _named_dataset(name: str, request: DatasetRequest) -> Dataset[object]:
    if name in dataset_registry:
        built = dataset_registry.get(name)(request)
        if not isinstance(built, Dataset):
            raise TypeError(
                f"dataset factory {name!r} returned {type(built).__name__}, not a torch Dataset"
            )
        return built
    if _looks_like_file(name):
        raise DataSourceError(
            f"data.dataset: {name!r} looks like a file; loading pickled dataset files is "
            "refused because unpickling runs arbitrary code. Register a dataset factory with "
            "speedtronic.data.register_dataset and give its name here, or use data.text_path"
        )
    raise DataSourceError(f"data.dataset: {dataset_registry.unknown(name)}")


def _dataset_options(config: DataSettings) -> Mapping[str, object]:
    options = config.dataset_options
    if not isinstance(options, Mapping):
        raise DataSourceError(f"data.dataset_options must be a mapping, got {options!r}")
    return options


def _setting(config: DataSettings, name: str, default: object) -> object:
    """A ``data`` key added after ``DataSettings`` was published (``tokens``, ``mixture``,
    ``tokenizer``, ``verify_shards``, ``collate``): settings objects without it keep working."""
    return getattr(config, name, default)


def text_tokenizer(config: DataSettings, vocab: int | None) -> Tokenizer | None:
    """The tokenizer ``data.tokenizer`` names for text files (``None``: the byte tokenizer),
    checked against the model's vocabulary ``vocab``."""
    spec = _setting(config, "tokenizer", None)
    if not isinstance(spec, str) or spec == BYTES:
        return None
    loaded = load_tokenizer(spec)
    if vocab is not None:
        check_vocab_fits(loaded.vocab_size, vocab, source=f"data.tokenizer: {spec}")
    return loaded


def _text_vocab(tokenizer: Tokenizer | None, vocab: int | None) -> int:
    if vocab is not None:
        return vocab
    own = getattr(tokenizer, "vocab_size", None)
    return own if isinstance(own, int) else 256


def _token_shards(
    config: DataSettings, *, part: TextPart, vocab: int | None, seed: int
) -> Dataset[object] | None:
    """``data.tokens`` or ``data.mixture`` (their training or held-out shards), or None."""
    tokens = _setting(config, "tokens", None)
    mixture = _setting(config, "mixture", None)
    if not tokens and not mixture:
        if _setting(config, "document_mask", False) is True:
            raise DataSourceError(
                "data.document_mask applies to token shards: set data.tokens or data.mixture"
            )
        return None
    spec = _setting(config, "tokenizer", None)
    tokenizer = spec if isinstance(spec, str) else None
    verify = _setting(config, "verify_shards", True) is not False
    common: _ShardArguments = {
        "block_size": _block_size(config),
        "part": part,
        "vocab_size": vocab,
        "tokenizer": tokenizer,
        "verify": verify,
        "document_mask": _setting(config, "document_mask", False) is True,
    }
    if is_url(tokens):
        assert isinstance(tokens, str)
        arguments = {key: value for key, value in common.items() if key != "verify"}
        return open_remote_token_dataset(tokens, _remote_options(config), **arguments)  # type: ignore[arg-type]  # _ShardArguments minus verify
    if isinstance(tokens, (str, Path)) and tokens:
        return open_token_dataset(tokens, **common)
    entries = [_mixture_entry(index, entry) for index, entry in enumerate(_sequence(mixture))]
    return open_mixture(entries, seed=seed, **common)


class _ShardArguments(TypedDict):
    block_size: int
    part: TextPart
    vocab_size: int | None
    tokenizer: str | None
    verify: bool
    document_mask: bool


def _remote_options(config: DataSettings) -> RemoteShardOptions:
    """How ``data.tokens`` at a URL is read (``speedtronic.data.remote_shards``)."""
    storage = _setting(config, "storage_options", {})
    cache = _setting(config, "shard_cache", None)
    return RemoteShardOptions(
        storage_options=dict(storage) if isinstance(storage, Mapping) else {},
        cache=cache if isinstance(cache, str) else None,
        cache_bytes=int(str(_setting(config, "shard_cache_bytes", 16 << 30))),
        prefetch=int(str(_setting(config, "shard_prefetch", 4))),
    )


def _sequence(value: object) -> Sequence[object]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return value
    raise DataSourceError(f"data.mixture must be a list of sources, got {value!r}")


def _mixture_entry(index: int, entry: object) -> tuple[str, float]:
    """``(directory, weight)`` of a ``data.mixture`` entry (a ``MixtureSource`` or a mapping)."""
    if isinstance(entry, Mapping):
        tokens, weight = entry.get("tokens"), entry.get("weight", 1.0)
    else:
        tokens, weight = getattr(entry, "tokens", None), getattr(entry, "weight", 1.0)
    if not isinstance(tokens, (str, Path)) or not str(tokens):
        raise DataSourceError(f"data.mixture[{index}].tokens must name a shard directory")
    if is_url(tokens):
        raise DataSourceError(
            f"data.mixture[{index}].tokens: {tokens} is a URL; shards in object storage are "
            "read through data.tokens (a mixture reads local shard directories)"
        )
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise DataSourceError(f"data.mixture[{index}].weight must be a positive number")
    return str(tokens), float(weight)


def resolve_dataset(
    config: DataSettings,
    *,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
    part: TextPart = "all",
    held_out_fraction: float = 0.05,
) -> Dataset[object]:
    """The dataset ``config`` selects (source order in the module docstring). ``part``
    ``"train"``/``"held_out"`` selects the training part or the held-out split of the
    source (``DatasetRequest.part``); a named dataset not registered with ``held_out=True``
    has no held-out split of its own (``DataSourceError`` when ``"held_out"`` is asked of
    it). ``tokenizer`` (a Python object) wins over ``data.tokenizer`` for a text file."""
    vocab = vocab_size if vocab_size is not None else config.vocab_size
    seed = config.seed if config.seed is not None else DEFAULT_DATA_SEED
    shards = _token_shards(config, part=part, vocab=vocab, seed=seed)
    if shards is not None:
        return shards
    if config.text_path:
        if tokenizer is None:
            tokenizer = text_tokenizer(config, vocab)
        text_vocab = _text_vocab(tokenizer, vocab)
        return TextFileTokenDataset(
            config.text_path,
            _block_size(config),
            tokenizer,
            text_vocab,
            part=part,
            held_out_fraction=held_out_fraction,
        )
    named = config.dataset
    if isinstance(named, Dataset):
        if part == "held_out":
            raise DataSourceError(
                "a Dataset object given as data.dataset has no held-out split: pass the "
                "held-out data yourself (Trainer(eval_data=...))"
            )
        return named
    if isinstance(named, str):
        if part != "all" and not has_held_out_split(named):
            if part == "train":
                part = "all"  # the user's dataset is all training data
            else:
                raise DataSourceError(
                    f"data.dataset {named!r} has no held-out split of its own (it was not "
                    "registered with register_dataset(..., held_out=True)): name the held-out "
                    "set with eval.dataset (and eval.dataset_options) or eval.text_path"
                )
        request = DatasetRequest(
            block_size=_block_size(config),
            vocab_size=vocab,
            seed=seed,
            num_samples=config.num_tokens,
            options=_dataset_options(config),
            part=part,
            held_out_fraction=held_out_fraction,
        )
        return _named_dataset(named, request)
    if named is not None:
        raise DataSourceError(
            f"data.dataset must be a dataset name or a Dataset, got {type(named).__name__}"
        )
    if config.synthetic:
        kind = config.synthetic_kind
        if kind not in SYNTHETIC_KINDS:
            raise DataSourceError(
                f"data.synthetic_kind must be one of {list(SYNTHETIC_KINDS)}, got {kind!r}"
            )
        if vocab is None:
            raise DataSourceError("synthetic data needs a vocab size (data.vocab_size)")
        dataset_type = SyntheticTokenDataset if kind == "uniform" else LearnableLanguageDataset
        return dataset_type(
            num_samples=config.num_tokens,
            block_size=_block_size(config),
            vocab_size=vocab,
            seed=seed,
            held_out=part == "held_out",
        )
    raise DataSourceError(
        "no data source: set data.tokens, data.mixture, data.text_path, data.dataset, or "
        "data.synthetic: true"
    )


_PARENT_POLL_S = 0.5
"""How often a DataLoader worker checks that the training process still exists."""


def _exit_with_parent(worker_id: int) -> None:
    """``worker_init_fn``: exit this worker (at once) once its parent process is gone."""
    del worker_id
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="speedtronic-parent-watch", daemon=True).start()


def training_dataset(
    config: DataSettings,
    *,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
    held_out_fraction: float | None = None,
) -> Dataset[object]:
    """The dataset ``build_dataloader`` trains on: all of the source, or its training part
    when ``held_out_fraction`` is given (evaluation on the source's own held-out split).
    Building it reads nothing yet; ``DataSourceError`` when the source cannot be."""
    return resolve_dataset(
        config,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        part="all" if held_out_fraction is None else "train",
        held_out_fraction=0.05 if held_out_fraction is None else held_out_fraction,
    )


def build_dataloader(
    config: DataSettings,
    *,
    dataset: Dataset[object] | None = None,
    tokenizer: Tokenizer | None = None,
    pin_memory_device: bool = False,
    vocab_size: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    held_out_fraction: float | None = None,
) -> DataLoader[object]:
    """The training ``DataLoader`` for the ``data`` config section (module docstring).

    ``vocab_size`` overrides ``data.vocab_size`` (the runtime passes the model's);
    ``pin_memory_device`` is the pin_memory default when ``data.pin_memory`` is None;
    ``rank`` and ``world_size`` select this rank's shard of the data; ``held_out_fraction``
    (evaluation on the held-out split of this source) keeps a text file's tail out of it.
    """
    source = (
        dataset
        if dataset is not None
        else training_dataset(
            config,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            held_out_fraction=held_out_fraction,
        )
    )
    seed = config.seed if config.seed is not None else DEFAULT_DATA_SEED
    workers = config.num_workers
    collate = resolve_collate(
        str(getattr(config, "collate", "auto")),
        config.dataset if dataset is None else None,
        source,
    )
    sampler: ResumableSampler | None = None
    if isinstance(source, IterableDataset):
        if config.shuffle:
            warn(
                "data.shuffle is ignored for an iterable dataset (it streams in file order)",
            )
        if world_size > 1:
            source = RankShardedIterable(source, rank=rank, world_size=world_size)
    elif isinstance(source, Sized):
        shuffle = config.shuffle
        if shuffle is None:
            shuffle = getattr(source, "default_shuffle", False) is True
        if isinstance(source, ProvidesSampler):
            sampler = source.make_sampler(
                shuffle=shuffle, seed=seed, rank=rank, world_size=world_size
            )
        else:
            sampler = ResumableSampler(
                len(source), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size
            )
    else:
        raise TypeError(
            f"map-style dataset {type(source).__name__} needs __len__ (for its sampler)"
        )
    return FastLoader(
        source,
        batch_size=config.micro_batch,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=config.pin_memory if config.pin_memory is not None else pin_memory_device,
        drop_last=config.drop_last,
        generator=torch.Generator().manual_seed(seed & ((1 << 64) - 1)),
        prefetch_factor=(config.prefetch_factor or 2) if workers > 0 else None,
        persistent_workers=workers > 0,
        worker_init_fn=_exit_with_parent if workers > 0 else None,
    )
