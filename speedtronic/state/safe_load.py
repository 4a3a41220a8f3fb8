"""What may go into a checkpoint and what may come out of one: the weights-only rule.

The one place where checkpoint bytes become Python objects is ``restricted_load``, a
weights-only unpickle. Every unpickling path of the storage layer goes through it: a plain
checkpoint file, a sharded checkpoint's ``state.pt`` and ``.metadata``, and every record of
its ``.distcp`` shards -- tensors and the non-tensor "bytes" records (optimizer settings and
the like) that ``torch.distributed.checkpoint``'s default planner would unpickle with
``weights_only=False`` (``sharded_checkpoint`` reads them through its own reader and planner
for that reason). ``speedtronic evaluate --checkpoint`` and resume load through the same
functions. So a single function decides what may come back: tensors, plain data, and the
classes a caller names for one load (DCP's metadata dataclasses), nothing that runs code.
Why a refusal happened -- tampering or damage -- is ``speedtronic.state.pickle_scan``'s
verdict. Hub files (DiLoCo deltas) are safetensors, which hold no pickle at all.

Saves check the same rule up front (``plain_state``), so a callback that puts an arbitrary
object in its state fails at save time with the key that is wrong, not at resume time.
"""

from __future__ import annotations

import contextlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from speedtronic.state.errors import CheckpointError, CorruptCheckpointError, first_line
from speedtronic.state.pickle_scan import classify_refusal, pickled_globals

__all__ = ["TENSOR_TYPES", "SafeGlobal", "pickled_globals", "plain_state", "restricted_load"]

SafeGlobal = Callable[..., object] | tuple[Callable[..., object], str]
"""A class (or ``(class, "module.Name")``) a weights-only load may build, as torch takes them."""


def restricted_load(
    source: Path | BinaryIO, *, name: str, allowed: Sequence[SafeGlobal] = ()
) -> object:
    """``torch.load(source, map_location="cpu", weights_only=True)``, allowing ``allowed``
    besides tensors and plain data; ``name`` says in errors what was loaded (a file, or a
    record of one).

    ``UnsafeCheckpointError`` when the bytes hold any other pickled object (it is refused,
    never built); ``CorruptCheckpointError`` when they do not unpickle (truncated, damaged,
    not a pickle). No other exception for any input.
    """
    try:
        with _allowing(allowed):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise classify_refusal(name, source, exc) from exc
    except Exception as exc:  # torch: OSError/RuntimeError/EOFError/KeyError/... for damage
        # A zip cut short is an OSError from torch ("[Errno 22] Invalid argument"): callers
        # check that a file can be read at all before, so here it is damage, not access.
        raise CorruptCheckpointError(
            f"checkpoint {name} is unreadable (truncated or corrupt): "
            f"{type(exc).__name__}: {first_line(exc)}"
        ) from exc


@contextlib.contextmanager
def _allowing(allowed: Sequence[SafeGlobal]) -> Iterator[None]:
    if not allowed:
        yield
        return
    with torch.serialization.safe_globals(list(allowed)):
        yield


# -- what may go into a checkpoint ----------------------------------------------------------

_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, bytearray, type(None))
_TORCH_LEAVES = (torch.Size, torch.dtype, torch.device)
TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
"""The tensor types a checkpoint holds as they are (``checkpoint_async`` copies exactly these)."""


class _NotPlain(Exception):
    """Internal: where a state holds something a weights-only load refuses."""


def plain_state(state: Mapping[str, object]) -> dict[str, object]:
    """``state`` in the form ``torch.load(weights_only=True)`` accepts, or ``CheckpointError``.

    Allowed: tensors, numbers, strings, bytes, ``None``, torch sizes/dtypes/devices, and
    dicts/lists/tuples/sets of those. Containers are rebuilt (tensors are not copied) and
    subclasses of the plain types become the plain type -- a ``str`` subclass such as
    ``torch.__version__``, an ``IntEnum``, a ``defaultdict``, a named tuple -- because a
    subclass would be pickled by class name and refused on load. Anything else is an error
    naming where it sits, e.g. ``state['callbacks']['ema']['fn'] is a builtins.function``.
    """
    try:
        plain = _PlainWalk().plain(dict(state), "state")
    except _NotPlain as exc:
        raise CheckpointError(
            f"cannot checkpoint this state: {exc}; checkpoints may hold only tensors, numbers, "
            "strings, None and dicts/lists/tuples of those (they are loaded with "
            "torch.load(weights_only=True), which refuses pickled objects)"
        ) from None
    assert isinstance(plain, dict)
    return plain


_MAX_STATE_DEPTH = 100
"""Deepest nesting of containers a checkpointed state may have (a model's state is ~5)."""


class _PlainWalk:
    """One ``plain_state`` pass: the containers on the path from the root (for cycles)."""

    def __init__(self) -> None:
        self.ancestors: dict[int, str] = {}

    def plain(self, value: object, where: str) -> object:
        kind = type(value)
        if kind in TENSOR_TYPES or kind in _PLAIN_LEAVES or isinstance(value, _TORCH_LEAVES):
            return value
        if isinstance(value, torch.Tensor):
            raise _NotPlain(f"{where} is a tensor subclass {kind.__module__}.{kind.__qualname__}")
        if isinstance(value, str):
            return str(value)
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value)
        if isinstance(value, dict | list | tuple | set):
            return self.container(value, where)
        raise _NotPlain(f"{where} is a {kind.__module__}.{kind.__qualname__}")

    def container(
        self,
        value: dict[object, object] | list[object] | tuple[object, ...] | set[object],
        where: str,
    ) -> object:
        key = id(value)
        if key in self.ancestors:
            raise _NotPlain(f"{where} refers back to {self.ancestors[key]} (a cycle)")
        if len(self.ancestors) >= _MAX_STATE_DEPTH:
            raise _NotPlain(f"{where} is nested more than {_MAX_STATE_DEPTH} containers deep")
        self.ancestors[key] = where
        try:
            return self.rebuild(value, where)
        finally:
            del self.ancestors[key]

    def rebuild(
        self,
        value: dict[object, object] | list[object] | tuple[object, ...] | set[object],
        where: str,
    ) -> object:
        if isinstance(value, dict):
            items = [
                (self.plain(k, f"{where} key {k!r}"), self.plain(v, f"{where}[{k!r}]"))
                for k, v in value.items()
            ]
            return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
        parts = [self.plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
        if isinstance(value, list):
            return parts
        return tuple(parts) if isinstance(value, tuple) else set(parts)
