"""Token shards in object storage: ``data: {tokens: s3://bucket/shards/}`` (any fsspec URL,
``file://`` too).

The manifest (``index.json``) is read from the URL and checked like a local one; the shards
are read from a bounded local cache (``speedtronic.data.shard_cache``: ``data.shard_cache``,
``data.shard_cache_bytes``) that downloads each one when it is first read, verifies its
sha256 (every manifest records one; a shard whose bytes differ is never used) and evicts the
least recently used. The windows, their order and the data position are those of the same
shards on local disk (``speedtronic.data.windows``): the same exact resume.

Prefetching. The sampler is the shard set's ``WindowSampler`` with one addition: whenever it
computes the next block of its order (``ORDER_BLOCK`` positions), it hands the shards that
block and the one after it read, in the order they are first read, to a background thread
that downloads the first ``data.shard_prefetch`` of them not cached yet. The sampler runs in
the training process (DataLoader workers only read), so one thread per rank prefetches, and
the ranks of a node share what it fetched through the cache.

Faults. Every store operation is retried (``tenacity``, jittered exponential backoff,
``data.shard_attempts`` tries): a lost connection, a shard whose downloaded bytes are
damaged (downloaded again), then one ``ShardError`` naming the shard's URL. A full cache
disk is one ``ShardCacheFull`` error at once (exit 2 from the CLI).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar, overload

import numpy as np
import numpy.typing as npt

from speedtronic.data.shard_cache import ShardCache, ShardCacheFull, default_cache_directory
from speedtronic.data.shards import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ManifestError,
    ShardEntry,
    ShardError,
    Split,
    TokenManifest,
    parse_manifest,
)
from speedtronic.data.text import DataSourceError, TextPart
from speedtronic.data.window_order import ORDER_BLOCK, WindowSampler
from speedtronic.data.windows import (
    DEFAULT_RESIDENT_BYTES,
    TokenWindowDataset,
    _Maps,
    checked_split,
)

if TYPE_CHECKING:
    from fsspec.spec import AbstractFileSystem

__all__ = ["RemoteShardOptions", "is_url", "open_remote_token_dataset"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_COPY_CHUNK = 8 << 20
"""Bytes read from the store per call while downloading a shard."""


def is_url(spec: object) -> bool:
    """Whether a ``data.tokens`` value names an fsspec URL rather than a local directory."""
    return isinstance(spec, str) and "://" in spec


@dataclass(frozen=True)
class RemoteShardOptions:
    """How shards at a URL are read (the ``data`` options of the same names)."""

    storage_options: Mapping[str, object] = field(default_factory=dict)
    cache: str | None = None
    """The cache directory; None: ``default_cache_directory()``."""
    cache_bytes: int = 16 << 30
    prefetch: int = 4
    attempts: int = 4
    backoff_s: float = 0.5


class _RemoteShardSet:
    """The shard set at ``url``: its manifest, and its shards through a ``ShardCache``."""

    def __init__(self, url: str, options: RemoteShardOptions, *, key: str = "data.tokens") -> None:
        try:
            import fsspec.core
        except ImportError as exc:
            raise DataSourceError(
                f"{key}: {url} needs fsspec (and s3fs for s3://): pip install 'speedtronic[remote]'"
            ) from exc
        self.url = url.rstrip("/")
        self.key = key
        self.options = options
        try:
            fs, root = fsspec.core.url_to_fs(self.url, **dict(options.storage_options))
        except ImportError as exc:
            raise DataSourceError(
                f"{key}: {url}: {exc}: pip install 'speedtronic[remote]'"
            ) from None
        except Exception as exc:  # an unknown protocol, a bad storage option
            raise DataSourceError(
                f"{key}: {url} cannot be opened: {type(exc).__name__}: {exc}"
            ) from None
        self.fs: AbstractFileSystem = fs
        self.root = str(root).rstrip("/")
        self.cache = ShardCache(options.cache or default_cache_directory(), options.cache_bytes)

    def __getstate__(self) -> dict[str, object]:
        return dict(self.__dict__)  # fsspec file systems pickle (DataLoader workers)

    def _retrying(self, what: str, operation: Callable[[], _T]) -> _T:
        from tenacity import (
            Retrying,
            retry_if_not_exception_type,
            stop_after_attempt,
            wait_random_exponential,
        )

        retrying = Retrying(
            stop=stop_after_attempt(self.options.attempts),
            wait=wait_random_exponential(multiplier=self.options.backoff_s, max=30.0),
            retry=retry_if_not_exception_type((ShardCacheFull, ManifestError, FileNotFoundError)),
            before_sleep=lambda state: logger.warning(
                "%s: %s failed (try %d of %d, %s); retrying",
                self.key,
                what,
                state.attempt_number,
                self.options.attempts,
                type(state.outcome.exception()).__name__ if state.outcome else "?",
            ),
            reraise=True,
        )
        return retrying(operation)

    def read_manifest(self) -> TokenManifest:
        where = f"{self.key}: {self.url}/{MANIFEST_NAME}"

        def read() -> bytes:
            with self.fs.open(f"{self.root}/{MANIFEST_NAME}", "rb") as handle:
                data: bytes = handle.read(MAX_MANIFEST_BYTES + 1)
                return data

        try:
            data = self._retrying("reading the manifest", read)
        except FileNotFoundError:
            raise ManifestError(
                f"{where} is missing: {self.url} is not a set of token shards (upload the "
                "directory speedtronic prepare wrote)"
            ) from None
        except Exception as exc:
            raise ManifestError(f"{where} cannot be read: {type(exc).__name__}: {exc}") from None
        manifest = parse_manifest(data, where)
        if b'"loss_masks"' in data:
            raise ManifestError(
                f"{where}: fine-tuning shards with loss masks are read from a local directory "
                "only; copy them to local disk"
            )
        return manifest

    def local(self, shard: ShardEntry, manifest: TokenManifest) -> Path:
        """The shard in the cache, downloaded and verified if need be (``ShardError``
        naming its URL when every try failed)."""
        size = shard.tokens * manifest.numpy_dtype.itemsize
        found = self.cache.lookup(shard, size)
        if found is not None:
            return found
        where = f"{self.key}: {self.url}/{shard.file}"

        def download(out: BinaryIO) -> None:
            with self.fs.open(f"{self.root}/{shard.file}", "rb", block_size=_COPY_CHUNK) as source:
                while chunk := source.read(_COPY_CHUNK):
                    out.write(chunk)

        def fetch() -> Path:
            return self.cache.fetch(shard, size, manifest.numpy_dtype, download, where)

        try:
            path = self._retrying(f"downloading {shard.file}", fetch)
        except ShardCacheFull:
            raise
        except ShardError as exc:
            raise ShardError(f"{exc} ({self.options.attempts} tries)") from None
        except FileNotFoundError:
            raise ShardError(f"{where} is missing (index.json lists it); upload it again") from None
        except Exception as exc:
            raise ShardError(
                f"{where} could not be downloaded after {self.options.attempts} tries: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        return path


class _CachedPaths(Sequence[Path]):
    """The local paths of a dataset's shards, each fetched into the cache when first asked
    for (``_Maps`` asks when it maps a shard)."""

    def __init__(self, dataset: _RemoteTokenWindowDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset.shards)

    @overload
    def __getitem__(self, index: int) -> Path: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Path]: ...
    def __getitem__(self, index: int | slice) -> Path | Sequence[Path]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        dataset = self.dataset
        return dataset.remote.local(dataset.shards[index], dataset.manifest)


class _Prefetcher:
    """Downloads the shards it is asked for, in order, on one daemon thread."""

    def __init__(self, dataset: _RemoteTokenWindowDataset) -> None:
        self.dataset = dataset
        self._wanted: list[int] = []
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None

    def want(self, shards: Sequence[int]) -> None:
        with self._condition:
            self._wanted = list(shards)
            self._condition.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="speedtronic-shard-prefetch", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        dataset = self.dataset
        while True:
            with self._condition:
                while not self._wanted:
                    self._condition.wait()
                shard = self._wanted.pop(0)
            try:
                dataset.remote.local(dataset.shards[shard], dataset.manifest)
            except Exception as exc:  # the reader fetches it again and reports what fails
                logger.debug("prefetching shard %d failed: %s", shard, exc)


class _PrefetchingSampler(WindowSampler):
    """The shard set's ``WindowSampler`` that tells the prefetcher what its next blocks read."""

    dataset: _RemoteTokenWindowDataset | None = None
    """Set by ``_RemoteTokenWindowDataset.make_sampler``."""

    def __iter__(self) -> Iterator[int]:
        dataset = self.dataset
        if self.dataset_len == 0 or dataset is None:
            yield from super().__iter__()
            return
        blocks = range(self.start, self.num_samples, ORDER_BLOCK)
        upcoming = self._block(blocks[0]) if blocks else None
        for begin in blocks:
            current = upcoming
            assert current is not None
            following = begin + ORDER_BLOCK
            upcoming = self._block(following) if following < self.num_samples else None
            dataset.prefetch(current, upcoming)
            yield from current.tolist()

    def _block(self, begin: int) -> npt.NDArray[np.int64]:
        end = min(begin + ORDER_BLOCK, self.num_samples)
        positions = self.rank + self.world_size * np.arange(begin, end, dtype=np.int64)
        return self._indices(positions % self.dataset_len)


class _RemoteTokenWindowDataset(TokenWindowDataset):
    """``TokenWindowDataset`` over shards at a URL, read through the cache (module docstring)."""

    sampler_type = _PrefetchingSampler

    def __init__(
        self,
        remote: _RemoteShardSet,
        manifest: TokenManifest,
        shards: Sequence[ShardEntry],
        block_size: int,
        *,
        document_mask: bool = False,
    ) -> None:
        self.remote = remote
        self._prefetcher: _Prefetcher | None = None
        super().__init__(
            remote.cache.directory,
            manifest,
            shards,
            block_size,
            resident_bytes=DEFAULT_RESIDENT_BYTES,
            document_mask=document_mask,
        )

    def _new_maps(self) -> _Maps:
        return _Maps(
            _CachedPaths(self),
            [shard.tokens for shard in self.shards],
            self.manifest.numpy_dtype,
            self._resident_bytes,
        )

    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        state["_prefetcher"] = None  # a worker reads; the training process prefetches
        return state

    def make_sampler(
        self, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1
    ) -> WindowSampler:
        sampler = super().make_sampler(shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
        assert isinstance(sampler, _PrefetchingSampler)
        sampler.dataset = self
        return sampler

    def prefetch(
        self, current: npt.NDArray[np.int64], upcoming: npt.NDArray[np.int64] | None
    ) -> None:
        """Queue the first ``prefetch`` uncached shards that ``current`` and then
        ``upcoming`` (window indices) read, in the order they are first read."""
        limit = self.remote.options.prefetch
        if limit <= 0:
            return
        windows = current if upcoming is None else np.concatenate([current, upcoming])
        shards = np.searchsorted(self._starts, windows, side="right") - 1
        _, first = np.unique(shards, return_index=True)
        itemsize = self.manifest.numpy_dtype.itemsize
        wanted = []
        for shard in shards[np.sort(first)].tolist():
            entry = self.shards[shard]
            if self.remote.cache.lookup(entry, entry.tokens * itemsize) is None:
                wanted.append(shard)
                if len(wanted) >= limit:
                    break
        if wanted:
            if self._prefetcher is None:
                self._prefetcher = _Prefetcher(self)
            self._prefetcher.want(wanted)


def open_remote_token_dataset(
    url: str,
    options: RemoteShardOptions,
    *,
    block_size: int,
    part: TextPart = "all",
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    key: str = "data.tokens",
    document_mask: bool = False,
) -> _RemoteTokenWindowDataset:
    """The windows of the shard set at ``url`` (as ``open_token_dataset`` for a local one):
    the manifest is read and checked now; each shard is downloaded and verified when it is
    first read (or prefetched)."""
    remote = _RemoteShardSet(url, options, key=key)
    manifest = remote.read_manifest()
    where = f"{key}: {url}"
    split: Split = "eval" if part == "held_out" else "train"
    shards = checked_split(manifest, url, where, split, vocab_size, tokenizer)
    dataset = _RemoteTokenWindowDataset(
        remote, manifest, shards, block_size, document_mask=document_mask
    )
    if len(dataset) == 0:
        raise DataSourceError(
            f"{where}: its shards hold {dataset.tokens} tokens, not one window of "
            f"block_size + 1 = {block_size + 1} tokens"
        )
    return dataset
