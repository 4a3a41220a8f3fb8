"""Elastic data: a token-shard or mixture run resumed on another number of data-parallel ranks
continues the same global sample sequence, with the same global batch.

Each run trains on shards of counting ids (``tests/sequential_shards.py``), so a batch's
first column names its windows; every rank records the windows of every step
(``tests/elastic_worker.py``). The ranks are real processes on gloo, forked from the
preloaded fork server (``tests/forked.py``). The ledger of the first part of the epoch and
of the resumed part must together be the epoch's global order, one global batch per step:
no window skipped or repeated, whatever the rank counts.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from elastic_worker import BLOCK, elastic_config, elastic_rank
from forked import Forked, cli_main
from rank_env import free_port, rank_env
from sequential_shards import write_sequential_shards

from speedtronic.config import SpeedtronicConfig
from speedtronic.data import build_dataloader
from speedtronic.data.stream import BatchStream
from speedtronic.runtime import build_runtime

GLOBAL_BATCH = 8
STEPS = 8  # one epoch of 64 windows
LAYOUTS = {1: (4, 8), 2: (2, 4), 4: (2, 2)}
"""Per rank count, the configured (micro_batch_size, target_batch_size): 8 samples a step."""
NO_RANK = {key: None for key in rank_env(0, 1, 0)}


def data_spec(root: Path, kind: str) -> dict[str, object]:
    if kind == "tokens":
        return {"tokens": str(write_sequential_shards(root / "a", [(0, 129), (1000, 129)]))}
    first = write_sequential_shards(root / "a", [(0, 129)])
    second = write_sequential_shards(root / "b", [(1000, 129)])
    return {"mixture": [{"tokens": str(first), "weight": 1.0}, {"tokens": str(second)}]}


def epoch_order(config: dict[str, object]) -> list[int]:
    """The window ids of epoch 0's global order (one rank's view of all of it)."""
    cfg = SpeedtronicConfig.from_dict(config)
    loader = build_dataloader(cfg.data, vocab_size=cfg.model.vocab_size)
    sampler = loader.batch_sampler.sampler  # type: ignore[union-attr]  # a BatchSampler
    keys = sampler.global_order()  # type: ignore[attr-defined]  # a WindowSampler
    inputs, _ = loader.dataset.gather(keys)  # type: ignore[attr-defined]  # a WindowSource
    return [int(value) for value in inputs[:, 0] // BLOCK]


def run_ranks(
    forked: Forked, out: Path, tag: str, config: dict[str, object], world: int, *, resume: bool
) -> list[dict[str, object]]:
    port = free_port()
    envs = [rank_env(rank, world, port) for rank in range(world)] if world > 1 else [NO_RANK]
    children = [
        forked.start(elastic_rank, str(out), tag, json.dumps(config), resume, env=env)
        for env in envs
    ]
    for rank, child in enumerate(children):
        assert child.wait(timeout=120) == 0, f"rank {rank}:\n{child.output[-3000:]}"
    return [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(world)]


def step_windows(reports: list[dict[str, object]]) -> dict[int, Counter[int]]:
    """Every step's windows, all ranks together."""
    steps: dict[int, Counter[int]] = {}
    for report in reports:
        windows = report["windows"]
        assert isinstance(windows, dict)
        for step, ids in windows.items():
            steps.setdefault(int(step), Counter()).update(ids)
    return steps


@pytest.mark.parametrize(
    ("kind", "before", "after"),
    [("tokens", 2, 1), ("tokens", 1, 2), ("tokens", 2, 4), ("mixture", 2, 1), ("mixture", 1, 2)],
)
def test_a_resume_on_another_rank_count_continues_the_global_sample_sequence(
    tmp_path: Path, forked: Forked, kind: str, before: int, after: int
) -> None:
    data = data_spec(tmp_path, kind)
    run = tmp_path / "run"

    def config(world: int, steps: int) -> dict[str, object]:
        micro, target = LAYOUTS[world]
        return elastic_config(run, data, micro=micro, target=target, steps=steps)

    first = run_ranks(forked, tmp_path, "first", config(before, 3), before, resume=False)
    # the resumed run keeps its rank count's configured per-rank batch sizes: they would make
    # another global batch, and the checkpoint's (8) is kept instead
    resumed = run_ranks(forked, tmp_path, "resumed", config(after, STEPS), after, resume=True)
    order = epoch_order(config(1, STEPS))
    assert sorted(order) == sorted(set(order)) and len(order) == GLOBAL_BATCH * STEPS
    ledger = step_windows(first) | step_windows(resumed)
    assert sorted(ledger) == list(range(1, STEPS + 1))
    for step, windows in ledger.items():
        expected = Counter(order[(step - 1) * GLOBAL_BATCH : step * GLOBAL_BATCH])
        assert windows == expected, f"step {step}"
    consumed = sum(ledger.values(), Counter())
    assert set(consumed) == set(order) and set(consumed.values()) == {1}  # the whole epoch once
    micro, accumulation = resumed[0]["layout"]  # type: ignore[misc]  # a [micro, K] list
    assert micro * accumulation * after == GLOBAL_BATCH
    assert micro <= LAYOUTS[after][0]


def test_a_resume_that_cannot_keep_the_global_batch_exits_2_saying_why(
    tmp_path: Path, forked: Forked
) -> None:
    data = data_spec(tmp_path, "tokens")
    run = tmp_path / "run"
    run_ranks(
        forked,
        tmp_path,
        "first",
        elastic_config(run, data, micro=2, target=4, steps=2),
        2,
        resume=False,
    )
    config_path = tmp_path / "three.json"
    config_path.write_text(json.dumps(elastic_config(run, data, micro=2, target=4, steps=4)))
    port = free_port()
    children = [
        forked.start(
            cli_main, "train", "--config", str(config_path), "--resume", env=rank_env(rank, 3, port)
        )
        for rank in range(3)
    ]
    codes = [child.wait(timeout=120) for child in children]
    assert codes == [2, 2, 2], children[0].output[-3000:]
    output = children[0].output
    assert "global batch is 8 samples (micro-batch 2 x accumulation 2 x 2 rank(s))" in output
    assert "3 data-parallel ranks cannot share equally" in output
    assert "Traceback" not in output
    # every rank finds it alike: rank 0 alone prints it
    assert not any("cannot share equally" in child.output for child in children[1:])


def test_a_checkpoint_without_the_global_cursor_resumes_as_before(tmp_path: Path) -> None:
    """States written before the cursor and the layout were recorded resume on the same
    rank count exactly as they did: at the saved batch of the epoch."""
    torch.set_num_threads(1)
    data = data_spec(tmp_path, "tokens")
    config = elastic_config(tmp_path / "run", data, micro=2, target=4, steps=5)
    config["checkpoint"] = {"enabled": False}
    full, _ = build_runtime(config)
    full.fit()
    part, _ = build_runtime({**config, "run": {**config["run"], "max_steps": 2}})  # type: ignore[dict-item]  # a section mapping
    part.fit()
    state = part.state_dict()
    assert state["batch"] == {"micro": 2, "accumulation": 2, "ranks": 1}
    data_state = state["data"]
    assert isinstance(data_state, dict) and data_state["samples"] == 8
    del state["batch"], data_state["samples"]
    resumed, _ = build_runtime(config)
    resumed.load_state_dict(state)
    resumed.fit()
    for key, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key


def test_the_cursor_converts_between_batch_sizes_and_refuses_a_split_batch() -> None:
    from torch.utils.data import DataLoader

    from speedtronic.data import ResumableSampler

    def stream(rank: int, world: int, batch: int) -> BatchStream[torch.Tensor]:
        sampler = ResumableSampler(24, shuffle=True, seed=5, rank=rank, world_size=world)
        return BatchStream(DataLoader(list(range(24)), batch_size=batch, sampler=sampler))

    two = [stream(rank, 2, 3) for rank in (0, 1)]
    for ranks in two:
        next(ranks)
        next(ranks)
    state = two[0].state_dict()
    assert state["samples"] == 12
    one = stream(0, 1, 4)
    one.load_state_dict(state)
    assert one.batches_in_epoch == 3
    rest = sorted(torch.cat([next(one) for _ in range(3)]).tolist())
    seen = sorted(torch.cat([next(stream(r, 2, 6)) for r in (0, 1)]).tolist())
    assert sorted(rest + seen) == list(range(24))  # the first 12 of the order, then the rest
    with pytest.raises(ValueError, match="falls inside a batch of 1 rank"):
        stream(0, 1, 5).load_state_dict(state)


def test_the_new_layout_is_shown_once_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The checkpoint's global batch overriding the config's batch sizes is a warning (the
    CLI shows warnings; it showed no info line), on rank 0 only."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from speedtronic.data import ResumableSampler
    from speedtronic.engine.batch_layout import BatchLayout, resume_layout

    def trainer(distributed: object) -> Any:
        sampler = ResumableSampler(32, shuffle=False, seed=0, rank=0, world_size=1)
        source = DataLoader(list(range(32)), batch_size=4, sampler=sampler)
        state = SimpleNamespace(stream=SimpleNamespace(source=source), distributed=distributed)
        return SimpleNamespace(state=state, settings=SimpleNamespace(accumulation_steps=1))

    saved = {"batch": {"micro": 2, "accumulation": 2, "ranks": 2}, "data": {"samples": 8}}
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        assert resume_layout(trainer(None), saved) == BatchLayout(4, 2, 1)
        assert resume_layout(trainer(SimpleNamespace(is_main=False)), saved) is not None
    assert [record.getMessage() for record in caplog.records] == [
        "resumed on 1 data-parallel rank(s) instead of 2: the global batch stays 8 samples "
        "(micro-batch 4 x accumulation 2 x 1 rank(s))"
    ]
