"""Where DiLoCo files live: a ``Transport`` (list / get / put / delete of whole files).

Two implementations:

* ``DirectoryTransport`` -- a directory on local disk or a network filesystem shared by
  all nodes. Writes go to a temporary sibling, are fsynced and atomically renamed, so a
  reader sees either the old file or the complete new one, never half of one.
* ``HubTransport`` -- a Hugging Face Hub model repository through ``huggingface_hub``
  (imported lazily; install the ``hub`` extra). Every upload is one commit, which is atomic
  on the Hub. The token is read from an environment variable when the client is created
  and is never stored elsewhere, written to disk or included in messages.

``RetryingTransport`` wraps either one: every call gets a hard timeout and transient
failures are retried with jittered exponential backoff; permanent failures (bad
credentials, missing repository, permission denied) fail at once, so they can be reported
clearly instead of burning the whole backoff budget.

Hub layout (relative paths, the same for both transports)::

    global/step_count.json                      the pointer: current outer step + files
    global/model_<outer_step:08d>.safetensors   global weights per outer step (kept: last few)
    global/outer_<outer_step:08d>.safetensors   master momentum + ledger per outer step
    nodes/<node_id>/delta_<step>_<hash16>.safetensors   deltas (deleted once applied)
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import random
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

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


@dataclass(frozen=True)
class RemoteFile:
    """A listed file. ``version`` changes whenever the content may have changed (mtime/
    size/inode for a directory, blob id for the Hub), so callers can skip files they have
    already examined without downloading them again."""

    path: str
    size: int
    version: str


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
        """The whole file, or ``None`` when it does not exist."""

    @abc.abstractmethod
    def put(self, path: str, data: bytes) -> None:
        """Write the whole file atomically (readers see old or new content, never a mix)."""

    @abc.abstractmethod
    def delete(self, paths: Sequence[str]) -> None:
        """Remove files; missing ones are ignored."""

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


# -- shared directory ------------------------------------------------------------------


class DirectoryTransport(Transport):
    """A hub in a directory (local disk, NFS, SMB, a mounted bucket).

    Atomicity comes from ``os.replace`` of a fully written, fsynced temporary file in the
    same directory; temporary files start with ``.`` and are never listed.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()

    @property
    def location(self) -> str:
        return str(self.root)

    def _resolve(self, path: str) -> Path:
        return self.root.joinpath(*check_remote_path(path).split("/"))

    def _require_root(self, operation: str) -> None:
        if not self.root.is_dir():
            raise PermanentTransportError(
                operation,
                f"hub directory {self.root} does not exist (the master creates it; check that "
                "the shared filesystem is mounted on this machine)",
            )

    def prepare(self, *, create: bool) -> None:
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise self._os_error("prepare", exc) from exc
        self._require_root("prepare")

    def list_files(self, prefix: str) -> list[RemoteFile]:
        self._require_root("list")
        base = self._resolve(prefix)
        found: list[RemoteFile] = []
        try:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in filenames:
                    if name.startswith("."):
                        continue  # a temporary file of a write in progress
                    full = Path(dirpath, name)
                    try:
                        stat = full.stat()
                    except FileNotFoundError:
                        continue  # deleted while listing
                    relative = full.relative_to(self.root).as_posix()
                    version = f"{stat.st_mtime_ns}:{stat.st_size}:{stat.st_ino}"
                    found.append(RemoteFile(relative, stat.st_size, version))
        except OSError as exc:
            raise self._os_error("list", exc) from exc
        return sorted(found, key=lambda item: item.path)

    def get(self, path: str) -> bytes | None:
        target = self._resolve(path)
        self._require_root("get")
        try:
            return target.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._os_error(f"get {path}", exc) from exc

    def put(self, path: str, data: bytes) -> None:
        target = self._resolve(path)
        self._require_root("put")
        temporary = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
            self._fsync_directory(target.parent)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise self._os_error(f"put {path}", exc) from exc

    def delete(self, paths: Sequence[str]) -> None:
        self._require_root("delete")
        for path in paths:
            try:
                self._resolve(path).unlink(missing_ok=True)
            except OSError as exc:
                raise self._os_error(f"delete {path}", exc) from exc

    @staticmethod
    def _fsync_directory(directory: Path) -> None:
        """Persist the rename itself (best effort: some filesystems refuse)."""
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    @staticmethod
    def _os_error(operation: str, exc: OSError) -> TransportError:
        # Only a refusal is permanent; I/O errors, stale NFS handles and a full disk can
        # clear up, so they are retried.
        if isinstance(exc, PermissionError) or exc.errno in {errno.EROFS, errno.EACCES}:
            return PermanentTransportError(operation, f"permission denied: {exc}")
        return TransientTransportError(operation, str(exc))


# -- Hugging Face Hub --------------------------------------------------------------------


class HubApi(Protocol):
    """The part of ``huggingface_hub.HfApi`` that ``HubTransport`` uses (tests fake it)."""

    def create_repo(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        repo_type: str | None = None,
        exist_ok: bool = False,
    ) -> object: ...

    def list_repo_tree(
        self,
        repo_id: str,
        path_in_repo: str | None = None,
        *,
        recursive: bool = False,
        repo_type: str | None = None,
    ) -> Iterable[object]: ...

    def upload_file(
        self,
        *,
        path_or_fileobj: bytes,
        path_in_repo: str,
        repo_id: str,
        repo_type: str | None = None,
        commit_message: str | None = None,
    ) -> object: ...

    def hf_hub_download(
        self,
        repo_id: str,
        filename: str,
        *,
        repo_type: str | None = None,
        local_dir: str | None = None,
    ) -> object: ...

    def create_commit(
        self,
        repo_id: str,
        operations: list[CommitOperationAdd | CommitOperationDelete],
        *,
        commit_message: str,
        repo_type: str | None = None,
    ) -> object: ...

    def delete_files(
        self,
        repo_id: str,
        delete_patterns: list[str],
        *,
        repo_type: str | None = None,
        commit_message: str | None = None,
    ) -> object: ...


_NOT_FOUND_ERRORS = {"EntryNotFoundError", "RemoteEntryNotFoundError"}
_OFFLINE_ERRORS = {"LocalEntryNotFoundError", "OfflineModeIsEnabled"}
"""Raised by a download that could not reach the Hub (and found no cached copy): the file
may well exist, so these are transient, not "not found"."""
_PERMANENT_ERRORS = {
    "RepositoryNotFoundError",
    "GatedRepoError",
    "RevisionNotFoundError",
    "DisabledRepoError",
    "HFValidationError",
    "LocalTokenNotFoundError",
}
_PERMANENT_STATUS = {400, 401, 403, 404, 405, 409, 410, 413, 422}


def _error_names(error: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(error).__mro__}


def hub_status_code(error: BaseException) -> int | None:
    """The HTTP status of a ``huggingface_hub`` error, when it has a response."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def classify_hub_error(error: BaseException) -> str:
    """``"not_found"`` (a missing file), ``"permanent"`` or ``"transient"``.

    Decided by exception class names and HTTP status, so that it works across
    ``huggingface_hub`` versions (requests- or httpx-based) without importing them.
    """
    names = _error_names(error)
    if names & _OFFLINE_ERRORS:
        return "transient"
    if names & _NOT_FOUND_ERRORS:
        return "not_found"
    if names & _PERMANENT_ERRORS:
        return "permanent"
    status = hub_status_code(error)
    if status is not None:
        if status == 429 or status >= 500:
            return "transient"
        if status in _PERMANENT_STATUS or 400 <= status < 500:
            return "permanent"
    if isinstance(error, (ValueError, TypeError, AttributeError, ImportError)):
        return "permanent"
    return "transient"


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """Replace every secret that occurs in ``text`` with ``<redacted>``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


class HubTransport(Transport):
    """A Hugging Face Hub model repository as a hub (commits are atomic).

    ``token_env`` names the environment variable holding the access token (default
    ``HF_TOKEN``); when it is unset the SDK's own login is used. The token lives only in
    the ``HfApi`` object: it is never stored on disk, logged or put in error messages.
    """

    atomic_commit = True

    def __init__(
        self,
        repo_id: str,
        *,
        token_env: str = "HF_TOKEN",
        private: bool = True,
        api: HubApi | None = None,
    ) -> None:
        if not repo_id or repo_id.count("/") > 1:
            raise ValueError(f"repo_id must look like 'owner/name', got {repo_id!r}")
        self.repo_id = repo_id
        self.token_env = token_env
        self.private = private
        self._api = api
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return f"hf://{self.repo_id}"

    def _token(self) -> str | None:
        return os.environ.get(self.token_env) or None

    @property
    def api(self) -> HubApi:
        """The ``HfApi`` client, created on first use (raises a permanent error with an
        install hint when ``huggingface_hub`` is missing)."""
        with self._lock:
            if self._api is None:
                try:
                    from huggingface_hub import HfApi
                except ImportError as exc:
                    raise PermanentTransportError(
                        "connect",
                        "huggingface_hub is not installed; pip install 'speedtronic[hub]'",
                    ) from exc
                self._api = HfApi(token=self._token())
            return self._api

    def _fail(self, operation: str, error: Exception) -> TransportError:
        message = redact(f"{type(error).__name__}: {error}", [self._token()])
        status = hub_status_code(error)
        if status in {401, 403}:
            message += f" (check the token in ${self.token_env} and its write access)"
        if "RepositoryNotFoundError" in _error_names(error):
            message += f" (repository {self.repo_id!r} is missing or not visible to the token)"
        if classify_hub_error(error) == "transient":
            return TransientTransportError(operation, message)
        return PermanentTransportError(operation, message)

    def classify(self, error: Exception) -> bool:
        return classify_hub_error(error) == "transient"

    def prepare(self, *, create: bool) -> None:
        try:
            if create:
                self.api.create_repo(
                    self.repo_id, private=self.private, repo_type="model", exist_ok=True
                )
            else:
                list(self.api.list_repo_tree(self.repo_id, None, repo_type="model"))
        except TransportError:
            raise
        except Exception as exc:
            raise self._fail("prepare", exc) from None

    def list_files(self, prefix: str) -> list[RemoteFile]:
        check_remote_path(prefix)
        try:
            items = list(
                self.api.list_repo_tree(self.repo_id, prefix, recursive=True, repo_type="model")
            )
        except TransportError:
            raise
        except Exception as exc:
            if classify_hub_error(exc) == "not_found":
                return []
            raise self._fail(f"list {prefix}", exc) from None
        found: list[RemoteFile] = []
        for item in items:
            path = getattr(item, "path", None)
            size = getattr(item, "size", None)
            if not isinstance(path, str) or not isinstance(size, int):
                continue  # a folder entry
            lfs = getattr(item, "lfs", None)
            version = getattr(lfs, "sha256", None) or getattr(item, "blob_id", None) or ""
            found.append(RemoteFile(path, size, f"{version}:{size}"))
        return sorted(found, key=lambda entry: entry.path)

    def get(self, path: str) -> bytes | None:
        check_remote_path(path)
        with tempfile.TemporaryDirectory(prefix="speedtronic-hub-") as scratch:
            try:
                local = self.api.hf_hub_download(
                    self.repo_id, path, repo_type="model", local_dir=scratch
                )
            except TransportError:
                raise
            except Exception as exc:
                if classify_hub_error(exc) == "not_found":
                    return None
                raise self._fail(f"get {path}", exc) from None
            if not isinstance(local, (str, os.PathLike)):
                raise PermanentTransportError(f"get {path}", "download returned no file path")
            return Path(local).read_bytes()

    def put(self, path: str, data: bytes) -> None:
        check_remote_path(path)
        try:
            self.api.upload_file(
                path_or_fileobj=data,
                path_in_repo=path,
                repo_id=self.repo_id,
                repo_type="model",
                commit_message=f"speedtronic diloco: {path}",
            )
        except TransportError:
            raise
        except Exception as exc:
            raise self._fail(f"put {path}", exc) from None

    def commit(self, puts: Sequence[tuple[str, bytes]], deletes: Sequence[str] = ()) -> None:
        """One atomic Hub commit: readers see all of it or none of it. If a file to delete
        has gone already, the commit is retried without the deletions."""
        for path, _ in puts:
            check_remote_path(path)
        for path in deletes:
            check_remote_path(path)
        try:
            from huggingface_hub import CommitOperationAdd, CommitOperationDelete
        except ImportError as exc:
            raise PermanentTransportError(
                "commit", "huggingface_hub is not installed; pip install 'speedtronic[hub]'"
            ) from exc
        adds: list[CommitOperationAdd | CommitOperationDelete] = [
            CommitOperationAdd(path_in_repo=path, path_or_fileobj=data) for path, data in puts
        ]
        removals: list[CommitOperationAdd | CommitOperationDelete] = [
            CommitOperationDelete(path_in_repo=path) for path in deletes
        ]
        message = f"speedtronic diloco: {', '.join(path for path, _ in puts) or 'cleanup'}"
        try:
            try:
                self.api.create_commit(
                    self.repo_id, adds + removals, commit_message=message, repo_type="model"
                )
            except Exception as exc:
                if not removals or classify_hub_error(exc) != "not_found":
                    raise
                self.api.create_commit(
                    self.repo_id, adds, commit_message=message, repo_type="model"
                )
        except TransportError:
            raise
        except Exception as exc:
            raise self._fail("commit", exc) from None

    def delete(self, paths: Sequence[str]) -> None:
        if not paths:
            return
        for path in paths:
            check_remote_path(path)
        try:
            self.api.delete_files(
                self.repo_id,
                list(paths),
                repo_type="model",
                commit_message=f"speedtronic diloco: remove {len(paths)} applied file(s)",
            )
        except TransportError:
            raise
        except Exception as exc:
            if classify_hub_error(exc) == "not_found":
                return
            raise self._fail("delete", exc) from None


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

    def delay(self, retry_index: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry_index`` (1-based)."""
        base = min(self.maximum, self.initial * float(2 ** (retry_index - 1)))
        return base * (0.5 + 0.5 * rng.random())


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


class Cancelled(TransientTransportError):
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
                raise Cancelled(operation, "shutting down")
        elif self.cancel.wait(seconds):
            raise Cancelled(operation, "shutting down")

    def _call(self, operation: str, function: Callable[[], T]) -> T:
        last: TransportError | None = None
        for attempt in range(1, self.policy.attempts + 1):
            if attempt > 1:
                with self._lock:
                    self.retries += 1
                self._wait(self.policy.delay(attempt - 1, self._rng), operation)
            try:
                return call_with_timeout(function, self.policy.timeout, operation)
            except TransportError as exc:
                if not exc.transient:
                    raise
                last = exc
            except Exception as exc:
                error: TransportError = (
                    TransientTransportError(operation, f"{type(exc).__name__}: {exc}")
                    if self.inner.classify(exc)
                    else PermanentTransportError(operation, f"{type(exc).__name__}: {exc}")
                )
                if not error.transient:
                    raise error from exc
                last = error
        assert last is not None  # attempts >= 1, so at least one failure was recorded
        raise TransientTransportError(
            operation, f"failed after {self.policy.attempts} attempts: {last.message}"
        ) from last

    def prepare(self, *, create: bool) -> None:
        self._call("prepare", lambda: self.inner.prepare(create=create))

    def list_files(self, prefix: str) -> list[RemoteFile]:
        return self._call(f"list {prefix}", lambda: self.inner.list_files(prefix))

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
