"""The Trainer's own cost per step in machine instructions, counted by Valgrind's callgrind.

``loop_cost.py`` counts Python bytecodes and calls; this counts every instruction the CPU
executes -- the interpreter, torch's dispatcher, allocations, garbage collection -- on the
scalar model of ``overhead.py``. Instruction counts do not depend on how busy the machine
is, so a shared VM gives the same answer as a quiet one.

Each case runs in its own process under ``valgrind --tool=callgrind`` with collection off
except inside two marker calls: ``functools.reduce`` wraps a 100-step run and ``sorted`` a
300-step run (after a 20-step warm-up). The per-step count is the difference of the two
markers' inclusive counts over the 200 extra steps, so setup and teardown cancel out. The
heap left by the imports and the warm-up is frozen (``gc.freeze``) first, so that a full
garbage collection of it cannot land in one marker and not the other.

    python benchmarks/loop_instructions.py          # hand loop, 0 and 20 no-op callbacks
    python benchmarks/loop_instructions.py --baseline ec44da5   # and an earlier Trainer
    python benchmarks/loop_instructions.py --cases hand 0 budget   # with a time budget set

``budget`` is the Trainer with the ``time_budget`` callback (``run.max_time`` set, a budget
that does not run out): what a budget costs per step when there is one. Without one the
callback does not exist, so the ``0`` case is the loop of a run without ``max_time``.
``spike_guard`` is the Trainer with the ``spike_guard`` callback on a loss that never spikes
(past its warm-up in both markers): what the guard costs per step when nothing happens.

``loader`` and ``auto`` run the scalar model's batches through a ``DataLoader`` (what
``micro_batch_size: auto`` needs: a batch size it can change); ``auto`` adds the
out-of-memory recovery, on a model that never runs out: their difference is what the
recovery costs per step when nothing happens.

``transformer`` and ``transformer_spike_guard`` are the same two Trainers (no callback; the
guard) on a realistic small step: the smoke-sized reference transformer of ``overhead.py``
(2 layers, d_model 64, 2 microbatches of 8 x 32 tokens per step, AdamW), 2 and 6 steps in
the markers (its per-step count is large and steady; 4 steps are enough).

``--baseline`` counts the Trainer of an earlier commit too (unpacked with ``git archive``;
the benchmark's own scripts stay today's), so a timing taken on another machine at that
commit converts into µs per instruction there.

Needs ``valgrind`` and a C compiler: the imports run uninstrumented (a tiny helper built
with ``cc`` against ``valgrind/callgrind.h`` turns instrumentation on once they are done),
which takes ``import torch`` from minutes to seconds; the cases run side by side.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("hand", "0", "20")
EXTRA_CASES = ("budget", "spike_guard", "loader", "auto", "transformer", "transformer_spike_guard")
LABELS = {
    "budget": "time budget set",
    "spike_guard": "spike_guard on (nothing spikes)",
    "loader": "0 callbacks, a DataLoader",
    "auto": "0 callbacks, a DataLoader, micro_batch_size auto (no OOM)",
    "transformer": "smoke transformer, no callbacks",
    "transformer_spike_guard": "smoke transformer, spike_guard on (nothing spikes)",
}
# Steps in the two markers: (first, second); the per-step count is their difference over
# ``second - first`` steps.
MARKER_STEPS = {"transformer": (2, 6), "transformer_spike_guard": (2, 6)}
DEFAULT_MARKER_STEPS = (100, 300)
HELPER_C = """#include <valgrind/callgrind.h>
void start_instrumentation(void) { CALLGRIND_START_INSTRUMENTATION; }
"""
MARKERS = ("functools_reduce", "builtin_sorted")


def child(case: str) -> None:
    """Inside valgrind: warm up, then run 100 steps in one marker and 300 in the other."""
    import torch

    sys.path.insert(0, str(HERE))
    from loop_cost import hand_loop, trainer_loop

    torch.set_num_threads(1)
    if case in ("loader", "auto"):
        run = loader_loop(auto=case == "auto")
    elif case.startswith("transformer"):
        run = transformer_loop(case)
    elif case in EXTRA_CASES:
        run = extra_loop(case)
    else:
        run = hand_loop if case == "hand" else trainer_loop(int(case))
    helper = os.environ.get("LOOP_INSTRUCTIONS_HELPER")
    if helper:  # the imports are done: count from here (the markers still select)
        import ctypes

        ctypes.CDLL(helper).start_instrumentation()
    first, second = MARKER_STEPS.get(case, DEFAULT_MARKER_STEPS)
    run(2 if case.startswith("transformer") else 20)
    # Without this, whether a full (generation 2) collection of torch's ~10^5 objects falls
    # into one marker or the other moved the count by up to ±30,000 instructions per step.
    # Frozen objects are never collected again; young ones still are, as in a real run.
    gc.collect()
    gc.freeze()
    functools.reduce(lambda _a, _b: run(first), [0, 0])
    sorted([0, 1], key=lambda a: (run(second) or 0) if a else 0)  # keys must compare


def transformer_loop(case: str) -> Callable[[int], None]:
    """The Trainer on the smoke-sized reference transformer (``overhead.py``'s model,
    batches and AdamW; 2 microbatches a step), with the spike guard or no callback."""
    from overhead import K, make_batches, make_model, optimizer_for

    from speedtronic import Trainer
    from speedtronic.engine.callback import Callback
    from speedtronic_callbacks.spike_guard import SpikeGuard

    batches = make_batches()

    def run(steps: int) -> None:
        model = make_model()
        optimizer, scheduler = optimizer_for(model)
        guard: list[Callback] = [SpikeGuard(warmup_steps=2)] if "spike" in case else []
        with tempfile.TemporaryDirectory() as out:
            Trainer(
                model,
                optimizer,
                batches,
                device="cpu",
                scheduler=scheduler,
                callbacks=guard,
                accumulation_steps=K,
                max_steps=steps,
                metrics_every=100,
                output_dir=Path(out),
            ).fit()

    return run


def extra_loop(case: str) -> Callable[[int], None]:
    """The ``0`` case's Trainer with one built-in callback that has nothing to do: a time
    budget that does not run out, or a spike guard on a loss that never spikes."""
    from loop_cost import trainer_loop

    from speedtronic.engine.callback import Callback
    from speedtronic_callbacks.spike_guard import SpikeGuard
    from speedtronic_callbacks.time_budget import TimeBudget

    def callbacks() -> list[Callback]:
        return [TimeBudget("1d")] if case == "budget" else [SpikeGuard()]

    return trainer_loop(0, callbacks)


def loader_loop(*, auto: bool) -> Callable[[int], None]:
    """The ``0`` case's Trainer over a ``DataLoader`` of the scalar batches, with or
    without ``micro_batch_size: auto``."""
    import dataclasses

    import torch
    from overhead import SCALAR_CASE

    from speedtronic import Trainer

    generator = torch.Generator().manual_seed(2)
    items = [(torch.randn(4, generator=generator), torch.randn((), generator=generator))] * 32

    def run(steps: int) -> None:
        model = SCALAR_CASE.make_model()
        loader = torch.utils.data.DataLoader(items, batch_size=1)
        with tempfile.TemporaryDirectory() as out:
            trainer = Trainer(
                model,
                SCALAR_CASE.make_optimizer(model),
                loader,
                device="cpu",
                max_steps=steps,
                metrics_every=100,
                output_dir=Path(out),
            )
            trainer.settings = dataclasses.replace(trainer.settings, auto_micro_batch=auto)
            trainer.fit()

    return run


def inclusive_counts(out_file: Path, markers: Sequence[str] = MARKERS) -> dict[str, int]:
    """Each marker function's inclusive instruction count in a callgrind output file."""
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out_file)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts: dict[str, int] = {}
    for line in annotated.splitlines():
        for marker in markers:
            if line.rstrip().endswith("]") and f":{marker} " in line:
                counts[marker] = int(re.sub(r"[^0-9]", "", line.split()[0]))
    return counts


def export_revision(revision: str, into: Path) -> Path:
    """The tree of git ``revision`` unpacked under ``into`` (its speedtronic, not this one)."""
    tree = into / "baseline"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", revision], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def build_helper(into: Path) -> Path:
    """The shared library whose one function turns callgrind's instrumentation on."""
    source = into / "start_instrumentation.c"
    source.write_text(HELPER_C, encoding="utf-8")
    library = into / "start_instrumentation.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    return library


def start_callgrind(
    script: str, child_args: Sequence[str], markers: Sequence[str], out: Path, source: Path
) -> subprocess.Popen[bytes]:
    """``script --child *child_args`` under callgrind, collecting only inside ``markers``
    and importing speedtronic from ``source``; uninstrumented until the child calls the
    helper (``build_helper``, next to ``out``)."""
    path = os.pathsep.join([str(source), str(source / "callbacks")])
    helper = out.parent / "start_instrumentation.so"
    if not helper.exists():
        build_helper(out.parent)
    return subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--instr-atstart=no",
            *(f"--toggle-collect={marker}" for marker in markers),
            f"--callgrind-out-file={out}",
            sys.executable,
            script,
            "--child",
            *child_args,
        ],
        env=dict(
            os.environ,
            PYTHONHASHSEED="0",
            PYTHONPATH=path,
            LOOP_INSTRUCTIONS_HELPER=str(helper),
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def callgrind(case: str, out: Path, source: Path) -> subprocess.Popen[bytes]:
    """One case under callgrind, importing speedtronic from ``source``."""
    return start_callgrind(__file__, [case], MARKERS, out, source)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also count the Trainer of git revision REV (no callbacks), e.g. the commit an "
        "earlier timing was taken at",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=CASES + EXTRA_CASES,
        default=list(CASES),
        help="which cases to count (hand is always counted: the reference)",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("needs valgrind (apt install valgrind)")
    cases = ["hand", *(case for case in args.cases if case != "hand")]
    with tempfile.TemporaryDirectory() as tmp:
        outs = {case: Path(tmp) / f"callgrind.{case}" for case in cases}
        running = [callgrind(case, outs[case], HERE.parent) for case in cases]
        if args.baseline:
            outs["baseline"] = Path(tmp) / "callgrind.baseline"
            source = export_revision(args.baseline, Path(tmp))
            running.append(callgrind("0", outs["baseline"], source))
        for process in running:
            if process.wait() != 0:
                sys.exit(f"a valgrind run failed (exit {process.returncode})")
        per_step = {}
        for case, out in outs.items():
            counts = inclusive_counts(out)
            first, second = MARKER_STEPS.get(case, DEFAULT_MARKER_STEPS)
            extra_steps = second - first
            per_step[case] = (counts["builtin_sorted"] - counts["functools_reduce"]) / extra_steps
    hand = per_step["hand"]
    print(f"hand-written loop: {hand:,.0f} instructions per step")
    print("| Trainer | instructions/step | extra over the hand loop | extra |")
    print("|---|---:|---:|---:|")
    rows = [(LABELS.get(case, f"{case} callbacks"), case) for case in cases[1:]]
    if args.baseline:
        rows.append((f"{args.baseline}, no callbacks", "baseline"))
    for label, case in rows:
        if case.startswith("transformer"):
            continue
        extra = per_step[case] - hand
        print(f"| {label} | {per_step[case]:,.0f} | {extra:,.0f} | {extra / hand:.1%} |")
    if "transformer" in per_step:
        step = per_step["transformer"]
        print(f"smoke transformer step, no callbacks: {step:,.0f} instructions per step")
        if "transformer_spike_guard" in per_step:
            extra = per_step["transformer_spike_guard"] - step
            print(f"spike_guard on it: {extra:+,.0f} instructions per step ({extra / step:.2%})")


if __name__ == "__main__":
    main()
