"""``benchmarks/gpu_check.py`` on a machine without CUDA: it refuses in one line, and every
configuration it would train validates, so a mistyped option shows before a GPU is lent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_check_module import load_gpu_check

from speedtronic.config import SpeedtronicConfig

gpu_check = load_gpu_check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only machines")
def test_without_cuda_it_runs_nothing_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([]) == 2
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was run"
    ]


@pytest.mark.parametrize("name", sorted(gpu_check.VARIANTS))
def test_every_check_config_validates(name: str, tmp_path: Path) -> None:
    sections, _ = gpu_check.VARIANTS[name]
    config = SpeedtronicConfig.from_dict(gpu_check.tiny_config(tmp_path / "run", **sections))
    assert config.run.device == "cuda"
    assert config.run.max_steps == gpu_check.STEPS


def test_every_check_has_a_runner_and_every_variant_is_checked() -> None:
    checks = set(gpu_check.CHECKS)
    assert set(gpu_check.VARIANTS) <= checks
    assert "attention_masks" in checks


def test_the_table_reports_a_failure_with_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> object:
        raise ValueError("no kernel image is available")

    failed = gpu_check.run_check("bf16", broken)
    passed = gpu_check.CheckResult(
        "fp32", True, 1.0, gpu_check.Outcome(12345.6, 3 * 2**20, 0.25, "note")
    )
    assert not failed.ok and failed.error.startswith("ValueError: no kernel image is available")
    gpu_check.print_table([passed, failed], markdown=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| fp32 | ok | 12,346 | 3 | 25.0% | 1.0 | note |"
    assert lines[3].startswith("| bf16 | FAILED | - | - | - |")
    assert "ValueError: no kernel image is available" in lines[3]


def test_records_give_throughput_memory_and_mfu() -> None:
    records = [
        {"step": 10, "tokens_per_sec": 100.0},
        {"step": 20, "tokens_per_sec": 2000.0, "memory_peak_bytes": 4096, "mfu": 0.5},
    ]
    outcome = gpu_check.outcome_of_records(records, "n")
    assert outcome == gpu_check.Outcome(2000.0, 4096, 0.5, "n")
    assert gpu_check.outcome_of_records([]) == gpu_check.Outcome()


SMALL_CPU_RUN: dict[str, object] = {
    "model": {"max_seq_len": 32, "n_layer": 1, "d_model": 32, "d_ff": 64},
    "data": {"num_tokens": 4096, "micro_batch_size": 4, "target_batch_size": 8},
    "logging": {"every_steps": 1, "console": False},
    "ooo_backprop": True,
}


@pytest.mark.filterwarnings("ignore:system_metrics. no mfu:UserWarning")
def test_a_check_fit_runs_through_the_real_composition_path(tmp_path: Path) -> None:
    """The same ``fit_in_process`` on the CPU (two steps, with the stage-stream scheduler,
    which reports itself disabled off CUDA): a check that demands its feature's note fails."""
    cpu = {"device": "cpu", "max_steps": 2}
    outcome = gpu_check.fit_in_process(
        gpu_check.tiny_config(tmp_path / "a", run=cpu, **SMALL_CPU_RUN)
    )
    assert outcome.tokens_per_s is not None and outcome.tokens_per_s > 0
    with pytest.raises(RuntimeError, match="ooo_backprop did not run"):
        gpu_check.fit_in_process(
            gpu_check.tiny_config(tmp_path / "b", run=cpu, **SMALL_CPU_RUN),
            require_note="ooo_backprop",
        )
