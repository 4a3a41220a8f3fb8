"""``speedtronic prepare --format chat | prompt-completion``: fine-tuning examples into token
shards with loss masks.

JSONL rows are rendered (``speedtronic.data.chat``), tokenized with their loss masks and
packed (``speedtronic.data.packing``), then written as a shard set that ``data.tokens`` reads
like any other -- token shards, a mask shard beside each (``speedtronic.data.loss_masks``)
and one manifest. Shards are cut between packed units (examples, or bins of ``--window``
tokens), and each shard ends with one extra end-of-document id without loss, so that the
training windows of a first-fit shard (``block_size = window``) are exactly its bins. The
held-out split (``--eval-fraction``) is the last units.

The examples are held in memory while they are packed (fine-tuning sets are small next to
pretraining corpora). Output is written like ``prepare``'s: into a staging directory, the
manifest last, published in one rename; any error -- each names the file and line -- leaves
an existing output as it was.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from speedtronic.data.chat import ChatTemplate, Example, RowFormat, load_chat_template, render_row
from speedtronic.data.corpus import DEFAULT_MAX_DOCUMENT_BYTES, expand_inputs
from speedtronic.data.loss_masks import SFTRecord, mask_file, sft_fields
from speedtronic.data.packing import Encoded, PackMode, TooLong, encode_examples
from speedtronic.data.packing import pack as pack_units
from speedtronic.data.prepare import PrepareError, PrepareResult, _one_thread_per_process
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
    TOKENIZER_NAME,
    ShardEntry,
    TokenizerRecord,
    TokenManifest,
    token_dtype,
)
from speedtronic.data.text import DataSourceError, open_data_file
from speedtronic.data.token_bytes import token_byte_lengths
from speedtronic.data.tokenizer import (
    CorpusTokenizer,
    FileTokenizer,
    load_tokenizer,
    tokenizer_from_bytes,
)
from speedtronic.state.atomic_io import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizerObject

__all__ = ["SFTOptions", "prepare_examples"]

_ENCODE_BATCH = 512
"""Rows rendered and then encoded together (one call of the tokenizer)."""


@dataclass(frozen=True)
class SFTOptions:
    """``speedtronic prepare --format chat | prompt-completion`` (docs/fine-tuning.md)."""

    inputs: Sequence[str]
    tokenizer: str
    output: str | Path
    format: RowFormat
    chat_template: str | None = None
    pack: PackMode = "concatenate"
    window: int | None = None
    too_long: TooLong = "refuse"
    eos_token: str | None = None
    eval_fraction: float = 0.0
    shard_tokens: int = 100_000_000
    overwrite: bool = False


def _check(options: SFTOptions) -> None:
    if options.pack == "first-fit" and options.window is None:
        raise PrepareError("--pack first-fit needs --window (the model's max_seq_len)")
    if options.window is not None and options.window < 2:
        raise PrepareError(f"--window must be at least 2, got {options.window}")
    if not 0 <= options.eval_fraction < 1 or not math.isfinite(options.eval_fraction):
        raise PrepareError(f"--eval-fraction must be in [0, 1), got {options.eval_fraction}")
    if options.shard_tokens < 2:
        raise PrepareError(f"--shard-tokens must be at least 2, got {options.shard_tokens}")
    if options.format == "prompt-completion" and options.chat_template is not None:
        raise PrepareError("--chat-template applies to --format chat only")


def _rows(files: Sequence[Path]) -> Iterator[tuple[object, str]]:
    """``(parsed row, "file:line")`` of every non-blank line of the JSONL inputs."""
    for file in files:
        if file.suffix != ".jsonl":
            raise PrepareError(f"--input {file}: fine-tuning rows are read from .jsonl files")
        with open_data_file(file) as handle:  # a regular file: never waits on a FIFO
            number = 0
            # a line longer than a document may be is never read whole (issue-30 bound)
            while raw := handle.readline(DEFAULT_MAX_DOCUMENT_BYTES + 1):
                number += 1
                where = f"{file}:{number}"
                if len(raw) > DEFAULT_MAX_DOCUMENT_BYTES and not raw.endswith(b"\n"):
                    raise DataSourceError(
                        f"{where}: a row of more than {DEFAULT_MAX_DOCUMENT_BYTES:,} bytes; "
                        "split the example, or shorten it"
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataSourceError(f"{where}: invalid UTF-8 at byte {exc.start}") from None
                if not line.strip():
                    continue
                try:
                    yield json.loads(line), where
                except json.JSONDecodeError as exc:
                    raise DataSourceError(
                        f"{where}: malformed JSON at column {exc.colno} ({exc.msg})"
                    ) from None


def _encoded(
    files: Sequence[Path],
    options: SFTOptions,
    template: ChatTemplate | None,
    tokenizer: HFTokenizerObject | None,
    eos_id: int,
) -> Iterator[Encoded]:
    byte_lengths = None if tokenizer is None else token_byte_lengths(tokenizer)
    batch: list[tuple[Example, str]] = []
    for row, where in _rows(files):
        batch.append((render_row(options.format, row, where, template), where))
        if len(batch) >= _ENCODE_BATCH:
            yield from encode_examples(batch, tokenizer, eos_id, byte_lengths)
            batch = []
    if batch:
        yield from encode_examples(batch, tokenizer, eos_id, byte_lengths)


def prepare_examples(options: SFTOptions) -> PrepareResult:
    """Render, tokenize, pack and write the examples (module docstring)."""
    _check(options)
    output = Path(options.output).expanduser()
    replacing = check_output(output, options.overwrite)
    files = expand_inputs(options.inputs)
    corpus_tokenizer = load_tokenizer(options.tokenizer)
    eos_id = corpus_tokenizer.eos_id(options.eos_token)
    template = (
        load_chat_template(options.tokenizer, options.chat_template)
        if options.format == "chat"
        else None
    )
    offsets: HFTokenizerObject | None = None
    if isinstance(corpus_tokenizer, FileTokenizer):
        loaded = tokenizer_from_bytes(corpus_tokenizer.data, options.tokenizer)
        # A chat template writes the model's special tokens as text: they must encode as
        # those tokens. Prompt-completion text is encoded like pretraining text.
        loaded.encode_special_tokens = options.format != "chat"
        offsets = loaded
    started = time.perf_counter()
    with _one_thread_per_process():  # as plain prepare: one tokenizing thread
        examples = list(_encoded(files, options, template, offsets, eos_id))
    if not examples:
        inputs = ", ".join(options.inputs)
        raise DataSourceError(f"no examples: the input(s) hold no rows ({inputs})")
    units = pack_units(examples, options.pack, options.window, options.too_long, eos_id)
    dtype = token_dtype(corpus_tokenizer.vocab_size)
    made = missing_parent(output)
    staging = staging_directory(output)
    try:
        manifest = _write(staging, units, len(examples), corpus_tokenizer, dtype, eos_id, options)
        publish(staging, output, replacing)
    except BaseException:
        discard(staging, made)
        raise
    return PrepareResult(output, manifest, len(files), time.perf_counter() - started)


def _split(units: Sequence[Encoded], fraction: float) -> int:
    """The index of the first held-out unit (``len(units)``: none)."""
    if fraction == 0:
        return len(units)
    total = sum(len(unit.ids) for unit in units)
    held, cut = 0, len(units)
    while cut > 1 and held < fraction * total:
        cut -= 1
        held += len(units[cut].ids)
    if cut == len(units) or cut == 0:
        raise PrepareError(
            f"{len(units)} packed unit(s): too few to hold out --eval-fraction {fraction} "
            "(pass --eval-fraction 0)"
        )
    return cut


def _groups(units: Sequence[Encoded], shard_tokens: int) -> Iterator[list[Encoded]]:
    group: list[Encoded] = []
    size = 0
    for unit in units:
        if group and size + len(unit.ids) + 1 > shard_tokens:
            yield group
            group, size = [], 0
        group.append(unit)
        size += len(unit.ids)
    if group:
        yield group


def _write(
    staging: Path,
    units: Sequence[Encoded],
    examples: int,
    tokenizer: CorpusTokenizer,
    dtype: str,
    eos_id: int,
    options: SFTOptions,
) -> TokenManifest:
    numpy_dtype = DTYPES[dtype]
    cut = _split(units, options.eval_fraction)
    shards: list[ShardEntry] = []
    masks: list[tuple[str, str]] = []
    for split, part in (("train", units[:cut]), ("eval", units[cut:])):
        for number, group in enumerate(_groups(part, options.shard_tokens)):
            # One end-of-document id without loss closes the shard (module docstring).
            ids = np.concatenate([*(unit.ids for unit in group), [eos_id]]).astype(numpy_dtype)
            mask = np.concatenate([*(unit.mask for unit in group), [0]]).astype(np.uint8)
            name = f"{split}-{number:05d}.bin"
            data = ids.astype(numpy_dtype.newbyteorder("<")).tobytes()
            atomic_write_bytes(staging / name, data)
            atomic_write_bytes(staging / mask_file(name), mask.tobytes())
            shards.append(
                ShardEntry(name, "train" if split == "train" else "eval", len(ids), _sha(data))
            )
            masks.append((mask_file(name), _sha(mask.tobytes())))
    if isinstance(tokenizer, FileTokenizer):
        atomic_write_bytes(staging / TOKENIZER_NAME, tokenizer.data)
        record = TokenizerRecord("tokenizers", tokenizer.sha256, TOKENIZER_NAME)
    else:
        record = TokenizerRecord("bytes", tokenizer.sha256, None)
    manifest = TokenManifest(
        dtype="uint16" if dtype == "uint16" else "uint32",
        vocab_size=tokenizer.vocab_size,
        eos_id=eos_id,
        tokenizer=record,
        documents=examples,
        eval_fraction=options.eval_fraction,
        shard_tokens=options.shard_tokens,
        shards=tuple(shards),
    )
    values = json.loads(manifest.to_json())
    sft = SFTRecord(options.format, options.pack, options.window, examples)
    values.update(sft_fields(sft, masks))
    atomic_write_text(staging / MANIFEST_NAME, json.dumps(values, indent=2) + "\n")
    return manifest


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
