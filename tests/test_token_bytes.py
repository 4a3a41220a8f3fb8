"""A byte-level BPE's loss masks from the ids alone (``speedtronic.data.token_bytes``) equal
the ones found through the tokenizer's character offsets, on text with multi-byte
characters split across tokens, special tokens and several spans per example; any other
tokenizer has no byte-length table (the offsets are used)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from sft_data import chat_tokenizer

from speedtronic.data.chat import Example, RowError
from speedtronic.data.packing import Encoded, encode_examples
from speedtronic.data.token_bytes import token_byte_lengths

PIECES = ["the", " cat", " sat", "é", "ü", "日本", "🙂", "<|im_start|>", "<|im_end|>", "\n", " "]


def examples(count: int) -> list[tuple[Example, str]]:
    rng = random.Random(0)
    made: list[tuple[Example, str]] = []
    for index in range(count):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(3, 30)))
        spans: list[tuple[int, int]] = []
        position = 0
        while position < len(text) - 1 and len(spans) < 3:
            low = rng.randint(position, len(text) - 1)
            high = rng.randint(low + 1, len(text))
            spans.append((low, high))
            position = high + 1
        made.append((Example(text, tuple(spans)), f"rows.jsonl:{index + 1}"))
    return made


def encoded_one_by_one(
    rows: list[tuple[Example, str]], tokenizer: object, table: object
) -> list[Encoded | str]:
    found: list[Encoded | str] = []
    for row in rows:
        try:
            found += encode_examples([row], tokenizer, 0, table)  # type: ignore[arg-type]
        except RowError as exc:  # a span the first token alone holds: nothing to learn
            found.append(str(exc))
    return found


def test_masks_from_token_bytes_equal_masks_from_offsets(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(chat_tokenizer(tmp_path)))
    tokenizer.encode_special_tokens = False  # as --format chat encodes
    table = token_byte_lengths(tokenizer)
    assert table is not None
    rows = examples(300)
    by_offsets = encoded_one_by_one(rows, tokenizer, None)
    by_bytes = encoded_one_by_one(rows, tokenizer, table)
    assert sum(isinstance(item, str) for item in by_offsets) < 30
    for (example, _), old, new in zip(rows, by_offsets, by_bytes, strict=True):
        if isinstance(old, str) or isinstance(new, str):
            assert old == new
            continue
        assert np.array_equal(old.ids, new.ids), example
        assert np.array_equal(old.mask, new.mask), example
    # and a whole batch at once: the same examples in the same order
    good = [row for row, old in zip(rows, by_offsets, strict=True) if not isinstance(old, str)]
    batch = encode_examples(good, tokenizer, 0, table)
    assert [item.where for item in batch] == [where for _, where in good]
    for item, old in zip(batch, (o for o in by_offsets if not isinstance(o, str)), strict=True):
        assert np.array_equal(item.ids, old.ids) and np.array_equal(item.mask, old.mask)


def test_a_tokenizer_that_is_not_byte_level_has_no_table() -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert token_byte_lengths(word_level) is None
    lowered = Tokenizer(models.BPE())
    lowered.normalizer = normalizers.Lowercase()
    lowered.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert token_byte_lengths(lowered) is None
    prefixed = Tokenizer(models.BPE())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert token_byte_lengths(prefixed) is None
