"""Asynchronous checkpoint saves: a CPU snapshot of the state, written on a background thread.

``StateSnapshot.take`` copies a state tree into reused CPU buffers (pinned, non-blocking for
device tensors; deferred for storages the caller promises not to touch until
``_Snapshot.complete``). ``AsyncCheckpointWriter`` takes such a snapshot on the training thread
and hands it to one writer thread, which saves it through a ``CheckpointManager`` (and tells
``on_commit`` what it committed). The thread is the project's one background worker
(``speedtronic.util.worker``), which also runs the uploads of committed checkpoints to object
storage (``speedtronic.state.remote``).

The files themselves -- atomic writes, the pointer, retention, what a checkpoint may hold --
are ``speedtronic.state.checkpoint``'s business; this module only decides how a state gets there
without stopping training for the write.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from speedtronic.state.checkpoint import CheckpointError, CheckpointManager

# TENSOR_TYPES: the snapshot copies byte-wise exactly the tensor types plain_state admits.
from speedtronic.state.safe_load import TENSOR_TYPES, plain_state
from speedtronic.util.worker import BackgroundWorker

__all__ = ["AsyncCheckpointWriter", "StateSnapshot"]


@dataclass
class _Snapshot:
    """A state copied (or being copied) into CPU memory.

    ``deferred`` holds ``(destination, source)`` storage pairs whose copy was postponed:
    ``complete()`` performs them and waits for device copies, after which ``state`` is an
    independent CPU copy of what was snapshotted.
    """

    state: dict[str, object]
    deferred: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]
    ready: torch.cuda.Event | None

    def complete(self) -> None:
        if self.deferred:
            # One call for all the copies: the GIL is released once for the whole state,
            # not once per storage (each release would wait up to the switch interval to
            # get it back from a training thread running Python meanwhile).
            into = [_bytes_of(destination) for destination, _ in self.deferred]
            out_of = [_bytes_of(source) for _, source in self.deferred]
            torch._foreach_copy_(into, out_of)
        self.deferred = []
        if self.ready is not None:
            self.ready.synchronize()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A CPU storage as a ``uint8`` tensor over all of its bytes."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _copy_bytes(
    destination: torch.UntypedStorage, source: torch.UntypedStorage, *, non_blocking: bool
) -> None:
    """Copy a storage's bytes (any device to CPU) through uint8 tensor views."""
    into = torch.empty(0, dtype=torch.uint8).set_(destination)
    into.copy_(torch.empty(0, dtype=torch.uint8, device=source.device).set_(source), non_blocking)


class StateSnapshot:
    """Copies a state tree into CPU memory so that training can go on mutating the original.

    Tensors sharing storage (tied weights, views) stay shared in the copy, exactly as
    ``torch.save`` would store them. The CPU buffers are kept and reused by the next
    snapshot of a same-shaped state -- page-faulting fresh memory costs about as much as
    the copy itself -- so call ``take`` again only once the previous snapshot is written.

    Device tensors are copied into pinned buffers without blocking the host (``ready`` is
    recorded after them). CPU tensors whose storage pointer is in ``defer`` are not copied
    now: ``_Snapshot.complete`` copies them later, which is only correct while nothing writes
    to them (the checkpoint callback defers parameters and optimizer state, which only the
    next optimizer step changes, and waits for the copy before that step).
    """

    def __init__(self) -> None:
        self._buffers: list[torch.UntypedStorage] = []

    def take(self, state: Mapping[str, object], defer: frozenset[int] = frozenset()) -> _Snapshot:
        walk = _SnapshotWalk(self, defer)
        copied = walk.copy(dict(state))
        assert isinstance(copied, dict)
        ready: torch.cuda.Event | None = None
        if walk.uses_cuda:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            ready.record()
        return _Snapshot(copied, walk.deferred, ready)

    def buffer(self, index: int, nbytes: int, *, pinned: bool) -> torch.UntypedStorage:
        """The ``index``-th reusable CPU buffer, (re)allocated to ``nbytes``."""
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.nbytes() == nbytes and buffer.is_pinned() == pinned:
                return buffer
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer


class _SnapshotWalk:
    """One ``StateSnapshot.take``: the storages copied so far and the copies deferred."""

    def __init__(self, owner: StateSnapshot, defer: frozenset[int]) -> None:
        self.owner = owner
        self.defer = defer
        self.storages: dict[tuple[int, str], torch.UntypedStorage] = {}
        self.deferred: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self.uses_cuda = False

    def copy(self, value: object) -> object:
        if isinstance(value, torch.Tensor):
            return self.copy_tensor(value)
        if type(value) is OrderedDict:
            return OrderedDict((k, self.copy(v)) for k, v in value.items())
        if isinstance(value, dict):
            return {k: self.copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.copy(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.copy(v) for v in value)
        if isinstance(value, set):
            return {self.copy(v) for v in value}
        return value  # numbers, strings, None, dtypes: immutable

    def copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided or type(tensor) not in TENSOR_TYPES:
            return tensor.detach().to("cpu", copy=True)  # rare layouts: a plain blocking copy
        source = tensor.untyped_storage()
        key = (source.data_ptr(), str(tensor.device))
        storage = self.storages.get(key)
        if storage is None:
            pinned = tensor.is_cuda  # pinned host memory: the copy does not block the host
            storage = self.owner.buffer(len(self.storages), source.nbytes(), pinned=pinned)
            if tensor.device.type == "cpu" and source.data_ptr() in self.defer:
                self.deferred.append((storage, source))
            else:
                _copy_bytes(storage, source, non_blocking=pinned)
                self.uses_cuda = self.uses_cuda or pinned
            self.storages[key] = storage
        view = torch.empty(0, dtype=tensor.dtype)
        view.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
        return view


class AsyncCheckpointWriter:
    """Saves checkpoints on one background thread, at most one write in flight.

    ``submit`` snapshots the state on the calling (training) thread, waits for the previous
    write first, and hands the snapshot to the writer thread (``speedtronic.util.worker``),
    which completes the deferred copies (``snapshot_copied`` tells when), then writes through
    the manager. A failed write is raised as ``CheckpointError`` by the next ``submit``,
    ``poll`` or ``wait``. ``on_commit`` is called on the writer thread with each checkpoint
    it committed (it must not block: the checkpoint callback hands the path to its
    object-store mirror).
    """

    def __init__(
        self, manager: CheckpointManager, on_commit: Callable[[Path], None] | None = None
    ) -> None:
        self.manager = manager
        self.on_commit = on_commit
        self._snapshot = StateSnapshot()
        self._worker: BackgroundWorker[tuple[int, _Snapshot]] | None = None
        self._pending_step: int | None = None
        self._written: Path | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        worker = self._worker
        return self._pending_step is not None and worker is not None and worker.busy

    def submit(
        self, step: int, state: Mapping[str, object], *, defer: frozenset[int] = frozenset()
    ) -> None:
        """_Snapshot ``state`` and write it as ``step`` in the background. Storages in
        ``defer`` are copied by the writer thread: call ``wait_for_snapshot`` before
        anything changes them."""
        self.wait()
        # plain_state first: the same rule as a synchronous save, raised on this thread.
        snapshot = self._snapshot.take(plain_state(state), defer)
        if self._worker is None:
            self._worker = BackgroundWorker("speedtronic-checkpoint", self._write, max_pending=1)
        with self._lock:
            self._copied.clear()
            self._pending_step = step
            self._worker.submit((step, snapshot))

    def _write(self, job: tuple[int, _Snapshot]) -> None:
        step, snapshot = job
        try:
            snapshot.complete()
        finally:
            self._copied.set()  # also on failure: nobody may wait forever
        path = self.manager.save(step, snapshot.state)
        self._written = path
        if self.on_commit is not None:
            self.on_commit(path)

    def wait_for_snapshot(self) -> None:
        """Block until the deferred copies of the write in flight are done (then the
        training state may change again); raises the write's error if it failed."""
        self._copied.wait()
        self.poll()

    def poll(self) -> None:
        """Raise the error of a finished failed write, if any; never blocks."""
        if self._pending_step is not None and not self.in_flight:
            self.wait()

    def wait(self) -> Path | None:
        """Block until the write in flight is on disk; returns its path (``None`` if none)."""
        with self._lock:
            step, self._pending_step = self._pending_step, None
        if step is None or self._worker is None:
            return None
        try:
            self._worker.drain()
        except Exception as exc:
            raise CheckpointError(
                f"asynchronous save of step {step} failed: {type(exc).__name__}: {exc}"
            ) from exc
        path, self._written = self._written, None
        return path

    def close(self) -> None:
        """Wait for the last write (raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.close(None)
                self._worker = None
