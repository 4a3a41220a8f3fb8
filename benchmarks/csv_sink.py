"""The CSV sink's cost over a run whose keys keep appearing, against the JSONL sink.

Baseline: the ``jsonl`` sink fed the same records. An append-only text sink that encodes
each record once is the least any metrics file can cost (the file has to be written), and
it is what a user would otherwise pick; the CSV sink should stay within a constant factor
of it however many keys appear, i.e. linear in the run's length.

Both sinks are driven directly (``on_setup``, ``write_record`` per step, ``on_teardown``),
without a model, so the figures are the sinks' own. Scenarios:

  key every 10   records of 8 usual keys, plus one more key from every 10th step on (a
                 callback that starts logging new series as the run goes)
  key per step   8 usual keys plus one key that appears on one step only (the worst case
                 for a table: one new column per row)

Each round runs every (scenario, steps, sink) case once, in an order rotated from round to
round; the table gives the best-of-N and median seconds, the CSV file's size over the JSONL
file's (a table pays a cell, even an empty one, for every column on every row: with a new
column per step the CSV itself grows quadratically, whatever the sink does), and the bytes
the process wrote (``/proc/self/io`` ``wchar``: appends, rewrites and temporary files
alike) per byte of the final CSV -- the write amplification, which a linear sink keeps
bounded.

    python benchmarks/csv_sink.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "callbacks"))

from speedtronic.engine.contexts import FitContext, TeardownContext  # noqa: E402
from speedtronic.engine.view import TrainerView  # noqa: E402
from speedtronic_callbacks.csv_sink import CsvCallback  # noqa: E402
from speedtronic_callbacks.jsonl import JsonlCallback  # noqa: E402
from speedtronic_callbacks.sink import MetricSink, Record  # noqa: E402

USUAL = ("loss", "lr", "grad_norm", "tokens/s", "samples/s", "steps/s", "elapsed_s")


def key_every_10(step: int) -> Record:
    record: dict[str, float | int] = {"step": step}
    record.update({key: step * 0.001 + i for i, key in enumerate(USUAL)})
    record.update({f"series{j}": float(j) for j in range(0, step + 1, 10)})
    return record


def key_per_step(step: int) -> Record:
    record: dict[str, float | int] = {"step": step}
    record.update({key: step * 0.001 + i for i, key in enumerate(USUAL)})
    record[f"once{step}"] = float(step)
    return record


SCENARIOS: dict[str, tuple[Callable[[int], Record], tuple[int, ...]]] = {
    "key every 10": (key_every_10, (500, 1000, 2000, 4000)),
    "key per step": (key_per_step, (500, 1000, 2000)),
}
SINKS: dict[str, Callable[[Path], MetricSink]] = {
    "jsonl": lambda folder: JsonlCallback(folder / "m.jsonl"),
    "csv": lambda folder: CsvCallback(folder / "m.csv"),
}


def written_bytes() -> int:
    with open("/proc/self/io", encoding="ascii") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("wchar:"))


def run_case(sink_name: str, make: Callable[[int], Record], steps: int) -> tuple[float, float, int]:
    """Seconds for one fit's worth of records, bytes written per byte of the file, and the
    file's size."""
    records = [make(step) for step in range(1, steps + 1)]
    with tempfile.TemporaryDirectory(prefix="speedtronic-csv-bench-") as folder:
        sink = SINKS[sink_name](Path(folder))
        view = cast(TrainerView, SimpleNamespace(output_dir=Path(folder)))
        before_bytes, started = written_bytes(), time.perf_counter()
        sink.on_setup(view, FitContext(start_step=0, target_step=steps))
        for record in records:
            sink.write_record(view, record)
        sink.on_teardown(view, TeardownContext(step=steps, error=None))
        seconds = time.perf_counter() - started
        size = sum(path.stat().st_size for path in Path(folder).iterdir())
        return seconds, (written_bytes() - before_bytes) / size, size


def cases() -> Iterator[tuple[str, int, str]]:
    for scenario, (_, sizes) in SCENARIOS.items():
        for steps in sizes:
            for sink in SINKS:
                yield scenario, steps, sink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=4000, help="skip longer runs")
    args = parser.parse_args()
    all_cases = [case for case in cases() if case[1] <= args.max_steps]
    times: dict[tuple[str, int, str], list[float]] = {case: [] for case in all_cases}
    amplification: dict[tuple[str, int, str], float] = {}
    file_sizes: dict[tuple[str, int, str], int] = {}
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        shift = round_index * len(all_cases) // max(args.rounds, 1)
        for case in all_cases[shift:] + all_cases[:shift]:
            scenario, steps, sink = case
            seconds, amplification[case], file_sizes[case] = run_case(
                sink, SCENARIOS[scenario][0], steps
            )
            times[case].append(seconds)
        loads.append(os.getloadavg()[0])
    print(f"{args.rounds} rounds, load average {min(loads):.1f}-{max(loads):.1f}")
    print(
        "| scenario | steps | jsonl best (median) s | csv best (median) s | csv/jsonl (best) "
        "| csv file / jsonl file | csv bytes written / file |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for scenario, (_, sizes) in SCENARIOS.items():
        for steps in (size for size in sizes if size <= args.max_steps):
            j, c = times[scenario, steps, "jsonl"], times[scenario, steps, "csv"]
            wider = file_sizes[scenario, steps, "csv"] / file_sizes[scenario, steps, "jsonl"]
            print(
                f"| {scenario} | {steps} | {min(j):.3f} ({statistics.median(j):.3f}) | "
                f"{min(c):.3f} ({statistics.median(c):.3f}) | {min(c) / min(j):.1f}x | "
                f"{wider:.1f}x | "
                f"{amplification[scenario, steps, 'csv']:.2f} |"
            )


if __name__ == "__main__":
    main()
