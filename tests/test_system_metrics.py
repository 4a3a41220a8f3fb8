"""``system_metrics`` on a machine without an accelerator: this process's host memory and
CPU use in every due record, and one warning naming what it cannot log and why."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli
from sink_helpers import TinyRegressor, make_trainer
from torch import nn

from speedtronic_callbacks import system_metrics
from speedtronic_callbacks.system_metrics import SystemMetricsCallback


class CountsFlops(TinyRegressor):
    def flops_per_token(self, seq_len: int | None = None) -> int:
        return 30 * (seq_len or 1)


def fit(
    tmp_path: Path, callback: SystemMetricsCallback, model: nn.Module | None = None
) -> tuple[list[dict[str, object]], list[str]]:
    """The due records of a 4-step fit and the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = make_trainer(tmp_path, [callback], max_steps=4, model=model).fit()
    return [dict(r) for r in result.metrics], [str(w.message) for w in caught]


def test_host_memory_and_cpu_are_logged_on_a_cpu(tmp_path: Path) -> None:
    records, said = fit(tmp_path, SystemMetricsCallback(peak_flops=1e9), model=CountsFlops())
    assert said == []  # everything asked for is there: nothing to explain
    for record in records:
        assert "memory_bytes" not in record  # no device memory on a CPU ...
        rss = record["host/rss_bytes"]  # ... but the process's resident memory
        assert isinstance(rss, int) and rss > 10 * 2**20  # torch alone takes more
        cpu = record["host/cpu_percent"]
        assert isinstance(cpu, float) and cpu >= 0.0


def test_without_psutil_memory_comes_from_proc_and_then_it_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # ``import psutil`` raises
    if sys.platform == "linux":
        records, said = fit(tmp_path / "proc", SystemMetricsCallback(mfu=False))
        assert said == [] and all(int(str(r["host/rss_bytes"])) > 0 for r in records)
    monkeypatch.setattr(system_metrics, "_statm_rss", lambda: None)  # no /proc either
    records, said = fit(tmp_path / "none", SystemMetricsCallback(mfu=False))
    assert said == ["system_metrics: no host/rss_bytes: it needs psutil here (pip install psutil)"]
    assert all("host/rss_bytes" not in r and "host/cpu_percent" in r for r in records)


def test_what_cannot_be_logged_is_said_once_with_the_reason(tmp_path: Path) -> None:
    _, said = fit(tmp_path / "a", SystemMetricsCallback(host=False))
    assert said == [
        "system_metrics: no memory_bytes: cpu has no device memory counters (host: true logs "
        "this process's memory); no flops_per_sec or mfu: the model has no "
        "flops_per_token(seq_len) method"
    ]
    records, said = fit(tmp_path / "b", SystemMetricsCallback(), model=CountsFlops())
    assert said == [
        "system_metrics: no mfu: the peak FLOP/s of cpu in fp32 is not known (set the "
        "peak_flops option)"
    ]
    assert all("flops_per_sec" in r and "mfu" not in r for r in records)


def test_system_metrics_from_the_cli_on_a_cpu(tmp_path: Path) -> None:
    config = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": "out"},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "logging": {"every_steps": 2},
        "callbacks": [{"name": "system_metrics"}],
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("fit", "--config", "run.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "system_metrics" in line]
    assert warned == [
        "speedtronic: warning: system_metrics: no mfu: the peak FLOP/s of cpu in fp32 is not "
        "known (set the peak_flops option)"
    ]
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all('"host/rss_bytes":' in line for line in lines)
