"""Supervised fine-tuning examples as token sequences with a loss mask, packed for windows.

An example is its token ids and a mask of the same length: 1 where the token is a target of
the loss (the answer), 0 where it is context. ``encode_examples`` tokenizes the whole text of each
rendered example (``speedtronic.data.chat``) as inference would, and marks every token that
holds a part of a loss-bearing span: from the one holding its first character to the last
one holding a byte of its last (a character can be split over byte tokens) -- through the
tokenizer's character offsets, or, for a byte-level BPE, from the ids alone
(``speedtronic.data.token_bytes``, a quarter faster); an end-of-document id follows each example,
loss-bearing when the example ends on an answer (the model learns to stop). The first token
of an example is never a target: predicting it would take the previous example as context.

Packing (``--pack``):

* ``concatenate``: the examples one after the other; training windows cut them anywhere;
* ``first-fit``: bins of exactly ``window`` tokens (the model's ``max_seq_len``): each
  example goes into the first open bin with room for it, in input order, and the bins are
  padded with end-of-document ids that carry no loss, so no example is cut by a window.

An example longer than the window is split into window-sized pieces (``--too-long split``),
or refused (``refuse``), naming its file and line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from speedtronic.data.chat import Example, RowError
from speedtronic.data.token_bytes import mask_by_bytes

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizerObject

__all__ = ["Encoded", "PackMode", "TooLong", "encode_examples", "pack"]

PackMode = Literal["concatenate", "first-fit"]
TooLong = Literal["split", "refuse"]
_OPEN_BINS = 64
"""Bins first-fit keeps open (the earliest is closed beyond this): linear time."""


@dataclass(frozen=True)
class Encoded:
    """One example's ids and loss mask (same length), and where its row is."""

    ids: npt.NDArray[np.int64]
    mask: npt.NDArray[np.uint8]
    where: str


def encode_examples(
    examples: Sequence[tuple[Example, str]],
    tokenizer: HFTokenizerObject | None,
    eos_id: int,
    byte_lengths: npt.NDArray[np.int64] | None = None,
) -> list[Encoded]:
    """Tokenize ``(example, where)`` pairs with ``tokenizer`` (None: the byte tokenizer);
    the ids end with ``eos_id`` (module docstring). ``byte_lengths``: the tokenizer's
    ``token_byte_lengths``, which finds the spans' tokens without character offsets."""
    if tokenizer is None:
        return [_encode_bytes(example, where, eos_id) for example, where in examples]
    texts = [example.text for example, _ in examples]
    if byte_lengths is not None:
        spans = [example.spans for example, _ in examples]
        found = mask_by_bytes(tokenizer, byte_lengths, texts, spans)
        if found is not None:
            return _finish_batch(*found, [where for _, where in examples], eos_id)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    encoded: list[Encoded] = []
    for (example, where), encoding in zip(examples, encodings, strict=True):
        ids = np.asarray(encoding.ids, dtype=np.int64)
        inside = np.zeros(len(ids), dtype=bool)
        for low, high in example.spans:
            # The tokens of the span's first and last characters (two lookups, not a list
            # of every token's offsets).
            first, last = encoding.char_to_token(low), encoding.char_to_token(high - 1)
            if first is None or last is None:  # a character no token covers
                inside |= _starts_within(encoding.offsets, low, high)
                continue
            # A character of several byte tokens maps to the first: take the rest of it too.
            while last + 1 < len(ids):
                chars = encoding.token_to_chars(last + 1)
                if chars is None or chars[0] >= high:
                    break
                last += 1
            inside[first : last + 1] = True
        encoded.append(_finish(ids, inside, where, eos_id))
    return encoded


def _starts_within(offsets: list[tuple[int, int]], low: int, high: int) -> npt.NDArray[np.bool_]:
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    return (starts >= low) & (starts < high)


def _encode_bytes(example: Example, where: str, eos_id: int) -> Encoded:
    data = example.text.encode("utf-8")
    inside = np.zeros(len(data), dtype=bool)
    for low, high in example.spans:
        start = len(example.text[:low].encode("utf-8"))
        inside[start : start + len(example.text[low:high].encode("utf-8"))] = True
    return _finish(np.frombuffer(data, dtype=np.uint8).astype(np.int64), inside, where, eos_id)


def _finish_batch(
    ids: npt.NDArray[np.int64],
    bounds: npt.NDArray[np.int64],
    inside: npt.NDArray[np.bool_],
    wheres: Sequence[str],
    eos_id: int,
) -> list[Encoded]:
    """``_finish`` of every example of a batch at once (``ids`` one after the other, example
    ``i`` from ``bounds[i]`` to ``bounds[i + 1]``)."""
    shift = np.arange(len(wheres), dtype=np.int64)
    all_ids = np.insert(ids, bounds[1:], eos_id)  # an end-of-document id after each example
    mask = np.insert(inside.astype(np.uint8), bounds[1:], 0)
    starts, ends = bounds[:-1] + shift, bounds[1:] + shift
    mask[starts] = 0  # never a target: its context would be the previous example
    # the end of an answer is learned (not after a one-token example: its only token is 0)
    mask[ends] = np.where(ends - starts > 1, mask[ends - 1], 0)
    learned = np.add.reduceat(mask, starts, dtype=np.int64)
    if not learned.all():
        where = wheres[int(np.argmin(learned != 0))]
        raise RowError(f"{where}: the example has no loss-bearing token once tokenized")
    cuts = (ends[:-1] + 1).tolist()
    return [
        Encoded(piece_ids, piece_mask, where)
        for piece_ids, piece_mask, where in zip(
            np.split(all_ids, cuts), np.split(mask, cuts), wheres, strict=True
        )
    ]


def _finish(
    ids: npt.NDArray[np.int64], inside: npt.NDArray[np.bool_], where: str, eos_id: int
) -> Encoded:
    mask = np.zeros(len(ids) + 1, dtype=np.uint8)
    mask[:-1] = inside
    mask[0] = 0  # never a target: its context would be the previous example
    mask[-1] = mask[-2] if len(ids) > 1 else 0  # the end of an answer is learned
    if not mask.any():
        raise RowError(f"{where}: the example has no loss-bearing token once tokenized")
    return Encoded(np.append(ids, eos_id), mask, where)


def _pieces(example: Encoded, window: int | None, too_long: TooLong) -> Iterator[Encoded]:
    """The example, or its window-sized pieces (each piece's first token no target)."""
    if window is None or len(example.ids) <= window:
        yield example
        return
    if too_long == "refuse":
        raise RowError(
            f"{example.where}: the example is {len(example.ids)} tokens, longer than a window "
            f"of {window} (--window); shorten it, or pass --too-long split"
        )
    for start in range(0, len(example.ids), window):
        mask = example.mask[start : start + window].copy()
        mask[0] = 0
        yield Encoded(example.ids[start : start + window], mask, example.where)


def pack(
    examples: Iterable[Encoded],
    mode: PackMode,
    window: int | None,
    too_long: TooLong,
    eos_id: int,
) -> list[Encoded]:
    """The packed units, in order: one per example (``concatenate``) or one per bin of
    ``window`` tokens (``first-fit``, which needs ``window``)."""
    pieces = (piece for example in examples for piece in _pieces(example, window, too_long))
    if mode == "concatenate":
        return list(pieces)
    assert window is not None  # the options check it
    closed: list[list[Encoded]] = []
    open_bins: list[tuple[int, list[Encoded]]] = []  # (free tokens, contents)
    for piece in pieces:
        size = len(piece.ids)
        for index, (free, contents) in enumerate(open_bins):
            if size <= free:
                contents.append(piece)
                open_bins[index] = (free - size, contents)
                break
        else:
            if len(open_bins) >= _OPEN_BINS:
                closed.append(open_bins.pop(0)[1])
            open_bins.append((window - size, [piece]))
    closed.extend(contents for _, contents in open_bins)
    return [_bin(contents, window, eos_id) for contents in closed]


def _bin(contents: Sequence[Encoded], window: int, eos_id: int) -> Encoded:
    used = sum(len(piece.ids) for piece in contents)
    ids = np.full(window, eos_id, dtype=np.int64)
    mask = np.zeros(window, dtype=np.uint8)
    ids[:used] = np.concatenate([piece.ids for piece in contents])
    mask[:used] = np.concatenate([piece.mask for piece in contents])
    return Encoded(ids, mask, contents[0].where)
