"""A DiLoCo hub in a Hugging Face Hub model repository, through ``huggingface_hub``.

``huggingface_hub`` is imported lazily (install the ``hub`` extra). Every upload is one
commit, which is atomic on the Hub. The token is read from an environment variable when the
client is created and is never stored elsewhere, written to disk or included in messages.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from speedtronic_callbacks.diloco.transport_base import (
    HubNotCreatedError,
    PermanentTransportError,
    RemoteFile,
    TransientTransportError,
    Transport,
    TransportError,
    UnreadableFileError,
    check_remote_path,
)

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete


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


def _hub_status_code(error: BaseException) -> int | None:
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
    status = _hub_status_code(error)
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
    ``HF_TOKEN``); when it is unset the SDK's own login is used. ``token`` (2.0's
    ``distributed.token``) is used instead of the variable when given. The token lives only
    in this object and the ``HfApi`` object: it is never stored on disk, logged or put in
    error messages.
    """

    atomic_commit = True

    def __init__(
        self,
        repo_id: str,
        *,
        token_env: str = "HF_TOKEN",
        private: bool = True,
        api: HubApi | None = None,
        token: str | None = None,
    ) -> None:
        if not repo_id or repo_id.count("/") > 1:
            raise ValueError(f"repo_id must look like 'owner/name', got {repo_id!r}")
        self.repo_id = repo_id
        self.token_env = token_env
        self.private = private
        self._api = api
        self._explicit_token = token
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return f"hf://{self.repo_id}"

    def _token(self) -> str | None:
        return self._explicit_token or os.environ.get(self.token_env) or None

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
        status = _hub_status_code(error)
        if status in {401, 403}:
            where = "distributed.token" if self._explicit_token else f"${self.token_env}"
            message += f" (check the token in {where} and its write access)"
        if "RepositoryNotFoundError" in _error_names(error):
            message += f" (repository {self.repo_id!r} is missing or not visible to the token)"
        if classify_hub_error(error) == "transient":
            return TransientTransportError(operation, message)
        if "RepositoryNotFoundError" in _error_names(error):
            return HubNotCreatedError(operation, message)
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
            downloaded = Path(local)
            if not downloaded.is_file():
                raise UnreadableFileError(f"get {path}", "the download is not a regular file")
            self.check_file_size(downloaded.stat().st_size, path)
            return downloaded.read_bytes()

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
