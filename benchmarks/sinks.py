"""Metric sink cost: the Trainer with no callbacks versus the Trainer with every file and
service sink logging every step.

Same model, batches and work per step as ``benchmarks/overhead.py`` (the smoke-sized
reference transformer, K=2, AdamW, warmup+cosine LR). Cases, all at ``metrics_every=1``:

  no callbacks   the bare Trainer
  file sinks     console (to a file), jsonl, csv, tensorboard, progress (lines, to a file)
  all sinks      file sinks + wandb (offline, in a temporary directory)

Runs are interleaved (bare, file, all, bare, file, all, ...); the table shows each case's
median steps/s, the median of its per-round ratio to the bare run, and the process CPU time
per step (all threads of this process; W&B's separate ``wandb-core`` service is not
included). The CPU column is the stable one on a busy machine: wall-clock ratios there move
by +-10% from round to round.

W&B spends ~0.25 ms of Python CPU per logged step (on the sink's background thread) plus
about as much in ``wandb-core``. With idle cores that runs in parallel with training; on a
machine whose cores are all busy it shows up in the ratio.

The clock runs from ``fit_start`` to the end of ``fit_end`` (a timer callback listed last,
so it includes the sinks' own ``fit_end`` work such as draining the W&B queue): it measures
the per-step cost. One-time setup -- ``wandb.init`` alone takes seconds -- is reported in a
separate column.

    python benchmarks/sinks.py               # prints a table; --markdown for docs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overhead import STEPS, K, make_batches, make_model, optimizer_for  # noqa: E402

from speedtronic import Callback, Trainer  # noqa: E402
from speedtronic.engine.contexts import FitContext, FitEndContext  # noqa: E402


class FitTimer(Callback):
    """Wall and process CPU time from ``fit_start`` to ``fit_end``, and the setup time."""

    def __init__(self) -> None:
        self.created = time.perf_counter()
        self.started = self.ended = 0.0
        self.cpu_started = self.cpu_ended = 0.0

    def on_fit_start(self, trainer: Trainer, ctx: FitContext) -> None:
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def on_fit_end(self, trainer: Trainer, ctx: FitEndContext) -> None:
        self.ended, self.cpu_ended = time.perf_counter(), time.process_time()


@dataclass
class Measurement:
    steps_per_sec: float
    cpu_ms_per_step: float
    setup_s: float


def file_sinks(out: Path) -> list[Callback]:
    from speedtronic_callbacks.console import ConsoleCallback
    from speedtronic_callbacks.csv_sink import CsvCallback
    from speedtronic_callbacks.jsonl import JsonlCallback
    from speedtronic_callbacks.progress import ProgressBarCallback
    from speedtronic_callbacks.tensorboard import TensorBoardCallback

    return [
        ConsoleCallback(file=out / "console.log"),
        JsonlCallback(out / "metrics.jsonl"),
        CsvCallback(out / "metrics.csv"),
        TensorBoardCallback(out / "tensorboard"),
        ProgressBarCallback(stream=(out / "progress.log").open("w"), mode="lines"),
    ]


def all_sinks(out: Path) -> list[Callback]:
    from speedtronic_callbacks.wandb import WandbCallback

    wandb = WandbCallback(project="speedtronic-bench", mode="offline", directory=out)
    return [*file_sinks(out), wandb]


def run(batches: list[object], callbacks: Callable[[Path], list[Callback]]) -> Measurement:
    out = Path(tempfile.mkdtemp(prefix="speedtronic-sinks-"))
    model = make_model()
    opt, sched = optimizer_for(model)
    timer = FitTimer()
    trainer = Trainer(
        model,
        opt,
        batches,
        device="cpu",
        scheduler=sched,
        callbacks=[*callbacks(out), timer],
        accumulation_steps=K,
        max_steps=STEPS,
        metrics_every=1,
        output_dir=out,
    )
    timer.created = time.perf_counter()
    trainer.fit()
    return Measurement(
        STEPS / (timer.ended - timer.started),
        1000 * (timer.cpu_ended - timer.cpu_started) / STEPS,
        timer.started - timer.created,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_SILENT", "true")
    batches = make_batches()
    cases: dict[str, Callable[[Path], list[Callback]]] = {
        "no callbacks": lambda _: [],
        "file sinks": file_sinks,
        "all sinks": all_sinks,
    }
    for factory in cases.values():  # warm-up: imports, allocator, W&B service start
        run(batches, factory)
    results: dict[str, list[Measurement]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, factory in cases.items():
            results[name].append(run(batches, factory))
    bare = results["no callbacks"]
    rows = []
    for name, measurements in results.items():
        rate = statistics.median(m.steps_per_sec for m in measurements)
        # Ratio of each round's pair (run back to back), then the median: robust to drift.
        paired = statistics.median(
            m.steps_per_sec / b.steps_per_sec for m, b in zip(measurements, bare, strict=True)
        )
        cpu = statistics.median(m.cpu_ms_per_step for m in measurements)
        setup = statistics.median(m.setup_s for m in measurements)
        rows.append((name, rate, paired, cpu, setup))
    if args.markdown:
        print("| case | steps/s | ratio to no callbacks | CPU ms/step | setup s |")
        print("|---|---:|---:|---:|---:|")
        for name, rate, ratio, cpu, setup in rows:
            print(f"| {name} | {rate:.1f} | {ratio:.3f} | {cpu:.2f} | {setup:.2f} |")
    else:
        for name, rate, ratio, cpu, setup in rows:
            print(
                f"{name:<14} {rate:8.1f} steps/s   ratio {ratio:.3f}   "
                f"cpu {cpu:6.2f} ms/step   setup {setup:5.2f} s"
            )


if __name__ == "__main__":
    main()
