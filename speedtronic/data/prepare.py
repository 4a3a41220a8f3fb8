"""``speedtronic prepare``: tokenize a corpus once into token shards (``speedtronic.data.shards``).

Pipeline. The inputs' documents (``speedtronic.data.corpus``, each at most
``max_document_bytes`` or split as ``long_documents`` says) are read in order in this process
and cut into batches of about ``BATCH_CHARS`` characters; each batch is encoded by
``workers`` processes (``speedtronic.data.encode_pool``: a dead worker, a tokenizer that
fails and a batch over ``tokenize_timeout`` are errors naming what and where; only the
byte tokenizer with ``workers=1`` runs here), results taken in submission order with at most
two batches per worker in flight, into token ids with the end-of-document id after each
document; the ids fill shards of ``shard_tokens`` tokens, one after the other, and each
shard's largest id is recorded. The batches depend only on the input and each batch's ids
only on the batch, so the output is byte-identical whatever the number of workers. Every
process tokenizes on one thread (``TOKENIZERS_PARALLELISM=false``): ``workers`` is the
parallelism, and nothing oversubscribes.

Held-out split (``eval_fraction``). The held-out shards are the corpus's last documents,
about ``eval_fraction`` of its tokens: the split falls on the document boundary nearest to
``tokens - ceil(eval_fraction * tokens)`` (on a tie, the earlier one), inside a document only
when the corpus is a single document. It is whole shards at the end (``eval-00000.bin``,
...): the shard the split falls in is cut in two.

Nothing is changed in place. Everything is written into a hidden staging directory next to
the output (``.<name>.prepare-<hex>``), each shard atomically (``speedtronic.state.atomic_io``)
and the manifest last; then the staging directory becomes the output in one rename (over an
absent or empty output) or, with ``overwrite``, two (the old shard directory is moved aside,
then deleted) -- only over a shard set ``prepare`` wrote that no run is reading
(``speedtronic.data.shard_output``). An error removes the staging directory; a killed run
leaves at most that directory, which nothing reads (delete it). The output is always the old
shard set or the new one, complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NoReturn, TextIO

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from speedtronic.data.corpus import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    CorpusError,
    DocumentLimit,
    InputFormat,
    LongDocuments,
    expand_inputs,
    read_segments,
)
from speedtronic.data.encode_pool import EncodePool, EncodeTask
from speedtronic.data.shard_output import (
    check_output,
    discard,
    missing_parent,
    publish,
    staging_directory,
)
from speedtronic.data.shards import (
    DTYPES,
    MANIFEST_NAME,
    MAX_SHARD_TOKENS,
    TOKENIZER_NAME,
    ShardEntry,
    Split,
    TokenizerRecord,
    TokenManifest,
    token_dtype,
)
from speedtronic.data.text import DataSourceError
from speedtronic.data.tokenizer import CorpusTokenizer, FileTokenizer, load_tokenizer
from speedtronic.state.atomic_io import atomic_write, atomic_write_bytes, atomic_write_text

__all__ = [
    "DEFAULT_MAX_DOCUMENT_BYTES",
    "PrepareError",
    "PrepareOptions",
    "PrepareResult",
    "prepare",
]

_DEFAULT_SHARD_TOKENS = 100_000_000
"""Tokens per shard: 200 MB files at uint16."""
_DEFAULT_EVAL_FRACTION = 0.01
_DEFAULT_TOKENIZE_TIMEOUT = 600.0
"""Seconds a worker may take for one batch (about ``BATCH_CHARS`` characters, or one
document of up to ``max_document_bytes``) before ``prepare`` gives up on the tokenizer."""
BATCH_CHARS = 1 << 20
_BATCH_SEGMENTS = 4096
_MAX_WORKERS = 1024
_SCAN_TOKENS = 1 << 20
_IN_FLIGHT_PER_WORKER = 2


class PrepareError(DataSourceError):
    """A ``speedtronic prepare`` request that cannot be carried out as given."""


@dataclass(frozen=True)
class PrepareOptions:
    """What ``speedtronic prepare`` is asked to do (its flags, ``docs/real-data.md``)."""

    inputs: Sequence[str]
    tokenizer: str
    output: str | Path
    text_key: str = "text"
    eos_token: str | None = None
    eval_fraction: float = _DEFAULT_EVAL_FRACTION
    shard_tokens: int = _DEFAULT_SHARD_TOKENS
    workers: int = 1
    overwrite: bool = False
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES
    long_documents: LongDocuments = "refuse"
    tokenize_timeout: float = _DEFAULT_TOKENIZE_TIMEOUT
    input_format: InputFormat | None = None
    """Read every input file as this format, whatever its name (default: by suffix)."""
    doc_separator: str | None = None
    """A line that separates the documents of a text file (``""``: a blank line)."""

    @property
    def limit(self) -> DocumentLimit:
        return DocumentLimit(self.max_document_bytes, self.long_documents)


@dataclass(frozen=True)
class PrepareResult:
    """What was written: the manifest, from how many files, in how long."""

    output: Path
    manifest: TokenManifest
    files: int
    seconds: float

    def summary(self) -> str:
        """One line for the terminal."""
        manifest = self.manifest
        train, held = manifest.split("train"), manifest.split("eval")
        held_tokens = sum(shard.tokens for shard in held)
        rate = manifest.tokens / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"prepared {self.output}: {manifest.documents:,} documents from {self.files} "
            f"file(s), {manifest.tokens:,} {manifest.dtype} tokens in {len(train)} training "
            f"+ {len(held)} held-out shard(s) ({held_tokens:,} tokens held out) in "
            f"{self.seconds:.1f} s ({rate:,.0f} tokens/s)"
        )


# -- checks before any work ---------------------------------------------------------------------


def _check_options(options: PrepareOptions) -> None:
    if not 0 <= options.eval_fraction < 1 or not math.isfinite(options.eval_fraction):
        raise PrepareError(f"--eval-fraction must be in [0, 1), got {options.eval_fraction}")
    if not 1 <= options.shard_tokens <= MAX_SHARD_TOKENS:
        raise PrepareError(
            f"--shard-tokens must be in [1, {MAX_SHARD_TOKENS}], got {options.shard_tokens}"
        )
    if not 1 <= options.workers <= _MAX_WORKERS:
        raise PrepareError(f"--workers must be in [1, {_MAX_WORKERS}], got {options.workers}")
    if not options.text_key:
        raise PrepareError("--text-key must not be empty")
    if options.max_document_bytes < 1:
        raise PrepareError(
            f"--max-document-bytes must be positive, got {options.max_document_bytes}"
        )
    if options.long_documents not in ("refuse", "split"):
        raise PrepareError(
            f"--long-documents must be refuse or split, got {options.long_documents!r}"
        )
    if not (math.isfinite(options.tokenize_timeout) and options.tokenize_timeout > 0):
        raise PrepareError(
            f"--tokenize-timeout must be a positive number of seconds, got "
            f"{options.tokenize_timeout}"
        )


def _check_inputs_outside(files: Sequence[Path], output: Path) -> None:
    root = output.resolve()
    for file in files:
        if file.resolve().is_relative_to(root):
            raise PrepareError(
                f"--input {file} is inside --output {output}, which --overwrite would replace"
            )


# -- reading and encoding ---------------------------------------------------------------------


@dataclass
class _Batch:
    texts: list[str]
    ends: list[bool]
    nbytes: int
    wheres: list[str] = field(default_factory=list)


@dataclass
class _Count:
    documents: int = 0


def _batches(files: Sequence[Path], options: PrepareOptions, count: _Count) -> Iterator[_Batch]:
    """The corpus's segments in batches of about ``BATCH_CHARS`` characters (``count``
    counts the documents)."""
    batch = _Batch([], [], 0)
    chars = 0
    for path in files:
        for segment in read_segments(
            path,
            options.text_key,
            options.limit,
            given=options.input_format,
            separator=options.doc_separator,
        ):
            batch.nbytes += segment.nbytes
            if not segment.text and not segment.ends_document:
                continue
            batch.texts.append(segment.text)
            batch.ends.append(segment.ends_document)
            batch.wheres.append(segment.where)
            count.documents += segment.ends_document
            chars += len(segment.text)
            if chars >= BATCH_CHARS or len(batch.texts) >= _BATCH_SEGMENTS:
                yield batch
                batch, chars = _Batch([], [], 0), 0
    if batch.texts or batch.nbytes:
        yield batch


def _encoded(
    batches: Iterator[_Batch],
    tokenizer: CorpusTokenizer,
    eos_id: int,
    dtype: str,
    options: PrepareOptions,
    bar: tqdm[NoReturn],
) -> Iterator[npt.NDArray[np.unsignedinteger]]:
    """Each batch's ids, in order (module docstring)."""
    if options.workers == 1 and not isinstance(tokenizer, FileTokenizer):
        for batch in batches:  # the byte tokenizer: NumPy, nothing to contain
            bar.update(batch.nbytes)
            yield tokenizer.encode_documents(batch.texts, batch.ends, eos_id, DTYPES[dtype])
        return
    with EncodePool(tokenizer, options.workers, options.tokenize_timeout) as pool:
        pending: deque[_Batch] = deque()
        for batch in batches:
            bar.update(batch.nbytes)
            pool.submit(EncodeTask(batch.texts, batch.ends, eos_id, dtype))
            pending.append(batch)
            if len(pending) >= _IN_FLIGHT_PER_WORKER * options.workers:
                yield pool.result(pending.popleft().wheres)
        while pending:
            yield pool.result(pending.popleft().wheres)


@contextlib.contextmanager
def _one_thread_per_process() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM=false`` while preparing (workers inherit it)."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


# -- writing shards ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """A shard written to the staging directory, before the held-out split names it."""

    path: Path
    tokens: int
    sha256: str
    max_id: int


class _TokenFlow:
    """The encoded arrays as one stream of tokens that fills shard after shard."""

    def __init__(self, arrays: Iterator[npt.NDArray[np.unsignedinteger]]) -> None:
        self._arrays = arrays
        self._head: npt.NDArray[np.unsignedinteger] | None = None

    def more(self) -> bool:
        while self._head is None or not len(self._head):
            self._head = next(self._arrays, None)
            if self._head is None:
                return False
        return True

    def fill(self, handle: BinaryIO, limit: int) -> tuple[int, str, int]:
        """Write up to ``limit`` tokens; ``(written, sha256, largest id)``."""
        digest = hashlib.sha256()
        written = 0
        largest = -1
        while written < limit and self.more():
            assert self._head is not None
            take = min(len(self._head), limit - written)
            piece = self._head[:take]
            data = piece.tobytes()
            handle.write(data)
            digest.update(data)
            largest = max(largest, int(piece.max()))
            written += take
            self._head = self._head[take:]
        return written, digest.hexdigest(), largest


def _write_parts(flow: _TokenFlow, staging: Path, shard_tokens: int) -> list[_Part]:
    parts: list[_Part] = []
    while flow.more():
        path = staging / f".part-{len(parts):05d}.bin"
        parts.append(_write_part(path, flow, shard_tokens))
    return parts


def _write_part(path: Path, flow: _TokenFlow, shard_tokens: int) -> _Part:
    filled: list[tuple[int, str, int]] = []
    atomic_write(path, lambda handle: filled.append(flow.fill(handle, shard_tokens)))
    return _Part(path, *filled[0])


class _Tokens:
    """Read access to the staged parts as one array of tokens (for the held-out split)."""

    def __init__(self, parts: Sequence[_Part], dtype: np.dtype[np.unsignedinteger]) -> None:
        self.parts = parts
        self.dtype = dtype
        self.starts = np.concatenate([[0], np.cumsum([part.tokens for part in parts])])
        self.total = int(self.starts[-1])

    def read(self, start: int, stop: int) -> npt.NDArray[np.unsignedinteger]:
        pieces = []
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for index in range(first, len(self.parts)):
            begin = int(self.starts[index])
            if begin >= stop:
                break
            mapped = np.memmap(
                self.parts[index].path,
                dtype=self.dtype,
                mode="r",
                shape=(self.parts[index].tokens,),
            )
            pieces.append(np.array(mapped[max(0, start - begin) : stop - begin]))
            del mapped
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)

    def next_eos(self, eos_id: int, start: int, stop: int) -> int | None:
        """The first position in ``[start, stop)`` holding ``eos_id``."""
        for begin in range(start, stop, _SCAN_TOKENS):
            found = np.flatnonzero(self.read(begin, min(begin + _SCAN_TOKENS, stop)) == eos_id)
            if found.size:
                return begin + int(found[0])
        return None

    def previous_eos(self, eos_id: int, start: int, stop: int) -> int | None:
        """The last position in ``[start, stop)`` holding ``eos_id``."""
        end = stop
        while end > start:
            begin = max(start, end - _SCAN_TOKENS)
            found = np.flatnonzero(self.read(begin, end) == eos_id)
            if found.size:
                return begin + int(found[-1])
            end = begin
        return None


def _held_out_start(tokens: _Tokens, eos_id: int, fraction: float) -> int:
    """The token offset where the held-out split begins (``tokens.total``: none)."""
    total = tokens.total
    if fraction == 0:
        return total
    target = total - max(1, math.ceil(total * fraction))
    if target <= 0:
        raise PrepareError(
            f"the corpus has {total} token(s): too few to hold out --eval-fraction "
            f"{fraction} of them (pass --eval-fraction 0)"
        )
    # A boundary b (0 < b < total) follows an end-of-document id at b - 1.
    after = tokens.next_eos(eos_id, target - 1, total - 1)
    low = 0 if after is None else max(0, target - 1 - (after + 1 - target))
    before = tokens.previous_eos(eos_id, low, target - 1)
    candidates = [p + 1 for p in (before, after) if p is not None]
    if not candidates:
        return target  # one document: the split falls inside it
    return min(candidates, key=lambda boundary: (abs(boundary - target), boundary))


def _copy_range(
    source: _Part, dtype: np.dtype[np.unsignedinteger], start: int, stop: int, target: Path
) -> tuple[str, int]:
    """Write tokens ``[start, stop)`` of a part to ``target``; their sha256 and largest id."""
    digest = hashlib.sha256()
    largest = [-1]

    def write(handle: BinaryIO) -> None:
        mapped = np.memmap(source.path, dtype=dtype, mode="r", shape=(source.tokens,))
        for begin in range(start, stop, _SCAN_TOKENS):
            piece = mapped[begin : min(begin + _SCAN_TOKENS, stop)]
            data = piece.tobytes()
            handle.write(data)
            digest.update(data)
            largest[0] = max(largest[0], int(piece.max()))

    atomic_write(target, write)
    return digest.hexdigest(), largest[0]


def _name_shards(
    staging: Path, parts: Sequence[_Part], cut: int, dtype: np.dtype[np.unsignedinteger]
) -> list[ShardEntry]:
    """Rename the parts into training and held-out shards, cutting the one ``cut`` is in."""
    entries: list[ShardEntry] = []
    counts: dict[Split, int] = {"train": 0, "eval": 0}

    def add(split: Split, tokens: int, digest: tuple[str, int]) -> Path:
        name = f"{split}-{counts[split]:05d}.bin"
        counts[split] += 1
        entries.append(ShardEntry(name, split, tokens, sha256=digest[0], max_id=digest[1]))
        return staging / name

    offset = 0
    for part in parts:
        start, offset = offset, offset + part.tokens
        if offset <= cut or start >= cut:
            split: Split = "train" if offset <= cut else "eval"
            os.replace(part.path, add(split, part.tokens, (part.sha256, part.max_id)))
            continue
        head = cut - start
        head_path = staging / f".head-{part.path.name}"
        tail_path = staging / f".tail-{part.path.name}"
        head_digest = _copy_range(part, dtype, 0, head, head_path)
        tail_digest = _copy_range(part, dtype, head, part.tokens, tail_path)
        os.replace(head_path, add("train", head, head_digest))
        os.replace(tail_path, add("eval", part.tokens - head, tail_digest))
        part.path.unlink()
    return entries


def prepare(options: PrepareOptions, *, progress: TextIO | None = None) -> PrepareResult:
    """Tokenize the corpus into a shard directory (module docstring). ``progress`` gets a
    tqdm bar when it is a terminal (default: ``sys.stderr``). Every problem is a
    ``DataSourceError`` (``PrepareError``, ``CorpusError``, ...) raised before the output is
    touched."""
    _check_options(options)
    output = Path(options.output).expanduser()
    replacing = check_output(output, options.overwrite)
    files = expand_inputs(options.inputs, options.input_format)
    if replacing:
        _check_inputs_outside(files, output)
    tokenizer = load_tokenizer(options.tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    eos_id = tokenizer.eos_id(options.eos_token)
    stream = sys.stderr if progress is None else progress
    started = time.perf_counter()
    made = missing_parent(output)
    staging = staging_directory(output)
    try:
        total_bytes = sum(file.stat().st_size for file in files)
        terminal = hasattr(stream, "isatty") and stream.isatty()
        with (
            _one_thread_per_process(),
            tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                desc="prepare",
                file=stream,
                disable=not terminal,
            ) as bar,
        ):
            count = _Count()
            batches = _batches(files, options, count)
            flow = _TokenFlow(_encoded(batches, tokenizer, eos_id, dtype, options, bar))
            parts = _write_parts(flow, staging, options.shard_tokens)
        if count.documents == 0:
            raise CorpusError(
                f"empty corpus: the input(s) hold no text ({', '.join(options.inputs)})"
            )
        manifest = _manifest(staging, parts, count.documents, tokenizer, dtype, eos_id, options)
        publish(staging, output, replacing)
    except BaseException:
        discard(staging, made)
        raise
    return PrepareResult(output, manifest, len(files), time.perf_counter() - started)


def _manifest(
    staging: Path,
    parts: Sequence[_Part],
    documents: int,
    tokenizer: CorpusTokenizer,
    dtype: str,
    eos_id: int,
    options: PrepareOptions,
) -> TokenManifest:
    """Split, name, copy the tokenizer, and write the manifest (last)."""
    numpy_dtype = DTYPES[dtype]
    tokens = _Tokens(parts, numpy_dtype)
    cut = _held_out_start(tokens, eos_id, options.eval_fraction)
    shards = _name_shards(staging, parts, cut, numpy_dtype)
    if isinstance(tokenizer, FileTokenizer):
        atomic_write_bytes(staging / TOKENIZER_NAME, tokenizer.data)
        record = TokenizerRecord(kind="tokenizers", sha256=tokenizer.sha256, file=TOKENIZER_NAME)
    else:
        record = TokenizerRecord(kind="bytes", sha256=tokenizer.sha256, file=None)
    manifest = TokenManifest(
        dtype="uint16" if dtype == "uint16" else "uint32",
        vocab_size=tokenizer.vocab_size,
        eos_id=eos_id,
        tokenizer=record,
        documents=documents,
        eval_fraction=options.eval_fraction,
        shard_tokens=options.shard_tokens,
        shards=tuple(shards),
    )
    atomic_write_text(staging / MANIFEST_NAME, manifest.to_json())
    return manifest
