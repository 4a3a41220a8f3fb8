"""The cost of a logged step (issue 35): the default sinks against a hand-written log line.

Model: ``overhead.py``'s scalar model (four weights, SGD), so a step is almost only loop
overhead and the logging cost stands out. Four cases, each STEPS steps, in rotated rounds
in one process, timed in CPU seconds of this process (``time.process_time``: what the
logging costs, whatever else the shared machine runs):

  hand, silent     a hand loop (forward, backward, step, zero_grad) that writes nothing
  hand, logged     the same loop writing, every step, the same JSON line the ``jsonl`` sink
                   writes (the same keys: ``json.dumps`` of a dict built per step, written
                   and flushed) and the same console line (one f-string ``write`` to a
                   line-buffered file, cheaper than ``print``): the strongest baseline --
                   what a user writes to log the same things with the same bytes
  trainer, silent  ``Trainer`` with no callbacks and no due metrics (``metrics_every`` past
                   the run)
  trainer, logged  ``Trainer`` with the default sinks (``console`` to a file, ``jsonl``),
                   a record every step

The figure is the logging cost per step: ``trainer, logged - trainer, silent`` against
``hand, logged - hand, silent``, round by round (paired medians) and best-of-N (the
difference of the best rounds), with the load average before and after. Target: the
trainer's logging cost at most 1.5x the hand-written line's.

On a loaded machine a step's CPU time moves more between rounds than the logging costs, so
``--record-path`` times the record path alone (``record_path``: the record the loop builds,
its ``values()`` and the two sinks' ``write_record``) against the hand loop's logging alone
(``hand_line``), alternating rounds, thread CPU time per record.

``--instructions`` counts the four cases in machine instructions per step instead
(callgrind, ``loop_instructions.py``'s markers: a 100-step and a 300-step run in one process
after a 20-step warm-up, the difference over 200 steps), which the machine's load does not
move: the same two differences and their ratio. The write and flush system calls are the
same on both sides (one ``write`` per line: the JSON line flushed, the console file
line-buffered); callgrind counts the instructions around them, not the kernel's.

    python benchmarks/logged_step.py [--rounds 9] [--steps 2000] [--record-path]
    python benchmarks/logged_step.py --instructions
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overhead import ScalarModel, scalar_batches  # noqa: E402

from speedtronic import Trainer  # noqa: E402

STEPS = 2000
LR = 1e-3


def write_hand_line(
    jsonl: TextIO, console: TextIO, step: int, steps: int, elapsed: float, value: float, rate: float
) -> None:
    """What a hand loop logs per step: the trainer's record keys in its order as one JSON line
    (flushed) and a console line of the same fields."""
    record = {
        "step": step,
        "lr": LR,
        "steps_per_sec": rate,
        "samples_per_sec": rate,
        "tokens_per_sec": rate,
        "samples": step,
        "tokens": step,
        "micro_batches": 1,
        "elapsed_s": elapsed,
        "loss": value,
    }
    jsonl.write(json.dumps(record, separators=(",", ":")) + "\n")
    jsonl.flush()
    console.write(
        f"step {step}/{steps} | loss {value:.4f} | lr {LR:.2e} | "
        f"{step / elapsed:.1f} steps/s | {step / elapsed / 1e3:.1f}k tok/s\n"
    )


def hand_loop(steps: int, out: Path | None) -> float:
    """CPU seconds of ``steps`` hand-written steps; with ``out``, each step writes the JSON
    line and the console line the default sinks write (module docstring)."""
    torch.manual_seed(0)
    model = ScalarModel()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = scalar_batches()
    jsonl = None if out is None else (out / "hand.jsonl").open("a", encoding="utf-8")
    console = None if out is None else (out / "hand.log").open("a", buffering=1)
    start_wall = time.perf_counter()
    start = time.process_time()
    for step in range(1, steps + 1):
        x, y = batches[(step - 1) % len(batches)]
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if jsonl is not None and console is not None:
            elapsed = time.perf_counter() - start_wall
            write_hand_line(jsonl, console, step, steps, elapsed, loss.item(), step / elapsed)
    used = time.process_time() - start
    for handle in (jsonl, console):
        if handle is not None:
            handle.close()
    return used


def trainer_run(steps: int, out: Path, logged: bool) -> float:
    """CPU seconds of ``Trainer.fit`` over ``steps`` steps of the scalar model, with the
    default sinks and a record every step (``logged``) or no callbacks and no record."""
    from speedtronic_callbacks.console import ConsoleCallback
    from speedtronic_callbacks.jsonl import JsonlCallback

    torch.manual_seed(0)
    model = ScalarModel()
    run_dir = Path(tempfile.mkdtemp(dir=out))
    callbacks = (
        [ConsoleCallback(file=run_dir / "console.log"), JsonlCallback(run_dir / "metrics.jsonl")]
        if logged
        else []
    )
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        scalar_batches(),
        device="cpu",
        callbacks=callbacks,
        max_steps=steps,
        metrics_every=1 if logged else steps + 1,
        output_dir=run_dir,
    )
    start = time.process_time()
    trainer.fit()
    return time.process_time() - start


RECORDS = 5000


class _View:
    """What the two sinks read of the trainer: the target step and the output directory."""

    target_step = 100_000

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir


class _Start:
    start_step = 0


def record_path(out: Path) -> Callable[[], float]:
    """The record path alone, as the loop runs it on a logged step: the ``MetricRecord``
    the loop builds (``MetricRecord.of``: a tensor loss and eight numbers), the
    ``finished()`` mapping the sinks share, the ``jsonl`` and ``console`` sinks'
    ``write_record`` and the loop's own ``values()`` copy. Returns
    a function giving thread CPU us per record over RECORDS records."""
    from speedtronic.engine.metrics import MetricRecord, MetricValue
    from speedtronic_callbacks.console import ConsoleCallback
    from speedtronic_callbacks.jsonl import JsonlCallback

    view = _View(out)
    console = ConsoleCallback(file=out / "record-path.log")
    jsonl = JsonlCallback(out / "record-path.jsonl")
    console.on_setup(view, _Start())  # type: ignore[arg-type]  # the two fields they read
    jsonl.on_setup(view, _Start())  # type: ignore[arg-type]
    loss = torch.tensor(1.2345)

    def run() -> float:
        start = time.thread_time()
        for step in range(1, RECORDS + 1):
            values: dict[str, MetricValue] = {  # the loop's record, built as it builds it
                "step": step,
                "lr": LR,
                "steps_per_sec": 1234.5,
                "samples_per_sec": 1234.5,
                "tokens_per_sec": 1234.5,
                "samples": step,
                "tokens": step,
                "micro_batches": 1,
                "elapsed_s": 0.5,
            }
            record = MetricRecord.of(step, values, {"loss": loss})
            jsonl.write_record(view, record.finished())  # type: ignore[arg-type]
            console.write_record(view, record.finished())  # type: ignore[arg-type]
            record.values()  # the loop keeps the due record too
        return (time.thread_time() - start) / RECORDS * 1e6

    return run


def hand_line(out: Path) -> Callable[[], float]:
    """The hand loop's logging alone: the same JSON line (dict, ``json.dumps``, write,
    flush) and console line per record; thread CPU us per record over RECORDS records."""
    jsonl = (out / "hand-line.jsonl").open("a", encoding="utf-8")
    console = (out / "hand-line.log").open("a", buffering=1)
    loss = torch.tensor(1.2345)

    def run() -> float:
        start = time.thread_time()
        for step in range(1, RECORDS + 1):
            write_hand_line(jsonl, console, step, 100000, 0.5, loss.item(), 1234.5)
        return (time.thread_time() - start) / RECORDS * 1e6

    return run


def record_path_lines(out: Path, rounds: int) -> list[str]:
    """The record path against the hand line, alternating, ``rounds`` rounds."""
    ours, hand = record_path(out), hand_line(out)
    times: dict[str, list[float]] = {"record path": [], "hand line": []}
    for round_ in range(rounds):
        order = (("record path", ours), ("hand line", hand))
        for name, run in order if round_ % 2 == 0 else order[::-1]:
            times[name].append(run())
    ratios = [a / b for a, b in zip(times["record path"], times["hand line"], strict=True)]
    best = min(times["record path"]) / min(times["hand line"])
    lines = [f"record path alone: {RECORDS} records a round, {rounds} rounds, thread CPU us"]
    for name, values in times.items():
        lines.append(
            f"  {name:<12} best {min(values):6.1f}  median {statistics.median(values):6.1f}"
        )
    lines.append(
        f"  record path / hand line: paired median {statistics.median(ratios):.2f}x, best "
        f"{best:.2f}x (target <= 1.5x)"
    )
    return lines


CASES: dict[str, Callable[[int, Path], float]] = {
    "hand, silent": lambda steps, out: hand_loop(steps, None),
    "hand, logged": lambda steps, out: hand_loop(steps, Path(tempfile.mkdtemp(dir=out))),
    "trainer, silent": lambda steps, out: trainer_run(steps, out, logged=False),
    "trainer, logged": lambda steps, out: trainer_run(steps, out, logged=True),
}


INSTRUCTION_CASES = {  # --instructions: the child's case name for each case
    "hand, silent": "hand_silent",
    "hand, logged": "hand_logged",
    "trainer, silent": "trainer_silent",
    "trainer, logged": "trainer_logged",
}


def instructions_child(case: str) -> None:
    """Inside valgrind: one case, warmed up, then 100 steps in one marker and 300 in the
    other (``loop_instructions.child``'s scheme)."""
    import ctypes
    import functools
    import gc

    torch.set_num_threads(1)
    name = {child: name for name, child in INSTRUCTION_CASES.items()}[case]
    out = Path(tempfile.mkdtemp(prefix="speedtronic-logged-step-"))

    def run(steps: int) -> int:  # an int: the markers' callbacks must return one
        CASES[name](steps, out)
        return 0

    helper = os.environ.get("LOOP_INSTRUCTIONS_HELPER")
    if helper:  # the imports are done: count from here (the markers still select)
        ctypes.CDLL(helper).start_instrumentation()
    run(20)
    gc.collect()
    gc.freeze()  # an old-heap collection must not land in one marker only
    functools.reduce(lambda _a, _b: run(100), [0, 0])
    sorted([0, 1], key=lambda a: run(300) if a else 0)


def instruction_lines() -> list[str]:
    """The four cases in instructions per step, each under callgrind, side by side."""
    import shutil

    from loop_instructions import MARKERS, inclusive_counts, start_callgrind

    if shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind (apt install valgrind)")
    here = Path(__file__).resolve()
    per_step: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        outs = {name: Path(tmp) / f"callgrind.{child}" for name, child in INSTRUCTION_CASES.items()}
        running = [
            start_callgrind(
                str(here), [INSTRUCTION_CASES[name]], MARKERS, outs[name], here.parents[1]
            )
            for name in INSTRUCTION_CASES
        ]
        for process in running:
            if process.wait() != 0:
                sys.exit(f"a valgrind run failed (exit {process.returncode})")
        for name, out in outs.items():
            counts = inclusive_counts(out)
            per_step[name] = (counts["builtin_sorted"] - counts["functools_reduce"]) / 200
    ours = per_step["trainer, logged"] - per_step["trainer, silent"]
    hand = per_step["hand, logged"] - per_step["hand, silent"]
    lines = ["instructions per step (callgrind, 200 steps)"]
    lines += [f"  {name:<16} {count:12,.0f}" for name, count in per_step.items()]
    lines.append(
        f"  logging cost per step: trainer {ours:,.0f}, hand {hand:,.0f}: "
        f"{ours / hand:.2f}x (target <= 1.5x)"
    )
    return lines


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        instructions_child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--record-path", action="store_true", help="only the record path against the hand line"
    )
    parser.add_argument(
        "--instructions", action="store_true", help="count the cases in instructions (valgrind)"
    )
    args = parser.parse_args()
    if args.instructions:
        print("\n".join(instruction_lines()))
        return
    if args.record_path:
        torch.set_num_threads(1)
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory(prefix="speedtronic-logged-step-") as folder:
            lines = record_path_lines(Path(folder), args.rounds)
        print(f"machine: {os.cpu_count()} CPUs; load before {load_before}, after {os.getloadavg()}")
        print("\n".join(lines))
        return
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    per_step: dict[str, list[float]] = {name: [] for name in CASES}
    names = list(CASES)
    with tempfile.TemporaryDirectory(prefix="speedtronic-logged-step-") as folder:
        out = Path(folder)
        CASES["trainer, logged"](50, out)  # imports and first-use costs out of the rounds
        CASES["hand, logged"](50, out)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                per_step[name].append(CASES[name](args.steps, out) / args.steps * 1e6)
    print(f"machine: {os.cpu_count()} CPUs; load before {load_before}, after {os.getloadavg()}")
    print(f"{args.steps} steps per run, {args.rounds} rotated rounds, CPU us per step")
    for name, values in per_step.items():
        print(f"  {name:<16} best {min(values):7.1f}  median {statistics.median(values):7.1f}")
    ours = [
        a - b for a, b in zip(per_step["trainer, logged"], per_step["trainer, silent"], strict=True)
    ]
    hand = [a - b for a, b in zip(per_step["hand, logged"], per_step["hand, silent"], strict=True)]
    ratios = [a / b for a, b in zip(ours, hand, strict=True) if b > 0]
    best_ours = min(per_step["trainer, logged"]) - min(per_step["trainer, silent"])
    best_hand = min(per_step["hand, logged"]) - min(per_step["hand, silent"])
    print(
        f"  logging cost per step: trainer {statistics.median(ours):.1f} us (paired median), "
        f"{best_ours:.1f} us (best rounds); hand {statistics.median(hand):.1f} / "
        f"{best_hand:.1f} us"
    )
    print(
        f"  trainer / hand: paired median {statistics.median(ratios):.2f}x, best rounds "
        f"{best_ours / best_hand:.2f}x (target <= 1.5x)"
    )


if __name__ == "__main__":
    main()
