"""Loss masks of a byte-level BPE's encodings from the token ids alone, without offsets.

The loss-bearing spans of an example are character ranges of its text; the tokens they
cover are found through each token's place in the text. ``tokenizers`` gives those places
as character offsets, which cost about a quarter of an encode (every byte offset converted
to a character one). A byte-level BPE with no normalizer does not need them: each of its
vocabulary tokens is a string of the 256-character byte alphabet, one character per input
byte, and each added (special) token stands for its own UTF-8 bytes, so the ids say how many
bytes of the text every token covers. ``token_byte_lengths`` builds that table once (None
for any other tokenizer: a normalizer, a prefix space, byte fallback or a non-BPE model
make the token lengths differ from the text's); ``mask_by_bytes`` then encodes a batch with
``encode_batch_fast`` and marks the tokens of each span with one ``searchsorted`` over the
batch -- and returns None, for the caller to use the offsets, when the token bytes of an
example do not add up to its text's (an added token that strips the spaces around it).

A token is marked when it holds a byte of the span: the same tokens as the offsets mark
(``speedtronic.data.packing``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizerObject

__all__ = ["token_byte_lengths", "mask_by_bytes"]

Span = tuple[int, int]


def token_byte_lengths(tokenizer: HFTokenizerObject) -> npt.NDArray[np.int64] | None:
    """How many bytes of the input each token id stands for, or None when the tokenizer is
    not a byte-level BPE whose tokens map to the input byte for byte (module docstring)."""
    from tokenizers import pre_tokenizers

    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or model.get("type") != "BPE":
        return None
    if model.get("byte_fallback") or not _byte_level(spec.get("pre_tokenizer")):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = tokenizer.get_added_tokens_decoder()
    size = max([*tokenizer.get_vocab(with_added_tokens=True).values(), -1]) + 1
    table = np.full(size, -1, dtype=np.int64)
    for token, index in tokenizer.get_vocab(with_added_tokens=False).items():
        if index not in added:
            if not set(token) <= alphabet:
                return None
            table[index] = len(token)
    for index, special in added.items():
        if special.lstrip or special.rstrip:  # it can swallow spaces the table cannot see
            return None
        table[index] = len(special.content.encode("utf-8"))
    return None if (table < 0).any() else table


def _byte_level(pre_tokenizer: object) -> bool:
    """A ``ByteLevel`` pre-tokenizer without a prefix space, alone or last after ``Split``s
    (which only cut the text, never change it)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    steps = (
        pre_tokenizer.get("pretokenizers")
        if pre_tokenizer.get("type") == "Sequence"
        else [pre_tokenizer]
    )
    if not isinstance(steps, list) or not steps:
        return False
    *cuts, last = steps
    return (
        all(isinstance(step, dict) and step.get("type") == "Split" for step in cuts)
        and isinstance(last, dict)
        and last.get("type") == "ByteLevel"
        and not last.get("add_prefix_space", False)
    )


def mask_by_bytes(
    tokenizer: HFTokenizerObject,
    table: npt.NDArray[np.int64],
    texts: Sequence[str],
    spans: Sequence[Sequence[Span]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]] | None:
    """The ids of every text, one after the other; ``bounds`` (example ``i`` is
    ``ids[bounds[i]:bounds[i + 1]]``); whether each token holds a byte of its example's
    spans -- or None when an example's token bytes do not add up to its text's, or it has
    no token (module docstring)."""
    encodings = tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
    token_ids = [encoding.ids for encoding in encodings]
    counts = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    bounds = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    total = int(bounds[-1])
    ids = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=total)
    lengths = table[ids]
    ends = np.cumsum(lengths)  # each token's end, in bytes of the batch's texts laid end to end
    sizes = [len(text) if text.isascii() else len(text.encode("utf-8")) for text in texts]
    byte_bounds = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(sizes, out=byte_bounds[1:])
    if (counts == 0).any() or not np.array_equal(ends[bounds[1:] - 1], byte_bounds[1:]):
        return None
    lows: list[int] = []
    highs: list[int] = []
    for text, base, example_spans in zip(texts, byte_bounds[:-1].tolist(), spans, strict=True):
        ascii_text = text.isascii()
        for low, high in example_spans:
            if ascii_text:
                lows.append(base + low)
                highs.append(base + high)
            else:
                start = base + len(text[:low].encode("utf-8"))
                lows.append(start)
                highs.append(start + len(text[low:high].encode("utf-8")))
    # tokens from the one holding the span's first byte to the last one starting before its end
    first = np.searchsorted(ends, np.asarray(lows, dtype=np.int64), side="right")
    stop = np.searchsorted(ends - lengths, np.asarray(highs, dtype=np.int64), side="left")
    delta = np.zeros(total + 1, dtype=np.int64)
    np.add.at(delta, first, 1)
    np.add.at(delta, stop, -1)
    return ids, bounds, np.cumsum(delta[:-1]) > 0
