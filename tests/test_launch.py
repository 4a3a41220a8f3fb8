"""``speedtronic fit --nproc-per-node 2`` (``speedtronic.systems.launch``): the launcher
starts two real rank processes through ``torch.distributed.run``'s API and exits with the
run's own code -- 143 after SIGTERM (each rank saved at the step its stop line named), 75
when the time budget runs out (run by docs/cluster-runs.md's SLURM wrapper, which then
requeues), 2 for a mistake the ranks find -- with one line and no traceback. Each launcher is
a fresh ``python -m speedtronic`` (the ranks are too); the three run at once."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli

from speedtronic.systems.launch import rank_arguments, run_exit_code

ROOT = Path(__file__).resolve().parents[1]


def write_run(tmp_path: Path, name: str, **sections: dict[str, object]) -> Path:
    config: dict[str, dict[str, object]] = {
        "run": {"device": "cpu", "max_steps": 100_000, "output_dir": str(tmp_path / name)},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {"synthetic_kind": "learnable", "num_tokens": 256, "micro_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "logging": {"every_steps": 4, "console": False},
        "checkpoint": {"every_steps": 100_000},
        "distributed": {"timeout_s": 60},
    }
    for key, values in sections.items():
        config[key] = {**config[key], **values}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in RANK_VARIABLES}
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "callbacks")])
    )
    return {**env, **extra}


def launch_line(config: Path, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "speedtronic", "fit", "--config", str(config)]
    return [*command, "--nproc-per-node", "2", *extra]


def start(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def launcher(config: Path, *extra: str) -> subprocess.Popen[str]:
    return start(launch_line(config, *extra), config.parent, environment())


def slurm_wrapper(tmp_path: Path, config: Path) -> subprocess.Popen[str]:
    """docs/cluster-runs.md's requeue wrapper, its ``speedtronic fit`` line running this
    launcher with a 1 s budget, under a stub ``scontrol`` that records what it was asked."""
    page = (ROOT / "docs" / "cluster-runs.md").read_text(encoding="utf-8")
    script = re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", page, re.DOTALL)
    assert script is not None
    line = shlex.join(launch_line(config, "--max-time", "1s"))
    wrapper = re.sub(r"^speedtronic fit .*$", line, script.group(1), count=1, flags=re.M)
    assert line in wrapper and "scontrol requeue" in wrapper
    (tmp_path / "wrapper.sh").write_text(wrapper, encoding="utf-8")
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "scontrol.txt"}\n')
    (stub / "scontrol").chmod(0o755)
    env = environment(SLURM_JOB_ID="4242", PATH=f"{stub}{os.pathsep}{os.environ['PATH']}")
    return start(["bash", str(tmp_path / "wrapper.sh")], tmp_path, env)


def test_the_launcher_exits_with_the_runs_own_code(tmp_path: Path) -> None:
    signalled = launcher(write_run(tmp_path, "term"))
    budget = slurm_wrapper(tmp_path, write_run(tmp_path, "budget"))
    missing = write_run(tmp_path, "missing", data={"text_path": str(tmp_path / "nope.txt")})
    mistake = launcher(missing)
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text()):  # both ranks are training
        assert signalled.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    signalled.send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=240)[0] for process in (signalled, budget, mistake)]
    codes = [process.returncode for process in (signalled, budget, mistake)]
    assert codes == [143, 75, 2], outputs
    for output in outputs:
        assert "Traceback" not in output and "ChildFailedError" not in output, output
    # SIGTERM: both ranks stopped at one logging step, each named it and saved it; the step
    # each rank named on receiving the signal is the latest it could be (the signal reaches
    # the ranks at different moments, and the first rank's vote stops both).
    pointer = json.loads((tmp_path / "term" / "checkpoints" / "latest.json").read_text())
    stopped = re.findall(r"stopped by SIGTERM at step (\d+); checkpoint", outputs[0])
    assert stopped == [str(pointer["step"])] * 2 and pointer["step"] % 4 == 0, outputs[0]
    latest = [int(step) for step in re.findall(r"\(step (\d+) at the latest\)", outputs[0])]
    assert len(latest) == 2, outputs[0]
    assert all(pointer["step"] <= step <= pointer["step"] + 4 for step in latest), outputs[0]
    assert outputs[0].rstrip().endswith("exiting 143")
    assert "speedtronic: the run exited with 75 (rank " in outputs[1]
    assert (tmp_path / "scontrol.txt").read_text() == "requeue 4242\n"  # the docs' wrapper
    assert "data.text_path" in outputs[2]
    assert "speedtronic: the run exited with 2 (rank " in outputs[2]


def test_the_ranks_get_the_arguments_less_the_launchers_and_the_run_speaks_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["fit", "--config", "r.yaml", "--nproc-per-node", "2", "--nnodes=1", "--resume"]
    assert rank_arguments(argv) == ["fit", "--config", "r.yaml", "--resume"]
    assert run_exit_code({}) == 0
    assert run_exit_code({1: 2, 0: 2}) == 2
    assert run_exit_code({0: -15, 1: 75}) == 75  # rank 0 stopped by the agent after rank 1
    assert run_exit_code({0: 143, 1: 75}) == 75
    assert run_exit_code({1: -15}) == 143  # killed by SIGTERM
    # A launcher flag it cannot use: exit 2 and one line, before any rank starts.
    config = write_run(tmp_path, "flags")
    for flags, message in (
        (("--nproc-per-node", "2", "--nnodes", "2"), "--nnodes above 1 needs --rdzv-endpoint"),
        (("--nproc-per-node", "0"), "--nproc-per-node: 0 is not a positive count"),
        (("--nproc-per-node", "2", "--nnodes", "x"), "--nnodes: 'x' is not N or MIN:MAX"),
    ):
        done = run_cli("fit", "--config", str(config), *flags, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().startswith(f"speedtronic: error: {message}")
        assert "Traceback" not in done.stderr
    monkeypatch.setenv("LOCAL_RANK", "0")  # under torchrun: no ranks of ranks
    done = run_cli("fit", "--config", str(config), "--nproc-per-node", "2", cwd=tmp_path)
    assert done.returncode == 2 and "this process is already a rank" in done.stderr
    assert not (tmp_path / "flags").exists()
