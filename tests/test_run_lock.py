"""Issue 12.2 and 22.3: one run per run directory (a lock naming its holder, stale locks taken
over) and per path it writes elsewhere (a shared checkpoint directory, a metrics file, a
TensorBoard directory); a fresh run never silently truncates or prunes an earlier run's files,
and a resume never silently continues another run's checkpoints."""

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

from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.run_identity import RUN_ID_NAME
from speedtronic.state.run_lock import (
    FILE_LOCK_SUFFIX,
    LOCK_NAME,
    RunDirectoryError,
    RunDirectoryLock,
    claim_run_directory,
)
from speedtronic_callbacks.console import ConsoleCallback
from speedtronic_callbacks.csv_sink import CsvCallback
from speedtronic_callbacks.jsonl import JsonlCallback
from speedtronic_callbacks.tensorboard import TensorBoardCallback

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


@pytest.mark.parametrize("pid", [10**30, -(2**63), 2**31])
def test_a_lock_naming_an_impossible_pid_is_stale_not_a_raw_error(
    config_file: Path, tmp_path: Path, pid: int
) -> None:
    # The lock file is anyone's to write: a PID no process can have was handed to os.kill,
    # and "fit" exited 1 with a raw OverflowError. No process runs under it: a stale lock.
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    result = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out),
                         "--max-steps", "1", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"stale lock {out / LOCK_NAME} of PID {pid} on this host: it no longer runs" in (
        result.stderr
    )


def test_a_lock_naming_a_boolean_pid_is_refused(config_file: Path, tmp_path: Path) -> None:
    # json's true is an int to isinstance: it was taken for PID 1 (alive, always).
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": True}))
    result = speedtronic("fit", "--config", str(config_file), "--output-dir", str(out),
                         "--max-steps", "1", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"lock file {out / LOCK_NAME}: if that run is gone, delete the lock file" in (
        result.stderr
    )


# -- issue 22, item 3: every path a run writes is locked, checkpoints name their run ------------


def test_two_runs_started_together_on_one_checkpoint_directory(
    config_file: Path, tmp_path: Path, forked: Forked
) -> None:
    # Two runs with their own output directories and one absolute checkpoint.directory,
    # started together: both used to pass the earlier-run check and exit 0, one run's
    # checkpoints replacing the other's. Now the second to reach the checkpoint directory
    # exits 2 naming it and the lock of the run that holds it.
    shared = tmp_path / "shared-checkpoints"
    outs = [tmp_path / "run-a", tmp_path / "run-b"]
    children = [
        forked.start(
            cli_main, "fit", "--config", str(config_file), "--output-dir", str(out),
            "--set", f"checkpoint.directory={shared}", "--max-steps", "100000000", cwd=tmp_path,
        )
        for out in outs
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while all(child.poll() is None for child in children):
            assert time.monotonic() < deadline, [child.output for child in children]
            time.sleep(0.05)
        loser_index = next(i for i, child in enumerate(children) if child.poll() is not None)
        loser, winner = children[loser_index], children[1 - loser_index]
        assert loser.wait(timeout=30) == 2, loser.output
        assert winner.poll() is None, winner.output  # the holder trains on
        while not list(shared.glob("step_*.pt")):
            assert winner.poll() is None and time.monotonic() < deadline, winner.output
            time.sleep(0.05)
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(timeout=60) == 128 + signal.SIGTERM, winner.output
    finally:
        for child in children:
            child.kill()
    winner_out, loser_out = outs[1 - loser_index], outs[loser_index]
    message = loser.output
    assert (
        f"speedtronic: error: directory {shared} (written by this run's checkpoint callback) "
        f"is in use by PID {winner.pid} on host {socket.gethostname()}" in message
    ), message
    assert f"the run in {winner_out}" in message and f"lock file {shared / LOCK_NAME}" in message
    assert "Traceback" not in message
    assert not (loser_out / RUN_ID_NAME).exists()  # the loser never started
    # Every checkpoint there is the winner's, and says so.
    winner_id = (winner_out / RUN_ID_NAME).read_text().strip()
    manager = CheckpointManager(shared)
    for path in manager.checkpoint_paths():
        assert manager.load(path)["run"] == {"id": winner_id, "output_dir": str(winner_out)}
    # The loser's --resume would continue the winner's weights: refused, unless asked for.
    resumed = speedtronic("fit", "--config", str(config_file), "--output-dir", str(loser_out),
                          "--set", f"checkpoint.directory={shared}", "--resume",
                          cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 2, resumed.stderr
    assert "it was written by another run (run id " + winner_id in resumed.stderr
    assert f"run directory {winner_out})" in resumed.stderr
    assert "--resume-from-other-run" in resumed.stderr and "Traceback" not in resumed.stderr
    newest = manager.newest_step()
    assert newest is not None
    taken = speedtronic("fit", "--config", str(config_file), "--output-dir", str(loser_out),
                        "--set", f"checkpoint.directory={shared}", "--resume-from-other-run",
                        "--max-steps", str(newest + 1), cwd=tmp_path)  # fmt: skip
    assert taken.returncode == 0, taken.stderr
    assert "a checkpoint of another run (run id " + winner_id in taken.stderr
    loser_id = (loser_out / RUN_ID_NAME).read_text().strip()
    assert loser_id != winner_id
    assert manager.load(manager.path_for(newest + 1))["run"]["id"] == loser_id


def test_resume_over_another_runs_checkpoints_is_refused(config_file: Path, tmp_path: Path) -> None:
    # Run A trains into a checkpoint directory; run B, with a history of its own, is then
    # pointed at it with --resume: the newest checkpoint there is A's, so B refuses it.
    shared = tmp_path / "ck"
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    a = speedtronic("fit", "--config", str(config_file), "--output-dir", str(run_a),
                    "--set", f"checkpoint.directory={shared}", cwd=tmp_path)  # fmt: skip
    assert a.returncode == 0, a.stderr
    b = speedtronic("fit", "--config", str(config_file), "--output-dir", str(run_b), cwd=tmp_path)
    assert b.returncode == 0, b.stderr
    b_id = (run_b / RUN_ID_NAME).read_text().strip()
    refused = speedtronic("fit", "--config", str(config_file), "--output-dir", str(run_b),
                          "--set", f"checkpoint.directory={shared}", "--resume",
                          "--max-steps", "6", cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    a_id = (run_a / RUN_ID_NAME).read_text().strip()
    assert refused.stderr.splitlines()[-1].startswith(
        f"speedtronic: error: cannot resume from {shared / 'step_000000000004.pt'}: it was "
        f"written by another run (run id {a_id}, run directory {run_a}), not by this one "
        f"(run id {b_id}, run directory {run_b})"
    ), refused.stderr
    assert CheckpointManager(shared).newest_step() == 4  # nothing was written
    # A itself resumes (its id is kept across resumes and recorded in the new checkpoint).
    again = speedtronic("fit", "--config", str(config_file), "--output-dir", str(run_a),
                        "--set", f"checkpoint.directory={shared}", "--resume",
                        "--max-steps", "6", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert (run_a / RUN_ID_NAME).read_text().strip() == a_id
    manager = CheckpointManager(shared)
    assert manager.load(manager.path_for(6))["run"]["id"] == a_id


def test_sink_paths_outside_the_run_directory_are_locked_too(
    config_file: Path, tmp_path: Path
) -> None:
    # A run holding a metrics file, a CSV file and a TensorBoard directory outside its run
    # directory (RunClaim.cover, what build_runtime does); a second run naming any of them
    # is refused, naming the path; /dev/null is nobody's.
    metrics, table, board = tmp_path / "m.jsonl", tmp_path / "t.csv", tmp_path / "tb"
    holder = [
        JsonlCallback(metrics), CsvCallback(table), TensorBoardCallback(board),
        ConsoleCallback(file=os.devnull),
    ]  # fmt: skip
    with claim_run_directory(tmp_path / "holder") as claim:
        claim.cover(holder)
        assert (tmp_path / f".m.jsonl{FILE_LOCK_SUFFIX}").is_file()
        assert (board / LOCK_NAME).is_file() and not Path(os.devnull + FILE_LOCK_SUFFIX).exists()
        for what, sets, where in [
            ("jsonl", ["logging.json_file=" + str(metrics)], f"file {metrics}"),
            ("csv", [f"callbacks=[{{name: csv, path: {table}}}]"], f"file {table}"),
            ("tensorboard", [f"callbacks=[{{name: tensorboard, log_dir: {board}}}]"],
             f"directory {board}"),
        ]:  # fmt: skip
            args = [arg for value in sets for arg in ("--set", value)]
            second = speedtronic("fit", "--config", str(config_file), "--output-dir",
                                 str(tmp_path / what), *args, cwd=tmp_path)  # fmt: skip
            assert second.returncode == 2, second.stderr
            assert f"{where} (written by this run's {what} callback) is in use by PID " in (
                second.stderr
            ), second.stderr
            assert f"the run in {tmp_path / 'holder'}" in second.stderr
    # Released with the claim: the same run now starts.
    free = speedtronic("fit", "--config", str(config_file), "--output-dir", str(tmp_path / "c"),
                       "--set", "logging.json_file=" + str(metrics), cwd=tmp_path)  # fmt: skip
    assert free.returncode == 0, free.stderr
