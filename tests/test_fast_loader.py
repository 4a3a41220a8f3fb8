"""``FastLoader``: the same batches as torch's ``DataLoader``, without its per-batch profiler
label in the training process (``speedtronic.data.fast_loader``)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from speedtronic.data.fast_loader import FastLoader
from speedtronic.data.stream import ResumableSampler

LABEL = "enumerate(DataLoader)"


def profiled_names(loader: DataLoader[object]) -> tuple[list[object], set[str]]:
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        batches = list(loader)
    return batches, {event.name for event in trace.events()}


def make(kind: type[DataLoader[object]], data: object) -> DataLoader[object]:
    sampler = ResumableSampler(10, shuffle=True, seed=3)
    sampler.set_start(2)
    return kind(data, batch_size=3, sampler=sampler)  # type: ignore[arg-type]


def test_batches_match_torchs_loader_without_its_per_batch_label() -> None:
    torch.set_num_threads(1)
    data = TensorDataset(torch.arange(10) * 10)
    ours, our_names = profiled_names(make(FastLoader, data))
    theirs, their_names = profiled_names(make(DataLoader, data))
    assert len(ours) == len(theirs) == 3  # 8 samples from position 2, batches of 3
    for mine, torchs in zip(ours, theirs, strict=True):
        assert isinstance(mine, list) and isinstance(torchs, list)
        assert torch.equal(mine[0], torchs[0])
    assert any(name.startswith(LABEL) for name in their_names)
    assert not any(name.startswith(LABEL) for name in our_names)


class Counting(IterableDataset[int]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(5))


def test_an_iterable_dataset_keeps_torchs_iterator() -> None:
    loader = FastLoader(Counting(), batch_size=2)
    batches, names = profiled_names(loader)
    assert [batch.tolist() for batch in batches] == [[0, 1], [2, 3], [4]]  # type: ignore[attr-defined]
    assert any(name.startswith(LABEL) for name in names)
