"""The run's tokens, for ``speedtronic export``: which tokenizer file it used, its
end-of-document and beginning-of-text ids and its vocabulary, read from the ``data`` section
(``RunTokens``); and the files that make an exported directory a tokenizer too.

Where the facts come from:

* ``data.tokens`` / ``data.mixture``: each shard directory's manifest (``index.json``) --
  the end-of-document id ``prepare`` wrote between documents, the vocabulary (largest id +
  1) and the tokenizer (``data.tokenizer`` when it names the file, else the copy
  ``prepare`` left in the directory, checked against the manifest's sha256). The sources of
  a mixture share one tokenizer (training refuses others); their end-of-document ids may
  differ (``--eos-token``), and then ``eos_token_id`` lists them all, as ``transformers``
  allows;
* ``data.text_path`` with ``data.tokenizer``: that file, and its own end-of-document token
  when it has one (``EOS_CANDIDATES``); the text stream adds none;
* the byte tokenizer: no file; token shards made with it end documents with id 256.

A beginning-of-text id is the tokenizer's own special token of that name
(``_BOS_CANDIDATES``), when it has one; speedtronic's data never adds it, so it is there for
the tools that read ``bos_token_id``. A padding id is likewise its own ``_PAD_CANDIDATES``
token. An id the run's tokenizer does not have is written as ``null`` in place of the config
class's default (``LlamaConfig``'s ``bos_token_id`` 1 is an ordinary token of another
tokenizer); an id the model's config set itself is kept, or replaced with a warning.

``write_tokenizer`` copies the ``tokenizer.json`` and writes the ``tokenizer_config.json``
that makes ``transformers.AutoTokenizer.from_pretrained`` load it as a
``PreTrainedTokenizerFast`` -- without it, transformers 4 picks the tokenizer class from
``config.json``'s ``model_type`` (``LlamaTokenizerFast``, which adds a ``<s>`` the
tokenizer may not have) -- with the end-of-document and beginning-of-text tokens named.
``set_token_ids`` writes the ids into ``config.json`` and ``generation_config.json``.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from speedtronic.data.shards import TokenizerRecord, read_manifest
from speedtronic.data.text import DataSourceError
from speedtronic.data.tokenizer import BYTES, FileTokenizer, sha256_of_file

__all__ = [
    "TOKENIZER_NAME",
    "RunTokens",
    "TokenIdError",
    "run_tokens",
    "set_token_ids",
    "write_tokenizer",
]

TOKENIZER_NAME = "tokenizer.json"
_TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
_BOS_CANDIDATES = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "[BOS]")
"""Special tokens taken as the beginning-of-text token, in this order of preference."""
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
"""Special tokens taken as the padding token, in this order of preference."""
_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_CONFIG_FILES = ("config.json", "generation_config.json")


class TokenIdError(ValueError):
    """The run's tokens do not fit the exported model, or its tokenizer file is not the one
    its shards were made with (a user mistake: ``ExportError`` wraps it)."""


@dataclass(frozen=True)
class RunTokens:
    """What an export says about the run's tokens (module docstring). ``eos_ids`` holds
    one id, or several for a mixture whose sources end documents differently; empty when
    unknown."""

    file: Path | None = None
    eos_ids: tuple[int, ...] = ()
    bos_id: int | None = None
    vocab_size: int | None = None
    source: str = "data"
    pad_id: int | None = None
    """The ``data`` key the facts come from, for messages."""

    def config_ids(self) -> dict[str, int | list[int]]:
        """The ``config.json`` fields these ids set (only the known ones)."""
        fields: dict[str, int | list[int]] = {}
        if self.eos_ids:
            fields["eos_token_id"] = (
                self.eos_ids[0] if len(self.eos_ids) == 1 else list(self.eos_ids)
            )
        if self.bos_id is not None:
            fields["bos_token_id"] = self.bos_id
        if self.pad_id is not None:
            fields["pad_token_id"] = self.pad_id
        return fields

    @property
    def known(self) -> bool:
        """Whether the run's tokenizer is known (its ids can replace a config's defaults)."""
        return self.file is not None or bool(self.eos_ids)


def run_tokens(data: Mapping[str, object]) -> RunTokens:
    """The tokens of a run's resolved ``data`` section (keys read by name: an absent key
    means no such source). A shard directory that cannot be read any more (moved since
    training) is a warning and tells nothing; a tokenizer file that is not the one the
    shards were made with, or a mixture whose sources name different ones, is a
    ``TokenIdError``."""
    named = data.get("tokenizer")
    tokenizer = Path(named).expanduser() if isinstance(named, str) and named != BYTES else None
    directories = _shard_directories(data)
    if directories:
        return _from_shards(directories, tokenizer)
    if tokenizer is not None and tokenizer.is_file():
        loaded = FileTokenizer(tokenizer)
        return RunTokens(
            file=tokenizer,
            eos_ids=_own_eos(loaded),
            bos_id=_special(loaded, _BOS_CANDIDATES),
            vocab_size=loaded.vocab_size,
            source="data.tokenizer",
            pad_id=_special(loaded, _PAD_CANDIDATES),
        )
    return RunTokens()


def _shard_directories(data: Mapping[str, object]) -> list[tuple[str, Path]]:
    """``(config key, directory)`` of ``data.tokens`` or of each ``data.mixture`` source."""
    tokens = data.get("tokens")
    if isinstance(tokens, str) and tokens:
        return [("data.tokens", Path(tokens).expanduser())]
    mixture = data.get("mixture")
    entries = mixture if isinstance(mixture, list) else []
    found = []
    for index, entry in enumerate(entries):
        directory = entry.get("tokens") if isinstance(entry, Mapping) else None
        if isinstance(directory, str) and directory:
            found.append((f"data.mixture[{index}].tokens", Path(directory).expanduser()))
    return found


def _from_shards(directories: Sequence[tuple[str, Path]], named: Path | None) -> RunTokens:
    eos: list[int] = []
    vocab = 0
    files: dict[str, Path] = {}  # sha256 -> the file
    for key, directory in directories:
        try:
            manifest = read_manifest(directory)
        except DataSourceError as exc:
            warnings.warn(
                f"{key}: {exc}; the export carries no tokenizer and no token ids",
                UserWarning,
                stacklevel=4,
            )
            return RunTokens()
        if manifest.eos_id not in eos:
            eos.append(manifest.eos_id)
        vocab = max(vocab, manifest.vocab_size)
        record = manifest.tokenizer
        if record.kind == "tokenizers":
            files.setdefault(record.sha256, _shard_tokenizer(key, directory, record, named))
    if len(files) > 1:
        listed = ", ".join(str(path) for path in files.values())
        raise TokenIdError(
            f"data.mixture: the sources were prepared with different tokenizers ({listed}); "
            "there is no one tokenizer to export"
        )
    file = next(iter(files.values()), None)
    loaded = FileTokenizer(file) if file is not None else None
    bos = _special(loaded, _BOS_CANDIDATES) if loaded is not None else None
    pad = _special(loaded, _PAD_CANDIDATES) if loaded is not None else None
    source = directories[0][0] if len(directories) == 1 else "data.mixture"
    return RunTokens(file, tuple(sorted(eos)), bos, vocab, source, pad)


def _shard_tokenizer(
    key: str, directory: Path, record: TokenizerRecord, named: Path | None
) -> Path:
    """The tokenizer file of a shard directory: ``named`` (``data.tokenizer``, which
    training checked against the manifest) when given, else the directory's own copy,
    which must still be what the manifest records."""
    if named is not None and named.is_file():
        return named
    path = directory / (record.file or TOKENIZER_NAME)
    if not path.is_file():
        raise TokenIdError(
            f"{key}: {path} is missing (the shards were made with a tokenizer file); name "
            "it with data.tokenizer"
        )
    if sha256_of_file(path) != record.sha256:
        raise TokenIdError(
            f"{key}: {path} is not the tokenizer the shards were made with (its sha256 "
            "differs from index.json's); name the right one with data.tokenizer"
        )
    return path


def _own_eos(tokenizer: FileTokenizer) -> tuple[int, ...]:
    try:
        return (tokenizer.eos_id(None),)
    except DataSourceError:  # no end-of-document token: nothing to record
        return ()


def _special(tokenizer: FileTokenizer, candidates: Sequence[str]) -> int | None:
    for candidate in candidates:
        found = tokenizer.special_id(candidate)
        if found is not None:
            return found
    return None


def set_token_ids(directory: Path, tokens: RunTokens, vocab_size: int) -> None:
    """Write ``tokens``' ids into the exported ``config.json`` (and
    ``generation_config.json`` when there is one), after checking that they and the
    tokenizer's vocabulary fit the model's ``vocab_size``. An id the config holds at its
    class's default (``LlamaConfig``: bos 1, eos 2) is replaced by the data's, or by
    ``null`` when the run's tokenizer has no such token; an id the model's config set
    itself is replaced with a warning (the data's ids are the ones the model was trained
    to end documents with), or kept when the data has none."""
    ids = tokens.config_ids()
    largest = max(
        [*tokens.eos_ids, tokens.bos_id or 0, tokens.pad_id or 0, (tokens.vocab_size or 1) - 1]
    )
    if largest >= vocab_size:
        raise TokenIdError(
            f"{tokens.source}: the run's tokens go up to id {largest}, beyond the exported "
            f"model's vocabulary of {vocab_size}"
        )
    config_path = directory / "config.json"
    if not tokens.known or not config_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    defaults = _default_ids(config.get("model_type"))
    updates: dict[str, int | list[int] | None] = {}
    for key in _ID_KEYS:
        old = config.get(key)
        own = old is not None and old != defaults.get(key)  # the model's config set it
        if key in ids:
            if own and old != ids[key]:
                warnings.warn(
                    f"config.json: {key} {old} of the model's config replaced by {ids[key]}, "
                    f"the id the run's data uses ({tokens.source})",
                    UserWarning,
                    stacklevel=3,
                )
            updates[key] = ids[key]
        elif old is not None and not own:
            updates[key] = None  # a default of the config class, not a token of this data
    for name in _CONFIG_FILES:
        path = directory / name
        if updates and path.is_file():
            fields = json.loads(path.read_text(encoding="utf-8"))
            fields.update(updates)
            text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
            path.write_text(text, encoding="utf-8")


def _default_ids(model_type: object) -> dict[str, object]:
    """The token ids a default config of ``model_type`` holds (none for an unknown type)."""
    if not isinstance(model_type, str):
        return {}
    from transformers import AutoConfig  # the export writes transformers files anyway

    try:
        defaults = AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        return {}
    return {key: getattr(defaults, key, None) for key in _ID_KEYS}


def write_tokenizer(directory: Path, tokens: RunTokens, *, max_length: int | None) -> None:
    """Copy the run's ``tokenizer.json`` into ``directory`` with a ``tokenizer_config.json``
    (module docstring); nothing for a run without a tokenizer file."""
    if tokens.file is None:
        return
    shutil.copyfile(tokens.file, directory / TOKENIZER_NAME)
    fields: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    loaded = FileTokenizer(directory / TOKENIZER_NAME)
    if len(tokens.eos_ids) == 1:
        fields["eos_token"] = loaded.token(tokens.eos_ids[0])
    if tokens.bos_id is not None:
        fields["bos_token"] = loaded.token(tokens.bos_id)
    if tokens.pad_id is not None:
        fields["pad_token"] = loaded.token(tokens.pad_id)
    if max_length is not None:
        fields["model_max_length"] = max_length
    fields["clean_up_tokenization_spaces"] = False
    text = json.dumps({key: value for key, value in fields.items() if value is not None}, indent=2)
    (directory / _TOKENIZER_CONFIG_NAME).write_text(text + "\n", encoding="utf-8")
