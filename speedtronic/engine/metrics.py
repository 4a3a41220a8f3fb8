"""The per-step metric record: contributors add keys, sinks read the finished values.

Values may be device tensors. They are only copied to the host when a sink asks for
``values()`` or ``finished()`` -- all of them in one transfer -- so steps on which nothing
is logged never force a device sync.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

MetricValue = float | int | str
"""A metric value as sinks see it."""


class MetricRecord:
    """One global step's metrics. Created by the trainer at the ``metrics`` event."""

    __slots__ = ("step", "_values", "_pending", "_finished")

    def __init__(self, step: int) -> None:
        self.step = step
        self._values: dict[str, MetricValue] = {"step": step}
        self._pending: dict[str, torch.Tensor] = {}
        self._finished: dict[str, MetricValue] | None = None

    @classmethod
    def of(
        cls, step: int, values: dict[str, MetricValue], tensors: dict[str, torch.Tensor]
    ) -> MetricRecord:
        """Step ``step``'s record made of ``values`` (plain numbers, starting with ``"step":
        step``) and ``tensors`` (read after them, in their order), both taken over, not
        copied: the record the loop builds on a metrics step in one call instead of a ``set``
        per key. The tensors are kept as they are, with their autograd history (``set`` cuts
        it off): the loop's loss is held by the training state until the next step anyway, so
        the record keeps no graph alive that would otherwise be freed, and a ``detach`` costs
        as much as the rest of a key."""
        record = cls.__new__(cls)
        record.step = step
        record._values = values
        record._pending = tensors
        record._finished = None
        return record

    def set(self, key: str, value: MetricValue | torch.Tensor) -> None:
        """Add or replace a key. A tensor is kept on its device until ``values()``."""
        if self._finished is not None:  # handed out (``finished``): its readers keep it as is
            self._values = dict(self._values)
            self._finished = None
        kind = type(value)
        # The exact-type tests first: a record is mostly plain numbers, and an isinstance
        # test against torch.Tensor costs as much as the rest of a plain set.
        if kind is float or kind is int or kind is str or not isinstance(value, torch.Tensor):
            pending = self._pending
            if pending and key in pending:  # a plain value replaces a tensor under the key
                del pending[key]
            self._values[key] = value  # type: ignore[assignment]  # not a tensor: tested above
        else:
            self._values.pop(key, None)
            # A tensor without autograd history has nothing to cut off (detach costs more
            # than the rest of a set).
            self._pending[key] = value.detach() if value.requires_grad else value

    def setdefault(self, key: str, value: MetricValue | torch.Tensor) -> None:
        if key not in self:
            self.set(key, value)

    def __contains__(self, key: object) -> bool:
        return key in self._values or key in self._pending

    def keys(self) -> Iterator[str]:
        yield from self._values
        yield from self._pending

    def values(self) -> dict[str, MetricValue]:
        """The record as plain Python numbers (one host transfer for all tensor values): a
        new dict the caller owns."""
        return dict(self.finished())

    def finished(self) -> Mapping[str, MetricValue]:
        """The record as plain Python numbers, read-only: the same mapping for every reader
        until the next ``set``, so the sinks of one ``metrics`` event share it (``values()``
        gives a caller its own). It is the record's own dict, not a copy: a later ``set``
        copies before it changes anything (copy on write), so a reader's mapping never
        changes under it."""
        finished = self._finished
        if finished is None:
            if self._pending:
                self._materialise()
            finished = self._finished = self._values
        return finished

    def _materialise(self) -> None:
        """Read every pending tensor into ``_values`` (one transfer for device tensors)."""
        pending = self._pending
        one_by_one = True
        if len(pending) > 1:  # a single tensor is one read wherever it is: nothing to batch
            for tensor in pending.values():
                one_by_one = one_by_one and tensor.is_cpu  # is_cpu: no device object built
        if one_by_one:
            # Host tensors: no transfer to batch up, and one read each costs less than
            # stacking them (the same float32 value either way).
            for key, tensor in pending.items():
                single = tensor if tensor.dtype == torch.float32 else tensor.float()
                self._values[key] = single.item()  # a Python float: float32 reads as one
        else:
            keys = list(pending)
            tensors = [pending[k].reshape(()).float() for k in keys]
            if len({t.device for t in tensors}) == 1:
                numbers = torch.stack(tensors).cpu().tolist()  # one transfer, one sync
            else:
                numbers = [t.item() for t in tensors]
            for key, number in zip(keys, numbers, strict=True):
                self._values[key] = float(number)
        pending.clear()

    def get(self, key: str) -> MetricValue | None:
        """One value (materialises the record when the key is still a tensor)."""
        if key in self._pending:
            return self.finished().get(key)
        return self._values.get(key)
