"""The text sinks show every key a callback logs by default: ``console`` lines and the
``progress`` output end with them (after the standard fields), ``other_keys: false`` turns
that off, and the trainer's own counters stay in ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path

import yaml
from cli_runner import run_cli

from speedtronic_callbacks.console import describe_record
from speedtronic_callbacks.progress import _postfix, progress_line

PLUGIN = """
import torch
from speedtronic import Callback, register_callback


@register_callback("grad_max")
class GradMax(Callback):
    def on_metrics(self, trainer, ctx):
        if ctx.due:
            ctx.record.set("mine/grad_max", torch.tensor(0.125))
            ctx.record.set("mine/tokens_seen_bytes", 3 * 2**20)
"""

RECORD = {
    "step": 4,
    "loss": 2.5,
    "lr": 1e-3,
    "lr/group1": 2e-3,
    "steps_per_sec": 12.0,
    "samples_per_sec": 48.0,
    "tokens_per_sec": 3200.0,
    "samples": 16,
    "tokens": 512,
    "micro_batches": 2,
    "elapsed_s": 0.4,
    "host/rss_bytes": 3 * 2**30,
    "host/cpu_percent": 97.25,
    "mine/grad_max": 0.125,
    "note": "warm",
}


def write_run(tmp_path: Path, console: dict[str, object] | None) -> Path:
    (tmp_path / "my_plugins.py").write_text(PLUGIN)
    config: dict[str, object] = {
        "imports": ["my_plugins"],
        "run": {"device": "cpu", "max_steps": 4, "output_dir": "out"},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "logging": {"every_steps": 2, "jsonl": False},
        "callbacks": [{"name": "grad_max"}] + ([{"name": "console", **console}] if console else []),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def step_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


def test_a_callbacks_keys_are_on_the_console_without_configuring_it(tmp_path: Path) -> None:
    done = run_cli("fit", "--config", str(write_run(tmp_path, None)), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = step_lines(done.stdout)
    assert len(lines) == 2
    for line in lines:
        assert line.endswith(" tok/s | mine/grad_max 0.1250 | mine/tokens_seen_bytes 3.00MiB")
        assert "samples" not in line and "elapsed" not in line  # the trainer's counters


def test_other_keys_false_keeps_the_short_line_and_keys_come_first(tmp_path: Path) -> None:
    quiet = write_run(tmp_path, {"other_keys": False, "keys": ["samples"]})
    done = run_cli("fit", "--config", str(quiet), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = step_lines(done.stdout)
    assert [line.rsplit(" | ", 1)[1] for line in lines] == ["samples 4", "samples 8"]
    assert "mine/" not in done.stdout


def test_lines_show_other_keys_in_name_order_with_their_units() -> None:
    line = describe_record(RECORD, 10, ["samples"])
    assert line == (
        "step 4/10 | loss 2.5000 | lr 1.00e-03 | 12.0 steps/s | 3.2k tok/s | samples 16 | "
        "host/cpu_percent 97.2% | host/rss_bytes 3.00GiB | mine/grad_max 0.1250 | note warm"
    )
    assert describe_record(RECORD, 10, other=False) == (
        "step 4/10 | loss 2.5000 | lr 1.00e-03 | 12.0 steps/s | 3.2k tok/s"
    )
    assert progress_line(RECORD, 0, 10).endswith(
        "| elapsed 0:00 | eta 0:00 | host/cpu_percent 97.2% | host/rss_bytes 3.00GiB | "
        "mine/grad_max 0.1250 | note warm"
    )
    assert _postfix(RECORD) == (
        "loss=2.5000, lr=1.00e-03, tok/s=3.2k, host/cpu_percent=97.2%, "
        "host/rss_bytes=3.00GiB, mine/grad_max=0.1250, note=warm"
    )
    assert _postfix(RECORD, other=False) == "loss=2.5000, lr=1.00e-03, tok/s=3.2k"


def test_a_line_follows_its_records_keys_as_they_appear_change_type_and_go() -> None:
    """The console plans a line once per record shape: a record with a new key, the same
    keys with another value type, or a key gone again each get the line of their own."""
    base = {"step": 1, "loss": 2.5, "lr": 1e-3}
    assert describe_record(base, 10) == "step 1/10 | loss 2.5000 | lr 1.00e-03"
    grown = {**base, "step": 2, "eval/loss": 2.25, "mine/x": 1.5}
    assert describe_record(grown, 10) == (
        "step 2/10 | loss 2.5000 | eval/loss 2.2500 | lr 1.00e-03 | mine/x 1.5000"
    )
    texts = {**grown, "step": 3, "loss": "nan?", "mine/x": "warm"}  # same keys, other types
    assert describe_record(texts, 10) == (
        "step 3/10 | eval/loss 2.2500 | lr 1.00e-03 | mine/x warm"
    )
    assert describe_record({**base, "step": 4}, 10) == "step 4/10 | loss 2.5000 | lr 1.00e-03"
    assert describe_record(grown, 10, ["mine/x"]) == (
        "step 2/10 | loss 2.5000 | eval/loss 2.2500 | lr 1.00e-03 | mine/x 1.5000"
    )
    assert describe_record({**grown, "extra": 7}, 10, ["extra"]).endswith(
        "| extra 7 | mine/x 1.5000"
    )
