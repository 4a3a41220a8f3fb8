"""A short run on a byte-tokenized text file, for the generation and task tests."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

CORPUS = "the cat sat on the mat. the dog ran in the park. " * 60


def text_run_config(
    tmp_path: Path,
    *,
    steps: int = 4,
    extra: dict[str, object] | None = None,
    **eval_section: object,
) -> Path:
    """A config training a tiny reference transformer on ``CORPUS`` (byte tokenizer),
    checkpointed at its last step; ``extra`` adds or replaces top-level sections."""
    (tmp_path / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    config = {
        "run": {"device": "cpu", "max_steps": steps, "output_dir": str(tmp_path / "run")},
        "model": {"vocab_size": 257, "max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {"text_path": str(tmp_path / "corpus.txt"), "micro_batch_size": 4},
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "scheduler": {"warmup_steps": 0},
        "logging": {"console": False, "jsonl": True},
        "checkpoint": {"every_steps": steps},
        "eval": {"every_steps": steps, "max_batches": 1, **eval_section},
        **(extra or {}),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
