"""Loss-mask shards: which tokens of a shard set carry the loss (supervised fine-tuning).

``speedtronic prepare --format chat | prompt-completion`` writes, beside each token shard
``train-00000.bin``, a mask shard ``train-00000.mask``: one byte per token, 1 where the
token is a target of the loss (an answer's token), 0 where it is context. The manifest
(``index.json``) lists them in a ``loss_masks`` list parallel to ``shards`` (``file``,
``sha256``) and describes the examples in ``sft`` (``format``, ``pack``, ``window``,
``examples``). A reader of the format that does not know these keys still reads the token
shards; speedtronic's window reader turns every label whose mask byte is 0 into ``-100``.

The keys are untrusted input like the rest of the manifest: every file name must be a plain
name inside the directory, and each mask shard must hold one byte per token of its shard
and, unless ``data.verify_shards: false``, the recorded sha256.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from speedtronic.data.shards import (
    MANIFEST_NAME,
    ManifestError,
    ShardEntry,
    ShardError,
    TokenManifest,
    check_inside,
)
from speedtronic.data.tokenizer import sha256_of_file

__all__ = ["SFTRecord", "listed_mask_files", "mask_file", "read_loss_masks", "sft_fields"]

_MASK_SUFFIX = ".mask"
MAX_MANIFEST_BYTES = 64 << 20
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class SFTRecord:
    """The manifest's ``sft`` object: how the examples were rendered and packed."""

    format: str
    pack: str
    window: int | None
    examples: int

    def to_dict(self) -> dict[str, object]:
        return {
            "format": self.format,
            "pack": self.pack,
            "window": self.window,
            "examples": self.examples,
        }


def mask_file(shard_file: str) -> str:
    """The mask shard's name for a token shard's (``train-00000.bin`` -> ``.mask``)."""
    return shard_file.rsplit(".", 1)[0] + _MASK_SUFFIX


def sft_fields(sft: SFTRecord, masks: Sequence[tuple[str, str]]) -> dict[str, object]:
    """The manifest keys this module adds: ``loss_masks`` (``(file, sha256)`` per shard, in
    the shards' order) and ``sft``."""
    return {
        "loss_masks": [{"file": file, "sha256": digest} for file, digest in masks],
        "sft": sft.to_dict(),
    }


def read_loss_masks(
    directory: str | Path,
    manifest: TokenManifest,
    shards: Sequence[ShardEntry],
    *,
    verify: bool,
    key: str,
) -> tuple[list[Path], SFTRecord] | None:
    """The mask shard of each of ``shards`` and the ``sft`` record, or None when the shard
    set has no loss masks (pretraining shards). ``ManifestError``/``ShardError`` name ``key``."""
    folder = Path(directory)
    path = folder / MANIFEST_NAME
    where = f"{key}: {path}"
    values = json.loads(path.read_bytes()[:MAX_MANIFEST_BYTES].decode("utf-8"))
    raw = values.get("loss_masks") if isinstance(values, dict) else None
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != len(manifest.shards):
        raise ManifestError(f"{where}: loss_masks must list one mask per shard")
    sft = _sft_record(values.get("sft"), where)
    by_shard: dict[str, tuple[str, str]] = {}
    for index, (entry, shard) in enumerate(zip(raw, manifest.shards, strict=True)):
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: loss_masks[{index}] must be an object")
        file, digest = entry.get("file"), entry.get("sha256")
        if not isinstance(file, str) or not _PLAIN.fullmatch(file) or ".." in file:
            raise ManifestError(
                f"{where}: loss_masks[{index}].file: {file!r} is not a plain file name "
                "inside the shard directory"
            )
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ManifestError(f"{where}: loss_masks[{index}].sha256 is not a sha256")
        by_shard[shard.file] = (file, digest)
    paths = []
    for shard in shards:
        file, digest = by_shard[shard.file]
        mask_path = folder / file
        _check_mask(mask_path, shard, digest, verify, key)
        paths.append(mask_path)
    return paths, sft


def listed_mask_files(directory: str | Path) -> set[str]:
    """The plain file names ``loss_masks`` lists in ``directory``'s manifest (none for
    pretraining shards), the files themselves unchecked: what ``--overwrite`` may replace."""
    path = Path(directory) / MANIFEST_NAME
    try:
        values = json.loads(path.read_bytes()[:MAX_MANIFEST_BYTES].decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return set()
    raw = values.get("loss_masks") if isinstance(values, dict) else None
    entries = raw if isinstance(raw, list) else []
    files = (entry.get("file") for entry in entries if isinstance(entry, dict))
    return {
        file
        for file in files
        if isinstance(file, str) and _PLAIN.fullmatch(file) and ".." not in file
    }


def _sft_record(value: object, where: str) -> SFTRecord:
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: sft must be an object beside loss_masks")
    window = value.get("window")
    examples = value.get("examples")
    fmt, pack = value.get("format"), value.get("pack")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ManifestError(f"{where}: sft.window must be an integer or null")
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 0:
        raise ManifestError(f"{where}: sft.examples must be a count")
    if not isinstance(fmt, str) or not isinstance(pack, str):
        raise ManifestError(f"{where}: sft.format and sft.pack must be strings")
    return SFTRecord(fmt, pack, window, examples)


def _check_mask(path: Path, shard: ShardEntry, digest: str, verify: bool, key: str) -> None:
    if not path.is_file():
        what = "not a regular file" if path.exists() else "missing (index.json lists it)"
        raise ShardError(f"{key}: {path}: {what}; prepare the data again")
    try:
        check_inside(path, path.parent)  # as a shard: never a link out of the directory
    except ShardError as exc:
        raise ShardError(f"{key}: {exc}") from None
    size = path.stat().st_size
    if size != shard.tokens:
        raise ShardError(
            f"{key}: {path}: {size:,} bytes, but its shard holds {shard.tokens:,} tokens (one "
            "mask byte each): the mask is truncated or was replaced; prepare the data again"
        )
    if verify and sha256_of_file(path) != digest:
        raise ShardError(
            f"{key}: {path}: sha256 differs from index.json's: the mask was modified; prepare "
            "the data again"
        )
