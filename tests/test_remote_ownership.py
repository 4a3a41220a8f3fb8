"""Issue 30, items 3, 4, 5, 7, 10: who may write a ``checkpoint.remote`` prefix, and fits
that must end.

Through ``speedtronic fit`` (in-process ``run_cli`` where the outcome is an exit code and
files, forked child processes where a hang or a signal is the point), against a ``moto`` S3
server on loopback (one per module, the fixtures of test_remote_checkpoint.py) and
``file://`` stores:

* a prefix belongs to one run (``owner.json``): a second run is refused with exit 2 naming
  the prefix and both run ids, and deletes nothing; ``--resume-from-other-run`` takes it
  over, after which retention never deletes the first run's checkpoints and the first run
  is refused in turn;
* a refused download changes nothing on disk (staging removed, ``latest.json`` untouched);
* a symlink planted at a checkpoint name of a ``file://`` store is replaced, never written
  through; a FIFO at ``latest.json`` or a checkpoint file is exit 2 naming it, not a hang;
* a store that never answers holds the end of a fit for ``remote_final_wait_s`` at most,
  saying what it waits for, and a SIGTERM during that wait exits 143 at once with the local
  checkpoint intact;
* ``remote_options`` holding a URL with a password are refused like the URL itself;
* any ownership record or remote pointer bytes decode or are refused with a reason.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import run_cli
from forked import Forked, cli_main
from hypothesis import given
from hypothesis import strategies as st
from test_checkpoint import saved_steps, tiny_trainer
from test_remote_checkpoint import (  # noqa: F401 - the fixtures s3_endpoint and s3
    FAST_RETRY,
    S3,
    cli_config,
    fit_cli,
    fuzz,
    remote_pointer,
    s3,
    s3_endpoint,
    verified_intact,
)

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.engine.trainer import Trainer
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.remote import parse_remote_pointer, read_remote_pointer
from speedtronic.state.remote_owner import (
    OWNER_NAME,
    RemoteOwnerError,
    check,
    claim,
    parse_owner,
    read_owner,
    this_run,
)
from speedtronic.state.remote_store import RemoteNotRegular, Retry, RetryPolicy, open_store
from speedtronic_callbacks.checkpoint import CheckpointCallback

RUN_ID = ".speedtronic-run-id"


def run_id(out: Path) -> str:
    return (out / RUN_ID).read_text().strip()


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too) with its bytes."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not path.name.endswith(".lock")
    }


# -- item 3: one prefix, one run ------------------------------------------------------------


def test_a_second_run_on_a_prefix_is_refused_and_a_takeover_keeps_the_first_runs_checkpoints(
    s3: S3,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    config = cli_config(tmp_path, remote=s3.url, remote_options=s3.options, async_save=False)
    first = fit_cli(config, "a", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    store = s3.store()
    a_id = run_id(tmp_path / "a")
    assert verified_intact(store) == "step_000000000004.pt"
    before = {name: store.fs.cat_file(store.path(name)) for name in store.checkpoint_names()}

    # Another run, its own directory, the same prefix: refused, naming both runs.
    second = fit_cli(config, "b", "8", cwd=tmp_path)
    assert second.returncode == 2, second.stderr
    b_id = run_id(tmp_path / "b")
    error = second.stderr.strip().splitlines()[-1]
    assert error.startswith(f"speedtronic: error: checkpoint.remote {s3.url} belongs to another")
    assert a_id in error and b_id in error and "--resume-from-other-run" in error
    # nothing of run a's was taken or deleted
    assert {n: store.fs.cat_file(store.path(n)) for n in store.checkpoint_names()} == before
    pointer = remote_pointer(store)
    assert pointer["file"] == "step_000000000004.pt"
    assert {r["run_id"] for r in pointer["checkpoints"].values()} == {a_id}  # type: ignore[union-attr]

    # Taking it over, as asked: b continues from a's newest and the prefix is b's ...
    taken = run_cli(
        "fit", "--config", str(config), "--output-dir", "b", "--max-steps", "10",
        "--resume-from-other-run", cwd=tmp_path,
    )  # fmt: skip
    assert taken.returncode == 0, taken.stderr
    assert "resumed from b/checkpoints/step_000000000004.pt (step 4)" in taken.stdout
    assert json.loads(store.fs.cat_file(store.path("owner.json")))["run_id"] == b_id
    # ... while retention (keep_last 2) deleted only b's own older checkpoints.
    records = remote_pointer(store)["checkpoints"]
    assert isinstance(records, dict)
    owners = {name: record["run_id"] for name, record in records.items()}
    # (an upload still waiting when a newer checkpoint commits is dropped for it)
    assert {name for name, owner in owners.items() if owner == a_id} == set(before)
    mine = sorted(name for name, owner in owners.items() if owner == b_id)
    assert (
        mine[-1] == "step_000000000010.pt"
        and len(mine) <= 2
        and len(owners) == len(before) + len(mine)
    )
    assert "step_000000000004.pt" in before and len(before) <= 2
    assert sorted(store.checkpoint_names()) == sorted(owners)
    for name, data in before.items():
        assert store.fs.cat_file(store.path(name)) == data
    assert verified_intact(store) == "step_000000000010.pt"

    # Run a, resumed: the prefix is b's now; refused before anything local changes.
    a_files = snapshot(tmp_path / "a")
    again = fit_cli(config, "a", "12", resume=True, cwd=tmp_path)
    assert again.returncode == 2, again.stderr
    assert f"cannot resume from checkpoint.remote {s3.url}: it belongs to another run" in (
        again.stderr
    )
    assert b_id in again.stderr and a_id in again.stderr
    assert snapshot(tmp_path / "a") == a_files


# -- item 4: a refused download changes nothing ---------------------------------------------


def test_a_refused_download_leaves_the_local_directory_as_it_was(tmp_path: Path) -> None:
    """The remote's newest checkpoint is another run's while the prefix records this run as
    owner (a takeover racing the old owner's last upload, or a hand-edited store): refused
    from its record before any download, and -- with the record forged to name this run --
    from its content after the download to staging; either way exit 2 and the run
    directory byte for byte as before, so its own resume with ``remote: null`` works."""
    store = tmp_path / "store"
    a_config = cli_config(tmp_path / "a_cfg", remote=store.as_uri())
    assert fit_cli(a_config, str(tmp_path / "a"), "6", cwd=tmp_path).returncode == 0
    local = cli_config(tmp_path / "b_cfg")  # run b: local checkpoints, then the store
    assert fit_cli(local, str(tmp_path / "b"), "2", cwd=tmp_path).returncode == 0
    b_id = run_id(tmp_path / "b")
    owner = json.loads((store / "owner.json").read_text())
    (store / "owner.json").write_text(json.dumps({**owner, "run_id": b_id}))
    b_config = cli_config(tmp_path / "b_remote_cfg", remote=store.as_uri())
    before = snapshot(tmp_path / "b")

    refused = fit_cli(b_config, str(tmp_path / "b"), "8", resume=True, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert f"cannot resume from {store.as_uri()}/step_000000000006.pt: it was written by " in (
        refused.stderr
    )
    assert run_id(tmp_path / "a") in refused.stderr and "nothing was changed" in refused.stderr
    assert snapshot(tmp_path / "b") == before

    pointer = json.loads((store / "latest.json").read_text())
    for record in pointer["checkpoints"].values():
        record["run_id"] = b_id  # the record lies; the checkpoint's own state does not
    (store / "latest.json").write_text(json.dumps(pointer))
    forged = fit_cli(b_config, str(tmp_path / "b"), "8", resume=True, cwd=tmp_path)
    assert forged.returncode == 2, forged.stderr
    assert "step_000000000006.pt: it was written by another run" in forged.stderr
    assert snapshot(tmp_path / "b") == before  # the staged download is gone too

    own = fit_cli(local, str(tmp_path / "b"), "4", resume=True, cwd=tmp_path)
    assert own.returncode == 0, own.stderr
    assert "resumed from" in own.stdout and "(step 2)" in own.stdout


# -- items 5 and 7: what a file:// store holds besides files ----------------------------------


def test_a_symlink_planted_in_a_file_store_is_replaced_not_written_through(
    tmp_path: Path,
) -> None:
    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir()
    outside.mkdir()
    precious = outside / "precious.bin"
    precious.write_bytes(b"not yours")
    for step in (2, 4):
        (store / f"step_{step:012d}.pt").symlink_to(precious)
    config = cli_config(tmp_path / "cfg", remote=store.as_uri(), async_save=False)
    result = fit_cli(config, str(tmp_path / "a"), "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert precious.read_bytes() == b"not yours"
    assert sorted(p.name for p in outside.iterdir()) == ["precious.bin"]
    upload = store / "step_000000000004.pt"
    assert upload.is_file() and not upload.is_symlink()
    assert upload.read_bytes() == (tmp_path / "a" / "checkpoints" / upload.name).read_bytes()


@pytest.mark.parametrize("planted", ["latest.json", "step_000000000004.pt", "owner.json"])
def test_a_fifo_in_a_file_store_is_refused_not_waited_on(
    tmp_path: Path, forked: Forked, planted: str
) -> None:
    store = tmp_path / "store"
    config = cli_config(tmp_path / "cfg", remote=store.as_uri())
    assert fit_cli(config, str(tmp_path / "a"), "4", cwd=tmp_path).returncode == 0
    (store / planted).unlink()
    os.mkfifo(store / planted)
    argv = ("fit", "--config", str(config), "--output-dir", str(tmp_path / "b"))
    child = forked.start(cli_main, *argv, "--max-steps", "6", "--resume", cwd=tmp_path)
    assert child.wait(timeout=60) == 2, child.output
    assert (
        f"speedtronic: error: {store.as_uri()}/{planted} is a FIFO (named pipe), not a regular file"
        in child.output
    )
    assert not (tmp_path / "b" / "checkpoints").exists()  # not even made for the download


# -- item 10: a store that never answers ------------------------------------------------------


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An HTTP endpoint on loopback that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for connection in held:
        connection.close()
    server.close()


def stalled_config(tmp_path: Path, endpoint: str, **checkpoint: object) -> Path:
    return cli_config(
        tmp_path / "cfg",
        remote="s3://stalled/run",
        remote_options={"endpoint_url": endpoint},
        async_save=False,
        **checkpoint,
    )


def assert_resumable(out: Path, step: int) -> None:
    manager = CheckpointManager(out / "checkpoints")
    loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == step


def test_a_stalled_store_holds_the_end_of_a_fit_for_the_final_wait_at_most(
    tmp_path: Path, forked: Forked, silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    config = stalled_config(tmp_path, silent_endpoint, remote_final_wait_s=3.5)
    out = tmp_path / "a"
    argv = ("fit", "--config", str(config), "--output-dir", str(out), "--max-steps", "4")
    child = forked.start(cli_main, *argv, cwd=tmp_path)
    assert child.wait(timeout=90) == 0, child.output
    waiting = next(
        line for line in child.output.splitlines() if "checkpoint.remote: waiting up to" in line
    )
    assert "for step_000000000004.pt to reach s3://stalled/run; now: checking who owns" in waiting
    assert "stopped waiting for the upload" in child.output
    assert "checkpoint.remote_final_wait_s 3.5 s passed" in child.output
    assert_resumable(out, 4)


def test_sigterm_during_the_final_wait_exits_143_at_once(
    tmp_path: Path, forked: Forked, silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    config = stalled_config(tmp_path, silent_endpoint)  # the default wait: 10 minutes
    out = tmp_path / "a"
    argv = ("fit", "--config", str(config), "--output-dir", str(out), "--max-steps", "4")
    child = forked.start(cli_main, *argv, cwd=tmp_path)
    child.wait_for_output("checkpoint.remote: waiting up to 9m", timeout=90)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=15) == 128 + signal.SIGTERM, child.output
    assert "stopped waiting for the upload (checking who owns s3://stalled/run" in child.output
    assert "SIGTERM received" in child.output
    assert "stopped early: signal SIGTERM" in child.output
    assert_resumable(out, 4)


# -- weak spot: a password in any URL-valued remote option ------------------------------------


def test_a_password_in_remote_options_urls_is_refused(tmp_path: Path) -> None:
    endpoint = "https://AKIA:s3cr3t@s3.example.com"
    with pytest.raises(
        ConfigError, match=r"checkpoint.remote_options.endpoint_url: the URL holds a password"
    ):
        SpeedtronicConfig.from_dict(
            {"checkpoint": {"remote": "s3://b/r", "remote_options": {"endpoint_url": endpoint}}}
        )
    nested = {"client_kwargs": {"endpoint_url": endpoint}}
    with pytest.raises(
        ConfigError,
        match=r"callbacks\[0\].remote_options.client_kwargs.endpoint_url: the URL holds",
    ):
        SpeedtronicConfig.from_dict(
            {"callbacks": [{"name": "checkpoint", "remote": "s3://b/r", "remote_options": nested}]}
        )
    config = cli_config(tmp_path, remote="s3://b/r", remote_options={"endpoint_url": endpoint})
    result = run_cli("fit", "--config", str(config), "--output-dir", "out", cwd=tmp_path)
    assert result.returncode == 2 and "s3cr3t" not in result.stdout
    assert "remote_options.endpoint_url: the URL holds a password" in result.stderr
    assert not (tmp_path / "out" / "config.yaml").exists()
    # a user name alone is no secret
    SpeedtronicConfig.from_dict(
        {"checkpoint": {"remote": "s3://b/r", "remote_options": {"endpoint_url": "http://me@x"}}}
    )


# -- fuzzing: ownership records and remote pointers -------------------------------------------


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4)
    ),
    max_leaves=20,
)


@fuzz
@given(
    st.binary(max_size=512)
    | st.builds(lambda value: json.dumps(value).encode(), json_values)
    | st.builds(
        lambda run, extra: json.dumps({"run_id": run, **extra}).encode(),
        st.text(max_size=140) | st.just("20261202T090000Z-1a2b3c4d"),
        st.dictionaries(st.sampled_from(["output_dir", "host", "x"]), json_values, max_size=3),
    )
)
def test_any_ownership_record_decodes_or_is_refused_with_a_reason(data: bytes) -> None:
    owner, problem = parse_owner(data)
    assert (owner is None) != (problem is None)
    if owner is not None:
        assert 0 < len(owner.run_id) <= 128 and "/" not in owner.run_id
        assert json.loads(owner.to_bytes())["run_id"] == owner.run_id  # round trip


def test_an_oversized_or_deeply_nested_ownership_record_is_refused_quickly() -> None:
    assert parse_owner(b" " * (10**6))[1] == "it is more than 65536 bytes"
    nested = b"[" * 50_000 + b"]" * 50_000
    assert parse_owner(nested)[0] is None
    assert parse_remote_pointer(b"{" * 100_000)[0] is None


@fuzz
@given(st.one_of(st.none(), st.integers(), st.text(max_size=200), st.lists(st.integers())))
def test_a_damaged_run_id_of_a_remote_record_is_rejected(value: object) -> None:
    content = {
        "step": 4,
        "file": "step_000000000004.pt",
        "checkpoints": {
            "step_000000000004.pt": {
                "run_id": value,
                "files": {"step_000000000004.pt": {"size": 10, "sha256": "b" * 64}},
            }
        },
    }
    pointer, problem = parse_remote_pointer(json.dumps(content).encode())
    if pointer is None:
        assert problem == "the record of 'step_000000000004.pt' has an invalid run_id"
    else:
        run = pointer.records["step_000000000004.pt"].run_id
        assert run == value and (run is None or len(run) <= 128)


# -- the claim itself -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["s3", "file", "memory"])
def test_of_two_claims_one_owns_the_prefix(
    kind: str,
    s3: S3,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    store = {
        "s3": lambda: s3.store(),
        "file": lambda: open_store((tmp_path / "store").as_uri()),
        "memory": lambda: open_store(f"memory://{tmp_path.name}/run"),
    }[kind]()
    fast = Retry(RetryPolicy(attempts=1), "claiming")
    first, second = this_run("run-a", "/a"), this_run("run-b", "/b")
    claim(store, first, fast)
    claim(store, first, fast)  # its own record: fine
    with pytest.raises(RemoteOwnerError, match=r"belongs to another run \(run id run-a, run dir"):
        claim(store, second, fast)
    assert store.create_small(OWNER_NAME, second.to_bytes()) is False  # conditional create
    assert read_owner(store, fast) == first
    claim(store, second, fast, take_over=True)
    assert read_owner(store, fast) == second
    with pytest.raises(RemoteOwnerError, match="was taken over by another run"):
        check(store, "run-a", fast)


def test_a_link_planted_at_owner_json_is_not_followed(tmp_path: Path) -> None:
    store_dir, target = tmp_path / "store", tmp_path / "elsewhere.json"
    store_dir.mkdir()
    (store_dir / OWNER_NAME).symlink_to(target)  # dangling: a create through it would work
    store = open_store(store_dir.as_uri())
    assert store.create_small(OWNER_NAME, b"{}") is False and not target.exists()
    with pytest.raises(RemoteNotRegular, match="owner.json is a symbolic link"):
        read_owner(store, Retry(RetryPolicy(attempts=1), "reading"))


class TakeOver(Callback):
    """At step ``step`` (once the uploads so far are done), another run takes the prefix."""

    def __init__(self, checkpoint: CheckpointCallback, url: str, step: int) -> None:
        self.checkpoint, self.url, self.step = checkpoint, url, step

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        if ctx.step == self.step:
            assert self.checkpoint.mirror is not None
            self.checkpoint.mirror.flush()
            fast = Retry(RetryPolicy(attempts=1), "taking over")
            claim(open_store(self.url), this_run("run-b", None), fast, take_over=True)


def test_a_run_whose_prefix_was_taken_over_stops_uploading_there(tmp_path: Path) -> None:
    url = (tmp_path / "store").as_uri()
    checkpoint = CheckpointCallback(
        tmp_path / "ck", every_steps=2, keep_last=1, remote=url, remote_retry=FAST_RETRY
    )
    trainer = tiny_trainer([checkpoint, TakeOver(checkpoint, url, 3)])
    trainer.run_id = "run-a"
    with pytest.raises(RemoteOwnerError, match=r"was taken over by another run \(run id run-b"):
        trainer.fit(12)
    assert trainer.step < 12  # stopped at the step after the refusal, not at the end
    store = open_store(url)
    data = read_remote_pointer(store)
    assert data is not None
    pointer, _ = parse_remote_pointer(data)
    assert pointer is not None and pointer.target == "step_000000000002.pt"
    assert store.checkpoint_names() == ["step_000000000002.pt"]  # nothing after the takeover
    assert saved_steps(tmp_path / "ck")[-1] >= 4  # its newer checkpoints stay local
