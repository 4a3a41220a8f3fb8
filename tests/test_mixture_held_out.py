"""A mixture's held-out set is read as a fixed, seeded interleave of its sources, in
proportion to their held-out windows (issue 36, item 3): a bounded evaluation
(``eval.max_batches``) sees every source, not the first one alone. The shards are written
by ``speedtronic prepare`` in real processes (forked, tests/forked.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from forked import Forked, cli_main
from token_data import bpe_tokenizer, documents, run_config, write_config, write_jsonl

from speedtronic.config import load_config
from speedtronic.data.held_out import build_eval_loader, held_out_dataset
from speedtronic.data.interleave import Interleave


def prepared(forked: Forked, tmp_path: Path, sizes: dict[str, int]) -> dict[str, Path]:
    """One shard directory per source (``sizes``: its documents), each prepared by
    ``speedtronic prepare`` in its own process, a fifth of the tokens held out."""
    tokenizer = bpe_tokenizer(tmp_path)
    children = {}
    for seed, (name, count) in enumerate(sizes.items()):
        corpus = write_jsonl(tmp_path / f"{name}.jsonl", documents(count, seed=seed))
        argv = ["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer)]
        argv += ["--output", str(tmp_path / name), "--eval-fraction", "0.2"]
        children[name] = forked.start(cli_main, *argv, cwd=tmp_path)
    for child in children.values():
        assert child.wait(timeout=120) == 0, child.output[-2000:]
    return {name: tmp_path / name for name in sizes}


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
    # The bounded evaluation (2 batches of 4 windows) reads the first 8: both sources.
    first = sorted(set(sources[:8].tolist()))
    assert first == [0, 1]
    batches = list(build_eval_loader(config.data, config.eval))
    read = torch.cat([batch["input_ids"] for batch in batches])
    expected = torch.stack([held[i]["input_ids"] for i in range(8)])
    assert torch.equal(read, expected)
    # Fixed: the same order when built again (another run, rank or resume).
    again = held_out_dataset(config.data, config.eval)
    assert isinstance(again, Interleave) and np.array_equal(again.order, held.order)
