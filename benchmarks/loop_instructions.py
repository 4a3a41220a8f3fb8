"""The Trainer's own cost per step in machine instructions, counted by Valgrind's callgrind.

``loop_cost.py`` counts Python bytecodes and calls; this counts every instruction the CPU
executes -- the interpreter, torch's dispatcher, allocations, garbage collection -- on the
scalar model of ``overhead.py``. Instruction counts do not depend on how busy the machine
is, so a shared VM gives the same answer as a quiet one.

Each case runs in its own process under ``valgrind --tool=callgrind`` with collection off
except inside two marker calls: ``functools.reduce`` wraps a 100-step run and ``sorted`` a
300-step run (after a 20-step warm-up). The per-step count is the difference of the two
markers' inclusive counts over the 200 extra steps, so setup and teardown cancel out.

    python benchmarks/loop_instructions.py          # hand loop, 0 and 20 no-op callbacks

Needs ``valgrind``; each case takes about six CPU-minutes (mostly ``import torch`` under
valgrind), the three cases run side by side.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("hand", "0", "20")
MARKERS = ("functools_reduce", "builtin_sorted")


def child(case: str) -> None:
    """Inside valgrind: warm up, then run 100 steps in one marker and 300 in the other."""
    import torch

    sys.path.insert(0, str(HERE))
    from loop_cost import hand_loop, trainer_loop

    torch.set_num_threads(1)
    run = hand_loop if case == "hand" else trainer_loop(int(case))
    run(20)
    functools.reduce(lambda _a, _b: run(100), [0, 0])
    sorted([0, 1], key=lambda a: (run(300) or 0) if a else 0)  # keys must compare


def inclusive_counts(out_file: Path) -> dict[str, int]:
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", str(out_file)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts: dict[str, int] = {}
    for line in annotated.splitlines():
        for marker in MARKERS:
            if line.rstrip().endswith("]") and f":{marker} " in line:
                counts[marker] = int(re.sub(r"[^0-9]", "", line.split()[0]))
    return counts


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    if shutil.which("valgrind") is None:
        sys.exit("needs valgrind (apt install valgrind)")
    env = dict(os.environ, PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory() as tmp:
        outs = {case: Path(tmp) / f"callgrind.{case}" for case in CASES}
        running = [
            subprocess.Popen(
                [
                    "valgrind",
                    "--tool=callgrind",
                    "--collect-atstart=no",
                    *(f"--toggle-collect={marker}" for marker in MARKERS),
                    f"--callgrind-out-file={outs[case]}",
                    sys.executable,
                    __file__,
                    "--child",
                    case,
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for case in CASES
        ]
        for process in running:
            if process.wait() != 0:
                sys.exit(f"a valgrind run failed (exit {process.returncode})")
        per_step = {}
        for case, out in outs.items():
            counts = inclusive_counts(out)
            per_step[case] = (counts["builtin_sorted"] - counts["functools_reduce"]) / 200
    hand = per_step["hand"]
    print(f"hand-written loop: {hand:,.0f} instructions per step")
    print("| callbacks | instructions/step | extra over the hand loop | extra |")
    print("|---:|---:|---:|---:|")
    for case in CASES[1:]:
        extra = per_step[case] - hand
        print(f"| {case} | {per_step[case]:,.0f} | {extra:,.0f} | {extra / hand:.1%} |")


if __name__ == "__main__":
    main()
