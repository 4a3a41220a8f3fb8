"""What an attacker who can write a checkpoint directory plants, for the tests that prove it
is refused: a pickle that would run a command, put where each unpickling path would meet it,
with every checksum rewritten to match (the manifest's and the pointer's), so that only the
refusal of pickled objects stands between it and ``os.system``.

``RunsCode(marker)`` pickles as ``os.system("touch <marker>")``: the marker file existing
afterwards is the proof that the payload ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from pathlib import Path

import torch

from speedtronic.state.dcp_io import METADATA_NAME, read_metadata
from speedtronic.state.sharded_checkpoint import MANIFEST_NAME, STATE_NAME


class RunsCode:
    """Pickles as a call to ``os.system``: unpickling it would run a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def payload(marker: Path, *, wrapped: object = None) -> bytes:
    """``torch.save`` bytes of a ``RunsCode`` (alone, or inside ``wrapped``'s dict)."""
    buffer = io.BytesIO()
    value = RunsCode(marker)
    torch.save({**wrapped, "payload": value} if isinstance(wrapped, dict) else value, buffer)
    return buffer.getvalue()


def plant_in_record(checkpoint: Path, record: str, data: bytes) -> Path:
    """Make ``record`` (a key such as ``optimizer.param_groups.0.lr``) of the sharded
    checkpoint ``checkpoint`` read as ``data``: appended to the record's ``.distcp`` shard,
    ``.metadata`` pointed at it, the hashes rewritten. Returns the shard's path."""
    metadata = read_metadata(checkpoint)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == record)
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as handle:
        handle.write(data)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(data))
    metadata.storage_meta = None
    with open(checkpoint / METADATA_NAME, "wb") as handle:
        torch.save(metadata, handle)
    rehash(checkpoint)
    return shard


def plant_file(checkpoint: Path, name: str, data: bytes) -> Path:
    """Replace the file ``name`` of the sharded checkpoint with ``data``, hashes rewritten."""
    (checkpoint / name).write_bytes(data)
    rehash(checkpoint)
    return checkpoint / name


def rehash(checkpoint: Path) -> None:
    """Rewrite the manifest's sizes and SHA-256s for the files as they are now, and the
    pointer's record of the manifest, as an attacker covering their tracks would."""
    manifest_path = checkpoint / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))
    pointer_path = checkpoint.parent / "latest.json"
    pointer = json.loads(pointer_path.read_text())
    if checkpoint.name in pointer["checkpoints"]:
        digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
        pointer["checkpoints"][checkpoint.name]["sha256"] = digest
        pointer_path.write_text(json.dumps(pointer))


__all__ = ["STATE_NAME", "RunsCode", "payload", "plant_file", "plant_in_record", "rehash"]
