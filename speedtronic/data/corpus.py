"""The documents of a corpus, for ``speedtronic prepare``: which files, and the text in them.

Inputs (``expand_inputs``): each ``--input`` is a file, a directory (its ``.txt``, ``.jsonl``
and ``.parquet`` files, recursively, sorted by path) or a glob (``*``, ``?``, ``[...]``;
``**`` descends; matches sorted). Files are read in the order the inputs are given; a file
named twice is read once, the first time.

With ``--input-format`` (``given``) every file is read as that format whatever its name, and a
directory gives all its files but hidden ones.

Documents, by format (``read_segments``; the suffix unless ``--input-format`` says):

* ``.txt``: the whole file is one document, read in chunks of about ``TEXT_CHUNK_BYTES``
  cut at whitespace (a chunk boundary never splits a word), so a file of any size streams;
  with a ``separator`` (``--doc-separator``) each run of lines between lines equal to it
  (blank lines for ``""``) is a document, read line by line in bounded pieces;
* ``.jsonl``: one document per line, the string under ``text_key`` (blank lines skipped);
* ``.parquet`` (needs ``pyarrow``): one document per row of the string column ``text_key``
  (``string``, ``large_string``, ``string_view``, or dictionary-encoded strings).

A document that is empty or only whitespace is no document: it is skipped. A leading UTF-8
byte-order mark is not text and is dropped (a file holding only one has no document).

Document size (``DocumentLimit``). A JSONL line or a parquet value is held in memory whole,
so its size is bounded: ``max_bytes`` (``--max-document-bytes``, default
``DEFAULT_MAX_DOCUMENT_BYTES``). A longer one is refused, naming its file and line (row),
or, with ``long="split"`` (``--long-documents split``), tokenized in pieces of about
``TEXT_CHUNK_BYTES`` cut at whitespace, as a ``.txt`` file is (it stays one document); in
that mode a JSONL line of up to ``_SPLIT_LINE_CEILING`` bytes is read. A line is read with
that bound, never whole first. A ``.txt`` file streams whatever its size.

Each segment carries ``where`` its document is (``file:line``, ``file row N``, ``file``)
for the messages of a tokenizer that fails on it.

Every problem is a ``CorpusError`` (a ``DataSourceError``) that names the file and the place:
the line of a JSONL row (malformed JSON, no ``text_key``, not a string), the byte offset of
invalid UTF-8 (or of a NUL byte: a binary file, called so even when an invalid byte comes
after its first NUL), the row of a parquet null.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import BinaryIO, Literal, cast

from speedtronic.data.text import DataSourceError, open_data_file, read_text_chunks
from speedtronic.data.tokenizer import require_module

__all__ = [
    "DEFAULT_MAX_DOCUMENT_BYTES",
    "CorpusError",
    "DocumentLimit",
    "InputFormat",
    "LongDocuments",
    "Segment",
    "expand_inputs",
    "read_segments",
]

_SUFFIXES = (".txt", ".jsonl", ".parquet")
TEXT_CHUNK_BYTES = 1 << 20
_PARQUET_BATCH_ROWS = 1024
DEFAULT_MAX_DOCUMENT_BYTES = 64 << 20
"""The longest JSONL line / parquet value ``prepare`` takes by default (64 MiB)."""
_SPLIT_LINE_CEILING = 1 << 30
"""The longest JSONL line read (whole) with ``--long-documents split`` (1 GiB)."""
_SNIFF_BYTES = 1 << 16
_MAX_BLANK_CHUNKS = 64
"""Leading whitespace-only chunks of a ``.txt`` file held back to see whether text follows."""

LongDocuments = Literal["refuse", "split"]
InputFormat = Literal["txt", "jsonl", "parquet"]
_BOM = "\ufeff"
_GLOB_CHARACTERS = frozenset("*?[")


class CorpusError(DataSourceError):
    """An input of ``speedtronic prepare`` that cannot be read as text."""


@dataclass(frozen=True)
class Segment:
    """A piece of a document: its text, whether the document ends with it, and how many
    bytes of the input file it accounts for (for the progress bar)."""

    text: str
    ends_document: bool
    nbytes: int
    where: str = ""


@dataclass(frozen=True)
class DocumentLimit:
    """How long a document held in memory may be, and what a longer one gets (module
    docstring)."""

    max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES
    long: LongDocuments = "refuse"

    @property
    def line_bytes(self) -> int:
        """The longest JSONL line read."""
        return max(self.max_bytes, _SPLIT_LINE_CEILING) if self.long == "split" else self.max_bytes


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _file_format(path: Path, given: InputFormat | None = None) -> InputFormat | None:
    """How a file is read: ``given`` (``--input-format``), else by its suffix (None: not a
    corpus file)."""
    if given is not None:
        return given
    suffix = _suffix(path)
    return cast(InputFormat, suffix[1:]) if suffix in _SUFFIXES else None


def _directory_files(directory: Path, given: InputFormat | None) -> list[Path]:
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    if given is not None:  # every file but hidden ones (``.git``, editor swap files)
        relative = [path.relative_to(directory) for path in files]
        usable = [
            path
            for path, name in zip(files, relative, strict=True)
            if not any(part.startswith(".") for part in name.parts)
        ]
    else:
        usable = [path for path in files if _suffix(path) in _SUFFIXES]
    if not usable:
        others = ", ".join(path.name for path in files[:3]) or "none"
        raise CorpusError(
            f"--input {directory}: a directory with no {', '.join(_SUFFIXES)} files in it "
            f"({len(files)} other files: {others}{', ...' if len(files) > 3 else ''})"
        )
    return usable


def _one_input(pattern: str, given: InputFormat | None) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_dir():
        return _directory_files(path, given)
    if path.exists():
        found = [path]
    elif _GLOB_CHARACTERS & set(pattern):
        found = sorted(Path(match) for match in glob.glob(str(path), recursive=True))
        found = [match for match in found if match.is_file()]
        if not found:
            raise CorpusError(f"--input {pattern!r} matches no file")
    else:
        raise CorpusError(f"--input {pattern}: no such file or directory")
    for file in found:
        if not file.is_file():
            raise CorpusError(f"--input {file}: not a regular file")
        if _file_format(file, given) is None:
            matched = f" (matched by {pattern!r})" if str(file) != pattern else ""
            raise CorpusError(
                f"--input {file}{matched}: not a {', '.join(_SUFFIXES)} file; rename it, name "
                "its format with --input-format, or leave it out"
            )
    return found


def expand_inputs(patterns: Sequence[str], given: InputFormat | None = None) -> list[Path]:
    """The input files, in order, each once (module docstring); ``given``: every file is of
    that format (``--input-format``), whatever its name."""
    if not patterns:
        raise CorpusError("no --input given")
    files: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        for file in _one_input(pattern, given):
            resolved = file.resolve()
            if resolved not in seen:
                seen.add(resolved)
                files.append(file)
    return files


def read_segments(
    path: Path,
    text_key: str,
    limit: DocumentLimit | None = None,
    *,
    given: InputFormat | None = None,
    separator: str | None = None,
) -> Iterator[Segment]:
    """The documents of one input file as segments (module docstring): ``given`` is the
    format of every file (``--input-format``; default: by suffix), ``separator`` the line
    that separates the documents of a text file (``--doc-separator``)."""
    kind = _file_format(path, given) or "txt"
    limit = DocumentLimit() if limit is None else limit
    if kind == "txt":
        return _text_file(path) if separator is None else _separated_documents(path, separator)
    if kind == "jsonl":
        return _jsonl_file(path, text_key, limit)
    return _parquet_file(path, text_key, limit)


def _text_chunks(path: Path) -> Iterator[Segment]:
    """The file's text in chunks (none ends the document: ``_text_file`` decides)."""
    read = 0  # file offset read up to
    text_bytes = 0  # bytes of the text handed out so far (where the next chunk starts)
    where = str(path)
    try:
        for text, end in read_text_chunks(path, TEXT_CHUNK_BYTES):
            if read == 0 and text.startswith(_BOM):
                text, text_bytes = text[1:], 3
            nul = text.find("\x00")
            if nul >= 0:
                offset = text_bytes + len(text[:nul].encode("utf-8"))
                raise CorpusError(f"{path}: binary data, not text (a NUL byte at byte {offset})")
            text_bytes += len(text) if text.isascii() else len(text.encode("utf-8"))
            yield Segment(text, False, end - read, where)
            read = end
    except CorpusError:
        raise
    except DataSourceError as exc:  # invalid UTF-8 (with its byte offset), not a file
        raise _binary_or(path, CorpusError(str(exc))) from None


def _binary_or(path: Path, error: CorpusError) -> CorpusError:
    """``error`` (invalid UTF-8), or the plainer news that the file is binary when a NUL byte
    comes first in its first ``_SNIFF_BYTES`` (a binary file's first invalid byte may come
    after its first NUL)."""
    with contextlib.suppress(OSError, DataSourceError), open_data_file(path) as handle:
        nul = handle.read(_SNIFF_BYTES).find(b"\x00")
        if nul >= 0:
            return CorpusError(f"{path}: binary data, not text (a NUL byte at byte {nul})")
    return error


def _text_file(path: Path) -> Iterator[Segment]:
    """One document: its last chunk ends it; whitespace only is no document."""
    pending: list[Segment] = []  # the last chunk, and leading whitespace-only ones
    has_text = False
    for segment in _text_chunks(path):
        pending.append(segment)
        has_text = has_text or bool(segment.text.strip()) or len(pending) > _MAX_BLANK_CHUNKS
        if has_text and len(pending) > 1:
            yield from pending[:-1]
            del pending[:-1]
    if not pending:
        return
    if has_text:
        last = pending[-1]
        yield Segment(last.text, True, last.nbytes, last.where)
    else:
        yield Segment("", False, sum(segment.nbytes for segment in pending), str(path))


class _Document:
    """The document being read from a separated text file (``_separated_documents``)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.pieces: list[str] = []
        self.chars = 0
        self.nbytes = 0
        self.has_text = False

    def add(self, text: str, nbytes: int) -> Segment | None:
        """Take a line; a segment to hand out when a chunk's worth has gathered."""
        self.pieces.append(text)
        self.chars += len(text)
        self.nbytes += nbytes
        self.has_text = self.has_text or bool(text.strip())
        if self.chars < TEXT_CHUNK_BYTES:
            return None
        segment = Segment("".join(self.pieces) if self.has_text else "", False, self.nbytes)
        self.pieces, self.chars, self.nbytes = [], 0, 0  # leading whitespace alone: dropped
        return Segment(segment.text, False, segment.nbytes, self.where)

    def end(self, nbytes: int) -> Segment:
        """The document's last segment (no document when it held only whitespace)."""
        text = "".join(self.pieces) if self.has_text else ""
        return Segment(text, self.has_text, self.nbytes + nbytes, self.where)


def _is_separator(line: str, separator: str) -> bool:
    line = line.rstrip("\r\n")
    return not line.strip() if separator == "" else line == separator


def _separated_documents(path: Path, separator: str) -> Iterator[Segment]:
    """A text file whose documents are separated by lines equal to ``separator`` (``""``:
    blank lines), e.g. fortune's ``%``: each run of lines between them is a document, read
    line by line in bounded pieces (module docstring)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    number, offset, line_start = 1, 0, True
    document = _Document(f"{path}:1")
    with open_data_file(path) as handle:
        while raw := handle.readline(TEXT_CHUNK_BYTES):
            # A read short of the bound without a newline is the file's last line.
            whole = raw.endswith(b"\n") or len(raw) < TEXT_CHUNK_BYTES
            start, offset = offset, offset + len(raw)
            if start == 0 and raw.startswith(b"\xef\xbb\xbf"):
                raw, start = raw[3:], 3
            if (nul := raw.find(b"\x00")) >= 0:
                raise CorpusError(
                    f"{path}:{number}: binary data, not text (a NUL byte at byte {start + nul})"
                )
            try:
                text = decoder.decode(raw)
            except UnicodeDecodeError as exc:
                raise CorpusError(
                    f"{path}:{number}: invalid UTF-8 at byte {start + exc.start} ({exc.reason})"
                ) from None
            if line_start and whole and _is_separator(text, separator):
                yield document.end(len(raw))
                document = _Document(f"{path}:{number + 1}")
            elif (segment := document.add(text, len(raw))) is not None:
                yield segment
            line_start = whole
            number += whole
    if decoder.decode(b"", final=False) or decoder.getstate()[0]:
        raise CorpusError(f"{path}: invalid UTF-8 at byte {offset} (the file ends mid-character)")
    yield document.end(0)


def _too_long(where: str, size: int, limit: DocumentLimit) -> CorpusError:
    return CorpusError(
        f"{where}: a document of {size:,} bytes, more than --max-document-bytes "
        f"{limit.max_bytes:,}; pass --long-documents split to tokenize it in pieces, or raise "
        "--max-document-bytes"
    )


def _line_too_long(where: str, limit: DocumentLimit) -> CorpusError:
    if limit.long == "split":
        return CorpusError(
            f"{where}: a line of more than {limit.line_bytes:,} bytes, longer than any line "
            "prepare reads (1 GiB with --long-documents split); split the document over "
            "several lines"
        )
    return CorpusError(
        f"{where}: a line of more than {limit.line_bytes:,} bytes (--max-document-bytes); pass "
        "--long-documents split to tokenize long documents in pieces, or raise "
        "--max-document-bytes"
    )


def _document(text: str, where: str, nbytes: int, limit: DocumentLimit) -> Iterator[Segment]:
    """A document read whole, as one segment, or pieces when it is long (module docstring)."""
    if not text.strip():
        yield Segment("", False, nbytes, where)
        return
    size = len(text) if len(text) <= limit.max_bytes // 4 or text.isascii() else 0
    size = size or len(text.encode("utf-8"))
    if size <= limit.max_bytes:
        yield Segment(text, True, nbytes, where)
        return
    if limit.long == "refuse":
        raise _too_long(where, size, limit)
    start = 0
    while start < len(text):
        stop = min(len(text), start + TEXT_CHUNK_BYTES)
        if stop < len(text):
            cut = max(text.rfind(char, start + 1, stop) for char in (" ", "\n", "\t", "\r"))
            stop = cut if cut > start else stop
        last = stop >= len(text)
        yield Segment(text[start:stop], last, nbytes if last else 0, where)
        start = stop


def _jsonl_file(path: Path, text_key: str, limit: DocumentLimit) -> Iterator[Segment]:
    offset = 0
    bound = limit.line_bytes
    with open_data_file(path) as handle:
        number = 0
        while raw := handle.readline(bound + 1):  # a line longer than the bound is not read
            number += 1
            if len(raw) > bound and not raw.endswith(b"\n"):
                raise _line_too_long(f"{path}:{number}", limit)
            start, offset = offset, offset + len(raw)
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw, start = raw[3:], start + 3
            if (nul := raw.find(b"\x00")) >= 0:
                raise CorpusError(
                    f"{path}:{number}: binary data, not text (a NUL byte at byte {start + nul})"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(
                    f"{path}:{number}: invalid UTF-8 at byte {start + exc.start} ({exc.reason})"
                ) from None
            if not line.strip():
                continue
            text = _jsonl_text(path, number, line, text_key)
            yield from _document(text, f"{path}:{number}", len(raw), limit)


def _jsonl_text(path: Path, number: int, line: str, text_key: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(
            f"{path}:{number}: malformed JSON at column {exc.colno} ({exc.msg})"
        ) from None
    except (RecursionError, ValueError) as exc:
        raise CorpusError(f"{path}:{number}: malformed JSON ({type(exc).__name__})") from None
    if not isinstance(row, dict):
        raise CorpusError(
            f"{path}:{number}: a line must be a JSON object with a {text_key!r} key, got "
            f"{type(row).__name__}"
        )
    if text_key not in row:
        keys = ", ".join(repr(key) for key in list(row)[:8]) or "none"
        raise CorpusError(
            f"{path}:{number}: no {text_key!r} key (the row has {keys}); name the text field "
            "with --text-key"
        )
    text = row[text_key]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise CorpusError(f"{path}:{number}: {text_key!r} is {kind}, not a string")
    _check_encodable(text, f"{path}:{number}")
    return text


def _check_encodable(text: str, where: str) -> None:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which are not UTF-8."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CorpusError(
            f"{where}: the text holds {text[exc.start]!r} (an unpaired surrogate), not UTF-8"
        ) from None


def _parquet_file(path: Path, text_key: str, limit: DocumentLimit) -> Iterator[Segment]:
    parquet = require_module("pyarrow.parquet", f"reading {path}")
    with open_data_file(path) as handle:  # a FIFO is refused, not waited on
        yield from _parquet_rows(parquet, handle, path, text_key, limit)


def _parquet_rows(
    parquet: ModuleType, handle: BinaryIO, path: Path, text_key: str, limit: DocumentLimit
) -> Iterator[Segment]:
    try:
        reader = parquet.ParquetFile(handle)
        schema = reader.schema_arrow
    except Exception as exc:  # pyarrow raises its own ArrowException subclasses
        raise CorpusError(f"{path}: not a readable parquet file ({_first_line(exc)})") from None
    if text_key not in schema.names:
        names = ", ".join(repr(name) for name in schema.names[:8]) or "none"
        raise CorpusError(
            f"{path}: no column {text_key!r} (columns: {names}); name the text column with "
            "--text-key"
        )
    kind = schema.field(text_key).type
    # A dictionary-encoded column (pandas' category dtype, repeated texts) reads as strings.
    values = kind.value_type if str(kind).startswith("dictionary<") else kind
    if str(values) not in ("string", "large_string", "string_view"):
        raise CorpusError(f"{path}: column {text_key!r} is {kind}, not a string column")
    rows = max(1, int(reader.metadata.num_rows))
    size = path.stat().st_size
    row = 0
    try:
        for batch in reader.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_key]):
            values = batch.column(0).to_pylist()
            share = size * len(values) // rows
            for text in values:
                row += 1
                if text is None:
                    raise CorpusError(f"{path}: row {row} of column {text_key!r} is null")
                yield from _document(text, f"{path} row {row}", 0, limit)
            yield Segment("", False, share)
    except CorpusError:
        raise
    except Exception as exc:  # a corrupt page, invalid UTF-8 in a string column, ...
        raise CorpusError(f"{path}: after row {row}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
