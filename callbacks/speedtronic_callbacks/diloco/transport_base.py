"""What every DiLoCo hub store shares: the ``Transport`` interface, its errors, and retries.

A ``Transport`` is a flat file store (list / get / put / delete of whole files) addressed by
relative POSIX paths. The kinds live in their own modules: ``directory_transport``
(a shared directory) and ``hub_transport`` (a Hugging Face Hub repository).

``RetryingTransport`` wraps either one: every call gets a hard timeout and transient
failures are retried with jittered exponential backoff; permanent failures (bad
credentials, missing repository, permission denied) fail at once, so they can be reported
clearly instead of burning the whole backoff budget.

Hub layout (relative paths, the same for every transport)::

    global/step_count.json                      the pointer: current outer step + files
    global/model_<outer_step:08d>.safetensors   global weights per outer step (kept: last few)
    global/outer_<outer_step:08d>.safetensors   master momentum + ledger per outer step
    nodes/<node_id>/delta_<step>_<hash16>.safetensors   deltas (deleted once applied)
"""

from __future__ import annotations

import abc
import logging
import random
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from speedtronic.util.retry import Backoff, retry

T = TypeVar("T")

logger = logging.getLogger("speedtronic.diloco")

_PATH_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")


class TransportError(RuntimeError):
    """A transport operation failed. ``transient`` says whether retrying may help."""

    transient: bool = True

    def __init__(self, operation: str, message: str) -> None:
        super().__init__(f"{operation}: {message}")
        self.operation = operation
        self.message = message


class TransientTransportError(TransportError):
    """Network blips, timeouts, rate limits, server errors: retried with backoff."""

    transient = True


class PermanentTransportError(TransportError):
    """Bad credentials, missing repository or directory, no permission: not retried."""

    transient = False


class HubNotCreatedError(PermanentTransportError):
    """The hub (directory or repository) does not exist yet: the master creates it, so a
    worker started first waits for it (reported once, quietly) and keeps polling."""


class UnreadableFileError(PermanentTransportError):
    """The store holds something at this path that must not be read: not a regular file
    (a symlink, FIFO, device or directory), reached through a symbolic link, or larger than
    the store's ``max_file_bytes``. ``too_large`` tells the two cases apart. Never retried:
    the master records it as a rejection and the round goes on."""

    def __init__(self, operation: str, message: str, *, too_large: bool = False) -> None:
        super().__init__(operation, message)
        self.too_large = too_large


@dataclass(frozen=True)
class RemoteFile:
    """A listed file. ``version`` changes whenever the content may have changed (mtime/
    size/inode for a directory, blob id for the Hub), so callers can skip files they have
    already examined without downloading them again."""

    path: str
    size: int
    version: str


@dataclass(frozen=True)
class Replaced:
    """What ``Transport.replace`` wrote over: the file's ``data`` (``None`` when there was
    no file, or it could not be read: then ``unreadable`` says why). ``exact``: these are
    exactly the bytes the write replaced (an atomic exchange); otherwise they were read
    just before the write, and a write by someone else in between went unseen. ``seen``
    is false when even that read failed (a transient error): nothing is known."""

    data: bytes | None
    exact: bool
    unreadable: str | None = None
    seen: bool = True


def check_remote_path(path: str) -> str:
    """Reject absolute paths, ``..`` and odd characters (paths are joined to a root)."""
    if not _PATH_PATTERN.match(path) or any(part in {".", ".."} for part in path.split("/")):
        raise ValueError(f"invalid hub path {path!r}")
    return path


class Transport(abc.ABC):
    """A flat file store addressed by relative POSIX paths.

    ``atomic_commit`` is true when ``commit`` applies all its changes at once (the Hub);
    otherwise ``commit`` is a sequence of individually atomic puts.
    """

    atomic_commit: bool = False
    max_file_bytes: int | None = None
    """``get`` refuses (``UnreadableFileError``) files larger than this, checked before
    reading them; ``None`` means no limit. Set with ``limit_file_size``."""

    def limit_file_size(self, max_bytes: int) -> None:
        """Refuse to read files larger than ``max_bytes`` (the smallest limit set wins)."""
        if max_bytes < 1:
            raise ValueError(f"max_file_bytes must be >= 1, got {max_bytes}")
        current = self.max_file_bytes
        self.max_file_bytes = max_bytes if current is None else min(current, max_bytes)

    def check_file_size(self, size: int, path: str) -> None:
        """``UnreadableFileError`` when ``size`` exceeds ``max_file_bytes``."""
        limit = self.max_file_bytes
        if limit is not None and size > limit:
            raise UnreadableFileError(
                f"get {path}", f"file is {size} bytes, the limit is {limit}", too_large=True
            )

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """A display name that identifies the store (no secrets)."""

    @abc.abstractmethod
    def prepare(self, *, create: bool) -> None:
        """Make sure the store exists (``create``: make it, as the master does)."""

    @abc.abstractmethod
    def list_files(self, prefix: str) -> list[RemoteFile]:
        """Every file under ``prefix`` (a folder path), sorted by path."""

    @abc.abstractmethod
    def get(self, path: str) -> bytes | None:
        """The whole file, or ``None`` when it does not exist. Only regular files no larger
        than ``max_file_bytes`` are read; anything else raises ``UnreadableFileError``."""

    @abc.abstractmethod
    def put(self, path: str, data: bytes) -> None:
        """Write the whole file atomically (readers see old or new content, never a mix)."""

    @abc.abstractmethod
    def delete(self, paths: Sequence[str]) -> None:
        """Remove files; missing ones are ignored."""

    def replace(self, path: str, data: bytes) -> Replaced:
        """Write ``data`` to ``path`` (atomically, as ``put``) and say what it replaced, so
        the master can tell what it published over (``master.MasterLoop._publish``). This
        default reads the file, then puts (``exact`` false); ``DirectoryTransport`` swaps
        the new file in atomically and reads what came out where the OS can."""
        try:
            previous = Replaced(self.get(path), exact=False)
        except UnreadableFileError as exc:
            previous = Replaced(None, exact=False, unreadable=exc.message)
        except TransportError:
            previous = Replaced(None, exact=False, seen=False)  # the write matters, not this
        self.put(path, data)
        return previous

    def commit(self, puts: Sequence[tuple[str, bytes]], deletes: Sequence[str] = ()) -> None:
        """Write ``puts`` in order, then remove ``deletes``.

        The default is not atomic as a whole: each put is atomic and they happen in order
        (put the file readers look up first -- the pointer -- last), and the deletions are
        best effort once every put succeeded. ``HubTransport`` makes it one atomic commit.
        """
        for path, data in puts:
            self.put(path, data)
        if deletes:
            try:
                self.delete(deletes)
            except TransportError as exc:
                logger.warning("diloco could not remove %d old file(s): %s", len(deletes), exc)

    def classify(self, error: Exception) -> bool:
        """Whether an unexpected exception from this transport is transient."""
        return not isinstance(error, (ValueError, TypeError, AttributeError, PermissionError))


# -- retries, backoff and timeouts ----------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff with a hard timeout per request.

    ``attempts`` counts tries in total. Before try ``n + 1`` the delay is
    ``min(maximum, initial * 2**(n - 1))`` scaled by a random factor in ``[0.5, 1]``
    ("equal jitter"), so nodes that failed together do not retry together.
    """

    attempts: int = 6
    initial: float = 1.0
    maximum: float = 60.0
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"retry attempts must be >= 1, got {self.attempts}")
        if self.initial <= 0 or self.maximum < self.initial:
            raise ValueError("retry delays need 0 < initial <= maximum")
        if self.timeout <= 0:
            raise ValueError(f"request timeout must be > 0, got {self.timeout}")

    @property
    def backoff(self) -> Backoff:
        """The schedule as the project's one retry policy (``speedtronic.util.retry``)."""
        return Backoff(self.attempts, self.initial, self.maximum, jitter="equal")

    def delay(self, retry_index: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry_index`` (1-based)."""
        return self.backoff.delay(retry_index, rng.random())


def call_with_timeout(function: Callable[[], T], timeout: float, operation: str) -> T:
    """Run ``function`` on a helper daemon thread and wait at most ``timeout`` seconds.

    A call that hangs (a dead NFS server, a stuck socket) cannot be killed, but the caller
    stops waiting for it and treats it as a transient failure.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(function())
        except BaseException as exc:  # handed to the waiting thread below
            failure.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=run, name=f"speedtronic-diloco-io-{operation}", daemon=True)
    worker.start()
    if not done.wait(timeout):
        raise TransientTransportError(operation, f"timed out after {timeout:g} s")
    if failure:
        raise failure[0]
    return outcome[0]


class _Cancelled(TransientTransportError):
    """A retry wait was interrupted because the node is shutting down."""


class RetryingTransport(Transport):
    """Adds timeouts, retries with backoff and byte counters to another transport.

    ``cancel`` interrupts backoff waits (set at shutdown so that teardown never sleeps
    through a retry schedule); ``sleep`` and ``rng`` are injectable for tests.
    """

    def __init__(
        self,
        inner: Transport,
        policy: RetryPolicy | None = None,
        *,
        cancel: threading.Event | None = None,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.inner = inner
        self.atomic_commit = inner.atomic_commit
        self.policy = policy or RetryPolicy()
        self.cancel = cancel or threading.Event()
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self.retries = 0

    @property
    def location(self) -> str:
        return self.inner.location

    def _wait(self, seconds: float, operation: str) -> None:
        if self._sleep is not None:
            self._sleep(seconds)
            if self.cancel.is_set():
                raise _Cancelled(operation, "shutting down")
        elif self.cancel.wait(seconds):
            raise _Cancelled(operation, "shutting down")

    def _call(self, operation: str, function: Callable[[], T]) -> T:
        def attempt() -> T:
            try:
                return call_with_timeout(function, self.policy.timeout, operation)
            except TransportError:
                raise
            except Exception as exc:
                kind = (
                    TransientTransportError if self.inner.classify(exc) else PermanentTransportError
                )
                raise kind(operation, f"{type(exc).__name__}: {exc}") from exc

        def count(error: BaseException, seconds: float) -> None:
            with self._lock:
                self.retries += 1

        def give_up(last: BaseException) -> NoReturn:
            message = last.message if isinstance(last, TransportError) else str(last)
            raise TransientTransportError(
                operation, f"failed after {self.policy.attempts} attempts: {message}"
            ) from last

        return retry(
            self.policy.backoff,
            attempt,
            retry_if=lambda error: isinstance(error, TransportError) and error.transient,
            on_retry=count,
            give_up=give_up,
            sleep=lambda seconds: self._wait(seconds, operation),
            rng=self._rng,
        )

    def prepare(self, *, create: bool) -> None:
        self._call("prepare", lambda: self.inner.prepare(create=create))

    def list_files(self, prefix: str) -> list[RemoteFile]:
        return self._call(f"list {prefix}", lambda: self.inner.list_files(prefix))

    def limit_file_size(self, max_bytes: int) -> None:
        super().limit_file_size(max_bytes)
        self.inner.limit_file_size(max_bytes)

    def get(self, path: str) -> bytes | None:
        data = self._call(f"get {path}", lambda: self.inner.get(path))
        if data is not None:
            with self._lock:
                self.bytes_down += len(data)
        return data

    def put(self, path: str, data: bytes) -> None:
        self._call(f"put {path}", lambda: self.inner.put(path, data))
        with self._lock:
            self.bytes_up += len(data)

    def delete(self, paths: Sequence[str]) -> None:
        self._call("delete", lambda: self.inner.delete(paths))

    def replace(self, path: str, data: bytes) -> Replaced:
        # A retry after a swap that landed but was reported failed replaces our own file:
        # the master recognises its own bytes (``MasterLoop._judge_replaced``).
        replaced = self._call(f"replace {path}", lambda: self.inner.replace(path, data))
        with self._lock:
            self.bytes_up += len(data)
        return replaced

    def commit(self, puts: Sequence[tuple[str, bytes]], deletes: Sequence[str] = ()) -> None:
        if not self.inner.atomic_commit:
            super().commit(puts, deletes)  # each put retried on its own, in order
            return
        # Retrying a whole atomic commit is safe: it either happened or it did not.
        self._call("commit", lambda: self.inner.commit(puts, deletes))
        with self._lock:
            self.bytes_up += sum(len(data) for _, data in puts)

    def classify(self, error: Exception) -> bool:
        return self.inner.classify(error)
