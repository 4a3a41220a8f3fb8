"""A rank of the multiple-choice reduction test (tests/test_tasks.py): scores its share of
a task file and writes the reduced score (``rank<N>.json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from speedtronic.evaluation.tasks import MultipleChoiceTask, read_task
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.systems.distributed import setup_distributed, teardown_distributed


def task_model() -> ReferenceTransformer:
    """The same seeded model in every process, with a spread that makes choices differ."""
    torch.manual_seed(0)
    model = ReferenceTransformer(vocab_size=257, block_size=64, n_layer=1, n_head=2, d_model=16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.5)
    return model


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def score_rank(out: str, task_file: str) -> int:
    torch.set_num_threads(1)
    distributed = setup_distributed("cpu", timeout_s=60)
    try:
        task = MultipleChoiceTask("t", read_task(task_file), encode, batch_size=4, context=64)
        score = task.score(task_model(), device=torch.device("cpu"), distributed=distributed)
        report = {"correct": score.correct, "correct_norm": score.correct_norm, "rows": score.rows}
        rank = os.environ["RANK"]
        Path(out, f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    finally:
        teardown_distributed(distributed)
    return 0
