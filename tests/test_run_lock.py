"""Issue 12.2: one run per run directory (a lock naming its holder, stale locks taken over),
and a fresh run never silently truncates or prunes an earlier run's files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli as speedtronic
from forked import Forked, cli_main

from speedtronic.state.run_lock import LOCK_NAME, RunDirectoryError, RunDirectoryLock

ROOT = Path(__file__).resolve().parent.parent

TINY = {
    "run": {"name": "lock", "device": "cpu", "max_steps": 4, "seed": 3},
    "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
    "logging": {"every_steps": 1, "console": False},
    "checkpoint": {"every_steps": 2},
}


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_second_lock_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with RunDirectoryLock(tmp_path):
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunDirectoryError, match=f"in use by PID {os.getpid()} on host"):
            RunDirectoryLock(tmp_path).acquire()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released: empty, free
    with RunDirectoryLock(tmp_path):
        pass


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    stale = {"host": socket.gethostname(), "pid": dead_pid(), "started": "earlier"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    with pytest.warns(UserWarning, match=f"stale lock .* PID {stale['pid']}"):
        lock = RunDirectoryLock(tmp_path)
        lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_lock_of_another_host_is_refused(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(RunDirectoryError, match="PID 1 on host elsewhere.*delete the lock"):
        RunDirectoryLock(tmp_path).acquire()


@pytest.fixture()
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_a_second_run_in_a_busy_directory_exits_2_at_once(
    config_file: Path, tmp_path: Path, forked: Forked
) -> None:
    # The holder is a real process (its own PID, killed below to leave a stale lock; forked
    # from the suite's preloaded server, tests/forked.py); the commands that meet its lock
    # run in this process.
    out = tmp_path / "out"
    first = forked.start(
        cli_main, "fit", "--config", str(config_file), "--output-dir", str(out),
        "--max-steps", "100000000", cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").stat().st_size:
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        metrics_before = (out / "metrics.jsonl").stat().st_size
        second = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out),
                             "--resume", cwd=tmp_path)  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"in use by PID {first.pid} on host {socket.gethostname()}" in second.stderr
        assert (out / "metrics.jsonl").stat().st_size >= metrics_before  # untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # The killed run left its lock behind: the next run on this host takes it over.
    resumed = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out),
                          "--resume", "--max-steps", "1", cwd=tmp_path)  # fmt: skip
    assert "stale lock" in resumed.stderr, resumed.stderr
    assert resumed.returncode == 0, resumed.stderr


def test_fresh_run_over_an_earlier_run_is_refused_until_resume_or_overwrite(
    config_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    metrics = (out / "metrics.jsonl").read_text()
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    again = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out), cwd=tmp_path)
    assert again.returncode == 2, again.stderr
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing lost
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == checkpoints
    resumed = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out),
                          "--resume", "--max-steps", "6", cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "metrics.jsonl").read_text().startswith(metrics)
    replaced = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out),
                           "--overwrite", "--max-steps", "2", cwd=tmp_path)  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    assert "--overwrite: deleted" in replaced.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.suffix == ".pt") == [
        "step_000000000002.pt"
    ]


def test_a_stale_lock_naming_a_live_pid_is_described_as_such(
    config_file: Path, tmp_path: Path
) -> None:
    # Issue 22, item 10: a stale lock whose PID now belongs to another (live) process was
    # described as "no longer runs". That process does not hold the flock, so it is not the
    # run: the lock is taken over, and the warning says what is true.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "out"
        out.mkdir()
        holder = {"host": socket.gethostname(), "pid": other.pid, "started": "earlier"}
        (out / LOCK_NAME).write_text(json.dumps(holder))
        result = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out),
                             "--max-steps", "1", cwd=tmp_path)  # fmt: skip
        assert other.poll() is None  # still alive: the PID was live throughout
    finally:
        other.kill()
        other.wait()
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "stale lock" in line]
    assert len(warning) == 1, result.stderr
    assert f"stale lock {out / LOCK_NAME} of PID {other.pid} on this host" in warning[0]
    assert "does not hold the lock, so it is not the run" in warning[0]
    assert "no longer runs" not in warning[0]
