"""Text data: the byte tokenizer, the tokenizer protocol and the streaming text-file dataset."""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal, Protocol, runtime_checkable

import torch
from torch.utils.data import IterableDataset, get_worker_info

from speedtronic.state.regular_file import NotRegularFileError, open_regular

__all__ = [
    "CharTokenizer",
    "DataSourceError",
    "TextPart",
    "held_out_cut",
    "open_data_file",
    "SupportsEncode",
    "TextFileTokenDataset",
    "Tokenizer",
    "encode_text",
    "read_text_chunks",
]

_DEFAULT_CHUNK_BYTES = 1 << 20
"""Bytes read from the file per chunk by ``TextFileTokenDataset``."""

_CUT_CHARACTERS = (" ", "\n", "\t", "\r")
"""Where a chunk may end (see ``TextFileTokenDataset``)."""


class DataSourceError(ValueError):
    """A data source that cannot be used: bad bytes, unknown name, refused file, no source."""


def open_data_file(path: Path) -> BinaryIO:
    """``path`` opened for reading when it is a regular file: a FIFO or a device (which
    would block or never end) is a ``DataSourceError`` naming it, found without blocking
    (``speedtronic.state.regular_file``); ``FileNotFoundError`` as ``open``."""
    try:
        return open_regular(path)
    except NotRegularFileError as exc:
        raise DataSourceError(str(exc)) from None


TextPart = Literal["all", "train", "held_out"]
"""Which bytes of a text file a ``TextFileTokenDataset`` reads: all of them, the training
part (everything before the held-out tail) or the held-out tail."""

_WHITESPACE_BYTES = frozenset(b" \n\t\r")
_CUT_SEARCH_BYTES = 1 << 20


def held_out_cut(path: Path, fraction: float) -> int:
    """The byte offset where the held-out tail of a text file starts: about the last
    ``fraction`` of its bytes, moved forward to the next ASCII whitespace byte (which never
    sits inside a multi-byte UTF-8 character, and where no word is split). The file size
    when there is no whitespace after that point (the held-out part is then empty)."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
    size = path.stat().st_size
    start = min(size, math.floor(size * (1 - fraction)))
    with open_data_file(path) as handle:
        handle.seek(start)
        position = start
        while position < size:
            window = handle.read(_CUT_SEARCH_BYTES)
            if not window:
                break
            for offset, byte in enumerate(window):
                if byte in _WHITESPACE_BYTES:
                    return position + offset
            position += len(window)
    return size


@runtime_checkable
class SupportsEncode(Protocol):
    """A tokenizer object with ``encode(text)`` returning token ids (a sequence of ints, or
    anything with ``.tolist()`` such as a tensor or an array)."""

    def encode(self, text: str) -> object: ...


Tokenizer = SupportsEncode | Callable[[str], object]
"""A tokenizer: an object with ``encode(text)``, or a callable ``text -> ids``."""


class CharTokenizer:
    """UTF-8 byte tokenizer: each byte ``b`` becomes ``b % vocab_size`` (lossy below 256)."""

    def __init__(self, vocab_size: int = 256) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        if self.vocab_size >= 256:
            return list(data)
        return [byte % self.vocab_size for byte in data]

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as plain ints, whatever the tokenizer returns."""
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode(text)
    ids = tokenizer.encode(text) if isinstance(tokenizer, SupportsEncode) else tokenizer(text)
    tolist = getattr(ids, "tolist", None)
    if callable(tolist):
        ids = tolist()
    if not isinstance(ids, (list, tuple)):
        raise TypeError(
            f"tokenizer returned {type(ids).__name__}; expected a sequence of token ids"
        )
    return [int(token) for token in ids]


class TextFileTokenDataset(IterableDataset[dict[str, torch.Tensor]]):
    """Streams a UTF-8 text file as ``{input_ids, labels}`` blocks of ``block_size`` tokens.

    The file is read in chunks of ``chunk_bytes`` bytes through an incremental UTF-8
    decoder, so a character split across two chunks is decoded whole; invalid UTF-8 is a
    ``DataSourceError`` naming the file and the byte offset. Each decoded chunk is cut after
    its last ASCII whitespace character and the rest is carried into the next chunk, so a
    tokenizer that does not merge across whitespace (byte-level, most BPE pre-tokenizers)
    sees the same words it would see on the whole text.

    Token ids are appended to a carry that is emitted as non-overlapping groups of
    ``block_size + 1`` tokens: ``input_ids = group[:-1]``, ``labels = group[1:]``. At the end
    of the file a carry of at least two tokens becomes one shorter block. With several
    DataLoader workers, worker ``w`` of ``W`` yields blocks ``w, w + W, ...`` (each reads
    the whole file), so together they yield every block exactly once.

    ``vocab_size`` is the modulus of the default ``CharTokenizer`` and the range every token
    id is checked against (an id outside it is an error here, not a device assert later).

    ``part`` and ``held_out_fraction`` split the file for evaluation (``held_out_cut``):
    ``"train"`` reads the bytes before the held-out tail, ``"held_out"`` the tail itself;
    the two never share a byte.
    """

    def __init__(
        self,
        path: str | Path,
        block_size: int,
        tokenizer: Tokenizer | None = None,
        vocab_size: int = 256,
        *,
        chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
        part: TextPart = "all",
        held_out_fraction: float = 0.05,
    ) -> None:
        super().__init__()
        for name, value in (
            ("block_size", block_size),
            ("vocab_size", vocab_size),
            ("chunk_bytes", chunk_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.path = Path(path)
        if not self.path.is_file():
            if self.path.exists():
                open_data_file(self.path).close()  # names what it is instead
            raise FileNotFoundError(f"text data file not found: {self.path}")
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.chunk_bytes = chunk_bytes
        self.tokenizer: Tokenizer = CharTokenizer(vocab_size) if tokenizer is None else tokenizer
        if part not in ("all", "train", "held_out"):
            raise ValueError(f"part must be 'all', 'train' or 'held_out', got {part!r}")
        self.part: TextPart = part
        self.held_out_fraction = held_out_fraction
        self._byte_range = (0, None) if part == "all" else self._split(held_out_fraction)

    def byte_count(self) -> int:
        """How many bytes of the file this dataset reads (its part)."""
        start, stop = self._byte_range
        size = self.path.stat().st_size
        return max(0, (size if stop is None else min(stop, size)) - start)

    def _split(self, fraction: float) -> tuple[int, int | None]:
        cut = held_out_cut(self.path, fraction)
        return (0, cut) if self.part == "train" else (cut, None)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for index, group in enumerate(self._groups()):
            if index % workers == worker:
                yield {
                    "input_ids": torch.tensor(group[:-1], dtype=torch.int64),
                    "labels": torch.tensor(group[1:], dtype=torch.int64),
                }

    def _groups(self) -> Iterator[list[int]]:
        size = self.block_size + 1
        carry: list[int] = []
        for text, read in read_text_chunks(self.path, self.chunk_bytes, self._byte_range):
            carry.extend(self._encode(text, read))
            whole = len(carry) - len(carry) % size
            for start in range(0, whole, size):
                yield carry[start : start + size]
            del carry[:whole]
        if len(carry) >= 2:
            yield carry

    def _encode(self, text: str, read: int) -> list[int]:
        try:
            ids = encode_text(self.tokenizer, text)
        except DataSourceError as exc:  # a tokenizer that failed on this text
            raise DataSourceError(f"{exc} on {self.path} (the text before byte {read:,})") from None
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise DataSourceError(
                f"{self.path}: the tokenizer produced token id {bad}, outside [0, "
                f"{self.vocab_size}); pass a vocab_size that matches the tokenizer and the model"
            )
        return ids


def read_text_chunks(
    path: Path, chunk_bytes: int, byte_range: tuple[int, int | None] = (0, None)
) -> Iterator[tuple[str, int]]:
    """The UTF-8 text of ``path`` (the bytes ``[start, stop)`` of ``byte_range``) in chunks of
    about ``chunk_bytes`` bytes, each cut after its last ASCII whitespace character (the rest
    goes to the next chunk), with the file offset read up to. Invalid UTF-8 is a
    ``DataSourceError`` naming the file and the byte offset."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    consumed = 0  # bytes handed to the decoder so far
    pending = ""
    try:
        handle = open_data_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"text data file not found: {path}") from None
    start, stop = byte_range
    with handle:
        handle.seek(start)
        left = None if stop is None else stop - start
        while True:
            want = chunk_bytes if left is None else min(chunk_bytes, left)
            raw = handle.read(want) if want > 0 else b""
            if left is not None:
                left -= len(raw)
            buffered = len(decoder.getstate()[0])
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                # exc.start indexes the decoder's buffered bytes followed by ``raw``.
                offset = start + consumed - buffered + exc.start
                raise DataSourceError(
                    f"{path}: invalid UTF-8 at byte {offset} ({exc.reason})"
                ) from None
            consumed += len(raw)
            text = pending + text
            position = start + consumed
            if not raw:
                if text:
                    yield text, position
                return
            cut = max(text.rfind(char) for char in _CUT_CHARACTERS)
            if cut <= 0:
                # No place to cut: tokenise it all rather than let the carry grow.
                pending = ""
                yield text, position
            else:
                pending = text[cut:]
                yield text[:cut], position
