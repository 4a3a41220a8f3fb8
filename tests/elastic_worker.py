"""One rank of an elastic-data run (``tests/test_elastic_data.py``): trains from token shards
of counting ids (``sequential_shards``) and records, per step, the windows this rank read.

``elastic_rank`` runs in a process forked from the preloaded fork server with the torchrun
variables set (one process, no variables, for a single rank); it writes
``<out>/<tag>-rank<r>.json``: ``{"windows": {step: [window ids]}, "layout": [micro, K]}``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speedtronic.engine.callback import Callback  # noqa: E402
from speedtronic.engine.contexts import MicrobatchContext  # noqa: E402
from speedtronic.engine.view import TrainerView  # noqa: E402
from speedtronic.runtime import build_runtime  # noqa: E402

BLOCK = 4
"""Tokens per window: window ids are first ids // BLOCK."""


def elastic_config(
    output_dir: Path, data: Mapping[str, object], *, micro: int, target: int, steps: int
) -> dict[str, object]:
    """A one-layer reference transformer on ``data`` (``tokens`` or ``mixture``), a
    checkpoint at every step."""
    return {
        "run": {"seed": 3, "device": "cpu", "max_steps": steps, "output_dir": str(output_dir)},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 2048,
            "max_seq_len": BLOCK,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 16,
            "d_ff": 32,
        },
        "data": {
            **data,
            "synthetic": False,
            "micro_batch_size": micro,
            "target_batch_size": target,
            "verify_shards": False,
        },
        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        "logging": {"every_steps": 1, "console": False, "jsonl": False},
        "checkpoint": {"enabled": True, "every_steps": 1, "keep_last": None},
        "distributed": {"timeout_s": 60.0},
    }


class WindowLedger(Callback):
    """The window ids of every microbatch this rank trained on, by step."""

    def __init__(self) -> None:
        self.windows: dict[int, list[int]] = {}

    def on_microbatch_start(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        batch = ctx.batch
        assert isinstance(batch, dict)
        first = batch["input_ids"][:, 0] // BLOCK
        self.windows.setdefault(ctx.step, []).extend(int(value) for value in first)


def elastic_rank(out: str, tag: str, raw_config: str, resume: bool) -> int:
    """Train ``raw_config`` (JSON) on this rank, resuming when asked; record the windows."""
    torch.set_num_threads(1)
    ledger = WindowLedger()
    trainer, _ = build_runtime(json.loads(raw_config), resume=resume, extra_callbacks=[ledger])
    trainer.fit()
    rank = int(os.environ.get("RANK", "0"))
    report = {
        "windows": {str(step): ids for step, ids in ledger.windows.items()},
        "layout": [trainer.state.stream.source.batch_size, trainer.settings.accumulation_steps],  # type: ignore[attr-defined]  # a DataLoader
    }
    Path(out, f"{tag}-rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    return 0
