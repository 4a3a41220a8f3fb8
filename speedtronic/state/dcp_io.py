"""How ``torch.distributed.checkpoint`` (DCP) reads and writes a sharded checkpoint's files.

``speedtronic.state.sharded_checkpoint`` decides the layout, the manifest and the commit; this
module is the DCP plumbing underneath it, which closes two holes DCP leaves open:

* **Reading runs no pickle.** DCP's default planner unpickles every non-tensor record of a
  ``.distcp`` shard (``BytesStorageMetadata``: optimizer settings and the like) with
  ``torch.load(weights_only=False)``, and its file-system reader unpickles ``.metadata`` with
  ``pickle.load``: a record replaced by a pickle that calls ``os.system`` would run on
  resume. ``load`` therefore runs ``dcp.load`` with ``_RestrictedReader`` and
  ``_RestrictedLoadPlanner``: every record -- tensor or bytes -- and ``.metadata`` go through
  ``speedtronic.state.safe_load.restricted_load`` (``.metadata`` allowing DCP's own metadata
  dataclasses and nothing else), and ``.metadata`` is then checked field by field
  (``read_metadata``): every record must lie in a shard file named the way DCP names them
  (``__<rank>_<n>.distcp``, so nothing outside the directory is ever opened), at a
  non-negative offset and length, with no stream transforms (which would decompress
  unbounded data). Shard files are opened without following symlinks.
* **Writing never follows a planted link.** ``BoundDirectory`` holds the temp directory a
  save writes (created exclusively by rank 0) open by descriptor; DCP's file system is
  replaced by one bound to it (``BoundWriter``), so every file -- the shards, ``.metadata``
  (written with ``torch.save``, not DCP's pickle), ``state.pt``, the manifest -- is created
  exclusively (``O_CREAT|O_EXCL|O_NOFOLLOW``) *in that directory*, even if its name is
  moved or replaced by a symlink while the save runs.

Importing ``torch.distributed.checkpoint`` costs ~0.7 s, so ``sharded_checkpoint`` imports
this module only when it reads or writes a sharded checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import reprlib
import stat
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from speedtronic.state.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    first_line,
)
from speedtronic.state.safe_load import SafeGlobal, restricted_load

__all__ = [
    "METADATA_NAME",
    "BoundDirectory",
    "BoundWriter",
    "check_bytes_records",
    "describe_failures",
    "load",
    "open_no_follow",
    "read_metadata",
    "save",
]

METADATA_NAME = ".metadata"
_SHARD_FILE = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")
"""The name of a rank's shard file, as DCP writes them (rank, then file number)."""
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NON_BLOCKING = getattr(os, "O_NONBLOCK", 0)  # only so that opening a FIFO cannot hang
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CHUNK = 16 * 1024 * 1024


def _metadata_classes() -> list[SafeGlobal]:
    """The classes a ``.metadata`` may hold: DCP's own metadata dataclasses, no others."""
    from torch.distributed.checkpoint import metadata

    return [
        metadata.Metadata,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
    ]


def open_no_follow(path: Path) -> BinaryIO:
    """``open(path, "rb")`` of a regular file: ``OSError`` for a symlink, and for a FIFO or
    a device (opened without blocking, then refused: reading one could wait forever)."""
    return _regular(os.open(path, os.O_RDONLY | _NO_FOLLOW | _NON_BLOCKING), path)


def _regular(descriptor: int, path: str | os.PathLike[str]) -> BinaryIO:
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return open(descriptor, "rb")


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns that it "assumes" a single process whenever there is no process group;
    here that is the intent (one process is one shard), so the warning says nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable")
        yield


# -- writing -------------------------------------------------------------------------------


class BoundDirectory:
    """A directory held open by descriptor (until ``close``); files are created and read
    relative to it, never through a symlink. ``expect`` (device, inode) refuses a directory
    that is not the one another rank created under that name."""

    def __init__(self, path: Path, *, expect: tuple[int, int] | None = None) -> None:
        self.path = path
        descriptor = os.open(path, os.O_RDONLY | _DIRECTORY | _NO_FOLLOW)
        found = os.fstat(descriptor)
        if expect is not None and (found.st_dev, found.st_ino) != expect:
            os.close(descriptor)
            raise CheckpointError(
                f"{path} is not the directory this save created (it was replaced meanwhile)"
            )
        self._descriptor: int | None = descriptor

    @property
    def descriptor(self) -> int:
        if self._descriptor is None:
            raise CheckpointError(f"{self.path} is closed")
        return self._descriptor

    def name_of(self, path: str | os.PathLike[str]) -> str:
        """The name of ``path`` in this directory; ``CheckpointError`` for any other place."""
        candidate = Path(path)
        if candidate.parent != self.path or candidate.name in ("", ".", ".."):
            raise CheckpointError(f"refusing to write {candidate}: it is not in {self.path}")
        return candidate.name

    def create(self, name: str) -> BinaryIO:
        """A new file ``name``, created exclusively (whatever is there is left alone)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW
        return open(os.open(name, flags, 0o666, dir_fd=self.descriptor), "wb")

    def read(self, name: str) -> BinaryIO:
        """``name`` for reading (a regular file only, as ``open_no_follow``)."""
        flags = os.O_RDONLY | _NO_FOLLOW | _NON_BLOCKING
        return _regular(os.open(name, flags, dir_fd=self.descriptor), self.path / name)

    def write_synced(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        """Create ``name``, let ``write`` fill it, flush and fsync it."""
        with self.create(name) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())

    def regular_files(self) -> list[str]:
        """The names of the regular files in it (no links, no directories), sorted."""
        names = []
        for name in sorted(os.listdir(self.descriptor)):
            mode = os.stat(name, dir_fd=self.descriptor, follow_symlinks=False).st_mode
            if stat.S_ISREG(mode):
                names.append(name)
        return names

    def size_and_sha256(self, name: str) -> tuple[int, str]:
        digest = hashlib.sha256()
        size = 0
        with self.read(name) as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return size, digest.hexdigest()

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.descriptor, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def fsync(self) -> None:
        with contextlib.suppress(OSError):  # not every file system can fsync a directory
            os.fsync(self.descriptor)

    def close(self) -> None:
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            os.close(descriptor)


class _BoundFileSystem(FileSystem):
    """DCP's file system confined to one ``BoundDirectory``: it writes new files there and
    nowhere else."""

    def __init__(self, directory: BoundDirectory) -> None:
        super().__init__()
        self.directory = directory

    @contextlib.contextmanager
    def create_stream(  # type: ignore[override]  # the same contract; torch's is untyped there
        self, path: str | os.PathLike[str], mode: str
    ) -> Iterator[BinaryIO]:
        name = self.directory.name_of(path)
        if mode not in ("wb", "rb"):
            raise CheckpointError(f"refusing to open {path} in mode {mode!r}")
        with self.directory.create(name) if mode == "wb" else self.directory.read(name) as stream:
            yield stream

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        if Path(path) != self.directory.path:
            raise CheckpointError(f"refusing to create {path}: it is not {self.directory.path}")

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.directory.exists(self.directory.name_of(path))


class BoundWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` writing through a ``_BoundFileSystem`` into the temp
    directory ``path`` (whose device and inode are ``identity``), and ``.metadata`` with
    ``torch.save``. The directory is opened when DCP sets the writer up -- on every rank,
    inside DCP's own error handling -- and stays open (``directory``) until ``close``."""

    def __init__(self, path: Path, identity: tuple[int, int]) -> None:
        super().__init__(path, sync_files=True)
        self._identity = identity
        self._directory: BoundDirectory | None = None

    @property
    def directory(self) -> BoundDirectory:
        if self._directory is None:
            raise CheckpointError(f"{self.path} was not set up for writing")
        return self._directory

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if self._directory is None:
            self._directory = BoundDirectory(Path(self.path), expect=self._identity)
            self.fs = _BoundFileSystem(self._directory)

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        metadata.version = filesystem.CURRENT_DCP_VERSION
        metadata.storage_data = {
            result.index: result.storage_data for batch in results for result in batch
        }
        meta = self.storage_meta()
        if meta is not None:
            meta.checkpoint_id = None  # a path object; where it lives is not content
        metadata.storage_meta = meta
        self.directory.write_synced(METADATA_NAME, lambda handle: torch.save(metadata, handle))

    def close(self) -> None:
        directory, self._directory = self._directory, None
        if directory is not None:
            directory.close()


def save(state: dict[str, object], writer: BoundWriter, *, no_dist: bool) -> None:
    """``dcp.save`` of ``state`` through ``writer`` (a collective unless ``no_dist``). A
    failure is this layer's error when a rank raised one, else DCP's
    ``CheckpointException`` (a ``BaseException``) for the caller to report."""
    try:
        with _single_process_quietly():
            dcp_save(state, storage_writer=writer, no_dist=no_dist)
    except CheckpointException as exc:
        ours = _our_error(exc)
        if ours is not None:
            raise ours from exc
        raise


# -- reading -------------------------------------------------------------------------------


def read_metadata(directory: Path, load_id: str | None = None) -> Metadata:
    """A sharded checkpoint's ``.metadata``, through the restricted loader and checked
    field by field. ``UnsafeCheckpointError`` when it holds any object other than DCP's
    metadata; ``CorruptCheckpointError`` when it is missing, damaged or malformed."""
    path = directory / METADATA_NAME
    try:
        handle = open_no_follow(path)
    except OSError as exc:
        raise CorruptCheckpointError(
            f"sharded checkpoint {directory} is unreadable: no readable {METADATA_NAME} "
            f"({first_line(exc)})"
        ) from exc
    with handle:
        metadata = restricted_load(handle, name=str(path), allowed=_metadata_classes())
    try:
        problem = _metadata_problem(metadata)
    except Exception as exc:  # a field of an unexpected type deep inside
        problem = f"a field is malformed ({type(exc).__name__})"
    if problem is not None:
        raise CorruptCheckpointError(f"{path} is not valid DCP metadata: {problem}")
    checked = cast(Metadata, metadata)
    if checked.storage_meta is None:
        checked.storage_meta = StorageMeta()
    checked.storage_meta.load_id = load_id
    return checked


def _metadata_problem(metadata: object) -> str | None:
    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata"
    if not isinstance(metadata.state_dict_metadata, dict):
        return "its state_dict_metadata is not a table"
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not (
            isinstance(entry, BytesStorageMetadata) or _tensor_entry_ok(entry)
        ):
            return f"its entry {reprlib.repr(key)} is malformed"
    if not isinstance(metadata.storage_data, dict):
        return "its storage_data is not a table"
    for index, info in metadata.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)):
            return f"its storage_data has an invalid key {reprlib.repr(index)}"
        if not _storage_info_ok(info):
            return (
                f"the record of {reprlib.repr(index.fqn)} is malformed (it must lie in a shard "
                "file __<rank>_<n>.distcp, at a non-negative offset and length, untransformed)"
            )
    if not (metadata.storage_meta is None or isinstance(metadata.storage_meta, StorageMeta)):
        return "its storage_meta is malformed"
    for key, entry in metadata.state_dict_metadata.items():
        chunks = entry.chunks if isinstance(entry, TensorStorageMetadata) else [None]
        for chunk in chunks:
            if MetadataIndex(key, chunk.offsets if chunk else None) not in metadata.storage_data:
                return f"its entry {reprlib.repr(key)} has no record in storage_data"
    return None


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entry_ok(entry: object) -> bool:
    if not isinstance(entry, TensorStorageMetadata):
        return False
    size, properties = entry.size, entry.properties
    if not (isinstance(size, torch.Size) and all(_natural(d) for d in size)):
        return False
    if not (isinstance(properties, TensorProperties) and isinstance(properties.dtype, torch.dtype)):
        return False
    return isinstance(entry.chunks, list) and all(_chunk_ok(c, size) for c in entry.chunks)


def _chunk_ok(chunk: object, size: torch.Size) -> bool:
    if not isinstance(chunk, ChunkStorageMetadata):
        return False
    offsets, sizes = chunk.offsets, chunk.sizes
    if not (isinstance(offsets, torch.Size) and isinstance(sizes, torch.Size)):
        return False
    if not len(offsets) == len(sizes) == len(size):
        return False
    bounds = zip(offsets, sizes, size, strict=True)
    return all(_natural(o) and _natural(n) and o + n <= d for o, n, d in bounds)


def _storage_info_ok(info: object) -> bool:
    return (
        isinstance(info, filesystem._StorageInfo)
        and isinstance(info.relative_path, str)
        and _SHARD_FILE.fullmatch(info.relative_path) is not None
        and _natural(info.offset)
        and _natural(info.length)
        and not info.transform_descriptors
    )


def check_bytes_records(directory: Path, metadata: Metadata) -> None:
    """Unpickle every non-tensor record of the shards through the restricted loader (and
    drop the values): a verified checkpoint whose records would be refused is refused
    before anything is loaded into a model. They are small (optimizer settings): this
    reads kilobytes, the tensors are not touched."""
    by_file: dict[str, list[tuple[MetadataIndex, filesystem._StorageInfo]]] = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            by_file.setdefault(info.relative_path, []).append((index, info))
    for name, records in by_file.items():
        shard = directory / name
        with open_no_follow(shard) as stream:
            for index, info in records:
                stream.seek(info.offset)
                value = io.BytesIO(stream.read(info.length))
                restricted_load(value, name=f"{shard} (record {index.fqn!r})")


class _RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a bytes record is unpickled by the
    restricted loader (the default calls ``torch.load(weights_only=False)`` on it)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        shard = self.directory / _relative_path(self.metadata, read_item)
        loaded = restricted_load(value, name=f"{shard} (record {read_item.storage_index.fqn!r})")
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _relative_path(metadata: Metadata | None, item: ReadItem) -> str:
    storage = metadata.storage_data if metadata is not None else None
    info = storage.get(item.storage_index) if isinstance(storage, dict) else None
    if not isinstance(info, filesystem._StorageInfo):
        raise CorruptCheckpointError(
            f"record {item.storage_index.fqn!r} is not in the checkpoint's storage table"
        )
    return str(info.relative_path)


class _RestrictedReader(FileSystemReader):
    """DCP's ``FileSystemReader``, except that ``.metadata`` is read by ``read_metadata``
    and every record of a shard by the restricted loader (with ``_RestrictedLoadPlanner``,
    which it insists on), shard files opened without following symlinks."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.directory = path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(self.directory, self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, _RestrictedLoadPlanner):
            raise TypeError("_RestrictedReader reads with a _RestrictedLoadPlanner only")
        try:
            self._read(plan, planner)
        except CheckpointError:
            raise
        except Exception as exc:  # a record that is not what .metadata says it is
            raise CorruptCheckpointError(
                f"sharded checkpoint {self.directory} is unreadable: "
                f"{type(exc).__name__}: {first_line(exc)}"
            ) from exc
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read(self, plan: LoadPlan, planner: _RestrictedLoadPlanner) -> None:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(_relative_path(planner.metadata, item), []).append(item)
        for name, items in by_file.items():
            shard = self.directory / name
            with open_no_follow(shard) as stream:
                base = cast(io.IOBase, stream)
                for item in items:
                    info = self.storage_data[item.storage_index]
                    view = cast(BinaryIO, _create_file_view(base, info.offset, info.length))
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(view.read()))
                    else:
                        _read_tensor(shard, view, item, planner)


def _read_tensor(shard: Path, view: BinaryIO, item: ReadItem, planner: LoadPlanner) -> None:
    name = f"{shard} (record {item.storage_index.fqn!r})"
    tensor = restricted_load(view, name=name)
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{name} holds a {type(tensor).__name__}, not a tensor")
    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CorruptCheckpointError(
            f"{name} has shape {tuple(tensor.size())} where {tuple(target.size())} belongs"
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def load(state: dict[str, object], directory: Path, *, no_dist: bool) -> None:
    """``dcp.load`` of ``state`` (in place) from ``directory`` through the restricted reader
    and planner (a collective unless ``no_dist``). The first of this layer's errors any
    rank raised is raised as is -- ``UnsafeCheckpointError`` before others -- so a refused
    record names its file; any other failure is a ``CheckpointError``."""
    try:
        with _single_process_quietly():
            dcp_load(
                state,
                storage_reader=_RestrictedReader(directory),
                planner=_RestrictedLoadPlanner(directory),
                no_dist=no_dist,
            )
    except CheckpointException as exc:  # a BaseException: make it the error it is
        ours = _our_error(exc)
        if ours is not None:
            raise ours from exc
        raise CheckpointError(
            f"could not load sharded checkpoint {directory}: {describe_failures(exc)}"
        ) from exc


def describe_failures(exc: CheckpointException) -> str:
    """What failed on which rank, in one line per rank (DCP's own text is tracebacks)."""
    return "; ".join(
        f"rank {rank}: {type(failure[0]).__name__}: {first_line(failure[0])}"
        for rank, failure in sorted(exc.failures.items())
    )


def _our_error(exc: CheckpointException) -> CheckpointError | None:
    """The most telling ``CheckpointError`` among the ranks' failures, if any."""
    errors = [
        failure[0] for failure in exc.failures.values() if isinstance(failure[0], CheckpointError)
    ]
    errors.sort(key=lambda error: not isinstance(error, UnsafeCheckpointError))
    return errors[0] if errors else None
