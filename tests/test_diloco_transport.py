"""DiLoCo transports: the shared directory, the Hugging Face Hub (through an in-memory fake
of the ``HfApi`` methods it uses), retries with backoff and timeouts, and the lanes."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx2  # the HTTP client huggingface_hub builds its errors from
import pytest
import torch
from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)

from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.hub_transport import HubTransport, classify_hub_error, redact
from speedtronic_callbacks.diloco.lanes import ErrorReporter, Inbox, Lane
from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.transport_base import (
    PermanentTransportError,
    RemoteFile,
    RetryingTransport,
    RetryPolicy,
    TransientTransportError,
    Transport,
    UnreadableFileError,
    call_with_timeout,
)
from speedtronic_callbacks.diloco.wire import RejectionReason

# -- shared directory ---------------------------------------------------------------------


def test_directory_round_trip_and_listing(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    hub.prepare(create=True)
    hub.put("nodes/a/delta_1_0123456789abcdef.safetensors", b"one")
    hub.put("global/step_count.json", b"{}")
    (tmp_path / "hub" / "nodes" / "a" / ".delta_2.tmp-123").write_bytes(b"half")

    listed = hub.list_files("nodes")

    assert [item.path for item in listed] == ["nodes/a/delta_1_0123456789abcdef.safetensors"]
    assert listed[0].size == 3
    assert hub.get("global/step_count.json") == b"{}"
    assert hub.get("global/missing.json") is None
    assert hub.list_files("absent") == []
    hub.delete(["global/step_count.json", "global/never.json"])
    assert hub.get("global/step_count.json") is None


def test_directory_version_changes_when_a_file_is_replaced(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path)
    hub.put("nodes/a/f.safetensors", b"one")
    before = hub.list_files("nodes")[0].version
    hub.put("nodes/a/f.safetensors", b"three")
    assert hub.list_files("nodes")[0].version != before


def test_directory_put_is_atomic_for_concurrent_readers(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path)
    small, large = b"a" * 10, b"b" * 2_000_000
    hub.put("global/model.safetensors", small)
    seen: set[int] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            data = hub.get("global/model.safetensors")
            assert data is not None
            seen.add(len(data))

    reader = threading.Thread(target=read)
    reader.start()
    for index in range(20):
        hub.put("global/model.safetensors", large if index % 2 == 0 else small)
    stop.set()
    reader.join()
    assert seen <= {len(small), len(large)}  # never a torn file
    assert not [p for p in (tmp_path / "global").iterdir() if p.name.startswith(".")]


def test_directory_rejects_escaping_paths(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path)
    for bad in ("../x", "/etc/passwd", "a/../../b", "a//b", ""):
        with pytest.raises(ValueError):
            hub.put(bad, b"x")


def test_missing_directory_is_a_permanent_error_for_workers(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "not-mounted")
    with pytest.raises(PermanentTransportError, match="does not exist"):
        hub.prepare(create=False)
    with pytest.raises(PermanentTransportError):
        hub.list_files("nodes")
    assert not (tmp_path / "not-mounted").exists()


def test_permission_denied_is_permanent_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = DirectoryTransport(tmp_path)

    def refuse(source: object, target: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermanentTransportError, match="permission denied"):
        hub.put("global/y.json", b"2")
    assert list((tmp_path / "global").iterdir()) == []


# -- retries, backoff, timeouts -----------------------------------------------------------


class ScriptedTransport(Transport):
    """Fails according to a script of exceptions, then delegates to a directory."""

    def __init__(self, root: Path, failures: list[Exception]) -> None:
        self.inner = DirectoryTransport(root)
        self.failures = failures
        self.calls = 0

    @property
    def location(self) -> str:
        return "scripted"

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)

    def prepare(self, *, create: bool) -> None:
        self._maybe_fail()
        self.inner.prepare(create=create)

    def list_files(self, prefix: str) -> list[RemoteFile]:
        self._maybe_fail()
        return self.inner.list_files(prefix)

    def get(self, path: str) -> bytes | None:
        self._maybe_fail()
        return self.inner.get(path)

    def put(self, path: str, data: bytes) -> None:
        self._maybe_fail()
        self.inner.put(path, data)

    def delete(self, paths: Sequence[str]) -> None:
        self._maybe_fail()
        self.inner.delete(paths)


def _retrying(inner: Transport, attempts: int = 4) -> tuple[RetryingTransport, list[float]]:
    sleeps: list[float] = []
    policy = RetryPolicy(attempts=attempts, initial=1.0, maximum=3.0, timeout=5.0)
    return RetryingTransport(inner, policy, sleep=sleeps.append, rng=random.Random(0)), sleeps


def test_transient_failures_are_retried_with_jittered_exponential_backoff(tmp_path: Path) -> None:
    inner = ScriptedTransport(tmp_path, [TransientTransportError("put", "blip")] * 3)
    transport, sleeps = _retrying(inner)

    transport.put("global/a.json", b"12345")

    assert inner.calls == 4
    assert transport.inner.get("global/a.json") == b"12345"
    assert len(sleeps) == 3
    for delay, cap in zip(sleeps, [1.0, 2.0, 3.0], strict=True):
        assert cap / 2 <= delay <= cap  # equal jitter, capped at the maximum
    assert transport.bytes_up == 5
    assert transport.retries == 3


def test_unknown_os_errors_are_transient_but_value_errors_are_not(tmp_path: Path) -> None:
    inner = ScriptedTransport(tmp_path, [ConnectionResetError("reset")])
    transport, _ = _retrying(inner)
    assert transport.get("global/none.json") is None
    inner = ScriptedTransport(tmp_path, [ValueError("bad argument")])
    transport, sleeps = _retrying(inner)
    with pytest.raises(PermanentTransportError, match="bad argument"):
        transport.get("global/none.json")
    assert sleeps == []


def test_permanent_failures_are_not_retried(tmp_path: Path) -> None:
    inner = ScriptedTransport(tmp_path, [PermanentTransportError("put", "401 unauthorized")])
    transport, sleeps = _retrying(inner)
    with pytest.raises(PermanentTransportError, match="401"):
        transport.put("global/a.json", b"x")
    assert inner.calls == 1
    assert sleeps == []


def test_exhausted_retries_raise_a_transient_error_naming_the_attempts(tmp_path: Path) -> None:
    inner = ScriptedTransport(tmp_path, [TransientTransportError("get", "down")] * 10)
    transport, sleeps = _retrying(inner, attempts=3)
    with pytest.raises(TransientTransportError, match="failed after 3 attempts: down"):
        transport.get("global/a.json")
    assert len(sleeps) == 2


def test_a_hanging_call_times_out() -> None:
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(TransientTransportError, match="timed out"):
        call_with_timeout(lambda: release.wait(10), 0.2, "get")
    assert time.monotonic() - started < 2
    release.set()


def test_cancel_interrupts_backoff(tmp_path: Path) -> None:
    inner = ScriptedTransport(tmp_path, [TransientTransportError("get", "down")] * 10)
    policy = RetryPolicy(attempts=5, initial=30.0, maximum=60.0, timeout=5.0)
    transport = RetryingTransport(inner, policy)
    threading.Timer(0.1, transport.cancel.set).start()
    started = time.monotonic()
    with pytest.raises(TransientTransportError, match="shutting down"):
        transport.get("global/a.json")
    assert time.monotonic() - started < 5


def test_retry_policy_validates() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(initial=2.0, maximum=1.0)


# -- Hugging Face Hub (fake HfApi, no network) --------------------------------------------


def _response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/x"))


@dataclass
class FakeEntry:
    path: str
    size: int
    blob_id: str


class FakeHfApi:
    """The HfApi methods HubTransport uses, backed by a dict; ``fail`` injects errors."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.repos: list[tuple[str, bool | None]] = []
        self.fail: list[Exception] = []
        self.commits = 0

    def _maybe_fail(self) -> None:
        if self.fail:
            raise self.fail.pop(0)

    def create_repo(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        repo_type: str | None = None,
        exist_ok: bool = False,
    ) -> object:
        self._maybe_fail()
        self.repos.append((repo_id, private))
        return repo_id

    def list_repo_tree(
        self,
        repo_id: str,
        path_in_repo: str | None = None,
        *,
        recursive: bool = False,
        repo_type: str | None = None,
    ) -> Iterable[object]:
        self._maybe_fail()
        prefix = "" if path_in_repo is None else path_in_repo.rstrip("/") + "/"
        found = [
            FakeEntry(path, len(data), str(hash(data)))
            for path, data in sorted(self.files.items())
            if path.startswith(prefix)
        ]
        if path_in_repo and not found:
            raise RemoteEntryNotFoundError("no such folder", response=_response(404))
        return found

    def upload_file(
        self,
        *,
        path_or_fileobj: bytes,
        path_in_repo: str,
        repo_id: str,
        repo_type: str | None = None,
        commit_message: str | None = None,
    ) -> object:
        self._maybe_fail()
        self.files[path_in_repo] = bytes(path_or_fileobj)
        self.commits += 1
        return None

    def hf_hub_download(
        self,
        repo_id: str,
        filename: str,
        *,
        repo_type: str | None = None,
        local_dir: str | None = None,
    ) -> object:
        self._maybe_fail()
        if filename not in self.files:
            raise RemoteEntryNotFoundError("404 file", response=_response(404))
        assert local_dir is not None
        target = Path(local_dir, filename)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(self.files[filename])
        return str(target)

    def create_commit(
        self,
        repo_id: str,
        operations: list[CommitOperationAdd | CommitOperationDelete],
        *,
        commit_message: str,
        repo_type: str | None = None,
    ) -> object:
        self._maybe_fail()
        staged = dict(self.files)
        for operation in operations:
            if isinstance(operation, CommitOperationAdd):
                content = operation.path_or_fileobj
                assert isinstance(content, bytes)
                staged[operation.path_in_repo] = content
            elif operation.path_in_repo not in staged:
                raise RemoteEntryNotFoundError(
                    "cannot delete a missing file", response=_response(404)
                )
            else:
                del staged[operation.path_in_repo]
        self.files = staged  # all or nothing, like a Hub commit
        self.commits += 1
        return None

    def delete_files(
        self,
        repo_id: str,
        delete_patterns: list[str],
        *,
        repo_type: str | None = None,
        commit_message: str | None = None,
    ) -> object:
        self._maybe_fail()
        for path in delete_patterns:
            self.files.pop(path, None)
        self.commits += 1
        return None


def test_hub_round_trip_through_the_fake_api() -> None:
    api = FakeHfApi()
    hub = HubTransport("team/run", api=api)
    hub.prepare(create=True)
    hub.put("nodes/a/delta_3_0123456789abcdef.safetensors", b"delta")
    hub.put("global/step_count.json", b"{}")

    assert api.repos == [("team/run", True)]  # created private
    assert [f.path for f in hub.list_files("nodes")] == [
        "nodes/a/delta_3_0123456789abcdef.safetensors"
    ]
    assert hub.list_files("missing") == []
    assert hub.get("global/step_count.json") == b"{}"
    assert hub.get("global/none.json") is None
    hub.delete(["global/step_count.json"])
    assert hub.get("global/step_count.json") is None
    assert hub.location == "hf://team/run"


def test_hub_commit_is_one_atomic_commit_and_tolerates_missing_deletions() -> None:
    api = FakeHfApi()
    hub = HubTransport("team/run", api=api)
    hub.put("nodes/a/delta_1_0123456789abcdef.safetensors", b"delta")
    before = api.commits

    hub.commit(
        [("global/model_00000001.safetensors", b"m"), ("global/step_count.json", b"{}")],
        ["nodes/a/delta_1_0123456789abcdef.safetensors", "nodes/a/gone.safetensors"],
    )

    assert api.files["global/step_count.json"] == b"{}"
    assert "global/model_00000001.safetensors" in api.files
    assert api.commits == before + 1  # the retry without deletions is the only commit
    api.fail = [HfHubHTTPError("500", response=_response(500))]
    with pytest.raises(TransientTransportError):
        hub.commit([("global/step_count.json", b'{"new": 1}')])
    assert api.files["global/step_count.json"] == b"{}"  # nothing half-applied


def test_directory_commit_writes_in_order_then_deletes(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path)
    hub.put("nodes/a/old.safetensors", b"x")
    transport = RetryingTransport(hub, sleep=lambda _: None)
    transport.commit(
        [("global/a.json", b"1"), ("global/b.json", b"22")], ["nodes/a/old.safetensors"]
    )
    assert hub.get("global/b.json") == b"22" and hub.get("nodes/a/old.safetensors") is None
    assert transport.bytes_up == 3


def test_hub_error_classification() -> None:
    assert classify_hub_error(HfHubHTTPError("x", response=_response(401))) == "permanent"
    assert classify_hub_error(HfHubHTTPError("x", response=_response(403))) == "permanent"
    assert classify_hub_error(RepositoryNotFoundError("x", response=_response(404))) == (
        "permanent"
    )
    assert classify_hub_error(RemoteEntryNotFoundError("x", response=_response(404))) == (
        "not_found"
    )
    offline = LocalEntryNotFoundError("cannot reach the Hub and no cached copy")
    assert classify_hub_error(offline) == "transient"  # the file may exist: not "missing"
    assert classify_hub_error(HfHubHTTPError("x", response=_response(429))) == "transient"
    assert classify_hub_error(HfHubHTTPError("x", response=_response(503))) == "transient"
    assert classify_hub_error(ConnectionError("reset")) == "transient"
    assert classify_hub_error(TimeoutError("slow")) == "transient"
    assert classify_hub_error(ValueError("bad repo id")) == "permanent"


def test_hub_auth_failure_is_permanent_with_a_hint_and_no_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = "hf_SECRETTOKEN123"
    monkeypatch.setenv("HF_TOKEN", secret)
    api = FakeHfApi()
    api.fail = [HfHubHTTPError(f"401 Unauthorized for token {secret}", response=_response(401))]
    transport = RetryingTransport(HubTransport("team/run", api=api), sleep=lambda _: None)
    with pytest.raises(PermanentTransportError) as info:
        transport.put("global/a.json", b"x")
    message = str(info.value)
    assert secret not in message
    assert "<redacted>" in message
    assert "$HF_TOKEN" in message
    assert not any(secret.encode() in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())


def test_hub_missing_repository_is_permanent() -> None:
    api = FakeHfApi()
    api.fail = [RepositoryNotFoundError("Repository Not Found", response=_response(404))]
    transport = RetryingTransport(HubTransport("team/typo", api=api), sleep=lambda _: None)
    with pytest.raises(PermanentTransportError, match="'team/typo' is missing"):
        transport.list_files("nodes")


def test_hub_server_errors_are_retried() -> None:
    api = FakeHfApi()
    api.fail = [HfHubHTTPError("502", response=_response(502)), TimeoutError("slow")]
    sleeps: list[float] = []
    transport = RetryingTransport(HubTransport("team/run", api=api), sleep=sleeps.append)
    transport.put("global/a.json", b"x")
    assert api.files["global/a.json"] == b"x"
    assert len(sleeps) == 2


def test_hub_token_comes_from_the_named_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MY_HUB_TOKEN", "hf_abc")
    hub = HubTransport("team/run", token_env="MY_HUB_TOKEN", api=FakeHfApi())
    assert hub._token() == "hf_abc"
    assert "hf_abc" not in repr(hub.__dict__.get("repo_id"))
    assert redact("token hf_abc leaked", ["hf_abc", None]) == "token <redacted> leaked"


def test_hub_rejects_bad_repo_ids() -> None:
    with pytest.raises(ValueError):
        HubTransport("")
    with pytest.raises(ValueError):
        HubTransport("a/b/c")


# -- lanes --------------------------------------------------------------------------------


def test_a_busy_lane_skips_instead_of_queueing() -> None:
    lane = Lane("test")
    release = threading.Event()
    ran: list[int] = []

    def slow() -> None:
        release.wait(5)
        ran.append(1)

    assert lane.try_submit(slow)
    assert lane.busy
    assert not lane.try_submit(lambda: ran.append(2))
    release.set()
    assert lane.wait_idle(5)
    assert lane.try_submit(lambda: ran.append(3))
    assert lane.wait_idle(5)
    assert ran == [1, 3]
    assert (lane.submitted, lane.skipped) == (2, 1)


def test_a_failing_job_is_counted_and_the_lane_survives(caplog: pytest.LogCaptureFixture) -> None:
    lane = Lane("test")

    def boom() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="speedtronic.diloco"):
        assert lane.try_submit(boom)
        assert lane.wait_idle(5)
    assert lane.failures == 1
    assert lane.try_submit(lambda: None)
    assert lane.close(5)
    assert not lane.try_submit(lambda: None)  # closed until reopened
    lane.open()
    assert lane.try_submit(lambda: None)
    assert lane.wait_idle(5)


def test_inbox_is_fifo() -> None:
    inbox: Inbox[int] = Inbox()
    for item in (1, 2, 3):
        inbox.put(item)
    assert len(inbox) == 3
    assert inbox.drain() == [1, 2, 3]
    assert inbox.drain() == []


def test_error_reporter_reports_permanent_errors_once(caplog: pytest.LogCaptureFixture) -> None:
    reporter = ErrorReporter()
    error = PermanentTransportError("put", "401 unauthorized")
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        for _ in range(5):
            reporter.failure("upload", error, permanent=True)
        reporter.failure("poll", TransientTransportError("get", "blip"), permanent=False)
        reporter.failure("poll", TransientTransportError("get", "blip"), permanent=False)
        reporter.success("poll")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(errors) == 1 and "401 unauthorized" in errors[0].getMessage()
    assert len(warnings) == 1
    assert any("works again" in r.getMessage() for r in caplog.records)
    assert reporter.errors == 7
    assert reporter.permanent_errors == 5


def test_hub_files_over_the_size_limit_are_refused_before_they_are_read() -> None:
    class CountingApi(FakeHfApi):
        downloads: list[str] = []

        def hf_hub_download(
            self,
            repo_id: str,
            filename: str,
            *,
            repo_type: str | None = None,
            local_dir: str | None = None,
        ) -> object:
            self.downloads.append(filename)
            return super().hf_hub_download(
                repo_id, filename, repo_type=repo_type, local_dir=local_dir
            )

    api = CountingApi()
    hub = HubTransport("team/run", api=api)
    model = torch.nn.Linear(4, 1)
    master = MasterLoop(
        RetryingTransport(hub, RetryPolicy(attempts=1)),
        build_layout(model.state_dict()),
        MasterSettings(node_id="master", max_file_bytes=4096),
    )
    master.reconcile(model.state_dict())
    big = "nodes/w/delta_1_0123456789abcdef.safetensors"
    api.files[big] = b"\0" * 5000
    api.downloads.clear()

    report = master.sync_once()

    assert [(r.path, r.reason) for r in report.rejected] == [(big, RejectionReason.TOO_LARGE)]
    assert big not in api.downloads  # judged by the listed size alone
    with pytest.raises(UnreadableFileError) as refused:
        hub.get(big)  # a direct read checks the downloaded size before reading it
    assert refused.value.too_large
