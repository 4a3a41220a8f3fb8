"""Token shards whose ids count up (``first, first + 1, ...``), written with their manifest:
window ``i`` of a shard of block size ``b`` starts with id ``first + i * b``, so a batch's
first column names the windows it holds."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from speedtronic.data.shards import (
    MANIFEST_NAME,
    ShardEntry,
    TokenizerRecord,
    TokenManifest,
)
from speedtronic.data.tokenizer import BYTE_TOKENIZER_SHA256


def write_sequential_shards(
    directory: Path, shards: Sequence[tuple[int, int]], *, held_out: int = 0
) -> Path:
    """A shard directory of one training shard per ``(first, tokens)`` (ids ``first ..
    first + tokens - 1``, uint16), plus a held-out shard of ``held_out`` tokens when given."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    parts = [("train", first, count) for first, count in shards]
    if held_out:
        parts.append(("eval", 0, held_out))
    for index, (split, first, count) in enumerate(parts):
        ids = np.arange(first, first + count, dtype="<u2")
        name = f"{split}-{index:05d}.bin"
        (directory / name).write_bytes(ids.tobytes())
        digest = hashlib.sha256(ids.tobytes()).hexdigest()
        entries.append(ShardEntry(name, split, count, digest, int(ids.max())))  # type: ignore[arg-type]  # split is "train" or "eval"
    manifest = TokenManifest(
        dtype="uint16",
        vocab_size=max(first + count for _, first, count in parts),
        eos_id=0,
        tokenizer=TokenizerRecord("bytes", BYTE_TOKENIZER_SHA256, None),
        documents=len(parts),
        eval_fraction=0.0,
        shard_tokens=max(count for _, _, count in parts),
        shards=tuple(entries),
    )
    (directory / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return directory
