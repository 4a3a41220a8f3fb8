"""The run's tokenizer, both ways: ``RunText`` encodes a prompt and decodes what a model
wrote, with the tokenizer the run's data was tokenized with.

Which tokenizer: the ``tokenizer.json`` the run used (``data.tokenizer``, or the one the
``data.tokens`` / ``data.mixture`` shards were made with -- ``run_tokens``); the byte
tokenizer for text read without one (``data.text_path``, shards made with ``bytes``). A
run on synthetic tokens has no text: ``TextError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.data.text import DataSourceError
from speedtronic.data.tokenizer import BYTE_EOS_ID, BYTES, FileTokenizer, tokenizer_from_bytes
from speedtronic.models.export_tokens import TokenIdError, run_tokens

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["RunText", "TextError", "run_text"]

_TEXT_SOURCES = ("text_path", "tokens", "mixture")


class TextError(ValueError):
    """The run has no usable tokenizer (synthetic data, an unreadable file)."""


@dataclass(frozen=True)
class RunText:
    """Encode and decode with one tokenizer: ``file`` (a ``tokenizer.json``) or, when None,
    the byte tokenizer. ``stop_ids``: the end-of-document ids (generation stops there)."""

    file: Path | None
    stop_ids: tuple[int, ...]
    _tokenizer: Tokenizer | None = None

    @property
    def name(self) -> str:
        return BYTES if self.file is None else str(self.file)

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens (end-of-document) are left out."""
        if self._tokenizer is None:
            data = bytes(token for token in ids if 0 <= token < BYTE_EOS_ID)
            return data.decode("utf-8", errors="replace")
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


def _has_text(data: Mapping[str, object]) -> bool:
    named = data.get("tokenizer")
    return (
        bool(named)
        or any(data.get(key) for key in _TEXT_SOURCES)
        or (data.get("dataset") == "text")
    )


def run_text(data: Mapping[str, object]) -> RunText:
    """The tokenizer of a run's resolved ``data`` section (module docstring)."""
    if not _has_text(data):
        raise TextError(
            "the run trains on synthetic tokens, which have no text: generation and text "
            "tasks need a run on text (data.text_path, data.tokens or data.mixture)"
        )
    try:
        tokens = run_tokens(data)
        if tokens.file is None:
            return RunText(None, tokens.eos_ids or (BYTE_EOS_ID,))
        file = FileTokenizer(tokens.file)  # checks the file as prepare did
        tokenizer = tokenizer_from_bytes(file.data, str(tokens.file))
    except (TokenIdError, DataSourceError) as exc:
        raise TextError(str(exc)) from None
    return RunText(tokens.file, tokens.eos_ids, tokenizer)
