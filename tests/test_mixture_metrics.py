"""Per-source figures of a mixture (issue 36, item 7): ``data/<source>/samples`` and
``data/<source>/tokens`` on logging steps, the whole run's draws of each source (both ranks),
computed from the data position alone. A real 2-rank ``speedtronic fit`` (forked rank
processes on gloo) across an epoch boundary, checked against the draws its samplers make."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from forked import Forked, cli_main
from rank_env import free_port, rank_env
from test_mixture_held_out import prepared
from token_data import run_config, write_config

from speedtronic.config import load_config
from speedtronic.data.loader import DEFAULT_DATA_SEED, training_dataset
from speedtronic.data.mixture import MixtureDataset


def test_a_two_rank_mixture_logs_what_it_drew_from_each_source(
    forked: Forked, tmp_path: Path
) -> None:
    shards = prepared(forked, tmp_path, {"fortunes": 24, "manual": 8})
    data = {
        "mixture": [
            {"tokens": str(shards["fortunes"]), "weight": 0.7},
            {"tokens": str(shards["manual"]), "weight": 0.3},
        ],
        "micro_batch_size": 5,
    }
    config = run_config(tmp_path / "run", data, logging={"every_steps": 2, "console": False})
    config["run"] = {**config["run"], "max_steps": 9}  # type: ignore[dict-item]  # a mapping
    path = write_config(tmp_path / "run.yaml", config)
    port = free_port()
    ranks = [
        forked.start(cli_main, "fit", "--config", str(path), cwd=tmp_path, env=rank_env(r, 2, port))
        for r in (0, 1)
    ]
    assert [rank.wait(timeout=180) for rank in ranks] == [0, 0], ranks[0].output[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [2, 4, 6, 8, 9]  # logging steps only
    # The truth: the sources of the keys each rank's sampler yields, epoch by epoch.
    loaded = load_config(path)
    mixture = training_dataset(loaded.data, vocab_size=loaded.data.vocab_size)
    assert isinstance(mixture, MixtureDataset)
    samplers = [
        mixture.make_sampler(shuffle=True, seed=DEFAULT_DATA_SEED, rank=r, world_size=2)
        for r in (0, 1)
    ]
    per_rank = samplers[0].num_samples
    assert 9 * 5 > per_rank  # the run crosses an epoch boundary
    drawn: list[int] = []
    for epoch in range(9):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        keys = [sampler.order() for sampler in samplers]
        for index in range(per_rank):
            drawn.extend(int(rank_keys[index]) % 2 for rank_keys in keys)
    block = loaded.model.max_seq_len
    # each rank reads one batch of 5 a step; a short last batch is dropped or kept
    epoch_batches = per_rank // 5 if loaded.data.drop_last else -(-per_rank // 5)
    for record in records:
        epochs, within = divmod(record["step"], epoch_batches)
        taken: list[int] = []
        for epoch in range(epochs + 1):
            read = min((epoch_batches if epoch < epochs else within) * 5, per_rank)
            start = epoch * per_rank * 2
            taken.extend(drawn[start : start + read * 2])
        expected = np.bincount(taken, minlength=2).tolist()
        got = [record["data/fortunes/samples"], record["data/manual/samples"]]
        assert got == expected, (record["step"], got, expected)
        assert sum(got) == record["samples"]
        assert record["data/fortunes/tokens"] == got[0] * block
    last = records[-1]
    assert last["data/fortunes/samples"] > 2 * last["data/manual/samples"] > 0  # about 70/30
