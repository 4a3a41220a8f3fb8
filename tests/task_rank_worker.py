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
from speedtronic.systems.sharding import shard_model


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


def score_rank(out: str, task_file: str, sharded: bool = False, batch_size: int = 4) -> int:
    """Score this rank's share; ``sharded``: of the model under FSDP2 (its forwards in
    lockstep with the other rank's)."""
    torch.set_num_threads(1)
    distributed = setup_distributed("cpu", timeout_s=60)
    try:
        task = MultipleChoiceTask(
            "t", read_task(task_file), encode, batch_size=batch_size, context=64
        )
        model: torch.nn.Module = task_model()
        if sharded:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model = shard_model(
                model,
                optimizer,
                device=torch.device("cpu"),
                group=None,
                reshard_after_forward=True,
                param_dtype=None,
            )
        score = task.score(model, device=torch.device("cpu"), distributed=distributed)
        report = {"correct": score.correct, "correct_norm": score.correct_norm, "rows": score.rows}
        if sharded:
            report["passes"] = score.forward_passes
        rank = os.environ["RANK"]
        Path(out, f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    finally:
        teardown_distributed(distributed)
    return 0
