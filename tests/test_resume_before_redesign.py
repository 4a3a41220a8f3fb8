"""A checkpoint written by speedtronic before the one-house redesign (issue 33) resumes
bitwise after it.

``tests/data/before_redesign`` holds what the pre-redesign code (commit 30a59dd) left at
step 5 of a 10-step run (the reference transformer, AdamW with clipping, a cosine schedule,
the ``ema`` callback, checkpoints every 5 steps): the checkpoint, ``latest.json``, the run's
id and its first five metric lines. ``expected.json`` is what that same code wrote for steps
6-10 when it ran on: each step's loss and digests of the step-10 model, optimizer state and
EMA average. Resuming the fixture with today's code must give the same bits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "data" / "before_redesign"


def digest(tree: object) -> str:
    """sha256 over every tensor of ``tree`` (nested dicts and lists), with its path."""
    hasher = hashlib.sha256()

    def walk(node: object, path: str) -> None:
        if isinstance(node, torch.Tensor):
            hasher.update(path.encode())
            hasher.update(node.detach().reshape(-1).contiguous().numpy().tobytes())
        elif isinstance(node, dict):
            for key in sorted(node, key=str):
                walk(node[key], f"{path}/{key}")
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                walk(value, f"{path}/{index}")

    walk(tree, "")
    return hasher.hexdigest()


def test_a_checkpoint_from_before_the_redesign_resumes_bitwise(tmp_path: Path) -> None:
    work = tmp_path / "before_redesign"
    shutil.copytree(FIXTURE, work)
    fit = subprocess.run(
        [sys.executable, "-m", "speedtronic", "fit", "--config", "run.yaml", "--resume"],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert fit.returncode == 0, fit.stderr
    assert "resum" in (fit.stdout + fit.stderr).lower()
    expected = json.loads((FIXTURE / "expected.json").read_text())
    records = [json.loads(line) for line in (work / "run/metrics.jsonl").read_text().splitlines()]
    losses = {str(record["step"]): record["loss"] for record in records if record["step"] > 5}
    assert losses == expected["losses"]
    final = torch.load(work / "run/checkpoints/step_000000000010.pt", weights_only=True)
    assert digest(final["model"]) == expected["model"]
    assert digest(final["optimizer"]["state"]) == expected["optimizer_state"]
    assert digest(final["callbacks"]["ema"]) == expected["ema"]
