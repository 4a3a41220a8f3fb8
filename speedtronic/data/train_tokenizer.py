"""``speedtronic tokenizer``: train a byte-level BPE tokenizer on a corpus, the first thing a
run on real text needs.

The corpus is read exactly as ``speedtronic prepare`` reads it (``speedtronic.data.corpus``:
files, directories and globs of ``.txt``, ``.jsonl`` and ``.parquet``, the same errors), and
the tokenizer is trained with the ``tokenizers`` library: a byte-level BPE (every byte is in
the vocabulary, so any text encodes, nothing is unknown) of ``vocab_size`` ids, id 0 being the
end-of-text token ``<|endoftext|>`` that ``prepare`` puts after each document. Training is
deterministic: the same corpus and options give the same ``tokenizer.json``, byte for byte.
The file is written atomically; one that exists is replaced only with ``overwrite``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from speedtronic.data.corpus import CorpusError, InputFormat, expand_inputs, read_segments
from speedtronic.data.tokenizer import require_module
from speedtronic.state.atomic_io import atomic_write_text

__all__ = ["TokenizerOptions", "train_tokenizer"]

_END_OF_TEXT = "<|endoftext|>"
"""The end-of-text special token (id 0): what ``prepare`` puts after each document."""
_BYTE_ALPHABET = 256
_MIN_VOCAB_SIZE = _BYTE_ALPHABET + 1
"""Every byte and the end-of-text token; the merges come on top."""


@dataclass(frozen=True)
class TokenizerOptions:
    """What ``speedtronic tokenizer`` trains: on ``inputs`` (as ``prepare --input``), a
    vocabulary of ``vocab_size`` ids, written to ``output``."""

    inputs: Sequence[str]
    output: Path
    vocab_size: int = 4096
    text_key: str = "text"
    min_frequency: int = 2
    overwrite: bool = False
    input_format: InputFormat | None = None
    """As ``prepare --input-format``: the format of every input, whatever its name."""
    doc_separator: str | None = None
    """As ``prepare --doc-separator``: the line between the documents of a text file."""


@dataclass(frozen=True)
class _TrainedTokenizer:
    """What training made: the file, its vocabulary and what it was trained on."""

    path: Path
    vocab_size: int
    files: int
    documents: int

    def summary(self) -> str:
        return (
            f"wrote {self.path}: byte-level BPE of {self.vocab_size:,} ids ({_END_OF_TEXT} is "
            f"id 0), trained on {self.documents:,} documents from {self.files} file(s)"
        )


def _check(options: TokenizerOptions) -> None:
    if options.vocab_size < _MIN_VOCAB_SIZE:
        raise CorpusError(
            f"--vocab-size: {options.vocab_size} is below {_MIN_VOCAB_SIZE} (the {_BYTE_ALPHABET} "
            f"bytes and {_END_OF_TEXT})"
        )
    if options.min_frequency < 1:
        raise CorpusError(f"--min-frequency: {options.min_frequency} is below 1")
    output = Path(options.output)
    if output.is_dir():
        raise CorpusError(f"--output: {output} is a directory; name the tokenizer.json to write")
    if output.exists() and not options.overwrite:
        raise CorpusError(f"--output: {output} exists; pass --overwrite to replace it")


class _Corpus:
    """The corpus's text, piece by piece, counting documents as it goes."""

    def __init__(self, files: Sequence[Path], options: TokenizerOptions) -> None:
        self.files = files
        self.options = options
        self.documents = 0

    def __iter__(self) -> Iterator[str]:
        options = self.options
        for path in self.files:
            segments = read_segments(
                path,
                options.text_key,
                given=options.input_format,
                separator=options.doc_separator,
            )
            for segment in segments:
                self.documents += segment.ends_document
                yield segment.text


def train_tokenizer(options: TokenizerOptions) -> _TrainedTokenizer:
    """Train and write the tokenizer (module docstring); ``CorpusError`` (a
    ``DataSourceError``) for an input or an option that cannot be used."""
    _check(options)
    files = expand_inputs(options.inputs, options.input_format)
    library = require_module("tokenizers", "speedtronic tokenizer")
    tokenizer = library.Tokenizer(library.models.BPE())
    tokenizer.pre_tokenizer = library.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = library.decoders.ByteLevel()
    trainer = library.trainers.BpeTrainer(
        vocab_size=options.vocab_size,
        min_frequency=options.min_frequency,
        special_tokens=[_END_OF_TEXT],
        initial_alphabet=library.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _Corpus(files, options)
    tokenizer.train_from_iterator(corpus, trainer)
    if corpus.documents == 0:
        raise CorpusError(f"--input: no text in {len(files)} file(s) to train a tokenizer on")
    output = Path(options.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, tokenizer.to_str(pretty=True) + "\n")
    return _TrainedTokenizer(output, int(tokenizer.get_vocab_size()), len(files), corpus.documents)
