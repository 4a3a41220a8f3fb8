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

Writing (``write_sharded``, called on every rank): rank 0 creates a hidden temp directory
exclusively (``.step_000000000008.dcp.tmp-<pid of rank 0>``, or with a random suffix when
something -- a leftover, a planted symlink -- is at that name) and tells the other ranks its
name and identity; each writes and fsyncs its own shard (``dcp.save``, a collective) into
that directory held by descriptor, then rank 0 writes ``state.pt`` and the manifest,
fsyncs, renames the directory onto its final name and fsyncs the parent. Every file is
created exclusively, without following links (``speedtronic.state.dcp_io``). Only then does
the caller (``CheckpointManager.save``) point ``latest.json`` at it, recording the manifest's
SHA-256. A process killed at any moment leaves a temp directory (never a checkpoint) and the
previous pointer.

Reading: ``verify_sharded`` checks the manifest against the pointer and every file against
the manifest (regular files only: a symlink is not followed), and ``.metadata`` against the
manifest (every record in a listed shard, within its size) -- a missing rank's shard, a
truncated or changed file is a ``CorruptCheckpointError``, so the caller falls back to an
older checkpoint; in a
multi-rank job the ranks agree on the verdict before any of them loads (``agree_corrupt``),
so a damaged checkpoint never leaves one rank waiting in a collective the others skipped.
``load_sharded_tensors`` then loads the tensors into the trainer's own (possibly
differently sharded) model and optimizer: DCP reshards, so a checkpoint written by N ranks
resumes on M.

Nothing loaded runs code: ``state.pt``, ``.metadata`` and every record of every shard --
tensors and the non-tensor records DCP's default planner would unpickle with
``weights_only=False`` -- go through the one restricted loader
(``speedtronic.state.safe_load.restricted_load``; DCP reads through ``dcp_io``'s reader and
planner). A pickled object anywhere is an ``UnsafeCheckpointError`` naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import torch
import torch.distributed as dist
from torch import nn

from speedtronic.state.archive import load_checkpoint_file
from speedtronic.state.atomic_io import create_temporary_directory
from speedtronic.state.directory_swap import swap_in
from speedtronic.state.errors import CheckpointError, CorruptCheckpointError, first_line
from speedtronic.state.layout import SHARDED_SUFFIX
from speedtronic.state.model_fit import Shape, model_mismatch, tensor_shapes
from speedtronic.state.safe_load import plain_state

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from speedtronic.state import dcp_io

__all__ = [
    "CALLBACK_SHARDS",
    "MANIFEST_NAME",
    "SHARDED_SUFFIX",
    "STATE_NAME",
    "agree_corrupt",
    "copy_sharded",
    "is_sharded_state",
    "load_sharded_tensors",
    "load_sharded_weights",
    "load_tensor_entries",
    "read_sharded_state",
    "saved_tensor_entries",
    "verify_sharded",
    "write_sharded",
]

STATE_NAME = "state.pt"
MANIFEST_NAME = "manifest.json"
_MANIFEST_FORMAT = 1
CALLBACK_SHARDS = "callback_shards"
"""The entry of a training state holding the callbacks' ``DTensor`` leaves by index
(``speedtronic.state.callback_shards``); present only when some callback has them."""
_TENSOR_KEYS = ("model", "optimizer", CALLBACK_SHARDS)
"""The entries of a training state that DCP writes shard by shard."""
SHARDED_MARKER = "sharded"
"""A training state holding this key (True) is written as a sharded checkpoint; a loaded
one holds the directory's path under ``SHARDED_DIRECTORY`` instead of the tensors."""
SHARDED_DIRECTORY = "sharded_directory"
_HASH_CHUNK = 16 * 1024 * 1024


def is_sharded_state(state: Mapping[str, object]) -> bool:
    """Whether a training state is to be written (or was read) as a sharded checkpoint."""
    return state.get(SHARDED_MARKER) is True


def _is_main() -> bool:
    return not _multi_process() or dist.get_rank() == 0


def _multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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


def _temp_directory(path: Path) -> tuple[Path, tuple[int, int]]:
    """This save's temp directory and its (device, inode), the same on every rank: rank 0
    creates it exclusively and broadcasts it -- or its failure, so that no rank waits in a
    collective the others skipped."""
    message: list[object] = [None]
    if _is_main():
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
                _fsync_directory(path.parent.parent)
            temp = create_temporary_directory(path, tag=str(os.getpid()))
            found = os.lstat(temp)
            message = [(str(temp), found.st_dev, found.st_ino)]
        except OSError as exc:
            message = [f"{type(exc).__name__}: {exc}"]
    if _multi_process():
        dist.broadcast_object_list(message, src=0)
    created = message[0]
    if not isinstance(created, tuple):
        raise CheckpointError(f"could not write sharded checkpoint {path}: {created}")
    name, device, inode = created
    return Path(name), (device, inode)


def write_sharded(path: Path, state: Mapping[str, object]) -> str:
    """Write ``state`` as the sharded checkpoint ``path`` (on every rank: a collective).
    Returns the manifest's SHA-256 on rank 0 (what the pointer records), ``""`` elsewhere.
    ``CheckpointError`` (nothing visible is written) when the non-tensor part would not
    load with ``weights_only=True``."""
    from torch.distributed.checkpoint.api import CheckpointException

    from speedtronic.state import dcp_io

    rest = plain_state(
        {key: value for key, value in state.items() if key not in (*_TENSOR_KEYS, SHARDED_MARKER)}
    )
    temp, identity = _temp_directory(path)
    writer = dcp_io.BoundWriter(temp, identity)
    try:
        dcp_io.save(
            {key: state[key] for key in _TENSOR_KEYS if key in state},
            writer,
            no_dist=not _multi_process(),
        )
        if not _is_main():
            return ""
        directory = writer.directory
        directory.write_synced(STATE_NAME, lambda handle: torch.save(rest, handle))
        data = (json.dumps(_manifest(directory), indent=2, sort_keys=True) + "\n").encode()
        directory.write_synced(MANIFEST_NAME, lambda handle: handle.write(data))
        directory.fsync()
        _replace_directory(temp, path)
        _fsync_directory(path.parent)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        if _is_main():
            shutil.rmtree(temp, ignore_errors=True)  # never through a link (rmtree refuses)
        if isinstance(exc, CheckpointError):
            raise
        problem = (
            dcp_io.describe_failures(exc)
            if isinstance(exc, CheckpointException)
            else f"{type(exc).__name__}: {exc}"
        )
        raise CheckpointError(f"could not write sharded checkpoint {path}: {problem}") from exc
    finally:
        writer.close()
    return hashlib.sha256(data).hexdigest()


def _manifest(directory: dcp_io.BoundDirectory) -> dict[str, object]:
    files = {}
    for name in directory.regular_files():
        if name != MANIFEST_NAME:
            size, digest = directory.size_and_sha256(name)
            files[name] = {"size": size, "sha256": digest}
    world = dist.get_world_size() if _multi_process() else 1
    return {"format": _MANIFEST_FORMAT, "world_size": world, "files": files}


def _replace_directory(temp: Path, path: Path) -> None:
    """Rename ``temp`` onto ``path``; whatever is at ``path`` (a leftover of a killed run at
    the same step, or something planted there, a symlink included: the entry is moved, not
    followed) is moved aside first, put back if the rename fails, and removed after."""
    swap_in(temp, path, what="sharded checkpoint", any_entry=True)


def copy_sharded(source: Path, target: Path) -> None:
    """Copy the sharded checkpoint ``source`` to ``target`` (replacing what is there) the
    way it is written: into a temp directory created exclusively, its regular files only
    (links are neither followed nor copied), renamed into place."""
    from speedtronic.state import dcp_io

    temp = create_temporary_directory(target, tag=str(os.getpid()))
    try:
        with contextlib.closing(dcp_io.BoundDirectory(temp)) as directory:
            for entry in sorted(source.iterdir()):
                if entry.is_symlink() or not entry.is_file():
                    continue
                with dcp_io.open_no_follow(entry) as original:

                    def copy(handle: BinaryIO, source: BinaryIO = original) -> None:
                        shutil.copyfileobj(source, handle, _HASH_CHUNK)

                    directory.write_synced(entry.name, copy)
            directory.fsync()
        _replace_directory(temp, target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _fsync_directory(target.parent)


# -- reading -------------------------------------------------------------------------------


def verify_sharded(path: Path, checksum: str | None) -> None:
    """``CorruptCheckpointError`` unless ``path`` is a complete sharded checkpoint: its
    manifest matches ``checksum`` (the pointer's record, when there is one), every file it
    lists is present -- a regular file, not a link -- with its size and SHA-256 (a missing
    rank's shard is damage), ``.metadata`` is DCP's with every record inside a listed
    shard, and every non-tensor record unpickles through the restricted loader
    (``UnsafeCheckpointError`` for a pickled object in either)."""
    from speedtronic.state import dcp_io

    data = _read_manifest(path)
    actual = hashlib.sha256(data).hexdigest()
    if checksum is not None and actual != checksum:
        raise CorruptCheckpointError(
            f"sharded checkpoint {path} is unreadable (checksum mismatch: the pointer recorded "
            f"{checksum[:16]}..., its {MANIFEST_NAME} has {actual[:16]}...)"
        )
    files = _manifest_files(path, data)
    for name in (STATE_NAME, dcp_io.METADATA_NAME):
        if name not in files:
            raise CorruptCheckpointError(
                f"sharded checkpoint {path}: its {MANIFEST_NAME} lists no {name}"
            )
    for name, (size, digest) in files.items():
        entry = path / name
        if not _is_regular_file(entry):
            raise CorruptCheckpointError(
                f"sharded checkpoint {path} is incomplete: {name} is missing (a rank's shard "
                "was lost or never written) or is not a regular file"
            )
        if entry.stat().st_size != size or _sha256(entry) != digest:
            raise CorruptCheckpointError(
                f"sharded checkpoint {path} is unreadable: {name} was truncated or changed "
                "after it was saved (size or SHA-256 differs from the manifest)"
            )
    metadata = dcp_io.read_metadata(path)
    _check_storage(path, metadata, files)
    dcp_io.check_bytes_records(path, metadata)  # an unsafe one is refused before any load


MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""A larger ``manifest.json`` is not one this module wrote (a file's entry is ~100 bytes)."""
_MANIFEST_ENTRY = re.compile(r"state\.pt|\.metadata|__\d{1,9}_\d{1,9}\.distcp")
"""The files a sharded checkpoint holds besides its manifest (no path can be named)."""


def _read_manifest(path: Path) -> bytes:
    from speedtronic.state import dcp_io

    try:
        with dcp_io.open_no_follow(path / MANIFEST_NAME) as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise CorruptCheckpointError(
            f"sharded checkpoint {path} is incomplete: no readable {MANIFEST_NAME} "
            f"({first_line(exc)})"
        ) from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"sharded checkpoint {path}: its {MANIFEST_NAME} is larger than a manifest can be"
        )
    return data


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _manifest_files(path: Path, data: bytes) -> dict[str, tuple[int, str]]:
    try:
        content = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"sharded checkpoint {path}: {MANIFEST_NAME} is not JSON ({first_line(exc)})"
        ) from exc
    files = content.get("files") if isinstance(content, dict) else None
    if not isinstance(files, dict):
        raise CorruptCheckpointError(
            f"sharded checkpoint {path}: {MANIFEST_NAME} has no file table"
        )
    checked: dict[str, tuple[int, str]] = {}
    for name, record in files.items():
        size = record.get("size") if isinstance(record, dict) else None
        digest = record.get("sha256") if isinstance(record, dict) else None
        if (
            _MANIFEST_ENTRY.fullmatch(name) is None
            or not isinstance(size, int)
            or not isinstance(digest, str)
        ):
            raise CorruptCheckpointError(
                f"sharded checkpoint {path}: {MANIFEST_NAME} entry {name[:80]!r} is invalid"
            )
        checked[name] = (size, digest)
    return checked


def _check_storage(path: Path, metadata: Metadata, files: Mapping[str, tuple[int, str]]) -> None:
    """``CorruptCheckpointError`` unless every record ``.metadata`` places lies within a
    shard the manifest lists (and so was verified above): nothing else is ever read."""
    for index, info in metadata.storage_data.items():
        listed = files.get(info.relative_path)
        if listed is None or info.offset + info.length > listed[0]:
            raise CorruptCheckpointError(
                f"sharded checkpoint {path}: its .metadata places {index.fqn!r} outside the "
                "shards its manifest lists"
            )


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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from speedtronic.state import dcp_io

    saved = dcp_io.read_metadata(path).state_dict_metadata
    saved_model: dict[str, Shape] = {
        key[6:]: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in saved.items()
        if key.startswith("model.")
    }
    problem = model_mismatch(tensor_shapes(model_state), saved_model)
    if problem is not None:
        raise ValueError(problem)


def _load(state: dict[str, object], path: Path) -> None:
    from speedtronic.state import dcp_io

    dcp_io.load(state, path, no_dist=not _multi_process())


def load_sharded_tensors(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the tensors of the sharded checkpoint ``path`` into ``model`` and ``optimizer``
    (on every rank: a collective), resharding to however they are sharded now.
    ``ValueError`` naming the keys and shapes that do not fit (nothing is changed then)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_state, optimizer_state = capture_sharded_tensors(model, optimizer)
    _check_against(path, model_state)
    state: dict[str, object] = {"model": model_state, "optimizer": optimizer_state}
    _load(state, path)
    try:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=cast(dict[str, Any], state["model"]),
            optim_state_dict=cast(dict[str, Any], state["optimizer"]),
        )
    except Exception as exc:  # torch's errors for values of the wrong kind or shape
        raise ValueError(
            f"the checkpoint's state does not fit: {type(exc).__name__}: {first_line(exc)}"
        ) from exc


def saved_tensor_entries(path: Path, entry: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors the sharded checkpoint ``path`` holds under the top-level ``entry``, by
    key: their whole (unsharded) size and dtype, from its metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from speedtronic.state import dcp_io

    saved = dcp_io.read_metadata(path).state_dict_metadata
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
