"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) directories for FSDP runs.

A run with ``parallel.strategy: fsdp`` checkpoints into a directory per step, beside (and
under the same ``latest.json`` rules as) single-file checkpoints::

    step_000000000008.dcp/
        __0_0.distcp  __1_0.distcp   each rank's shard of the model and optimizer tensors
                                     (and of callbacks' sharded tensors: callback_shards)
        .metadata                    DCP's index of the shards (which rank wrote what)
        state.pt                     everything else: counters, RNG, data position, callback
                                     and scheduler state, config (rank 0, weights-only)
        manifest.json                size and SHA-256 of every file above (rank 0, last)

Writing (``write_sharded``, called on every rank): the ranks agree on a hidden temp
directory (``.step_000000000008.dcp.tmp-<pid of rank 0>``), each writes and fsyncs its own
shard (``dcp.save``, a collective), then rank 0 writes ``state.pt`` and the manifest,
fsyncs, renames the directory onto its final name and fsyncs the parent. Only then does the
caller (``CheckpointManager.save``) point ``latest.json`` at it, recording the manifest's
SHA-256. A process killed at any moment leaves a temp directory (never a checkpoint) and the
previous pointer.

Reading: ``verify_sharded`` checks the manifest against the pointer and every file against
the manifest -- a missing rank's shard, a truncated or changed file is a
``CorruptCheckpointError``, so the caller falls back to an older checkpoint; in a
multi-rank job the ranks agree on the verdict before any of them loads (``agree_corrupt``),
so a damaged checkpoint never leaves one rank waiting in a collective the others skipped.
``load_sharded_tensors`` then loads the tensors into the trainer's own (possibly
differently sharded) model and optimizer: DCP reshards, so a checkpoint written by N ranks
resumes on M.

No pickled objects: the shards' non-tensor items are ``torch.save`` records DCP loads with
``weights_only=True``; ``state.pt`` is loaded the same way; and ``.metadata``, which DCP
itself would pickle, is written with ``torch.save`` and read with ``weights_only=True``,
allowing only DCP's own metadata dataclasses (``METADATA_CLASSES``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from speedtronic.state.model_fit import Shape, model_mismatch, tensor_shapes

__all__ = [
    "CALLBACK_SHARDS",
    "MANIFEST_NAME",
    "SHARDED_SUFFIX",
    "STATE_NAME",
    "TENSOR_KEYS",
    "agree_corrupt",
    "is_sharded_state",
    "load_sharded_tensors",
    "load_sharded_weights",
    "load_tensor_entries",
    "read_sharded_state",
    "saved_tensor_entries",
    "verify_sharded",
    "write_sharded",
]

SHARDED_SUFFIX = ".dcp"
"""The suffix of a sharded checkpoint directory (``step_<12 digits>.dcp``)."""
STATE_NAME = "state.pt"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
CALLBACK_SHARDS = "callback_shards"
"""The entry of a training state holding the callbacks' ``DTensor`` leaves by index
(``speedtronic.state.callback_shards``); present only when some callback has them."""
TENSOR_KEYS = ("model", "optimizer", CALLBACK_SHARDS)
"""The entries of a training state that DCP writes shard by shard."""
SHARDED_MARKER = "sharded"
"""A training state holding this key (True) is written as a sharded checkpoint; a loaded
one holds the directory's path under ``SHARDED_DIRECTORY`` instead of the tensors."""
SHARDED_DIRECTORY = "sharded_directory"
_HASH_CHUNK = 16 * 1024 * 1024


def _errors() -> tuple[type[Exception], type[Exception]]:
    from speedtronic.state.checkpoint import CheckpointError, CorruptCheckpointError

    return CheckpointError, CorruptCheckpointError


def is_sharded_state(state: Mapping[str, object]) -> bool:
    """Whether a training state is to be written (or was read) as a sharded checkpoint."""
    return state.get(SHARDED_MARKER) is True


def _is_main() -> bool:
    return not _multi_process() or dist.get_rank() == 0


def _multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _metadata_classes() -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    from torch.distributed.checkpoint import filesystem, metadata

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


def _writer(path: Path) -> Any:
    """A DCP ``FileSystemWriter`` that writes ``.metadata`` with ``torch.save``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata

    class Writer(FileSystemWriter):
        def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
            from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

            metadata.version = CURRENT_DCP_VERSION
            metadata.storage_data = {
                result.index: result.storage_data for batch in results for result in batch
            }
            meta = self.storage_meta()
            if meta is not None:
                meta.checkpoint_id = None  # a path object; where it lives is not content
            metadata.storage_meta = meta
            _save_synced(metadata, path / ".metadata")

    return Writer(path, sync_files=True)


def _reader(path: Path) -> Any:
    """A DCP ``FileSystemReader`` that reads ``.metadata`` with ``weights_only=True``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return cast(Metadata, _read_metadata(path, self.load_id, StorageMeta))

    return Reader(path)


def _read_metadata(path: Path, load_id: object, storage_meta: type) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    from speedtronic.state.checkpoint import UnsafeCheckpointError

    try:
        with torch.serialization.safe_globals(_metadata_classes()):
            metadata = torch.load(path / ".metadata", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"refusing to load {path / '.metadata'}: it holds a pickled object other than "
            "DCP's own metadata, and loading it could run arbitrary code"
        ) from exc
    except Exception as exc:  # torch: RuntimeError/EOFError/... for a damaged archive
        raise _errors()[1](
            f"sharded checkpoint {path} is unreadable: its .metadata is damaged "
            f"({type(exc).__name__})"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise _errors()[1](f"{path / '.metadata'} is not DCP metadata")
    if metadata.storage_meta is None:
        metadata.storage_meta = storage_meta()
    metadata.storage_meta.load_id = load_id
    return metadata


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns that it "assumes" a single process whenever there is no process group;
    here that is the intent (one process is one shard), so the warning says nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable")
        yield


def _save_synced(value: object, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# -- writing -------------------------------------------------------------------------------


def _temp_directory(path: Path) -> Path:
    """The temp directory of this save, the same on every rank (rank 0's pid in its name)."""
    pid = [os.getpid()]
    if _multi_process():
        dist.broadcast_object_list(pid, src=0)
    return path.with_name(f".{path.name}.tmp-{pid[0]}")


def write_sharded(path: Path, state: Mapping[str, object]) -> str:
    """Write ``state`` as the sharded checkpoint ``path`` (on every rank: a collective).
    Returns the manifest's SHA-256 on rank 0 (what the pointer records), ``""`` elsewhere.
    ``CheckpointError`` (nothing visible is written) when the non-tensor part would not
    load with ``weights_only=True``."""
    from torch.distributed.checkpoint.state_dict_saver import save

    from speedtronic.state.checkpoint import plain_state

    checkpoint_error = _errors()[0]
    rest = plain_state(
        {key: value for key, value in state.items() if key not in (*TENSOR_KEYS, SHARDED_MARKER)}
    )
    from torch.distributed.checkpoint.api import CheckpointException

    temp = _temp_directory(path)
    try:
        with _single_process_quietly():
            save(
                {key: state[key] for key in TENSOR_KEYS if key in state},
                storage_writer=_writer(temp),
                no_dist=not _multi_process(),
            )
        if not _is_main():
            return ""
        _save_synced(rest, temp / STATE_NAME)
        manifest = _manifest(temp)
        data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
        with open(temp / MANIFEST_NAME, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_directory(temp)
        _replace_directory(temp, path)
        _fsync_directory(path.parent)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        if _is_main() and temp.is_dir():
            shutil.rmtree(temp, ignore_errors=True)
        if isinstance(exc, checkpoint_error):
            raise
        raise checkpoint_error(
            f"could not write sharded checkpoint {path}: {type(exc).__name__}: {exc}"
        ) from exc
    return hashlib.sha256(data).hexdigest()


def _manifest(directory: Path) -> dict[str, object]:
    files = {
        entry.name: {"size": entry.stat().st_size, "sha256": _sha256(entry)}
        for entry in sorted(directory.iterdir())
        if entry.is_file() and entry.name != MANIFEST_NAME
    }
    world = dist.get_world_size() if _multi_process() else 1
    return {"format": MANIFEST_FORMAT, "world_size": world, "files": files}


def _replace_directory(temp: Path, path: Path) -> None:
    """Rename ``temp`` onto ``path``; an existing ``path`` (a leftover of a killed run at
    the same step) is moved aside first and removed after."""
    if path.exists():
        aside = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, aside)
        os.replace(temp, path)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(temp, path)


# -- reading -------------------------------------------------------------------------------


def verify_sharded(path: Path, checksum: str | None) -> None:
    """``CorruptCheckpointError`` unless ``path`` is a complete sharded checkpoint: its
    manifest matches ``checksum`` (the pointer's record, when there is one) and every file
    it lists is present with its size and SHA-256 (a missing rank's shard is damage)."""
    corrupt = _errors()[1]
    manifest_path = path / MANIFEST_NAME
    try:
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise corrupt(
            f"sharded checkpoint {path} is incomplete: no readable {MANIFEST_NAME} ({exc})"
        ) from exc
    actual = hashlib.sha256(data).hexdigest()
    if checksum is not None and actual != checksum:
        raise corrupt(
            f"sharded checkpoint {path} is unreadable (checksum mismatch: the pointer recorded "
            f"{checksum[:16]}..., its {MANIFEST_NAME} has {actual[:16]}...)"
        )
    files = _manifest_files(path, data)
    for name in (STATE_NAME, ".metadata"):
        if name not in files:
            raise corrupt(f"sharded checkpoint {path}: its {MANIFEST_NAME} lists no {name}")
    for name, (size, digest) in files.items():
        entry = path / name
        if not entry.is_file():
            raise corrupt(
                f"sharded checkpoint {path} is incomplete: {name} is missing (a rank's shard "
                "was lost or never written)"
            )
        if entry.stat().st_size != size or _sha256(entry) != digest:
            raise corrupt(
                f"sharded checkpoint {path} is unreadable: {name} was truncated or changed "
                "after it was saved (size or SHA-256 differs from the manifest)"
            )
    from torch.distributed.checkpoint.metadata import StorageMeta

    _read_metadata(path, None, StorageMeta)  # weights-only: an unsafe one is refused here


def _manifest_files(path: Path, data: bytes) -> dict[str, tuple[int, str]]:
    corrupt = _errors()[1]
    try:
        content = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise corrupt(f"sharded checkpoint {path}: {MANIFEST_NAME} is not JSON ({exc})") from exc
    files = content.get("files") if isinstance(content, dict) else None
    if not isinstance(files, dict):
        raise corrupt(f"sharded checkpoint {path}: {MANIFEST_NAME} has no file table")
    checked: dict[str, tuple[int, str]] = {}
    for name, record in files.items():
        size = record.get("size") if isinstance(record, dict) else None
        digest = record.get("sha256") if isinstance(record, dict) else None
        if (
            os.sep in name
            or name.startswith("..")
            or not isinstance(size, int)
            or not isinstance(digest, str)
        ):
            raise corrupt(f"sharded checkpoint {path}: {MANIFEST_NAME} entry {name!r} is invalid")
        checked[name] = (size, digest)
    return checked


def agree_corrupt(verdict: int) -> int:
    """The worst of every rank's ``verdict`` on a checkpoint (0 fine, 1 damaged, 2 refused),
    by one tiny all-reduce in a multi-rank job: the ranks skip, load or refuse it together,
    and none waits in a collective the others skipped."""
    if not _multi_process():
        return verdict
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    flag = torch.tensor([verdict], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def read_sharded_state(path: Path) -> dict[str, object]:
    """The non-tensor part of a verified sharded checkpoint (weights-only), marked with the
    directory the tensors are to be loaded from (``load_sharded_tensors``)."""
    from speedtronic.state.checkpoint import load_checkpoint_file

    state = load_checkpoint_file(path / STATE_NAME)
    state[SHARDED_MARKER] = True
    state[SHARDED_DIRECTORY] = str(path)
    return state


def capture_sharded_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, object], dict[str, object]]:
    """The model's and the optimizer's state as DCP writes them: each rank's shards
    (``DTensor``) under FSDP, keyed by parameter name (so they reshard on load)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return cast(dict[str, object], model_state), cast(dict[str, object], optimizer_state)


def _check_against(path: Path, model_state: Mapping[str, object]) -> None:
    """``ValueError`` naming the model keys and shapes of ``path`` that do not fit."""
    from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

    saved = _read_metadata(path, None, StorageMeta).state_dict_metadata
    saved_model: dict[str, Shape] = {
        key[6:]: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in saved.items()
        if key.startswith("model.")
    }
    problem = model_mismatch(tensor_shapes(model_state), saved_model)
    if problem is not None:
        raise ValueError(problem)


def _load(state: dict[str, object], path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    try:
        with _single_process_quietly():
            load(state, storage_reader=_reader(path), no_dist=not _multi_process())
    except CheckpointException as exc:  # a BaseException: make it the error it is
        raise _errors()[0](f"could not load sharded checkpoint {path}: {exc}") from exc


def load_sharded_tensors(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the tensors of the sharded checkpoint ``path`` into ``model`` and ``optimizer``
    (on every rank: a collective), resharding to however they are sharded now.
    ``ValueError`` naming the keys and shapes that do not fit (nothing is changed then)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_state, optimizer_state = capture_sharded_tensors(model, optimizer)
    _check_against(path, model_state)
    state: dict[str, object] = {"model": model_state, "optimizer": optimizer_state}
    _load(state, path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=cast(dict[str, Any], state["model"]),
        optim_state_dict=cast(dict[str, Any], state["optimizer"]),
    )


def saved_tensor_entries(path: Path, entry: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors the sharded checkpoint ``path`` holds under the top-level ``entry``, by
    key: their whole (unsharded) size and dtype, from its metadata."""
    from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

    saved = _read_metadata(path, None, StorageMeta).state_dict_metadata
    prefix = f"{entry}."
    return {
        key[len(prefix) :]: (tuple(value.size), value.properties.dtype)
        for key, value in saved.items()
        if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)
    }


def load_tensor_entries(
    path: Path, entry: str, templates: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Load the tensors under the top-level ``entry`` of the sharded checkpoint ``path``
    into ``templates`` (on every rank: a collective); DCP reshards into how each template
    is laid out (a ``DTensor``'s shards, or a whole plain tensor)."""
    state: dict[str, object] = {entry: templates}
    _load(state, path)
    return templates


def load_sharded_weights(path: Path, model: nn.Module) -> None:
    """Load only the model weights of the sharded checkpoint ``path`` into an unsharded
    ``model`` in one process (``speedtronic evaluate``). ``ValueError`` when they do not fit."""
    weights = model.state_dict()
    _check_against(path, weights)
    state: dict[str, object] = {"model": weights}
    _load(state, path)
    model.load_state_dict(weights)
