"""``speedtronic prepare`` and ``speedtronic tokenizer``: the commands that read a corpus.

Both read their inputs the same way (``_add_corpus_args``: several paths per ``--input``,
``--input-format``, ``--doc-separator``), through ``speedtronic.data.corpus``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeAlias

from speedtronic.commands import EXIT_OK

__all__ = ["add_parsers", "prepare_command", "tokenizer_command"]

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_parsers(sub: Subcommands) -> None:
    """The ``prepare`` and ``tokenizer`` subcommands."""
    _add_prepare_parser(sub)
    _add_tokenizer_parser(sub)


def _add_corpus_args(parser: argparse.ArgumentParser) -> None:
    """The inputs of ``prepare`` and ``tokenizer``: the same paths, formats and documents."""
    parser.add_argument(
        "--input",
        dest="inputs",
        action="extend",
        nargs="+",
        required=True,
        metavar="PATH",
        help="a .txt, .jsonl or .parquet file, a directory of them, or a glob; several paths "
        "per --input (an unquoted glob the shell expanded), and repeatable",
    )
    parser.add_argument(
        "--input-format",
        choices=("txt", "jsonl", "parquet"),
        help="read every input file as this format, whatever its name (default: by suffix)",
    )
    parser.add_argument(
        "--doc-separator",
        metavar="LINE",
        help="a line that separates the documents of a text file, e.g. '%%' ('': a blank "
        "line; default: a text file is one document)",
    )


def _add_prepare_parser(sub: Subcommands) -> None:
    # The defaults are PrepareOptions' (a flag left out is not passed on).
    prepare = sub.add_parser(
        "prepare", help="tokenize a corpus once into token shards (data.tokens)"
    )
    _add_corpus_args(prepare)
    prepare.add_argument(
        "--tokenizer", required=True, help="a tokenizer.json, or 'bytes' for the byte tokenizer"
    )
    prepare.add_argument("--output", required=True, help="the shard directory to write")
    prepare.add_argument(
        "--text-key", help="the JSONL key / parquet column of the text (default 'text')"
    )
    prepare.add_argument(
        "--eos-token", help="the token that ends a document (default: the tokenizer's own)"
    )
    prepare.add_argument(
        "--eval-fraction",
        type=float,
        help="share of the tokens held out: the last documents (default 0.01)",
    )
    prepare.add_argument(
        "--shard-tokens",
        type=int,
        help="tokens per shard (default 100,000,000)",
    )
    prepare.add_argument("--workers", type=int, help="tokenizing processes (default 1)")
    prepare.add_argument(
        "--max-document-bytes",
        type=int,
        help="the longest JSONL line / parquet value read (default 67,108,864: 64 MiB)",
    )
    prepare.add_argument(
        "--long-documents",
        choices=("refuse", "split"),
        help="a longer document: refuse it (default) or tokenize it in pieces",
    )
    prepare.add_argument(
        "--tokenize-timeout",
        type=float,
        metavar="SECONDS",
        help="the longest a worker may take for one batch of documents (default 600)",
    )
    prepare.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the shard set in --output (once the new one is complete)",
    )
    _add_fine_tuning_args(prepare)


def _add_fine_tuning_args(prepare: argparse.ArgumentParser) -> None:
    """``--format chat | prompt-completion`` and its flags (docs/fine-tuning.md)."""
    prepare.add_argument(
        "--format",
        choices=("text", "chat", "prompt-completion"),
        default="text",
        help="text (default), or fine-tuning rows with a loss mask: chat, prompt-completion",
    )
    prepare.add_argument("--chat-template", help="a Jinja chat template file (--format chat)")
    prepare.add_argument("--pack", choices=("concatenate", "first-fit"), help="default concatenate")
    prepare.add_argument("--window", type=int, help="tokens per packed window (max_seq_len)")
    prepare.add_argument(
        "--too-long", choices=("split", "refuse"), help="an example over --window (refuse)"
    )


def _add_tokenizer_parser(sub: Subcommands) -> None:
    tokenizer = sub.add_parser(
        "tokenizer", help="train a byte-level BPE tokenizer.json on a corpus (for prepare)"
    )
    _add_corpus_args(tokenizer)
    tokenizer.add_argument("--output", required=True, help="the tokenizer.json to write")
    tokenizer.add_argument("--vocab-size", type=int, default=4096, help="ids (default 4096)")
    tokenizer.add_argument(
        "--text-key", default="text", help="the JSONL key / parquet column of the text"
    )
    tokenizer.add_argument(
        "--min-frequency", type=int, default=2, help="merge only pairs seen this often"
    )
    tokenizer.add_argument("--overwrite", action="store_true", help="replace --output")


# prepare's flags by the formats they apply to (a flag left out is None: the default).
_PREPARE_SHARED_OPTIONS = ("eos_token", "eval_fraction", "shard_tokens")
_PREPARE_TEXT_OPTIONS = (
    "workers",
    "text_key",
    "max_document_bytes",
    "long_documents",
    "tokenize_timeout",
    "input_format",
    "doc_separator",
)
_PREPARE_EXAMPLE_OPTIONS = ("chat_template", "pack", "window", "too_long")


def prepare_command(args: argparse.Namespace) -> int:
    from speedtronic.data.prepare import PrepareError, PrepareOptions, prepare

    if args.format != "text":
        return _prepare_examples(args)
    if any(getattr(args, key) is not None for key in _PREPARE_EXAMPLE_OPTIONS):
        raise PrepareError(
            "--chat-template, --pack, --window and --too-long apply to --format chat and "
            "--format prompt-completion"
        )
    keys = (*_PREPARE_SHARED_OPTIONS, *_PREPARE_TEXT_OPTIONS)
    given = {key: getattr(args, key) for key in keys if getattr(args, key) is not None}
    options = PrepareOptions(
        inputs=args.inputs,
        tokenizer=args.tokenizer,
        output=args.output,
        overwrite=args.overwrite,
        **given,
    )
    print(prepare(options).summary())
    return EXIT_OK


def tokenizer_command(args: argparse.Namespace) -> int:
    from speedtronic.data.train_tokenizer import TokenizerOptions, train_tokenizer

    options = TokenizerOptions(
        inputs=args.inputs,
        output=Path(args.output),
        vocab_size=args.vocab_size,
        text_key=args.text_key,
        min_frequency=args.min_frequency,
        overwrite=args.overwrite,
        input_format=args.input_format,
        doc_separator=args.doc_separator,
    )
    print(train_tokenizer(options).summary())
    return EXIT_OK


def _prepare_examples(args: argparse.Namespace) -> int:
    from speedtronic.data.prepare import PrepareError
    from speedtronic.data.sft_prepare import SFTOptions, prepare_examples

    text_only = [key for key in _PREPARE_TEXT_OPTIONS if getattr(args, key) is not None]
    if text_only:
        flags = ", ".join("--" + key.replace("_", "-") for key in text_only)
        raise PrepareError(f"{flags} apply to --format text only")
    keys = (*_PREPARE_SHARED_OPTIONS, *_PREPARE_EXAMPLE_OPTIONS)
    given = {key: getattr(args, key) for key in keys if getattr(args, key) is not None}
    options = SFTOptions(
        inputs=args.inputs,
        tokenizer=args.tokenizer,
        output=args.output,
        format=args.format,
        overwrite=args.overwrite,
        **given,
    )
    print(prepare_examples(options).summary())
    return EXIT_OK
