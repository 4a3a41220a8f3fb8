"""Tokenizers for real text: a ``tokenizer.json`` through the Hugging Face ``tokenizers``
library, or the byte tokenizer, behind one small interface (``CorpusTokenizer``).

``load_tokenizer(spec)`` takes what ``speedtronic prepare --tokenizer`` and
``data.tokenizer`` take: ``"bytes"`` (the byte tokenizer, no extra needed) or the path of a
``tokenizer.json``. The ``tokenizers`` library is imported only here and only when a file is
loaded; without it, loading one is a ``MissingExtraError`` naming the ``pip install`` line.

Both tokenizers encode text as it is: no special tokens are added (no BOS/EOS template: a
stream is encoded in chunks and ``prepare`` puts its own end-of-document id after each
document), and special-token text inside a document (a literal ``<|endoftext|>``) is
encoded as ordinary text, so the only end-of-document ids in token shards are the ones
``prepare`` wrote.

``vocab_size`` is the largest token id plus one (what a model's embedding needs), which is
more than the number of tokens when a vocabulary skips ids.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from speedtronic.data.text import DataSourceError, open_data_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizerObject

__all__ = [
    "BYTES",
    "BYTE_EOS_ID",
    "BYTE_TOKENIZER_SHA256",
    "EOS_CANDIDATES",
    "HF_EXTRA",
    "ByteCorpusTokenizer",
    "CorpusTokenizer",
    "FileTokenizer",
    "MissingExtraError",
    "TokenizerFailure",
    "load_tokenizer",
    "read_tokenizer_file",
    "require_module",
    "sha256_of_file",
    "tokenizer_from_bytes",
]

HF_EXTRA = 'pip install "speedtronic[hf]"'
"""The install line that brings ``tokenizers``, ``transformers``, ``safetensors``, ``pyarrow``."""

BYTES = "bytes"
"""The name of the byte tokenizer (``--tokenizer bytes``, ``data.tokenizer: bytes``)."""

_BYTE_VOCAB_SIZE = 257
"""The byte tokenizer of token shards: ids 0-255 are UTF-8 bytes, 256 ends a document."""

BYTE_EOS_ID = 256

BYTE_TOKENIZER_SHA256 = hashlib.sha256(
    b"speedtronic byte tokenizer v1: ids 0-255 are the UTF-8 bytes, 256 ends a document"
).hexdigest()
"""The fixed identity recorded as the byte tokenizer's sha256 in a shard manifest."""

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
"""Special tokens taken as the end-of-document token when ``--eos-token`` is not given, in
this order of preference (GPT-2/GPT-NeoX, Llama 3, Llama 2/Mistral/T5, Gemma, ...)."""

_HASH_CHUNK = 1 << 20


class MissingExtraError(DataSourceError):
    """An optional dependency (the ``hf`` extra) is needed and not installed."""


def require_module(name: str, purpose: str) -> ModuleType:
    """Import ``name`` (a module of the ``hf`` extra) or say how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingExtraError(
            f"{purpose} needs the {name.split('.')[0]!r} package: {HF_EXTRA}"
        ) from None


def sha256_of_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open_data_file(path) as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class TokenizerFailure(DataSourceError):
    """The ``tokenizers`` library failed on a text (a Rust panic: a pre-tokenizer's regex
    that gives up, ...); the message names the tokenizer file, ``reason`` is the library's."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _is_library_failure(exc: BaseException) -> bool:
    # pyo3 turns a Rust panic into ``pyo3_runtime.PanicException``, a BaseException that no
    # module exports by name.
    return type(exc).__name__ == "PanicException"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class CorpusTokenizer(Protocol):
    """What ``prepare`` and the text stream need of a tokenizer."""

    @property
    def name(self) -> str:
        """``"bytes"`` or the tokenizer file's path, for messages."""

    @property
    def sha256(self) -> str:
        """The identity recorded in (and checked against) a shard manifest."""

    @property
    def vocab_size(self) -> int:
        """The largest token id plus one."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added)."""

    def encode_documents(
        self, texts: Sequence[str], ends: Sequence[bool], eos_id: int, dtype: npt.DTypeLike
    ) -> npt.NDArray[np.unsignedinteger]:
        """The ids of ``texts`` one after the other as one array of ``dtype``, with
        ``eos_id`` after each text whose ``ends`` flag is set (the end of a document)."""

    def eos_id(self, token: str | None) -> int:
        """The end-of-document id: that of ``token`` when given, else the tokenizer's own
        (``EOS_CANDIDATES``); a ``DataSourceError`` when there is none."""


class ByteCorpusTokenizer:
    """The byte tokenizer: a UTF-8 byte ``b`` is id ``b``; id 256 ends a document."""

    name = BYTES
    sha256 = BYTE_TOKENIZER_SHA256
    vocab_size = _BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_documents(
        self, texts: Sequence[str], ends: Sequence[bool], eos_id: int, dtype: npt.DTypeLike
    ) -> npt.NDArray[np.unsignedinteger]:
        ids = [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
        return _joined(ids, ends, eos_id, dtype)

    def eos_id(self, token: str | None) -> int:
        if token is not None:
            raise DataSourceError(
                f"--eos-token {token!r}: the byte tokenizer's end-of-document id is always "
                f"{BYTE_EOS_ID}; leave --eos-token out"
            )
        return BYTE_EOS_ID


class FileTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: str | Path, data: bytes | None = None) -> None:
        """``data``: the file's bytes when they are already read (a worker process)."""
        self.path = Path(path)
        if data is None:
            data = read_tokenizer_file(self.path)
        self.data = data
        """The file's bytes, read once: what is hashed, loaded and copied is the same."""
        self.sha256 = hashlib.sha256(self.data).hexdigest()
        self._tokenizer = tokenizer_from_bytes(self.data, str(self.path))
        tokenizer = self._tokenizer
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(max(ids, default=-1) + 1, tokenizer.get_vocab_size(True))

    @property
    def name(self) -> str:
        return str(self.path)

    def encode(self, text: str) -> list[int]:
        try:
            return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        except BaseException as exc:
            raise self._failure(exc) from None

    def encode_documents(
        self, texts: Sequence[str], ends: Sequence[bool], eos_id: int, dtype: npt.DTypeLike
    ) -> npt.NDArray[np.unsignedinteger]:
        tokenizer = self._tokenizer
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets nobody reads.
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        try:
            encodings = encode(list(texts), add_special_tokens=False)
        except BaseException as exc:
            raise self._failure(exc) from None
        return _joined([encoding.ids for encoding in encodings], ends, eos_id, dtype)

    def _failure(self, exc: BaseException) -> BaseException:
        """A library failure as a ``TokenizerFailure``; anything else (Ctrl-C) unchanged."""
        if not _is_library_failure(exc):
            return exc
        reason = _first_line(exc)
        return TokenizerFailure(f"{self.path}: the tokenizer failed ({reason})", reason)

    def eos_id(self, token: str | None) -> int:
        if token is not None:
            found = self._tokenizer.token_to_id(token)
            if found is None:
                raise DataSourceError(f"--eos-token {token!r} is not a token of {self.path}")
            return int(found)
        special = self._special()
        for candidate in EOS_CANDIDATES:
            if candidate in special:
                return special[candidate]
        listed = ", ".join(repr(name) for name in sorted(special)) or "none"
        raise DataSourceError(
            f"{self.path} names no end-of-document token (special tokens: {listed}); "
            "pass --eos-token with the token that ends a document"
        )

    def _special(self) -> dict[str, int]:
        return {
            added.content: int(index)
            for index, added in self._tokenizer.get_added_tokens_decoder().items()
            if added.special
        }

    def special_id(self, token: str) -> int | None:
        """The id of the special token ``token``, None when the tokenizer has no such one."""
        return self._special().get(token)

    def token(self, token_id: int) -> str | None:
        """The text of token ``token_id`` (None for an id the vocabulary skips)."""
        found: str | None = self._tokenizer.id_to_token(token_id)
        return found


def read_tokenizer_file(path: Path) -> bytes:
    """The bytes of a ``tokenizer.json`` (a ``DataSourceError`` when it is missing or not a
    regular file: a FIFO is refused, never waited on)."""
    try:
        with open_data_file(path) as handle:
            return handle.read()
    except FileNotFoundError:
        raise DataSourceError(f"tokenizer file not found: {path}") from None
    except DataSourceError as exc:
        raise DataSourceError(f"tokenizer {exc}") from None
    except OSError as exc:
        raise DataSourceError(f"tokenizer {path}: cannot be read ({exc.strerror or exc})") from None


def tokenizer_from_bytes(data: bytes, where: str) -> HFTokenizerObject:
    """A ``tokenizers.Tokenizer`` from the bytes of a ``tokenizer.json`` (``where`` names it
    in errors), set to encode special-token text as text (module docstring)."""
    library = require_module("tokenizers", f"the tokenizer {where}")
    try:
        tokenizer: HFTokenizerObject = library.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the library raises plain Exception for a bad file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataSourceError(
            f"{where}: not a tokenizer file the tokenizers library can load ({reason})"
        ) from None
    tokenizer.encode_special_tokens = True
    return tokenizer


def _joined(
    ids: Sequence[Sequence[int] | npt.NDArray[np.unsignedinteger]],
    ends: Sequence[bool],
    eos_id: int,
    dtype: npt.DTypeLike,
) -> npt.NDArray[np.unsignedinteger]:
    """The ids of each text one after the other as one ``dtype`` array, ``eos_id`` after
    each text whose ``ends`` flag is set."""
    parts: list[npt.NDArray[np.unsignedinteger]] = []
    eos = np.array([eos_id], dtype=dtype)
    for text_ids, end in zip(ids, ends, strict=True):
        parts.append(np.asarray(text_ids, dtype=dtype))
        if end:
            parts.append(eos)
    if not parts:
        return np.empty(0, dtype=dtype)
    return np.concatenate(parts)


def load_tokenizer(spec: str | Path) -> CorpusTokenizer:
    """``"bytes"`` -> the byte tokenizer; anything else -> the ``tokenizer.json`` at that
    path (``DataSourceError`` when it is missing or unreadable, ``MissingExtraError``
    without the ``tokenizers`` package)."""
    if str(spec) == BYTES:
        return ByteCorpusTokenizer()
    return FileTokenizer(spec)
