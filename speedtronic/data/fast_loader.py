"""``FastLoader``: the ``DataLoader`` that ``build_dataloader`` makes, without torch's
per-batch profiler annotation when it reads in the training process.

torch's single-process iterator enters a ``record_function`` span around every batch (a
profiler label, recorded even while no profiler runs): about 6 us per batch on a 2-core
x86 machine, as much as reading a batch of eight 129-token windows. ``FastLoader`` keeps the
``DataLoader`` interface (sampler, batch sampler, collate, pinning, workers: everything the
stream and the batch layout read); its single-process iterator over a map-style dataset
takes the same steps -- next index, fetch (``__getitems__`` and collate), pin -- without the
span. With workers, or over an iterable dataset, the iterator is torch's own. A profiler
trace of a run therefore shows these data reads under the trainer's own spans, not under
torch's ``enumerate(DataLoader)`` label.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter, _SingleProcessDataLoaderIter

__all__ = ["FastLoader"]


class _PlainIterator(_SingleProcessDataLoaderIter):
    """torch's single-process iterator over a map-style dataset, minus the per-batch
    ``record_function`` span (its other check, a length warning, is for iterable datasets)."""

    def __next__(self) -> object:
        if self._sampler_iter is None:
            self._reset()  # type: ignore[call-arg]  # torch's own call, untyped there
        data = self._next_data()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self._num_yielded += 1
        return data


class FastLoader(DataLoader[object]):
    """A ``DataLoader`` whose single-process iterator skips the per-batch profiler span
    (module docstring); otherwise the same."""

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if self.num_workers == 0 and not isinstance(self.dataset, IterableDataset):
            return _PlainIterator(self)
        return super()._get_iterator()
