"""Issue 26, item 2: checkpoints mirrored to object storage (``checkpoint.remote``).

Against a real S3 API: a ``moto`` server on a loopback port, started by this module, with
``s3fs`` (dummy credentials in the environment, the endpoint in ``remote_options``); the
store-level tests use fsspec's ``memory://`` and ``file://``. What is checked: every
committed checkpoint (a file and a DCP directory) is uploaded and verified with the remote
pointer written last, retention applies remotely, ``--resume`` in an empty directory
downloads, verifies and continues bit for bit, and each fault -- an unreachable endpoint,
bad credentials, a bucket that disappears, a pointer naming a missing checkpoint, a
damaged remote file, a missing extra -- is one clear message while training or resume goes
on from the newest intact state and nothing is deleted before its replacement is verified.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import sys
import time
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cli_runner import CliResult, run_cli
from forked import Forked, cli_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_checkpoint import saved_steps, tiny_trainer
from test_distributed import curve, launch, succeeded
from test_hardening import CLI_CONFIG

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.engine.trainer import Trainer
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.remote import RemoteMirror, parse_remote_pointer, read_remote_pointer
from speedtronic.state.remote_fetch import fetch_newer
from speedtronic.state.remote_store import (
    PIP_LINE,
    RemoteError,
    RemoteStore,
    RetryPolicy,
    open_store,
)
from speedtronic.state.resume import resume_from
from speedtronic_callbacks.checkpoint import CheckpointCallback

FAST_RETRY = RetryPolicy(attempts=2, initial_s=0.01, max_s=0.02)


# -- the S3 server --------------------------------------------------------------------------


@dataclass
class S3:
    endpoint: str
    bucket: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/run"

    @property
    def options(self) -> dict[str, object]:
        return {"endpoint_url": self.endpoint}

    def store(self, prefix: str = "run") -> RemoteStore:
        return open_store(f"s3://{self.bucket}/{prefix}", self.options)

    def auth(self, enforced: bool) -> None:
        """Make the server check credentials (it accepts any by default)."""
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0" if enforced else b"inf",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request).read()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A fresh bucket; dummy credentials in the environment (as a user would set them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    server = S3(s3_endpoint, bucket)
    store = server.store("")
    store.fs.mkdir(bucket)
    return server


def remote_pointer(store: RemoteStore) -> dict[str, object]:
    data = read_remote_pointer(store)
    assert data is not None
    pointer, problem = parse_remote_pointer(data)
    assert pointer is not None, problem
    content = json.loads(data)
    assert isinstance(content, dict)
    return content


def verified_intact(store: RemoteStore) -> str:
    """The checkpoint the remote pointer names, after checking every one it records is
    complete in the store (a reader never sees a pointer to an incomplete upload)."""
    data = read_remote_pointer(store)
    assert data is not None
    pointer, problem = parse_remote_pointer(data)
    assert pointer is not None, problem
    for record in pointer.records.values():
        for rel, expected in record.files.items():
            store.verify(rel, expected)
    return pointer.target


def cli_config(tmp_path: Path, **checkpoint: object) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "run.yaml"
    config = {
        **CLI_CONFIG,
        "logging": {"every_steps": 1, "console": False},
        "scheduler": {"warmup_steps": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 2, **checkpoint},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def fit_cli(
    config: Path, out: str, max_steps: object, *, resume: bool = False, cwd: Path
) -> CliResult:
    """``speedtronic fit --config CONFIG --output-dir OUT --max-steps N [--resume]``."""
    argv = ["fit", "--config", str(config), "--output-dir", out, "--max-steps", str(max_steps)]
    return run_cli(*argv, *(["--resume"] if resume else []), cwd=cwd)


def losses(out: Path) -> dict[int, float]:
    """Step -> loss of ``out/metrics.jsonl`` (a line cut short by a kill is left out)."""
    found = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        found[int(record["step"])] = float(record["loss"])
    return found


# -- the store and the mirror ---------------------------------------------------------------


def test_uploads_are_verified_the_pointer_comes_last_and_retention_applies(
    tmp_path: Path,
) -> None:
    store = open_store(f"memory://{uuid.uuid4().hex}/run")
    manager = CheckpointManager(tmp_path / "ck", keep_last=2)
    mirror = RemoteMirror(store, manager, retry=FAST_RETRY)
    for step in (2, 4, 6):
        path = manager.save(step, {"weights": [float(step)] * 3, "counters": {"step": step}})
        mirror.submit(path)
        mirror.flush()
        assert mirror.verified == path.name
    content = remote_pointer(store)
    assert content["file"] == "step_000000000006.pt" and content["step"] == 6
    records = content["checkpoints"]
    assert isinstance(records, dict)
    assert sorted(records) == ["step_000000000004.pt", "step_000000000006.pt"]  # keep_last 2
    local = json.loads(manager.pointer_path.read_text())["checkpoints"]
    for name, record in records.items():
        # the local checksum travels along, and the bytes in the store are the local bytes
        assert record["sha256"] == local[name]["sha256"]
        assert store.fs.cat_file(store.path(name)) == (manager.directory / name).read_bytes()
    assert sorted(store.checkpoint_names()) == sorted(records)  # step 2 deleted remotely
    mirror.close()


def test_a_dropped_upload_and_a_leftover_of_a_killed_one_are_cleaned_up(tmp_path: Path) -> None:
    """While an upload runs, newer commits replace the one waiting (latest wins), and an
    upload no pointer records (a process killed mid-upload) is deleted by the next one."""
    store = open_store(f"file://{tmp_path}/remote")
    manager = CheckpointManager(tmp_path / "ck", keep_last=3)
    leftover = manager.save(1, {"counters": {"step": 1}})
    store.upload(open(leftover, "rb"), leftover.name)  # noqa: SIM115 - closed by the GC
    mirror = RemoteMirror(store, manager, retry=FAST_RETRY)
    paths = [manager.save(step, {"counters": {"step": step}}) for step in (2, 3, 4)]
    for path in paths:
        mirror.submit(path)
    mirror.close()
    assert mirror.verified == "step_000000000004.pt"
    assert verified_intact(store) == "step_000000000004.pt"
    assert "step_000000000001.pt" not in store.checkpoint_names()


def test_a_missing_extra_or_an_unknown_url_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(RemoteError, match="cannot be opened: ValueError: Protocol not known"):
        CheckpointCallback(tmp_path / "ck", remote="nosuch://bucket/run")
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if the extra were not installed
    with pytest.raises(RemoteError) as missing:
        CheckpointCallback(tmp_path / "ck", remote="s3://bucket/run")
    assert str(missing.value) == (
        f"checkpoint.remote needs the remote extra (fsspec, s3fs, tenacity): {PIP_LINE}"
    )
    config = cli_config(tmp_path, remote="s3://bucket/run")
    result = run_cli("fit", "--config", str(config), "--output-dir", "out", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"speedtronic: error: checkpoint.remote needs the remote extra (fsspec, s3fs, "
        f"tenacity): {PIP_LINE}"
    ]


def test_credentials_in_remote_options_are_refused() -> None:
    with pytest.raises(ConfigError) as refused:
        SpeedtronicConfig.from_dict(
            {
                "checkpoint": {
                    "remote": "s3://b/r",
                    "remote_options": {"endpoint_url": "http://x", "secret": "s3cr3t"},
                }
            }
        )
    assert "checkpoint.remote_options.secret: credentials do not belong in the config" in str(
        refused.value
    )
    assert "AWS_SECRET_ACCESS_KEY" in str(refused.value)
    with pytest.raises(ConfigError, match=r"callbacks\[0\].remote_options.client_kwargs.key"):
        SpeedtronicConfig.from_dict(
            {"callbacks": [{"name": "checkpoint", "remote_options": {"client_kwargs": {"key": 1}}}]}
        )


def test_a_password_in_the_remote_url_is_refused_like_one_in_the_options() -> None:
    # ``user:password@`` reaches the store through fsspec and would be saved with the run
    with pytest.raises(ConfigError, match=r"checkpoint.remote: the URL holds a password"):
        SpeedtronicConfig.from_dict({"checkpoint": {"remote": "s3://AKIA:s3cr3t@bucket/run"}})
    chained = "simplecache::s3://AKIA:s3cr3t@bucket/run"
    with pytest.raises(ConfigError, match=r"callbacks\[0\].remote: the URL holds a password"):
        SpeedtronicConfig.from_dict({"callbacks": [{"name": "checkpoint", "remote": chained}]})
    # a user name alone, or none, is no secret
    for url in ("s3://bucket/run", "sftp://me@host/run", "memory://run"):
        SpeedtronicConfig.from_dict({"checkpoint": {"remote": url}})


fuzz = settings(
    derandomize=True,
    database=None,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
VALID_POINTER = {
    "step": 4,
    "file": "step_000000000004.pt",
    "checkpoints": {
        "step_000000000004.pt": {
            "sha256": "a" * 64,
            "files": {"step_000000000004.pt": {"size": 10, "sha256": "b" * 64}},
        }
    },
}


@fuzz
@given(
    st.binary(max_size=512)
    | st.builds(
        lambda raw: json.dumps(raw).encode(),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=20), inner, max_size=4)
            ),
            max_leaves=20,
        ),
    )
)
def test_any_remote_pointer_parses_or_is_rejected_with_a_reason(data: bytes) -> None:
    pointer, problem = parse_remote_pointer(data)
    assert (pointer is None) != (problem is None)


@fuzz
@given(
    st.sampled_from(["file", "step", "checkpoints", "files", "size", "sha256", "rel"]),
    st.one_of(st.none(), st.integers(), st.text(max_size=30), st.lists(st.integers())),
)
def test_a_damaged_field_of_a_remote_pointer_is_rejected(field: str, value: object) -> None:
    content = json.loads(json.dumps(VALID_POINTER))
    record = content["checkpoints"]["step_000000000004.pt"]
    if field in ("file", "step", "checkpoints"):
        content[field] = value
    elif field == "files":
        record["files"] = value
    elif field == "rel":  # a file entry that names another path (../, another checkpoint)
        record["files"] = {str(value): {"size": 1, "sha256": "c" * 64}}
    else:
        record["files"]["step_000000000004.pt"][field] = value
    pointer, problem = parse_remote_pointer(json.dumps(content).encode())
    if pointer is not None:  # only values that are valid after all
        assert problem is None and pointer.target == "step_000000000004.pt"
        for rel, item in pointer.records[pointer.target].files.items():
            assert rel.startswith("step_000000000004.pt") and ".." not in rel
            assert item.size >= 0 and len(item.sha256) == 64


# -- S3: uploads, resume on a fresh machine -------------------------------------------------


def test_a_fresh_directory_resumes_from_s3_bit_for_bit(s3: S3, tmp_path: Path) -> None:
    reference = cli_config(tmp_path / "ref")
    full = fit_cli(reference, "full", "12", cwd=tmp_path / "ref")
    assert full.returncode == 0, full.stderr
    config = cli_config(tmp_path, remote=s3.url, remote_options=s3.options)
    first = fit_cli(config, "a", "6", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    store = s3.store()
    assert verified_intact(store) == "step_000000000006.pt"
    # keep_last 2 remotely too (uploads of steps 2 and 4 may have been dropped for newer ones
    # while the upload thread was busy: claiming the prefix, uploading)
    kept = sorted(store.checkpoint_names())
    assert 1 <= len(kept) <= 2 and kept[-1] == "step_000000000006.pt"
    assert kept == sorted(remote_pointer(store)["checkpoints"])  # type: ignore[arg-type]
    # another machine: an empty directory, the same run from its remote copy
    second = fit_cli(config, "b", "12", resume=True, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "resumed from b/checkpoints/step_000000000006.pt (step 6)" in second.stdout
    assert "another run" not in second.stderr  # its own copy, although the directory is new
    assert losses(tmp_path / "b") == {
        s: v for s, v in losses(tmp_path / "ref" / "full").items() if s > 6
    }
    assert verified_intact(store) == "step_000000000012.pt"
    assert (tmp_path / "a" / ".speedtronic-run-id").read_text() == (
        tmp_path / "b" / ".speedtronic-run-id"
    ).read_text()


def test_sharded_checkpoints_upload_as_directories_and_resume_elsewhere(
    s3: S3, tmp_path: Path
) -> None:
    config = cli_config(
        tmp_path, remote=s3.url, remote_options=s3.options, keep_last=1, async_save=False
    )
    text = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**text, "parallel": {"strategy": "fsdp"}}))
    first = fit_cli(config, "a", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    store = s3.store()
    assert verified_intact(store) == "step_000000000004.dcp"
    files = json.loads(read_remote_pointer(store) or b"{}")["checkpoints"]["step_000000000004.dcp"]
    assert "step_000000000004.dcp/manifest.json" in files["files"]
    assert store.checkpoint_names() == ["step_000000000004.dcp"]  # step 2's deleted
    second = fit_cli(config, "b", "6", resume=True, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "resumed from b/checkpoints/step_000000000004.dcp (step 4)" in second.stdout
    # the same run without interruption (its own prefix: the first one is run a's)
    config.write_text(config.read_text().replace(f"s3://{s3.bucket}/run", f"s3://{s3.bucket}/c"))
    third = fit_cli(config, "c", "6", cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert losses(tmp_path / "b") == {s: v for s, v in losses(tmp_path / "c").items() if s > 4}


def test_async_saves_are_uploaded_once_committed(s3: S3, tmp_path: Path) -> None:
    checkpoint = CheckpointCallback(
        tmp_path / "ck",
        every_steps=2,
        keep_last=2,
        async_save=True,
        remote=s3.url,
        remote_options=s3.options,
        remote_retry=FAST_RETRY,
    )
    trainer = tiny_trainer([checkpoint])
    trainer.fit(6)
    assert verified_intact(s3.store()) == "step_000000000006.pt"


# -- faults ---------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def upload_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The store's warnings, but for the final wait's progress line (timing-dependent)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and r.getMessage().startswith("checkpoint.remote:")
        and not r.getMessage().startswith("checkpoint.remote: waiting up to")
    ]


def test_an_unreachable_endpoint_is_reported_once_and_training_goes_on(
    s3: S3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unreachable = {
        "endpoint_url": f"http://127.0.0.1:{closed_port()}",
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    checkpoint = CheckpointCallback(
        tmp_path / "ck",
        every_steps=2,
        keep_last=2,
        remote=s3.url,
        remote_options=unreachable,
        remote_retry=FAST_RETRY,
    )
    with caplog.at_level(logging.INFO, "speedtronic.checkpoint"):
        result = tiny_trainer([checkpoint]).fit(6)
    assert result.steps == 6 and saved_steps(tmp_path / "ck") == [4, 6]
    reported = upload_warnings(caplog)
    assert len(reported[:-1]) == 1, reported  # once, however many checkpoints failed
    assert "could not upload step_000000000002.pt" in reported[0]
    assert "is the endpoint reachable?" in reported[0] and "training goes on" in reported[0]
    # at the end: the newest checkpoint is only local
    assert "the newest checkpoint step_000000000006.pt is not in" in reported[-1]


def test_bad_credentials_are_reported_once_and_the_remote_keeps_what_it_had(
    s3: S3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def checkpoint_callback() -> CheckpointCallback:
        return CheckpointCallback(
            tmp_path / "ck",
            every_steps=2,
            keep_last=1,
            remote=s3.url,
            remote_options=s3.options,
            remote_retry=FAST_RETRY,
        )

    tiny_trainer([checkpoint_callback()]).fit(2)
    store = s3.store()
    assert verified_intact(store) == "step_000000000002.pt"
    s3.auth(enforced=True)
    try:
        with caplog.at_level(logging.WARNING, "speedtronic.checkpoint"):
            trainer = tiny_trainer([checkpoint := checkpoint_callback()])
            with pytest.warns(
                UserWarning,
                match=r"cannot read .*latest.json \(PermissionError"
                r".*check the credentials.*resuming from the local directory",
            ):
                resume_from(trainer, checkpoint.manager)
            assert trainer.step == 2 and trainer.fit(6).steps == 6
    finally:
        s3.auth(enforced=False)
    reported = upload_warnings(caplog)
    assert "check the credentials" in reported[0] and len(reported) == 2  # + the end's line
    # nothing was deleted although keep_last is 1: no replacement was verified
    assert verified_intact(store) == "step_000000000002.pt"
    assert store.checkpoint_names() == ["step_000000000002.pt"]


class DeleteBucket(Callback):
    """Deletes the run's bucket once the upload of step ``step`` is verified."""

    def __init__(self, checkpoint: CheckpointCallback, s3: S3, step: int) -> None:
        self.checkpoint, self.s3, self.step = checkpoint, s3, step

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        if ctx.step == self.step:
            assert self.checkpoint.mirror is not None
            self.checkpoint.mirror.flush()
            self.s3.store("").fs.rm(self.s3.bucket, recursive=True)


def test_a_bucket_that_disappears_mid_run_is_reported_once(
    s3: S3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = CheckpointCallback(
        tmp_path / "ck",
        every_steps=2,
        keep_last=2,
        remote=s3.url,
        remote_options=s3.options,
        remote_retry=FAST_RETRY,
    )
    with caplog.at_level(logging.WARNING, "speedtronic.checkpoint"):
        result = tiny_trainer([checkpoint, DeleteBucket(checkpoint, s3, 2)]).fit(8)
    assert result.steps == 8 and saved_steps(tmp_path / "ck") == [6, 8]
    reported = upload_warnings(caplog)
    assert len(reported) == 2, reported
    assert "could not upload step_000000000004.pt" in reported[0]
    assert "does the bucket exist?" in reported[0]
    assert "the newest remote checkpoint is step_000000000002.pt" in reported[0]


def two_remote_checkpoints(s3: S3, tmp_path: Path) -> RemoteStore:
    checkpoint = CheckpointCallback(
        tmp_path / "a",
        every_steps=2,
        keep_last=2,
        remote=s3.url,
        remote_options=s3.options,
        remote_retry=FAST_RETRY,
    )
    tiny_trainer([checkpoint]).fit(4)
    store = s3.store()
    assert verified_intact(store) == "step_000000000004.pt"
    return store


def fresh_resume(s3: S3, directory: Path) -> tuple[Trainer, list[str]]:
    checkpoint = CheckpointCallback(
        directory, every_steps=2, remote=s3.url, remote_options=s3.options, remote_retry=FAST_RETRY
    )
    trainer = tiny_trainer([checkpoint])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume_from(trainer, checkpoint.manager)
    return trainer, [str(w.message) for w in caught]


def test_a_remote_pointer_naming_a_missing_checkpoint_resumes_from_the_previous_one(
    s3: S3, tmp_path: Path
) -> None:
    store = two_remote_checkpoints(s3, tmp_path)
    store.fs.rm(store.path("step_000000000004.pt"))
    trainer, messages = fresh_resume(s3, tmp_path / "b")
    assert trainer.step == 2
    assert messages == [
        f"checkpoint.remote: {s3.url}/latest.json names step_000000000004.pt, but the store "
        f"has no {s3.bucket}/run/step_000000000004.pt; resuming from the previous one instead"
    ]
    assert (tmp_path / "b" / "step_000000000002.pt").is_file()


def test_a_damaged_remote_checkpoint_is_skipped_for_the_previous_one(
    s3: S3, tmp_path: Path
) -> None:
    store = two_remote_checkpoints(s3, tmp_path)
    path = store.path("step_000000000004.pt")
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))
    trainer, messages = fresh_resume(s3, tmp_path / "b")
    assert trainer.step == 2 and len(messages) == 1
    assert messages[0].startswith(
        "checkpoint.remote: remote checkpoint step_000000000004.pt is "
        f"damaged: {s3.url}/step_000000000004.pt does not match its "
        "upload record"
    )
    assert not (tmp_path / "b" / "step_000000000004.pt").exists()  # nor a temp file of it
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "latest.json",
        "step_000000000002.pt",
    ]


def test_an_unreachable_store_at_resume_falls_back_to_the_local_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    local = CheckpointCallback(tmp_path / "ck", every_steps=2)
    tiny_trainer([local]).fit(4)
    options = {
        "endpoint_url": f"http://127.0.0.1:{closed_port()}",
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    checkpoint = CheckpointCallback(
        tmp_path / "ck", remote="s3://nowhere/run", remote_options=options, remote_retry=FAST_RETRY
    )
    trainer = tiny_trainer([checkpoint])
    with pytest.warns(
        UserWarning,
        match=r"checkpoint.remote: cannot read s3://nowhere/run/"
        r"latest.json \(.*is the endpoint reachable.*\); resuming from the local",
    ):
        resume_from(trainer, checkpoint.manager)
    assert trainer.step == 4


def test_a_newer_local_checkpoint_is_not_replaced_by_an_older_remote_one(
    s3: S3, tmp_path: Path
) -> None:
    store = two_remote_checkpoints(s3, tmp_path)
    assert fetch_newer(store, CheckpointManager(tmp_path / "a"), retry=FAST_RETRY).path is None
    local = CheckpointCallback(tmp_path / "c", every_steps=3)
    tiny_trainer([local]).fit(6)
    assert fetch_newer(store, local.manager, retry=FAST_RETRY).path is None
    assert saved_steps(tmp_path / "c") == [3, 6]


# -- SIGKILL during uploads -----------------------------------------------------------------


TRIALS = 10
CHAINS = 2


def test_sigkill_during_uploads_then_resume_elsewhere_continues_bit_for_bit(
    s3: S3, tmp_path: Path, forked: Forked
) -> None:
    """Two chains of five trials, side by side: in each trial a fresh empty run directory
    resumes from the chain's S3 copy and trains, saving (and uploading) every step, and is
    SIGKILLed at a random moment -- mostly during an upload: an upload takes longer than a
    step, so the upload thread is always busy. After every kill the remote
    pointer names a checkpoint whose every recorded file is complete; every step any trial
    logged has the loss of an uninterrupted run, bit for bit."""
    rng = random.Random(2026)
    configs = []
    for chain in range(CHAINS):
        config = cli_config(
            tmp_path / f"chain{chain}",
            every_steps=1,
            remote=f"s3://{s3.bucket}/chain{chain}",
            remote_options=s3.options,
            remote_attempts=2,
        )
        configs.append(config)
    seen: dict[int, float] = {}
    uploaded: set[int] = set()
    for trial in range(TRIALS // CHAINS):
        children = []
        for config in configs:
            out = config.parent / f"trial{trial}"
            argv = (
                "fit",
                "--config",
                str(config),
                "--output-dir",
                str(out),
                "--resume",
                "--max-steps",
                "1000000",
            )
            children.append((out, forked.start(cli_main, *argv, cwd=config.parent)))
        for out, child in children:
            deadline = time.monotonic() + 60
            while not (out / "metrics.jsonl").is_file() or len(losses(out)) < 3:
                assert child.poll() is None, child.output
                assert time.monotonic() < deadline, child.output
                time.sleep(0.01)
        for _, child in children:
            time.sleep(rng.uniform(0.0, 0.25))
            os.kill(child.pid, signal.SIGKILL)
        for out, child in children:
            assert child.wait(timeout=30) == -signal.SIGKILL
            for step, loss in losses(out).items():
                assert seen.setdefault(step, loss) == loss  # the two chains agree too
        for chain in range(CHAINS):
            store = s3.store(f"chain{chain}")
            # none until a first upload completed; from then on always an intact one
            if chain in uploaded or read_remote_pointer(store) is not None:
                verified_intact(store)
                uploaded.add(chain)
    for config in configs:
        # each trial resumed from what its chain's remote copy held: it never went back
        starts = [min(losses(config.parent / f"trial{t}")) - 1 for t in range(TRIALS // CHAINS)]
        assert starts == sorted(starts) and starts[-1] > starts[0], starts
    reference = cli_config(tmp_path / "ref", every_steps=10**6)
    full = fit_cli(reference, "full", str(max(seen)), cwd=tmp_path / "ref")
    assert full.returncode == 0, full.stderr
    expected = losses(tmp_path / "ref" / "full")
    assert {step: expected[step] for step in seen} == seen


def test_two_ranks_resume_from_the_store_in_an_empty_directory(
    tmp_path: Path, forked: Forked
) -> None:
    """Two gloo ranks: rank 0 uploads; on resume the node's local main downloads while the
    other rank waits for it, and both continue bit for bit from the store's step 4."""
    for report in succeeded(launch(forked, "remote_resume", tmp_path, timeout=120)):
        assert report["resumed_from"] == "step_000000000004.pt"
        resumed = curve(report, "resumed")
        assert resumed and resumed == {s: v for s, v in curve(report, "full").items() if s > 4}
        assert report["same_weights"] is True
