"""Asynchronous checkpoint saves: a CPU snapshot of the state, written on a background thread.

``StateSnapshot.take`` copies a state tree into reused CPU buffers (pinned, non-blocking for
device tensors; deferred for storages the caller promises not to touch until
``Snapshot.complete``). ``AsyncCheckpointWriter`` takes such a snapshot on the training thread
and hands it to one writer thread, which saves it through a ``CheckpointManager`` (and tells
``on_commit`` what it committed). ``LatestJobWorker`` is the same kind of one background
thread for work that may lag behind training, where only the newest job matters: uploads of
committed checkpoints to object storage (``speedtronic.state.remote``).

The files themselves -- atomic writes, the pointer, retention, what a checkpoint may hold --
are ``speedtronic.state.checkpoint``'s business; this module only decides how a state gets there
without stopping training for the write.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from speedtronic.state.checkpoint import CheckpointError, CheckpointManager

# TENSOR_TYPES: the snapshot copies byte-wise exactly the tensor types plain_state admits.
from speedtronic.state.safe_load import TENSOR_TYPES, plain_state

__all__ = ["AsyncCheckpointWriter", "LatestJobWorker", "Snapshot", "StateSnapshot"]


@dataclass
class Snapshot:
    """A state copied (or being copied) into CPU memory.

    ``deferred`` holds ``(destination, source)`` storage pairs whose copy was postponed:
    ``complete()`` performs them and waits for device copies, after which ``state`` is an
    independent CPU copy of what was snapshotted.
    """

    state: dict[str, object]
    deferred: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]
    ready: torch.cuda.Event | None

    def complete(self) -> None:
        for destination, source in self.deferred:
            _copy_bytes(destination, source, non_blocking=False)
        self.deferred = []
        if self.ready is not None:
            self.ready.synchronize()


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
    now: ``Snapshot.complete`` copies them later, which is only correct while nothing writes
    to them (the checkpoint callback defers parameters and optimizer state, which only the
    next optimizer step changes, and waits for the copy before that step).
    """

    def __init__(self) -> None:
        self._buffers: list[torch.UntypedStorage] = []

    def take(self, state: Mapping[str, object], defer: frozenset[int] = frozenset()) -> Snapshot:
        walk = _SnapshotWalk(self, defer)
        copied = walk.copy(dict(state))
        assert isinstance(copied, dict)
        ready: torch.cuda.Event | None = None
        if walk.uses_cuda:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            ready.record()
        return Snapshot(copied, walk.deferred, ready)

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
    write first, and hands the snapshot to the writer thread, which completes the deferred
    copies (``snapshot_copied`` tells when), then writes through the manager. A failed
    write is raised as ``CheckpointError`` by the next ``submit``, ``poll`` or ``wait``.
    ``on_commit`` is called on the writer thread with each checkpoint it committed (it must
    not block: the checkpoint callback hands the path to its object-store mirror).
    """

    def __init__(
        self, manager: CheckpointManager, on_commit: Callable[[Path], None] | None = None
    ) -> None:
        self.manager = manager
        self.on_commit = on_commit
        self._snapshot = StateSnapshot()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Path] | None = None
        self._pending_step: int | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def submit(
        self, step: int, state: Mapping[str, object], *, defer: frozenset[int] = frozenset()
    ) -> None:
        """Snapshot ``state`` and write it as ``step`` in the background. Storages in
        ``defer`` are copied by the writer thread: call ``wait_for_snapshot`` before
        anything changes them."""
        self.wait()
        # plain_state first: the same rule as a synchronous save, raised on this thread.
        snapshot = self._snapshot.take(plain_state(state), defer)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="speedtronic-checkpoint")
        with self._lock:
            self._copied.clear()
            self._pending = self._executor.submit(self._write, step, snapshot)
            self._pending_step = step

    def _write(self, step: int, snapshot: Snapshot) -> Path:
        try:
            snapshot.complete()
        finally:
            self._copied.set()  # also on failure: nobody may wait forever
        path = self.manager.save(step, snapshot.state)
        if self.on_commit is not None:
            self.on_commit(path)
        return path

    def wait_for_snapshot(self) -> None:
        """Block until the deferred copies of the write in flight are done (then the
        training state may change again); raises the write's error if it failed."""
        self._copied.wait()
        self.poll()

    def poll(self) -> None:
        """Raise the error of a finished failed write, if any; never blocks."""
        pending = self._pending
        if pending is not None and pending.done():
            self.wait()

    def wait(self) -> Path | None:
        """Block until the write in flight is on disk; returns its path (``None`` if none)."""
        with self._lock:
            pending, step = self._pending, self._pending_step
            self._pending, self._pending_step = None, None
        if pending is None:
            return None
        try:
            return pending.result()
        except Exception as exc:
            raise CheckpointError(
                f"asynchronous save of step {step} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Wait for the last write (raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


class LatestJobWorker:
    """One background thread for jobs where only the newest pending one matters.

    ``submit`` never blocks: the job runs when the thread is free, and a job still waiting
    when a newer one is submitted is dropped (the newer supersedes it; the one running is
    never interrupted). A job reports its own failures -- an exception escaping it is kept
    and raised by ``wait`` -- so that a slow or failing job never holds up the caller.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._condition = threading.Condition()
        self._waiting: Callable[[], None] | None = None
        self._running = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0
        """Jobs superseded by a newer one before they started."""

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker thread once it is free (replacing a job still waiting)."""
        with self._condition:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after close")
            if self._waiting is not None:
                self.dropped += 1
            self._waiting = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._condition.notify_all()

    @property
    def busy(self) -> bool:
        """Whether a job is running or waiting."""
        with self._condition:
            return self._running or self._waiting is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job is running or waiting (``False`` when ``timeout`` seconds
        passed first); raises what a job raised, once."""
        with self._condition:
            idle = self._condition.wait_for(
                lambda: not self._running and self._waiting is None, timeout
            )
            error, self._error = self._error, None
        if error is not None:
            raise error
        return idle

    def close(self, timeout: float | None = None) -> bool:
        """Finish what is running and waiting, then stop the thread (``wait``'s result)."""
        try:
            return self.wait(timeout)
        finally:
            with self._condition:
                self._closed = True
                self._condition.notify_all()

    def _work(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._waiting is not None or self._closed)
                job, self._waiting = self._waiting, None
                if job is None:
                    self._thread = None
                    return
                self._running = True
            try:
                job()
            except BaseException as exc:  # kept for wait(): the thread must go on
                with self._condition:
                    self._error = exc
            finally:
                with self._condition:
                    self._running = False
                    self._condition.notify_all()
