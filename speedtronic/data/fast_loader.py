"""``FastLoader``: the ``DataLoader`` that ``build_dataloader`` makes, without torch's
per-batch profiler annotation when it reads in the training process.

torch's single-process iterator enters a ``record_function`` span around every batch (a
profiler label, recorded even while no profiler runs): about 6 us per batch on a 2-core
x86 machine, as much as reading a batch of eight 129-token windows. ``FastLoader`` keeps the
``DataLoader`` interface (sampler, batch sampler, collate, pinning, workers: everything the
stream and the batch layout read); its single-process iterator over a map-style dataset
takes the same steps -- next index, fetch (``__getitems__`` and collate), pin -- without the
span. Over token windows (a ``WindowSource`` with its own collate) the fetch is the
dataset's ``read_batch`` of the batch's indices: what ``__getitems__`` and the collate make
of them, without the fetcher, the lazy batch object and the collate's dispatch between
(about 1 us a batch). With workers, or over an iterable dataset, the iterator is torch's
own. A profiler trace of a run therefore shows these data reads under the trainer's own
spans, not under torch's ``enumerate(DataLoader)`` label.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter, _SingleProcessDataLoaderIter

from speedtronic.data.windows import WindowSource

__all__ = ["FastLoader"]


class _PlainIterator(_SingleProcessDataLoaderIter):
    """torch's single-process iterator over a map-style dataset, minus the per-batch
    ``record_function`` span (its other check, a length warning, is for iterable datasets)."""

    def __init__(self, loader: DataLoader[object]) -> None:
        super().__init__(loader)
        dataset = loader.dataset
        self._read: Callable[[Sequence[int]], object] | None = None
        if (  # the dataset's own batch read, exactly what the fetcher and collate would do
            isinstance(dataset, WindowSource)
            and self._auto_collation
            and loader.collate_fn is WindowSource.collate_fn
            and type(dataset).__getitems__ is WindowSource.__getitems__
        ):
            self._read = dataset.read_batch

    def __next__(self) -> object:
        if self._sampler_iter is None:
            self._reset()  # type: ignore[call-arg]  # torch's own call, untyped there
        read = self._read
        if read is None:
            data = self._next_data()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        else:
            data = read(next(self._sampler_iter))
            if self._pin_memory:  # as torch's _next_data pins (it leaves pin_memory untyped)
                data = pin_memory(data, self._pin_memory_device)  # type: ignore[no-untyped-call]
        self._num_yielded += 1
        return data


class FastLoader(DataLoader[object]):
    """A ``DataLoader`` whose single-process iterator skips the per-batch profiler span
    (module docstring); otherwise the same."""

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if self.num_workers == 0 and not isinstance(self.dataset, IterableDataset):
            return _PlainIterator(self)
        return super()._get_iterator()
