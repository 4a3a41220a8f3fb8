"""A mixture's held-out set is read as a fixed, seeded interleave of its sources, in
proportion to their held-out windows, each batch from one source: a bounded evaluation
(``eval.max_batches``) sees every source, not the first one alone, and each source's loss
is reported (``eval/<source>/loss``), reduced across ranks. The shards are written by
``speedtronic prepare`` in real processes (forked, tests/forked.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import Forked, cli_main
from rank_env import free_port, rank_env
from token_data import bpe_tokenizer, documents, run_config, write_config, write_jsonl

from speedtronic.config import load_config
from speedtronic.data.held_out import build_eval_loader, held_out_dataset
from speedtronic.data.held_out_sources import held_out_parts, source_batch_counts
from speedtronic.data.interleave import Interleave


def prepared(
    forked: Forked,
    tmp_path: Path,
    sizes: dict[str, int],
    texts: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Path]:
    """One shard directory per source (``sizes``: its documents of random words, or its
    ``texts``), each prepared by ``speedtronic prepare`` in its own process, a fifth of
    the tokens held out."""
    tokenizer = bpe_tokenizer(tmp_path)
    children = {}
    for seed, (name, count) in enumerate(sizes.items()):
        given = (texts or {}).get(name)
        corpus = write_jsonl(
            tmp_path / f"{name}.jsonl", given if given else documents(count, seed=seed)
        )
        argv = ["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer)]
        argv += ["--output", str(tmp_path / name), "--eval-fraction", "0.2"]
        children[name] = forked.start(cli_main, *argv, cwd=tmp_path)
    for child in children.values():
        assert child.wait(timeout=120) == 0, child.output[-2000:]
    return {name: tmp_path / name for name in sizes}


def fit_on_two_ranks(forked: Forked, config: Path, cwd: Path) -> None:
    """``speedtronic fit`` on two gloo ranks (forked processes), both exiting 0."""
    port = free_port()
    children = [
        forked.start(cli_main, "fit", "--config", str(config), env=rank_env(r, 2, port), cwd=cwd)
        for r in (0, 1)
    ]
    assert [child.wait(timeout=180) for child in children] == [0, 0], children[0].output[-3000:]


def test_a_bounded_evaluation_of_a_mixture_sees_every_source(
    forked: Forked, tmp_path: Path
) -> None:
    shards = prepared(forked, tmp_path, {"fortunes": 300, "manual": 60})
    data = {"mixture": [{"tokens": str(path), "weight": 0.5} for path in shards.values()]}
    config = load_config(
        write_config(
            tmp_path / "run.yaml",
            run_config(tmp_path / "run", data, eval={"every_steps": 4, "max_batches": 2}),
        )
    )
    held = held_out_dataset(config.data, config.eval)
    assert isinstance(held, Interleave)
    sizes = [len(dataset) for dataset in held.datasets]  # type: ignore[arg-type]  # token windows are Sized
    assert sizes[0] > 3 * sizes[1] > 0
    # Every window once; each prefix holds each source in proportion (within one window).
    sources = np.array([held.source(i) for i in range(len(held))])
    assert np.bincount(sources).tolist() == sizes
    for end in range(1, len(held) + 1):
        share = np.bincount(sources[:end], minlength=2)
        assert np.all(np.abs(share - end * np.array(sizes) / len(held)) <= 1)
    # The bounded evaluation (2 batches of 4 windows) reads both sources: a batch of each
    # (the first 8 windows of the interleave hold both too), each batch from one source,
    # a source's first windows, in the interleave's order.
    first = sorted(set(sources[:8].tolist()))
    assert first == [0, 1]
    loader = build_eval_loader(config.data, config.eval)
    assert held_out_parts(loader) == (("fortunes", "manual"), (0, 1))
    batches = list(loader)
    assert len(batches) == 2
    for batch, dataset in zip(batches, held.datasets, strict=True):
        expected = torch.stack([dataset[i]["input_ids"] for i in range(4)])  # type: ignore[index]  # token windows
        assert torch.equal(batch["input_ids"], expected)
    # Two ranks: the same batches, dealt one each.
    shares = [
        list(build_eval_loader(config.data, config.eval, rank=rank, world_size=2))
        for rank in (0, 1)
    ]
    assert [len(share) for share in shares] == [1, 1]
    assert torch.equal(shares[1][0]["input_ids"], batches[1]["input_ids"])
    # Fixed: the same order when built again (another run, rank or resume).
    again = held_out_dataset(config.data, config.eval)
    assert isinstance(again, Interleave) and np.array_equal(again.order, held.order)


def test_source_batch_counts_give_every_source_a_batch_within_the_bound() -> None:
    # Unbounded: every window, in whole batches per source.
    assert source_batch_counts([10, 3], [10, 3], 4, None) == [3, 1]
    # Bounded to 2: one each although the second source leads with one window in eight.
    assert source_batch_counts([30, 9], [7, 1], 4, 2) == [1, 1]
    # The rest in proportion to the leading windows; a source holds what it fills.
    assert source_batch_counts([30, 9], [18, 6], 4, 6) == [4, 2]
    assert source_batch_counts([30, 2], [22, 2], 4, 6) == [5, 1]
    # A source without held-out windows gets nothing; a bound below the sources, the leaders.
    assert source_batch_counts([30, 0, 9], [6, 0, 2], 4, 3) == [2, 0, 1]
    assert source_batch_counts([30, 9, 9], [5, 2, 1], 4, 2) == [1, 1, 0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_source_has_its_held_out_loss_reduced_across_ranks(
    forked: Forked, tmp_path: Path, strategy: str
) -> None:
    """A varied source and a repetitive one: after training, their held-out losses differ
    clearly; a 2-rank fit logs both (and the whole set's) as one process evaluates them,
    and early stopping monitors one. Three batches on two ranks: rank 1 reads one, so under
    FSDP it repeats it (unscored) to keep the sharded forwards in lockstep."""
    shards = prepared(forked, tmp_path, {"fortunes": 200, "manual": 200}, texts={
        "manual": ["the cat sat on a mat " * 6] * 200})  # fmt: skip
    data = {"mixture": [{"tokens": str(path), "weight": 0.5} for path in shards.values()]}
    settings = run_config(
        tmp_path / "run",
        data,
        run={"max_steps": 40},
        optimizer={"lr": 1e-2},
        eval={"every_steps": 20, "max_batches": 3},
        checkpoint={"every_steps": 20},
        parallel={"strategy": strategy},
    )
    settings["callbacks"] = [
        {"name": "early_stopping", "monitor": "eval/manual/loss", "patience": 50}
    ]
    config = write_config(tmp_path / "run.yaml", settings)
    fit_on_two_ranks(forked, config, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    logged = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in logged] == [20, 40]
    last = logged[-1]
    varied, repeated = last["eval/fortunes/loss"], last["eval/manual/loss"]
    assert repeated < varied - 1.0  # clearly different
    assert min(varied, repeated) < last["eval/loss"] < max(varied, repeated)
    child = forked.start(cli_main, "evaluate", "--config", str(config), cwd=tmp_path)
    assert child.wait(timeout=120) == 0, child.output[-2000:]
    alone = dict(re.findall(r"(eval/\S+)=(\S+)", child.output))
    for key in ("eval/loss", "eval/fortunes/loss", "eval/manual/loss"):
        assert float(alone[key]) == pytest.approx(last[key], rel=1e-6), key


def test_sharded_ranks_with_uneven_held_out_batches_stay_in_step(
    forked: Forked, tmp_path: Path
) -> None:
    """One token source (no mixture parts to count batches by) under FSDP: three held-out
    samples, batches of one, dealt to two ranks, so rank 1 reads one batch. Its forwards
    gather shards with rank 0's: before each forward the ranks agree whether any still has
    a batch, and rank 1 makes an unscored one (without it, rank 0's second forward met rank
    1's all-reduce of the sums: the run hung until the distributed timeout). The logged
    loss is the one process's over the same three batches."""
    shards = prepared(forked, tmp_path, {"fortunes": 200})
    settings = run_config(
        tmp_path / "run",
        {"tokens": str(shards["fortunes"]), "micro_batch_size": 1},
        run={"max_steps": 4},
        eval={"every_steps": 4, "max_batches": 3},
        parallel={"strategy": "fsdp"},
        distributed={"timeout_s": 30.0},
    )
    config = write_config(tmp_path / "run.yaml", settings)
    fit_on_two_ranks(forked, config, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    logged = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(logged) == 1
    child = forked.start(cli_main, "evaluate", "--config", str(config), cwd=tmp_path)
    assert child.wait(timeout=120) == 0, child.output[-2000:]
    match = re.search(r"eval/loss=(\S+) .*batches=(\d+)", child.output)
    assert match is not None, child.output
    assert match.group(2) == "3"
    assert float(match.group(1)) == pytest.approx(logged[0], rel=1e-6)
