"""Token shards: the directory ``speedtronic prepare`` writes and ``data.tokens`` reads.

A shard directory holds

* the shards: flat arrays of token ids, little-endian ``uint16`` when the vocabulary fits
  (at most 65,536 ids), else ``uint32``; no header, so a shard of ``n`` tokens is exactly
  ``n * itemsize`` bytes and ``np.memmap`` reads it as it is. The training split comes
  first (``train-00000.bin``, ...), the held-out split last (``eval-00000.bin``, ...);
  one end-of-document id follows every document;
* ``tokenizer.json``: a copy of the tokenizer the shards were made with (none for the byte
  tokenizer);
* ``index.json``, the manifest, written last: ``format``, ``version``, ``dtype``,
  ``vocab_size`` (largest id + 1), ``eos_id``, ``tokenizer`` (``kind``, ``sha256``, ``file``),
  ``documents``, ``tokens``, ``eval_fraction``, ``shard_tokens`` and ``shards``: per shard its
  ``file``, ``split`` (``train`` or ``eval``), ``tokens``, ``sha256`` and ``max_id`` (its
  largest token id; absent from manifests written before it was recorded).

The manifest is untrusted input (a shard directory may come from anywhere): ``read_manifest``
reads at most ``MAX_MANIFEST_BYTES``, checks every field, and refuses a shard name that is not
a plain file name inside the directory (no path separators, no leading dot, so no ``..``).
Every problem is a ``ManifestError`` naming the file and the field; no other exception
escapes. ``verify_shards`` then checks that each shard is a file inside the directory (a link
out of it is refused), its size (always) and, with ``checksums``, in one read of its bytes,
its sha256 and its largest id (below ``vocab_size``, and equal to ``max_id`` when recorded),
so a truncated or modified shard -- ids beyond the vocabulary included, even under a
rewritten hash -- is refused before training reads it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import numpy as np

from speedtronic.data.text import DataSourceError, open_data_file
from speedtronic.data.tokenizer import BYTE_TOKENIZER_SHA256, BYTES, read_tokenizer_file

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "TOKENIZER_NAME",
    "ManifestError",
    "ShardEntry",
    "ShardError",
    "TokenManifest",
    "TokenizerRecord",
    "check_tokenizer",
    "check_vocab_fits",
    "read_manifest",
    "token_dtype",
    "verify_shards",
]

FORMAT = "speedtronic-token-shards"
_FORMAT_VERSION = 1
MANIFEST_NAME = "index.json"
TOKENIZER_NAME = "tokenizer.json"
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused unread (a million shards take about 150 MB less)."""
_MAX_SHARDS = 1_000_000
_MAX_VOCAB = 1 << 32
"""Token ids must fit ``uint32``."""
MAX_SHARD_TOKENS = 1 << 50

Split = Literal["train", "eval"]
_SPLITS: tuple[Split, ...] = ("train", "eval")
DTYPES: dict[str, np.dtype[np.unsignedinteger]] = {
    "uint16": np.dtype(np.uint16).newbyteorder("<"),
    "uint32": np.dtype(np.uint32).newbyteorder("<"),
}
"""The shard dtypes: little-endian whatever the machine."""

_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RESERVED = frozenset({MANIFEST_NAME, TOKENIZER_NAME})


class ManifestError(DataSourceError):
    """A shard directory's ``index.json`` that cannot be used."""


class ShardError(DataSourceError):
    """A shard whose bytes do not match its manifest (truncated, modified, missing)."""


def token_dtype(vocab_size: int) -> Literal["uint16", "uint32"]:
    """The shard dtype for a vocabulary of ``vocab_size`` ids (largest id + 1)."""
    if vocab_size > _MAX_VOCAB:
        raise DataSourceError(
            f"a vocabulary of {vocab_size:,} token ids does not fit token shards (at most "
            f"2^32 = {_MAX_VOCAB:,} ids, uint32)"
        )
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def check_vocab_fits(data_vocab: int, model_vocab: int, *, source: str) -> None:
    """Refuse token ids the model cannot embed: ``data_vocab`` (largest id + 1 of the data,
    described by ``source``) must be at most ``model_vocab`` (the model's vocab size)."""
    if data_vocab > model_vocab:
        raise DataSourceError(
            f"{source} holds token ids up to {data_vocab - 1} (a vocabulary of {data_vocab}), "
            f"more than the model's vocabulary of {model_vocab} (model.vocab_size): set "
            f"model.vocab_size to at least {data_vocab}, or prepare the data with the "
            "model's tokenizer"
        )


@dataclass(frozen=True)
class ShardEntry:
    """One shard of the manifest."""

    file: str
    split: Split
    tokens: int
    sha256: str
    max_id: int | None = None
    """The largest token id in the shard (None in manifests written before it was
    recorded: verification computes it then)."""

    def to_dict(self) -> dict[str, object]:
        values: dict[str, object] = {
            "file": self.file,
            "split": self.split,
            "tokens": self.tokens,
            "sha256": self.sha256,
        }
        if self.max_id is not None:
            values["max_id"] = self.max_id
        return values


@dataclass(frozen=True)
class TokenizerRecord:
    """Which tokenizer made the shards: ``kind`` ``bytes`` or ``tokenizers``; ``file`` is
    the copy in the directory (``tokenizer.json``), None for the byte tokenizer."""

    kind: Literal["bytes", "tokenizers"]
    sha256: str
    file: str | None

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "sha256": self.sha256, "file": self.file}


@dataclass(frozen=True)
class TokenManifest:
    """The parsed ``index.json`` (module docstring)."""

    dtype: Literal["uint16", "uint32"]
    vocab_size: int
    eos_id: int
    tokenizer: TokenizerRecord
    documents: int
    eval_fraction: float
    shard_tokens: int
    shards: tuple[ShardEntry, ...]

    @property
    def numpy_dtype(self) -> np.dtype[np.unsignedinteger]:
        return DTYPES[self.dtype]

    @property
    def tokens(self) -> int:
        return sum(shard.tokens for shard in self.shards)

    def split(self, split: Split) -> tuple[ShardEntry, ...]:
        """The shards of one split, in order."""
        return tuple(shard for shard in self.shards if shard.split == split)

    def to_json(self) -> str:
        """The manifest as written: fixed key order, so the same shards give the same bytes."""
        values = {
            "format": FORMAT,
            "version": _FORMAT_VERSION,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer": self.tokenizer.to_dict(),
            "documents": self.documents,
            "tokens": self.tokens,
            "eval_fraction": self.eval_fraction,
            "shard_tokens": self.shard_tokens,
            "shards": [shard.to_dict() for shard in self.shards],
        }
        return json.dumps(values, indent=2) + "\n"


# -- reading an untrusted manifest ---------------------------------------------------------------


class _Fields:
    """Typed reads of one JSON object, each failure a ``ManifestError`` with its path."""

    def __init__(self, where: str, values: object, path: str) -> None:
        self.where = where
        self.path = path
        if not isinstance(values, dict):
            raise self.error(f"must be an object, got {_kind(values)}")
        self.values: Mapping[str, object] = values

    def error(self, message: str, key: str | None = None) -> ManifestError:
        field = self.path if key is None else f"{self.path}.{key}" if self.path else key
        return ManifestError(f"{self.where}: {field or 'the manifest'}: {message}")

    def get(self, key: str) -> object:
        if key not in self.values:
            raise self.error("missing", key)
        return self.values[key]

    def integer(self, key: str, low: int, high: int) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"must be an integer, got {_kind(value)}", key)
        if not low <= value <= high:
            raise self.error(f"{value} is not in [{low}, {high}]", key)
        return value

    def text(self, key: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise self.error(f"must be a string, got {_kind(value)}", key)
        if pattern is not None and not pattern.fullmatch(value):
            raise self.error(f"{_short(value)} is not {what}", key)
        return value

    def choice(self, key: str, choices: Sequence[str]) -> str:
        value = self.get(key)
        if value not in choices:
            raise self.error(f"{_short(value)} is not one of {list(choices)}", key)
        return cast(str, value)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_PLAIN_NAME = "a plain file name inside the shard directory"


def _file_name(fields: _Fields, key: str) -> str:
    name = fields.text(key, _FILE_NAME, _PLAIN_NAME)
    if name in _RESERVED and key == "file":
        raise fields.error(f"{name!r} is reserved for the directory's own files", key)
    return name


def _shard(where: str, index: int, values: object, vocab: int) -> ShardEntry:
    fields = _Fields(where, values, f"shards[{index}]")
    has_max = "max_id" in fields.values  # absent from manifests written before it existed
    return ShardEntry(
        file=_file_name(fields, "file"),
        split=cast(Split, fields.choice("split", _SPLITS)),
        tokens=fields.integer("tokens", 1, MAX_SHARD_TOKENS),
        sha256=fields.text("sha256", _SHA256, "a sha256 (64 lower-case hex digits)"),
        max_id=fields.integer("max_id", 0, vocab - 1) if has_max else None,
    )


def _tokenizer(where: str, values: object) -> TokenizerRecord:
    fields = _Fields(where, values, "tokenizer")
    kind = cast(Literal["bytes", "tokenizers"], fields.choice("kind", ("bytes", "tokenizers")))
    sha = fields.text("sha256", _SHA256, "a sha256 (64 lower-case hex digits)")
    file = None if fields.get("file") is None else fields.text("file", _FILE_NAME, _PLAIN_NAME)
    return TokenizerRecord(kind=kind, sha256=sha, file=file)


def parse_manifest(data: bytes, where: str) -> TokenManifest:
    """The manifest in ``data`` (``where`` names it in errors); ``ManifestError`` otherwise."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {len(data):,} bytes, more than a manifest may have")
    try:
        values = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{where}: not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{where}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except (RecursionError, ValueError) as exc:  # nesting too deep, integers too long
        raise ManifestError(f"{where}: not a usable JSON document ({type(exc).__name__})") from None
    fields = _Fields(where, values, "")
    if fields.get("format") != FORMAT:
        raise fields.error(f"{_short(fields.get('format'))} is not {FORMAT!r}", "format")
    version = fields.integer("version", 1, 1 << 31)
    if version != _FORMAT_VERSION:
        raise fields.error(
            f"{version} is newer than this speedtronic reads ({_FORMAT_VERSION}): upgrade "
            "speedtronic or prepare the shards again",
            "version",
        )
    dtype = cast(Literal["uint16", "uint32"], fields.choice("dtype", tuple(DTYPES)))
    vocab = fields.integer("vocab_size", 1, _MAX_VOCAB)
    if DTYPES[dtype].itemsize < DTYPES[token_dtype(vocab)].itemsize:
        raise fields.error(f"{dtype} cannot hold a vocabulary of {vocab} ids", "dtype")
    eos = fields.integer("eos_id", 0, vocab - 1)
    fraction = fields.get("eval_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise fields.error(f"must be a number, got {_kind(fraction)}", "eval_fraction")
    if not (math.isfinite(fraction) and 0 <= fraction < 1):
        raise fields.error(f"{fraction!r} is not in [0, 1)", "eval_fraction")
    raw_shards = fields.get("shards")
    if not isinstance(raw_shards, list) or not raw_shards:
        raise fields.error("must be a non-empty list", "shards")
    if len(raw_shards) > _MAX_SHARDS:
        raise fields.error(f"{len(raw_shards):,} shards, more than {_MAX_SHARDS:,}", "shards")
    shards = tuple(_shard(where, index, item, vocab) for index, item in enumerate(raw_shards))
    seen: set[str] = set()
    for index, shard in enumerate(shards):
        if shard.file in seen:
            raise ManifestError(f"{where}: shards[{index}].file: {shard.file!r} is listed twice")
        seen.add(shard.file)
    manifest = TokenManifest(
        dtype=dtype,
        vocab_size=vocab,
        eos_id=eos,
        tokenizer=_tokenizer(where, fields.get("tokenizer")),
        documents=fields.integer("documents", 0, 1 << 62),
        eval_fraction=float(fraction),
        shard_tokens=fields.integer("shard_tokens", 1, MAX_SHARD_TOKENS),
        shards=shards,
    )
    total = fields.integer("tokens", 1, MAX_SHARD_TOKENS * _MAX_SHARDS)
    if total != manifest.tokens:
        raise fields.error(f"{total} is not the sum of the shards' tokens", "tokens")
    if manifest.tokenizer.file in seen:
        raise fields.error("names a shard as the tokenizer file", "tokenizer.file")
    return manifest


def read_manifest(directory: str | Path) -> TokenManifest:
    """The manifest of a shard directory (``ManifestError`` when it is missing or bad)."""
    folder = Path(directory)
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise ManifestError(
            f"{folder} is not a directory of token shards (make one with speedtronic prepare)"
        )
    try:
        with open_data_file(path) as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
    except DataSourceError as exc:  # a FIFO or a device: refused, never waited on
        raise ManifestError(f"{exc}; it must be the manifest written by prepare") from None
    except FileNotFoundError:
        raise ManifestError(
            f"{folder} has no {MANIFEST_NAME}: not a directory written by speedtronic prepare "
            "(or the prepare run did not finish)"
        ) from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return parse_manifest(data, str(path))


# -- verifying the shards ---------------------------------------------------------------------

_DIGESTS: dict[tuple[str, int, int, int, int], tuple[str, int]] = {}
"""``shard_digest`` of the shards this process already read, by (path, size, mtime, inode,
device): the training and the evaluation loader of a run read each shard once."""
_READ_CHUNK = 1 << 20  # a multiple of every dtype's itemsize


def _stat_key(path: Path) -> tuple[str, int, int, int, int]:
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev)


def shard_digest(path: Path, dtype: np.dtype[np.unsignedinteger]) -> tuple[str, int]:
    """``(sha256, largest token id)`` of a shard's bytes, in one read (``-1``: no tokens)."""
    digest = hashlib.sha256()
    largest = -1
    with open_data_file(path) as handle:
        while chunk := handle.read(_READ_CHUNK):
            digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype, count=len(chunk) // dtype.itemsize)
            if ids.size:
                largest = max(largest, int(ids.max()))
    return digest.hexdigest(), largest


def check_inside(path: Path, folder: Path) -> None:
    """Refuse a shard (or its loss mask) that is a link to a file outside its directory."""
    target = path.resolve()
    if not target.is_relative_to(folder.resolve()):
        raise ShardError(
            f"{path}: a link to {target}, outside {folder}: shards are read only from inside "
            "their own directory; copy the file in, or prepare the shards again"
        )


def _check_bytes(path: Path, manifest: TokenManifest, shard: ShardEntry) -> None:
    """The shard's sha256 and largest id against the manifest (``ShardError``)."""
    key = _stat_key(path)
    found = _DIGESTS.get(key)
    if found is None:
        found = _DIGESTS[key] = shard_digest(path, manifest.numpy_dtype)
    digest, largest = found
    if digest != shard.sha256:
        raise ShardError(
            f"{path}: sha256 {digest[:16]}... differs from index.json's "
            f"{shard.sha256[:16]}...: the shard was modified; prepare the shards again"
        )
    if largest >= manifest.vocab_size:
        raise ShardError(
            f"{path}: holds token id {largest}, outside index.json's vocabulary of "
            f"{manifest.vocab_size} ids (0-{manifest.vocab_size - 1}): the shard was altered "
            "after prepare; prepare the shards again"
        )
    if shard.max_id is not None and largest != shard.max_id:
        raise ShardError(
            f"{path}: its largest token id is {largest}, index.json records {shard.max_id}: "
            "the shard was modified; prepare the shards again"
        )


def verify_shards(
    directory: str | Path, manifest: TokenManifest, shards: Sequence[ShardEntry], *, checksums: bool
) -> None:
    """Check that each of ``shards`` is a file inside ``directory`` (a link out of it is
    refused) with the size its token count gives and, with ``checksums``, the sha256 and the
    largest token id (below ``vocab_size``, and the recorded ``max_id``) that the manifest
    records, all from one read of its bytes; ``ShardError`` otherwise."""
    folder = Path(directory)
    itemsize = manifest.numpy_dtype.itemsize
    for shard in shards:
        path = folder / shard.file
        expected = shard.tokens * itemsize
        if not path.is_file():
            what = "not a regular file" if path.exists() else "missing (index.json lists it)"
            raise ShardError(f"{path}: {what}; prepare the shards again")
        check_inside(path, folder)
        size = path.stat().st_size
        if size != expected:
            raise ShardError(
                f"{path}: {size:,} bytes, but index.json records {shard.tokens:,} {manifest.dtype} "
                f"tokens ({expected:,} bytes): the shard is truncated or was replaced; prepare "
                "the shards again"
            )
        if checksums:
            _check_bytes(path, manifest, shard)


def check_tokenizer(
    manifest: TokenManifest, directory: str | Path, tokenizer: str, *, key: str = "data.tokenizer"
) -> None:
    """Refuse shards made with another tokenizer than ``tokenizer`` (``"bytes"`` or a
    ``tokenizer.json`` path): their token ids would mean other text."""
    if tokenizer == BYTES:
        actual = BYTE_TOKENIZER_SHA256
    else:
        try:
            actual = hashlib.sha256(read_tokenizer_file(Path(tokenizer))).hexdigest()
        except DataSourceError as exc:
            raise DataSourceError(f"{key}: {exc}") from None
    expected = manifest.tokenizer.sha256
    if actual != expected:
        made_with = (
            "the byte tokenizer"
            if manifest.tokenizer.kind == "bytes"
            else f"{Path(directory) / (manifest.tokenizer.file or TOKENIZER_NAME)}"
        )
        raise DataSourceError(
            f"{key}: {tokenizer} (sha256 {actual[:12]}...) is not the tokenizer {directory} was "
            f"prepared with ({made_with}, sha256 {expected[:12]}... in {MANIFEST_NAME}): name "
            "that tokenizer, or prepare the shards again with this one"
        )
