"""``eval.max_batches`` counts the batches of the whole evaluation (issue 36, item 2): a
2-rank fit logs the held-out loss over the same samples as one process, so ``speedtronic
evaluate`` (one process) reproduces it. Real rank processes on gloo (forked, tests/forked.py)
running the CLI with the torchrun variables set."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from distributed_worker import base_config
from forked import Forked, cli_main
from rank_env import free_port, rank_env


def fit_on_ranks(forked: Forked, config: Path, world: int) -> None:
    port = free_port()
    children = [
        forked.start(cli_main, "fit", "--config", str(config), env=rank_env(r, world, port))
        for r in range(world)
    ]
    codes = [child.wait(timeout=120) for child in children]
    assert codes == [0] * world, [child.output[-2000:] for child in children]


def logged_eval(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r}


def test_a_two_rank_eval_loss_is_what_evaluate_reproduces_and_latest_json_has_the_global_loss(
    forked: Forked, tmp_path: Path
) -> None:
    # 3 global batches of 2 samples: 6 held-out samples, 3 on each rank (3 batches each
    # before the fix: twice the samples, another figure).
    config = base_config(
        tmp_path / "run", run={"max_steps": 4}, eval={"every_steps": 4, "max_batches": 3}
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    fit_on_ranks(forked, path, 2)
    logged = logged_eval(tmp_path / "run")
    assert sorted(logged) == [4]
    # latest.json records the loss the log has: the mean over the ranks, not rank 0's own
    # (issue 36, item 8).
    pointer = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    record = pointer["checkpoints"][pointer["file"]]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert record["loss"] == {r["step"]: r["loss"] for r in records}[4]
    child = forked.start(cli_main, "evaluate", "--config", str(path), cwd=tmp_path)
    assert child.wait(timeout=120) == 0, child.output[-2000:]
    match = re.search(r"eval/loss=(\S+) eval/ppl=\S+ step=4 batches=(\d+)", child.output)
    assert match is not None, child.output
    # The same 6 samples, batched differently: equal up to float32 rounding of batch means.
    assert float(match.group(1)) == pytest.approx(logged[4], rel=1e-6, abs=0)
    assert match.group(2) == "3"
