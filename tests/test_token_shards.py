"""Issue 23, items 2-4 below the CLI: the window sampler (order, ranks, resume), the memmap
window dataset, the mixture (proportions, epochs, resume), the manifest parser, the held-out
split, ``data.tokenizer`` for text, ``DatasetRequest.part`` for registered datasets, the
config rules; and one real two-rank ``speedtronic fit`` that reads every window once.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from cli_runner import run_cli
from forked import Forked, cli_main
from token_data import bpe_tokenizer, documents, losses, run_config, write_config, write_jsonl
from torch.utils.data import Dataset

from speedtronic.config import ConfigError, load_config
from speedtronic.data import (
    BatchStream,
    DatasetRequest,
    ResumableSampler,
    TextFileTokenDataset,
    build_dataloader,
    read_manifest,
    register_dataset,
)
from speedtronic.data.collate import collate_causal
from speedtronic.data.held_out import held_out_dataset
from speedtronic.data.interleave import Interleave
from speedtronic.data.mixture import MixtureDataset, apportion, open_mixture
from speedtronic.data.prepare import PrepareOptions, prepare
from speedtronic.data.shards import MANIFEST_NAME, ManifestError, ShardEntry, parse_manifest
from speedtronic.data.tokenizer import FileTokenizer
from speedtronic.data.windows import (
    FAULT_BYTES,
    ChunkedPermutation,
    Permutation,
    TokenWindowDataset,
    WindowSampler,
    locality,
    open_token_dataset,
)
from speedtronic.runtime import build_runtime


def make_shards(
    directory: Path, count: int, *, seed: int = 0, shard_tokens: int = 300, fraction: float = 0.1
) -> Path:
    """Shards of ``count`` documents, prepared with the test tokenizer."""
    corpus = write_jsonl(directory / "corpus.jsonl", documents(count, seed=seed))
    tokenizer = bpe_tokenizer(directory)
    output = directory / "shards"
    prepare(
        PrepareOptions(
            inputs=[str(corpus)],
            tokenizer=str(tokenizer),
            output=output,
            shard_tokens=shard_tokens,
            eval_fraction=fraction,
        )
    )
    return output


# -- the order -----------------------------------------------------------------------------------


def test_permutation_is_a_keyed_bijection_of_any_size() -> None:
    for n in [*range(1, 70), 1000, 4097, 65_537]:
        values = Permutation(n, key=7)(np.arange(n, dtype=np.int64))
        assert sorted(values.tolist()) == list(range(n)), n
    a = Permutation(1000, key=1)(np.arange(1000, dtype=np.int64))
    b = Permutation(1000, key=2)(np.arange(1000, dtype=np.int64))
    assert (a != b).mean() > 0.9  # another key, another order
    assert not np.array_equal(a, np.arange(1000))


@pytest.mark.parametrize(("n", "world"), [(10, 1), (10, 3), (7, 2), (2, 3), (1000, 4)])
def test_window_sampler_keeps_the_resumable_sampler_contract(n: int, world: int) -> None:
    for shuffle in (False, True):
        samplers = [
            WindowSampler(n, shuffle=shuffle, seed=5, rank=rank, world_size=world)
            for rank in range(world)
        ]
        plain = [
            ResumableSampler(n, shuffle=False, seed=5, rank=rank, world_size=world)
            for rank in range(world)
        ]
        for epoch in (0, 1):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            orders = [list(sampler) for sampler in samplers]
            assert all(len(order) == -(-n // world) for order in orders)
            every = Counter(index for order in orders for index in order)
            assert set(every) == set(range(n))  # every window, each once but the padding
            assert sum(every.values()) - n == -n % world
            if not shuffle:  # without shuffle: exactly ResumableSampler's sharded order
                assert orders == [sampler.order() for sampler in plain]
            # resume: starting at position k of an epoch is the rest of that epoch
            for sampler, order in zip(samplers, orders, strict=True):
                sampler.set_start(len(order) // 2)
                assert list(sampler) == order[len(order) // 2 :]
                assert len(sampler) == len(order) - len(order) // 2
                assert sampler.order() == order
    shuffled = WindowSampler(1000, shuffle=True, seed=5)
    first = list(shuffled)
    shuffled.set_epoch(1)
    assert list(shuffled) != first  # a new order each epoch
    assert WindowSampler(1000, shuffle=True, seed=6).order() != first  # and each seed


def test_window_sampler_takes_o1_memory_for_a_huge_corpus() -> None:
    sampler = WindowSampler(10**12, shuffle=True, seed=1, rank=3, world_size=8)
    sampler.set_start(10**11)
    window = next(iter(sampler))
    assert 0 <= window < 10**12


def test_the_chunked_permutation_is_a_bijection_for_any_chunk_group_and_tail() -> None:
    for n in (1, 2, 5, 64, 100, 1023, 4097):
        for chunk, group in ((2, 1), (3, 2), (16, 4), (64, 8), (5000, 2)):
            order = ChunkedPermutation(n, 11, chunk=chunk, group=group)
            values = order(np.arange(n, dtype=np.int64))
            assert sorted(values.tolist()) == list(range(n)), (n, chunk, group)
            tail = order(np.arange(n // 3, n, dtype=np.int64))  # any position, any block
            assert tail.tolist() == values[n // 3 :].tolist()
    assert ChunkedPermutation(1000, 4).key == 4  # chunk 1: the plain keyed permutation
    plain = Permutation(1000, 4)(np.arange(1000, dtype=np.int64))
    assert ChunkedPermutation(1000, 4)(np.arange(1000, dtype=np.int64)).tolist() == plain.tolist()
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        WindowSampler(10, shuffle=True, seed=0, chunk=0)


@pytest.mark.parametrize(
    ("n", "world", "chunk", "group"),
    [(1000, 1, 16, 4), (1003, 3, 16, 4), (7, 2, 4, 2), (5, 3, 8, 2), (20_000, 4, 1024, 8)],
)
def test_a_chunked_window_sampler_keeps_the_contract(
    n: int, world: int, chunk: int, group: int
) -> None:
    def samplers(seed: int) -> list[WindowSampler]:
        return [
            WindowSampler(n, shuffle=True, seed=seed, rank=rank, world_size=world, chunk=chunk,
                          group=group)
            for rank in range(world)
        ]  # fmt: skip

    ranks = samplers(5)
    epochs = []
    for epoch in (0, 1):
        for sampler in ranks:
            sampler.set_epoch(epoch)
        orders = [list(sampler) for sampler in ranks]
        epochs.append(orders)
        assert all(len(order) == -(-n // world) for order in orders)
        every = Counter(index for order in orders for index in order)
        assert set(every) == set(range(n)) and sum(every.values()) - n == -n % world
        whole = ranks[0].global_order()
        padded = (whole * world)[: len(orders[0]) * world]
        assert orders == [padded[rank::world] for rank in range(world)]  # strided, as before
        for sampler, order in zip(ranks, orders, strict=True):
            for start in (1, len(order) // 2, len(order) - 1):
                sampler.set_start(start)
                assert list(sampler) == order[start:]
    if n > 10:
        assert epochs[0] != epochs[1]  # a new order each epoch
        assert [list(sampler) for sampler in samplers(6)] != epochs[0]  # and each seed


def test_the_chunked_order_reads_locally_and_is_still_well_mixed() -> None:
    """At the scale of a 1 GB uint16 corpus (block 1024: 512 chunks of 1024 windows, working
    sets of 8 chunks): a working set's reads come from its 8 chunks, and yet the epoch is
    spread over the whole corpus from its start, and epochs and seeds give other orders."""
    chunk, group, chunks = 1024, 8, 512
    n = chunk * chunks
    sampler = WindowSampler(n, shuffle=True, seed=1, chunk=chunk, group=group)
    order = np.array(sampler.global_order())
    assert np.array_equal(np.sort(order), np.arange(n))
    of_chunk = order // chunk
    span = chunk * group
    for start in range(0, n, span):  # each working set: windows of 8 chunks, all of them
        sets = Counter(of_chunk[start : start + span].tolist())
        assert len(sets) == group and set(sets.values()) == {chunk}
    # within a working set the windows are dealt at random: consecutive samples come from
    # any of its chunks, hardly ever the next window
    same_chunk = (of_chunk[1:] == of_chunk[:-1]).mean()
    assert 0.08 < same_chunk < 0.2, same_chunk
    assert (np.abs(np.diff(order)) == 1).mean() < 0.01
    # the first eighth of the epoch (64 chunks) draws on every part of the corpus
    first = of_chunk[: n // 8] * 8 // chunks  # the eighth of the corpus each window is in
    shares = np.bincount(first, minlength=8) / first.size
    assert shares.min() > 0.03 and shares.max() < 0.25, shares
    assert abs(order[: n // 8].mean() / n - 0.5) < 0.1
    # another epoch, another seed: other working sets, other orders
    sampler.set_epoch(1)
    other_epoch = np.array(sampler.global_order())
    other_seed = np.array(
        WindowSampler(n, shuffle=True, seed=2, chunk=chunk, group=group).global_order()
    )
    for other in (other_epoch, other_seed):
        assert (other == order).mean() < 0.01
        assert len(set(of_chunk[:span].tolist()) & set((other[:span] // chunk).tolist())) <= 2


def test_a_shuffled_epoch_maps_each_block_about_once_per_working_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    from speedtronic.data import windows

    releases: list[set[tuple[int, int]]] = []
    original = windows._Maps.release

    def recorded(maps: windows._Maps) -> None:
        releases.append(set(maps._blocks))
        original(maps)

    monkeypatch.setattr(windows._Maps, "release", recorded)
    shard = tmp_path / "train-00000.bin"
    tokens = np.random.default_rng(0).integers(0, 300, (16 << 20) + 1, dtype=np.uint16)
    tokens.tofile(shard)  # 32 MiB: 16 blocks, 16384 windows of block 1024
    entry = ShardEntry(shard.name, "train", tokens.size, "0" * 64)
    manifest = read_manifest(make_shards(tmp_path / "small", 5))
    manifest = dataclasses.replace(manifest, shards=(entry,))
    budget = 4 * FAULT_BYTES
    dataset = TokenWindowDataset(tmp_path, manifest, (entry,), 1024, resident_bytes=budget)
    # a chunk is a block of windows; each can touch its block and the next: 2 chunks a set
    assert (dataset.chunk_windows, dataset.group_chunks) == locality(1024, 2, budget) == (1024, 2)
    span = dataset.chunk_windows * dataset.group_chunks

    def epoch(sampler: WindowSampler) -> tuple[int, list[set[tuple[int, int]]]]:
        releases.clear()
        fresh = TokenWindowDataset(tmp_path, manifest, (entry,), 1024, resident_bytes=budget)
        order = np.array(list(sampler))
        before, growth = psutil.Process().memory_info().rss, 0
        for start in range(0, order.size, 64):
            inputs, _ = fresh.gather(order[start : start + 64])
            expected = tokens[order[start] * 1024 :][:1024].astype(np.int64)
            assert torch.equal(inputs[0], torch.from_numpy(expected))
            growth = max(growth, psutil.Process().memory_info().rss - before)
        assert growth < 2 * budget, f"RSS grew by {growth / 2**20:.1f} MiB"
        first_bytes = [order[start : start + span] * 2048 for start in range(0, order.size, span)]
        sets = [  # the blocks each working set reads: its windows' first and last bytes'
            {(0, int(block)) for block in np.concatenate([at, at + 2049]) // FAULT_BYTES}
            for at in first_bytes
        ]
        return sum(map(len, releases)) + len(fresh._maps._blocks), sets

    mapped, sets = epoch(dataset.make_sampler(shuffle=True, seed=3))
    assert len(sets) == 8 and len(releases) <= len(sets) - 1
    assert mapped <= len(sets) * 4  # each working set maps at most its budget of blocks
    # a release drops what the finished working set read (and at most the next one's first)
    for number, released in enumerate(releases):
        assert released <= sets[number] | sets[number + 1]
    global_mapped, _ = epoch(WindowSampler(len(dataset), shuffle=True, seed=3))
    assert global_mapped > 50 * mapped  # the order of old: a block mapped per window or so


def test_a_chunked_order_resumes_at_the_exact_window_on_each_rank(tmp_path: Path) -> None:
    """A corpus of several working sets (4 MiB, budget 2 MiB: 2 sets of 4096 windows): a
    ``BatchStream`` restored from its state continues with the very next batch, mid-set, at
    the set boundary and in the next epoch, on one rank and on each of two."""
    shard = tmp_path / "train-00000.bin"
    tokens = np.random.default_rng(1).integers(0, 300, (2 << 20) + 1, dtype=np.uint16)
    tokens.tofile(shard)
    entry = ShardEntry(shard.name, "train", tokens.size, "0" * 64)
    manifest = read_manifest(make_shards(tmp_path / "small", 5))
    manifest = dataclasses.replace(manifest, shards=(entry,))

    def stream(rank: int, world: int) -> BatchStream[dict[str, torch.Tensor]]:
        dataset = TokenWindowDataset(tmp_path, manifest, (entry,), 256, resident_bytes=FAULT_BYTES)
        assert (dataset.chunk_windows, dataset.group_chunks, len(dataset)) == (4096, 1, 8192)
        sampler = dataset.make_sampler(shuffle=True, seed=7, rank=rank, world_size=world)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=64, sampler=sampler, collate_fn=dataset.collate_fn
        )
        return BatchStream(loader)

    for world in (1, 2):
        per_epoch = 8192 // world // 64
        for rank in range(world):
            whole = stream(rank, world)
            batches = [next(whole)["input_ids"] for _ in range(per_epoch + 10)]
            assert len({int(batch[0, 0]) for batch in batches[:per_epoch]}) > 1
            for at in (5, per_epoch // 2, per_epoch // 2 + 1, per_epoch + 3):
                replay = stream(rank, world)
                for _ in range(at):
                    next(replay)
                resumed = stream(rank, world)
                resumed.load_state_dict(replay.state_dict())
                for expected in batches[at : at + 2]:
                    assert torch.equal(next(resumed)["input_ids"], expected), (world, rank, at)

            # the position records its order; one saved before the order became
            # locality-aware (no "order") is restored loudly, not silently in the new order
            saved = whole.state_dict()
            assert saved["order"] == 2
            del saved["order"]
            with pytest.warns(UserWarning, match="data order version 1 .* reads version 2"):
                stream(rank, world).load_state_dict(saved)

# -- the windows ---------------------------------------------------------------------------------


def test_windows_are_block_plus_one_tokens_at_stride_block_size(tmp_path: Path) -> None:
    shards = make_shards(tmp_path, 60)
    manifest = read_manifest(shards)
    dataset = open_token_dataset(shards, block_size=16)
    train = manifest.split("train")
    assert dataset.shards == train
    expected = 0
    for shard in train:
        tokens = np.fromfile(shards / shard.file, dtype="<u2").astype(np.int64)
        count = (len(tokens) - 1) // 16
        for window in (0, count - 1):
            item = dataset[expected + window]
            start = window * 16
            assert item["input_ids"].tolist() == tokens[start : start + 16].tolist()
            assert item["labels"].tolist() == tokens[start + 1 : start + 17].tolist()
        expected += count
    assert len(dataset) == expected
    # the fast collate and the generic one give the same batch
    loader = build_dataloader(
        load_config(
            {
                "data": {"tokens": str(shards), "micro_batch_size": 5},
                "model": {"vocab_size": 320, "max_seq_len": 16},
            }
        ).data
    )
    batch = next(iter(loader))
    indices = list(loader.sampler)[:5]  # type: ignore[arg-type]  # a WindowSampler
    generic = collate_causal([dataset[index] for index in indices])
    assert set(batch) == {"input_ids", "labels"}
    assert torch.equal(batch["input_ids"], generic["input_ids"])
    assert torch.equal(batch["labels"], generic["labels"])
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].is_contiguous()


def test_the_dataset_keeps_its_rss_flat_and_few_shards_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    from speedtronic.data import windows

    shards = make_shards(tmp_path, 60, shard_tokens=100)
    dataset = open_token_dataset(shards, block_size=8)
    monkeypatch.setattr(windows, "MAX_OPEN_MAPS", 2)
    small = TokenWindowDataset(
        shards, dataset.manifest, dataset.shards, 8, resident_bytes=3 * FAULT_BYTES
    )
    opened = []
    for start in range(0, len(small) - 4, 4):
        inputs, labels = small.gather(list(range(start, start + 4)))
        opened.append(small._maps.open_maps)
        assert torch.equal(inputs, dataset.gather(list(range(start, start + 4)))[0])
    assert max(opened) == 2 and len(dataset.shards) > 3  # never all shards mapped at once
    clone = pickle.loads(pickle.dumps(small))  # what a spawned DataLoader worker gets
    assert clone._maps.open_maps == 0 and torch.equal(clone.gather([3])[1], small.gather([3])[1])

    # A shuffled epoch over 64 MB of shards: what stays mapped is bounded by resident_bytes.
    big = tmp_path / "big"
    big.mkdir()
    tokens = np.random.default_rng(0).integers(0, 300, 32 << 20, dtype=np.uint16)
    tokens.tofile(big / "train-00000.bin")
    entry = ShardEntry("train-00000.bin", "train", tokens.size, "0" * 64)
    manifest = dataclasses.replace(dataset.manifest, shards=(entry,))
    epoch = TokenWindowDataset(big, manifest, (entry,), 1024, resident_bytes=4 << 20)
    order = np.random.default_rng(1).permutation(len(epoch))
    before = psutil.Process().memory_info().rss
    growth = 0
    for start in range(0, len(order), 64):
        epoch.gather(order[start : start + 64])
        growth = max(growth, psutil.Process().memory_info().rss - before)
    assert growth < 16 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over a 64 MiB epoch"


def test_what_is_mapped_is_counted_by_block_so_a_small_split_is_never_unmapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from speedtronic.data import windows

    releases: list[int] = []
    original = windows._Maps.release

    def counted(maps: windows._Maps) -> None:
        releases.append(len(maps._blocks))
        original(maps)

    monkeypatch.setattr(windows._Maps, "release", counted)
    # Shards far smaller than the budget: read over and over, they stay mapped (each shard is
    # one block, counted once), instead of being unmapped and faulted in again every few reads.
    shards = make_shards(tmp_path, 60, shard_tokens=100)
    dataset = open_token_dataset(shards, block_size=8)
    budget = len(dataset.shards) * FAULT_BYTES
    small = TokenWindowDataset(shards, dataset.manifest, dataset.shards, 8, resident_bytes=budget)
    for _ in range(3):
        for start in range(0, len(small), 4):
            small.gather(list(range(start, min(start + 4, len(small)))))
    assert releases == []
    # A larger shard, a budget of two blocks: a window across a block boundary counts both,
    # a block read again counts nothing, and a third block first unmaps the two.
    big = tmp_path / "big"
    big.mkdir()
    tokens = np.arange(8 << 20, dtype=np.uint32).astype(np.uint16)  # 16 MiB, 8 blocks
    tokens.tofile(big / "train-00000.bin")
    entry = ShardEntry("train-00000.bin", "train", tokens.size, "0" * 64)
    manifest = dataclasses.replace(dataset.manifest, shards=(entry,))
    epoch = TokenWindowDataset(big, manifest, (entry,), 1024, resident_bytes=2 * FAULT_BYTES)
    per_block = FAULT_BYTES // 2 // 1024  # windows starting in one block (uint16, 1024 apart)
    inputs, labels = epoch.gather([per_block - 1])  # its last token is in the next block
    expected = tokens.astype(np.int64)
    assert torch.equal(labels[0], torch.from_numpy(expected[per_block * 1024 - 1023 :][:1024]))
    epoch.gather([per_block, per_block + 5, 3])
    assert releases == []
    epoch.gather([3 * per_block])
    assert releases == [2]
    assert torch.equal(inputs[0], torch.from_numpy(expected[(per_block - 1) * 1024 :][:1024]))


def test_training_never_reads_held_out_shards_and_eval_reads_them_by_default(
    tmp_path: Path,
) -> None:
    shards = make_shards(tmp_path, 80)
    manifest = read_manifest(shards)
    config = load_config(
        run_config(tmp_path / "run", {"tokens": str(shards)}, eval={"every_steps": 2})
    )
    trainer, _ = build_runtime(config)
    train = trainer.stream.source.dataset  # type: ignore[attr-defined]  # a DataLoader
    held = trainer.eval_data.dataset  # type: ignore[union-attr]  # the eval DataLoader
    assert isinstance(train, TokenWindowDataset) and isinstance(held, TokenWindowDataset)
    assert train.shards == manifest.split("train") and held.shards == manifest.split("eval")
    # the held-out split is the last documents, about eval_fraction of the tokens
    held_tokens = sum(shard.tokens for shard in held.shards)
    assert 0.05 < held_tokens / manifest.tokens < 0.2
    eos = manifest.eos_id
    last_train = np.fromfile(shards / manifest.split("train")[-1].file, dtype="<u2")
    assert last_train[-1] == eos  # the split falls on a document boundary
    assert sorted(shard.file for shard in held.shards)[0] == "eval-00000.bin"


# -- the mixture ---------------------------------------------------------------------------------


def test_apportion_is_exact_and_follows_the_weights() -> None:
    assert apportion(10, [0.8, 0.2]) == [8, 2]
    assert apportion(7, [1, 1, 1]) == [3, 2, 2]
    assert sum(apportion(1001, [0.3, 0.3, 0.4])) == 1001


class Windows(TokenWindowDataset):
    """A stand-in source of ``n`` windows whose window ``i`` is ``[tag, i, ...]``."""

    def __init__(self, tag: int, n: int) -> None:  # noqa: D107
        self.tag, self.n, self.block_size = tag, n, 2

    def __len__(self) -> int:
        return self.n

    def gather(self, indices: object) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.as_tensor(np.asarray(indices), dtype=torch.int64)
        inputs = torch.stack([torch.full_like(rows, self.tag), rows], dim=1)
        return inputs, inputs


def draws(mixture: MixtureDataset, sampler: WindowSampler) -> list[tuple[int, int]]:
    inputs, _ = mixture.gather(list(sampler))
    return [(int(tag), int(window)) for tag, window in inputs.tolist()]


def test_mixture_proportions_hold_per_epoch_and_sources_continue_across_epochs() -> None:
    web, code = Windows(0, 900), Windows(1, 100)
    mixture = MixtureDataset([web, code], [0.5, 0.5], seed=3)
    assert len(mixture) == 1000 and mixture.quotas.tolist() == [500, 500]
    sampler = mixture.make_sampler(shuffle=True, seed=3)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append(draws(mixture, sampler))
    for seen in epochs:
        counts = Counter(tag for tag, _ in seen)
        assert counts == {0: 500, 1: 500}  # exact per epoch
        first = Counter(tag for tag, _ in seen[:100])
        assert 35 <= first[0] <= 65  # and close within any stretch
    # web (900 windows, 500 an epoch) continues where it stopped: its 1000 draws of epochs
    # 0 and 1 are one whole pass (draws 0-899) and the first 100 draws of the next
    web_draws = Counter(window for seen in epochs[:2] for tag, window in seen if tag == 0)
    assert set(web_draws) == set(range(900))
    assert Counter(web_draws.values()) == {1: 800, 2: 100}
    # code (100 windows, 500 an epoch) starts a new pass, in a new order, when it runs out:
    # its 500 draws of an epoch are five whole passes
    code_draws = Counter(window for tag, window in epochs[0] if tag == 1)
    assert code_draws == dict.fromkeys(range(100), 5)
    keys = np.arange(200, dtype=np.int64) * 2 + 1  # draws 0-199 of source 1
    sources, windows = mixture.decode(keys)
    assert set(sources.tolist()) == {1}
    first, second = windows[:100].tolist(), windows[100:].tolist()
    assert sorted(first) == sorted(second) == list(range(100)) and first != second


def test_mixture_ranks_are_disjoint_and_resume_at_the_exact_draw() -> None:
    mixture = MixtureDataset([Windows(0, 60), Windows(1, 40), Windows(2, 7)], [3, 1, 1], seed=9)
    one = mixture.make_sampler(shuffle=True, seed=9)
    ranks = [mixture.make_sampler(shuffle=True, seed=9, rank=r, world_size=2) for r in (0, 1)]
    whole = list(one)
    shards = [list(sampler) for sampler in ranks]
    assert sorted(shards[0] + shards[1]) == sorted(whole + whole[:1])  # 107 is odd: one pad
    assert shards[0] == whole[0::2] and shards[1] == (whole + whole[:1])[1::2]
    # a BatchStream resumes mid-epoch on the very next batch
    loader = torch.utils.data.DataLoader(
        mixture, batch_size=4, sampler=one, collate_fn=mixture.collate_fn
    )
    stream = BatchStream(loader)
    seen = [next(stream)["input_ids"] for _ in range(40)]  # into the second epoch
    state = stream.state_dict()
    after = [next(stream)["input_ids"] for _ in range(5)]
    again = BatchStream(
        torch.utils.data.DataLoader(
            mixture,
            batch_size=4,
            sampler=mixture.make_sampler(shuffle=True, seed=9),
            collate_fn=mixture.collate_fn,
        )
    )
    again.load_state_dict(state)
    assert all(
        torch.equal(a, b)
        for a, b in zip(after, [next(again)["input_ids"] for _ in range(5)], strict=True)
    )
    assert len(seen) == 40


def test_a_mixture_of_chunked_sources_keeps_its_quotas_and_reads_each_source_locally() -> None:
    sources = [Windows(0, 30_000), Windows(1, 9_000), Windows(2, 777)]
    for source in sources:  # chunks of 64 windows, working sets of 4 chunks (256 windows)
        source.chunk_windows, source.group_chunks = 64, 4
    mixture = MixtureDataset(sources, [0.6, 0.3, 0.1], seed=4)
    quotas = mixture.quotas.tolist()
    sampler = mixture.make_sampler(shuffle=True, seed=4)
    assert sampler.rounds >= 2 * quotas[0] // 256  # a round: at most half a working set each
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        keys = np.array(list(sampler))
        assert np.unique(keys).size == keys.size == len(mixture)
        tags, windows = (np.array(column) for column in zip(*draws(mixture, sampler), strict=True))
        assert np.bincount(tags).tolist() == quotas  # exact per epoch
        # and exact at every round's end: floor(g N_s / K) draws of each source before round g
        for round_ in range(1, sampler.rounds, 17):
            before = [quota * round_ // sampler.rounds for quota in quotas]
            assert np.bincount(tags[: sum(before)], minlength=3).tolist() == before
        for tag in range(len(sources)):
            mine = windows[tags == tag]  # this source's windows, in the order it reads them
            for start in range(0, mine.size - 256, 256):  # 256 draws: 1-2 working sets' chunks
                assert len(set((mine[start : start + 256] // 64).tolist())) <= 12
    # web's first 30,000 draws (epoch 0 and the start of epoch 1) are one pass: each window once
    pass_ = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        keys = np.array(list(sampler))
        web = keys[(keys % 3 == 0) & (keys // 3 < 30_000)]
        pass_ += mixture.decode(web)[1].tolist()
    assert sorted(pass_) == list(range(30_000))
    # two ranks stride one order, and a rank resumes at any position of it
    ranks = [mixture.make_sampler(shuffle=True, seed=4, rank=r, world_size=2) for r in (0, 1)]
    sampler.set_epoch(2)
    whole = list(sampler)
    for rank, ranked in enumerate(ranks):
        ranked.set_epoch(2)
        order = list(ranked)
        assert order == (whole + whole[:1])[rank::2]
        ranked.set_start(12_345)
        assert list(ranked) == order[12_345:]


def test_a_mixture_from_config_trains_and_resumes_bitwise(tmp_path: Path) -> None:
    web = make_shards(tmp_path / "web", 80, seed=1)
    code = make_shards(tmp_path / "code", 30, seed=2)
    data = {"mixture": [{"tokens": str(web), "weight": 0.8}, {"tokens": str(code), "weight": 0.2}]}
    for name in ("full", "part"):
        write_config(
            tmp_path / f"{name}.yaml", run_config(tmp_path / name, data, eval={"every_steps": 4})
        )
    assert run_cli("fit", "--config", "full.yaml", cwd=tmp_path).returncode == 0
    assert run_cli("fit", "--config", "part.yaml", "--max-steps", "3", cwd=tmp_path).returncode == 0
    resumed = run_cli("fit", "--config", "part.yaml", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(tmp_path / "part" / "metrics.jsonl") == losses(
        tmp_path / "full" / "metrics.jsonl"
    )
    # its held-out set: both sources' held-out shards
    held = held_out_dataset(
        load_config(tmp_path / "full.yaml").data, load_config(tmp_path / "full.yaml").eval
    )
    assert isinstance(held, Interleave) and len(held.datasets) == 2
    # speedtronic evaluate scores the last checkpoint on it, as the fit's last evaluation did
    evaluated = run_cli("evaluate", "--config", "full.yaml", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    last = losses(tmp_path / "full" / "metrics.jsonl", "eval/loss")[8]
    assert evaluated.stdout.startswith(f"eval/loss={last!r} ")


def test_mixture_sources_must_share_a_tokenizer(tmp_path: Path) -> None:
    bpe = make_shards(tmp_path / "bpe", 20)
    corpus = write_jsonl(tmp_path / "b" / "c.jsonl", documents(20))
    raw = tmp_path / "b" / "shards"
    prepare(PrepareOptions(inputs=[str(corpus)], tokenizer="bytes", output=raw))
    with pytest.raises(
        ValueError, match=r"data.mixture\[1\].tokens: .* was prepared with another tokenizer"
    ):
        open_mixture([(str(bpe), 1.0), (str(raw), 1.0)], block_size=8, seed=0, vocab_size=320)


# -- the manifest --------------------------------------------------------------------------------


def test_the_manifest_round_trips_and_every_bad_field_is_named(tmp_path: Path) -> None:
    shards = make_shards(tmp_path, 20)
    text = (shards / MANIFEST_NAME).read_text()
    manifest = read_manifest(shards)
    assert manifest.to_json() == text  # what prepare wrote is what the parser reads back
    good = json.loads(text)

    def broken(path: str, value: object) -> str:
        data = json.loads(text)
        target = data
        *parents, last = path.split(".")
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
        with pytest.raises(ManifestError) as caught:
            parse_manifest(json.dumps(data).encode(), "index.json")
        return str(caught.value)

    assert broken("version", 2).startswith("index.json: version: 2 is newer than")
    assert broken("format", "zip") == "index.json: format: 'zip' is not 'speedtronic-token-shards'"
    assert (
        broken("dtype", "uint8") == "index.json: dtype: 'uint8' is not one of ['uint16', 'uint32']"
    )
    assert (
        broken("vocab_size", 70_000)
        == "index.json: dtype: uint16 cannot hold a vocabulary of 70000 ids"
    )
    assert broken("eos_id", 999) == "index.json: eos_id: 999 is not in [0, 319]"
    assert broken("tokens", 5) == "index.json: tokens: 5 is not the sum of the shards' tokens"
    assert broken("shards", []) == "index.json: shards: must be a non-empty list"
    assert (
        broken("shards.0.tokens", 0)
        == "index.json: shards[0].tokens: 0 is not in [1, 1125899906842624]"
    )
    assert broken("shards.0.sha256", "x") == (
        "index.json: shards[0].sha256: 'x' is not a sha256 (64 lower-case hex digits)"
    )
    assert (
        broken("shards.0.split", "test")
        == "index.json: shards[0].split: 'test' is not one of ['train', 'eval']"
    )
    assert broken("shards.1.file", good["shards"][0]["file"]) == (
        f"index.json: shards[1].file: {good['shards'][0]['file']!r} is listed twice"
    )
    assert broken("tokenizer.file", "../tokenizer.json").startswith(
        "index.json: tokenizer.file: '../tokenizer.json'"
    )
    assert broken("documents", KeyError) == "index.json: documents: missing"
    assert (
        broken("eval_fraction", float("nan")) == "index.json: eval_fraction: nan is not in [0, 1)"
    )
    for data, message in [
        (b"[" * 100_000, "index.json: not a usable JSON document (RecursionError)"),
        (b"\xff", "index.json: not UTF-8 (byte 0)"),
        (b"[]", "index.json: the manifest: must be an object, got list"),
        (b'{"a": 1' + b"1" * 5000 + b"}", "index.json: not a usable JSON document (ValueError)"),
        (b'{"a": ', "index.json: not JSON ("),
    ]:
        with pytest.raises(ManifestError) as caught:
            parse_manifest(data, "index.json")
        assert str(caught.value).startswith(message.rstrip("(")), str(caught.value)


# -- data.tokenizer for text, DatasetRequest.part, config rules ------------------------------------


def test_a_text_file_streams_through_data_tokenizer_for_training_and_eval(tmp_path: Path) -> None:
    tokenizer = bpe_tokenizer(tmp_path)
    text = " ".join(documents(30, seed=4))
    (tmp_path / "train.txt").write_text(text, encoding="utf-8")
    (tmp_path / "eval.txt").write_text(text[:400], encoding="utf-8")
    config = load_config(
        {
            "data": {"text_path": str(tmp_path / "train.txt"), "tokenizer": str(tokenizer)},
            "eval": {"every_steps": 1, "text_path": str(tmp_path / "eval.txt")},
            "model": {"vocab_size": 320, "max_seq_len": 8},
        }
    )
    expected = FileTokenizer(tokenizer).encode(text)
    assert max(expected) >= 256  # real BPE merges, not bytes
    stream = build_dataloader(config.data).dataset
    assert isinstance(stream, TextFileTokenDataset)
    ids = [t for block in stream for t in block["input_ids"].tolist()[:8]][:64]
    assert ids[:8] == expected[:8]
    held = held_out_dataset(config.data, config.eval)
    assert isinstance(held, TextFileTokenDataset)
    assert next(iter(held))["input_ids"].tolist() == FileTokenizer(tokenizer).encode(text[:400])[:8]
    small = config.to_dict()
    small["model"]["vocab_size"] = 100  # type: ignore[index]  # the model section
    small["data"]["vocab_size"] = None  # type: ignore[index]  # the data section
    with pytest.raises(
        ValueError,
        match=r"data.tokenizer: .* holds token ids up to 319 .* model's vocabulary of 100",
    ):
        build_dataloader(load_config(small).data)


def test_a_registered_dataset_names_its_own_held_out_split() -> None:
    asked: list[str] = []

    class Parts(Dataset[dict[str, torch.Tensor]]):
        def __init__(self, part: str) -> None:
            self.value = 1 if part == "held_out" else 0

        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            tokens = torch.full((5,), self.value)
            return {"input_ids": tokens[:-1], "labels": tokens[1:]}

    @register_dataset("parts-with-split", held_out=True)
    def parts(request: DatasetRequest) -> Dataset[dict[str, torch.Tensor]]:
        asked.append(request.part)
        return Parts(request.part)

    config = load_config(
        {"data": {"dataset": "parts-with-split"}, "eval": {"every_steps": 1},
         "model": {"vocab_size": 8, "max_seq_len": 4}, "run": {"max_steps": 1}}
    )  # fmt: skip
    trainer, _ = build_runtime(config)
    assert asked == ["train", "held_out"]  # no eval.dataset needed
    assert next(iter(trainer.eval_data))["input_ids"].unique().tolist() == [1]  # type: ignore[arg-type]
    assert next(iter(trainer.stream.source))["input_ids"].unique().tolist() == [0]  # type: ignore[attr-defined, index]

    @register_dataset("parts-without-split")
    def plain(request: DatasetRequest) -> Dataset[dict[str, torch.Tensor]]:
        asked.append(request.part)
        return Parts(request.part)

    config.data.dataset = "parts-without-split"
    with pytest.raises(ValueError, match="has no held-out split of its own .*held_out=True"):
        held_out_dataset(config.data, config.eval)


def test_config_rules_of_the_token_sources() -> None:
    def errors(data: dict[str, object], **sections: object) -> list[str]:
        with pytest.raises(ConfigError) as caught:
            load_config({"data": data, **sections})
        return caught.value.errors

    assert errors({"tokens": "a", "text_path": "b.txt"}) == [
        "data.text_path: give one training source, not data.tokens and data.text_path"
    ]
    assert errors({"mixture": [{"tokens": "a"}], "dataset": "learnable"}) == [
        "data.dataset: give one training source, not data.mixture and data.dataset"
    ]
    assert errors({"tokens": "a", "mixture": [{"tokens": "b"}]}) == [
        "data.mixture: give one training source, not data.tokens and data.mixture"
    ]
    assert errors({"tokenizer": "t.json"}) == [
        "data.tokenizer: nothing to tokenize or check (it applies to data.text_path, "
        "eval.text_path, data.tokens and data.mixture)"
    ]
    assert errors({"mixture": [{"tokens": "a"}], "shuffle": False}) == [
        "data.shuffle: false does not apply to data.mixture (a mixture is always shuffled)"
    ]
    assert errors({"mixture": [{"tokens": "a", "weight": 0}]})[0].startswith(
        "data.mixture[0].weight: 0 is less than or equal to the minimum of 0"
    )
    assert errors({"mixture": [{"path": "a"}]})[0].startswith("data.mixture[0]")
    fine = load_config({"data": {"mixture": [{"tokens": "a", "weight": 2}]}})
    assert fine.data.mixture[0].weight == 2.0 and fine.data.shuffle is None
    assert (
        load_config({"data": {"text_path": "x.txt", "tokenizer": "bytes"}}).data.tokenizer
        == "bytes"
    )


# -- processes -----------------------------------------------------------------------------------


def check_no_hf_import() -> int:
    """A forked child: the core and the data modules import without the hf extra."""
    import sys

    import speedtronic.cli
    import speedtronic.data.corpus
    import speedtronic.data.mixture
    import speedtronic.data.prepare
    import speedtronic.data.windows
    import speedtronic.runtime  # noqa: F401

    loaded = sorted(
        name for name in ("tokenizers", "pyarrow", "transformers") if name in sys.modules
    )
    print(f"loaded: {loaded}")
    return 0 if not loaded else 3


def test_nothing_in_the_core_imports_the_hf_extra(forked: Forked) -> None:
    child = forked.start(check_no_hf_import)
    assert child.wait(60) == 0, child.output


RECORDER = """
import json, os
from speedtronic import Callback, register_callback

@register_callback("record_windows")
class RecordWindows(Callback):
    def on_microbatch_start(self, trainer, ctx):
        rows = ctx.batch["input_ids"].tolist()
        with open(f"rows-{os.environ['RANK']}.jsonl", "a") as handle:
            handle.write("".join(json.dumps(row) + "\\n" for row in rows))
"""


def test_two_ranks_read_disjoint_windows_that_cover_the_epoch(
    tmp_path: Path, forked: Forked
) -> None:
    from test_distributed import free_port, rank_env

    shards = make_shards(tmp_path, 30, seed=6)
    dataset = open_token_dataset(shards, block_size=16)
    n = len(dataset)
    (tmp_path / "record_windows.py").write_text(RECORDER)
    config = run_config(
        tmp_path / "run",
        {"tokens": str(shards), "micro_batch_size": 2, "drop_last": False},
        run={"max_epochs": 1, "max_steps": 1000},
        checkpoint={"enabled": False},
    )
    config["imports"] = ["record_windows"]
    config["callbacks"] = [{"name": "record_windows"}]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    children = [
        forked.start(
            cli_main, "fit", "--config", "run.yaml", env=rank_env(rank, 2, port), cwd=tmp_path
        )
        for rank in (0, 1)
    ]
    assert [child.wait(120) for child in children] == [0, 0], children[0].output[-3000:]
    rows = [
        [
            tuple(json.loads(line))
            for line in (tmp_path / f"rows-{rank}.jsonl").read_text().splitlines()
        ]
        for rank in (0, 1)
    ]
    assert len(rows[0]) == len(rows[1]) == -(-n // 2)
    every = Counter(rows[0] + rows[1])
    windows = Counter(tuple(row) for row in dataset.gather(list(range(n)))[0].tolist())
    assert windows - every == Counter()  # every window of the epoch was read
    assert sum((every - windows).values()) == n % 2  # and none twice, but one pad if n is odd
