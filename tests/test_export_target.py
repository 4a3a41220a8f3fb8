"""Issue 30.2 and its weak spots: where ``speedtronic export`` may write. Never into a
directory a live run holds (a real ``fit`` process holding its lock), never over a directory
that is not an earlier export (``--overwrite`` lists what it would have removed), never
through a symbolic link, never at ``.`` or under a file -- one line, exit 2, nothing touched
and nothing left beside it. And NaN weights are refused unless ``--allow-nonfinite``."""

from __future__ import annotations

import errno
import json
import math
import signal
import socket
import tempfile
import time
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from forked import Forked, cli_main
from hf_helpers import VOCAB, run_config
from hypothesis import given, settings
from hypothesis import strategies as st

from speedtronic.models.export import (
    EXPORT_RECORD,
    ExportError,
    check_export_target,
    export_model,
)
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.run_holder import RunHeldError, runs_kept_out
from speedtronic.state.run_identity import RUN_ID_NAME
from speedtronic.state.run_lock import LOCK_NAME, RunDirectoryError, RunDirectoryLock

torch.set_num_threads(1)

TINY = {"name": "reference_transformer", "n_layer": 1, "n_head": 2, "d_model": 16}


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``directory`` with its size and modification time (ns)."""
    found = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        found[str(path.relative_to(directory))] = (info.st_size, info.st_mtime_ns)
    return found


def one_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("speedtronic: error:"), stderr
    assert "Traceback" not in stderr
    return lines[0]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_export_never_writes_into_a_live_runs_directory(tmp_path: Path, forked: Forked) -> None:
    # Issue 30.2: `export --overwrite --output <the run's directory>` deleted the live run's
    # lock, run id, metrics, config and checkpoints (exit 0). The holder is a real fit.
    config = run_config(tmp_path, TINY, steps=100_000_000)
    run = tmp_path / "run"
    fit = forked.start(cli_main, "fit", "--config", str(config), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob("step_*.pt")):
            assert fit.poll() is None and time.monotonic() < deadline, fit.output
            time.sleep(0.1)
        held = f"is held by a live run (PID {fit.pid} on host {socket.gethostname()}"
        for output in (run, run / "checkpoints", run / "hf"):
            result = run_cli("export", "--config", str(config), "--output", str(output),
                             "--overwrite", cwd=tmp_path)  # fmt: skip
            assert result.returncode == 2, result.stderr
            line = one_error(result.stderr)
            assert f"--output {output}: {run} {held}; the run in {run}; lock file" in line
            assert line.endswith("export never writes where a run writes")
            assert fit.poll() is None, fit.output  # the run trains on
        assert not (run / "hf").exists() and leftovers(run) == [] and leftovers(tmp_path) == []
        for kept in (LOCK_NAME, RUN_ID_NAME, "config.yaml", "metrics.jsonl", "checkpoints"):
            assert (run / kept).exists(), kept
        fit.send_signal(signal.SIGTERM)
        assert fit.wait(timeout=60) == 128 + signal.SIGTERM, fit.output
    finally:
        fit.kill()
    # The run is over: its directory is still not an export, so --overwrite lists what it
    # would remove and touches nothing.
    before = snapshot(run)
    result = run_cli("export", "--config", str(config), "--output", str(run), "--overwrite",
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    line = one_error(result.stderr)
    assert f"--output {run} is not a directory speedtronic export wrote (it holds no " in line
    assert f"would remove {RUN_ID_NAME}, {LOCK_NAME}, checkpoints, config.yaml, metrics" in line
    assert snapshot(run) == before and leftovers(tmp_path) == []


def test_no_run_starts_in_a_directory_export_is_writing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with RunDirectoryLock(run):  # a run that ended: its (released) lock file stays
        pass
    with runs_kept_out(run / "hf"):  # a stale lock does not stop the export...
        with pytest.raises(RunDirectoryError, match="is in use by"):
            RunDirectoryLock(run).acquire()  # ...but no run starts there meanwhile
    with RunDirectoryLock(run):
        with pytest.raises(RunHeldError, match=f"{run} is held by a live run"):
            with runs_kept_out(run / "hf"):
                pass


def test_an_output_that_is_no_directory_of_its_own_is_refused(tmp_path: Path) -> None:
    # Weak spot: a link, `.` or a path under a file gave NotADirectoryError / Errno 22
    # tracebacks, wrote through the link, or left `.tmp-old` directories behind.
    config = run_config(tmp_path, TINY, steps=2)
    assert run_cli("fit", "--config", str(config), cwd=tmp_path).returncode == 0
    cases = {
        "link": "--output link is a symbolic link; name a real directory",
        "gone": "--output gone is a symbolic link (dangling); name a real directory",
        ".": "--output . does not name a directory of its own",
        "notes.txt/hf": "--output notes.txt/hf: {work}/notes.txt is not a directory",
    }
    for index, (output, expected) in enumerate(cases.items()):
        work, elsewhere = tmp_path / f"work{index}", tmp_path / f"elsewhere{index}"
        work.mkdir()
        elsewhere.mkdir()
        (elsewhere / "keep.txt").write_text("not the export's")
        (work / "link").symlink_to(elsewhere)
        (work / "gone").symlink_to(tmp_path / "nothing")
        (work / "notes.txt").write_text("a file")
        before = snapshot(tmp_path)
        result = run_cli("export", "--config", str(config), "--output", output, "--overwrite",
                         cwd=work)  # fmt: skip
        assert result.returncode == 2, (output, result.stderr)
        assert expected.format(work=work) in one_error(result.stderr)
        assert snapshot(tmp_path) == before, output  # nothing touched, nothing left


def test_nan_weights_are_refused_unless_allowed(tmp_path: Path) -> None:
    config = run_config(tmp_path, TINY, steps=2)
    assert run_cli("fit", "--config", str(config), cwd=tmp_path).returncode == 0
    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    step = manager.newest_step()
    assert step is not None
    state = manager.load(manager.path_for(step))
    model = state["model"]
    assert isinstance(model, dict)
    model["transformer.h.0.mlp.up_proj.weight"][0, :3] = torch.tensor([math.nan, math.inf, 1.0])
    manager.save(step, state)
    output = tmp_path / "hf"
    result = run_cli("export", "--config", str(config), "--output", str(output), cwd=tmp_path)
    assert result.returncode == 2
    assert (
        "cannot export non-finite weights: tensor model.layers.0.mlp.up_proj.weight holds 1 "
        "NaN and 1 infinite values of " in one_error(result.stderr)
    )
    assert "pass --allow-nonfinite to write them anyway" in result.stderr
    assert not output.exists() and leftovers(tmp_path) == []
    result = run_cli("export", "--config", str(config), "--output", str(output),
                     "--allow-nonfinite", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (output / "model.safetensors").is_file() and (output / EXPORT_RECORD).is_file()


def test_an_export_that_fails_leaves_the_earlier_one_in_place(tmp_path: Path) -> None:
    model = ReferenceTransformer(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16)
    output = tmp_path / "hf"
    export_model(model, output)
    before = snapshot(output)
    with torch.no_grad():
        model.lm_head.weight[1, 1] = math.inf
    with pytest.raises(ExportError, match="tensor model.embed_tokens.weight holds 0 NaN and 1"):
        export_model(model, output, overwrite=True)
    assert snapshot(output) == before and leftovers(tmp_path) == []
    export_model(model, output, overwrite=True, allow_nonfinite=True)
    assert snapshot(output) != before


NAMES = st.sampled_from(["config.json", "model.safetensors", "README.md", "sub", "x"])


@settings(max_examples=60, deadline=None)
@given(
    record=st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda files: json.dumps({"files": files}).encode(),
            st.lists(st.one_of(NAMES, st.integers()), max_size=4),
        ),
    ),
    present=st.lists(NAMES, unique=True, max_size=4),
)
def test_overwrite_accepts_only_what_its_record_proves(record: bytes, present: list[str]) -> None:
    # Any record bytes, any directory contents: --overwrite either accepts a directory
    # whose every entry is the record or a regular file it lists, or refuses (ExportError).
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "hf"
        directory.mkdir()
        (directory / EXPORT_RECORD).write_bytes(record)
        for name in present:
            if name == "sub":
                (directory / name).mkdir()
            else:
                (directory / name).write_text("x")
        try:
            check_export_target(directory, overwrite=True)
        except ExportError as exc:
            assert "--overwrite replaces only an earlier export" in str(exc)
            return
        listed = json.loads(record)["files"]
        assert all(name in listed and name != "sub" for name in present)


def test_a_directory_that_cannot_be_written_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ReferenceTransformer(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16)

    def full(tensors: object, filename: str, **_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(ExportError, match="--output .*hf: cannot write it: No space left on"):
        export_model(model, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
