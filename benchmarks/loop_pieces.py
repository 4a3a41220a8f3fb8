"""What the loop's per-step pieces cost in machine instructions, one by one (callgrind).

``loop_instructions.py`` counts a whole step; this counts the pieces a step is made of, each
2,000 times in a row inside its own marker call, so a change to the loop can be weighed
before it is made: building an event context by calling its class versus ``new_context``
(``tuple.__new__``), detaching the loss, calling a no-op hook, collecting the learning rates.
Each row is per call, less a second run with the empty loop in the same marker.

    python benchmarks/loop_pieces.py        # needs valgrind; two runs of ~3 CPU-minutes

Numbers from this machine (Python 3.11, torch 2.13 CPU) are in ``docs/performance.md``.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from loop_instructions import inclusive_counts, start_callgrind  # noqa: E402

N = 2000


def pieces() -> dict[str, Callable[[], None]]:
    """The measured loops, the empty one first (imports inside: the child runs them)."""
    import torch

    from speedtronic.engine.contexts import OptimizerStepContext, StepContext, new_context

    weight = torch.nn.Parameter(torch.ones(4))
    losses = [(weight * float(i)).sum().square() for i in range(8)]
    batch = torch.ones(32, 128)
    groups = [{"lr": 0.1}]

    class NoOp:
        def hook(self, trainer: object, ctx: object) -> None:
            del trainer, ctx

    hook = NoOp().hook

    def empty() -> None:
        for i in range(N):
            losses[i & 7]

    def class_call() -> None:
        for i in range(N):
            StepContext(i, 1)

    def class_call_3() -> None:
        for i in range(N):
            OptimizerStepContext(i, False, None)

    def fast_new() -> None:
        for i in range(N):
            new_context(StepContext, (i, 1))

    def detach() -> None:
        for i in range(N):
            losses[i & 7].detach()

    def hook_call() -> None:
        for i in range(N):
            hook(None, i)

    def lrs_comprehension() -> None:
        for _ in range(N):
            tuple([float(group["lr"]) for group in groups])

    def lrs_one_group() -> None:
        for _ in range(N):
            (float(groups[0]["lr"]),) if len(groups) == 1 else ()

    def shape_and_numel() -> None:
        for _ in range(N):
            shape = batch.shape
            (shape[0], math.prod(shape))

    return {
        "empty loop": empty,
        "StepContext(step, k): the class called": class_call,
        "OptimizerStepContext(step, False, None): the class called": class_call_3,
        "new_context(StepContext, (step, k))": fast_new,
        "loss.detach() (0-d, requires grad)": detach,
        "a no-op hook called (bound method)": hook_call,
        "lrs by a list comprehension (one group)": lrs_comprehension,
        "lrs with the one-group fast path": lrs_one_group,
        "batch.shape and its product (samples, tokens)": shape_and_numel,
    }


# C functions that call back into Python once; each wraps one piece so that callgrind's
# inclusive count of the C function is that piece's cost (Python functions have no name of
# their own in callgrind: they all run inside the interpreter's eval loop).
MARKERS: tuple[tuple[str, Callable[[Callable[[], None]], object]], ...] = (
    ("functools_reduce", lambda run: functools.reduce(lambda _a, _b: run(), [0, 0])),
    ("builtin_sorted", lambda run: sorted([0, 1], key=lambda a: (run() or 0) if a else 0)),
    ("builtin_min", lambda run: min([0, 1], key=lambda a: (run() or 0) if a else 0)),
    ("builtin_max", lambda run: max([0, 1], key=lambda a: (run() or 0) if a else 0)),
    ("filter_next", lambda run: list(filter(lambda _a: run() or True, [0]))),
    ("map_next", lambda run: list(map(lambda _a: run(), [0]))),
    ("starmap_next", lambda run: list(itertools.starmap(run, [()]))),
    ("takewhile_next", lambda run: list(itertools.takewhile(lambda _a: run() or False, [0]))),
    ("dropwhile_next", lambda run: list(itertools.dropwhile(lambda _a: run() or False, [0]))),
)


def child(baseline: bool) -> None:
    """Inside valgrind: warm every piece up, then run each inside its own marker (or, for
    the baseline run, the empty loop inside every marker)."""
    import torch

    torch.set_num_threads(1)
    measured = list(pieces().values())
    for run in measured:
        run()
    gc.collect()
    gc.freeze()
    gc.disable()  # a collection landing in one marker would add to that piece alone
    for (_, wrap), run in zip(MARKERS, measured, strict=True):
        wrap(measured[0] if baseline else run)


def callgrind(out: Path, baseline: bool) -> subprocess.Popen[bytes]:
    markers = [name for name, _ in MARKERS]
    child_args = ["baseline" if baseline else "pieces"]
    return start_callgrind(__file__, child_args, markers, out, ROOT)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(baseline=sys.argv[2] == "baseline")
        return
    names = list(pieces())
    markers = [name for name, _ in MARKERS]
    with tempfile.TemporaryDirectory() as tmp:
        # A marker's inclusive count also holds its C function's calls outside the pieces
        # (``sorted`` and ``min`` run during imports): the baseline run, with the empty loop
        # in every marker, has the same ones, so the difference is the piece alone.
        outs = {baseline: Path(tmp) / f"callgrind.{baseline}" for baseline in (False, True)}
        running = [callgrind(out, baseline) for baseline, out in outs.items()]
        for process in running:
            if process.wait() != 0:
                sys.exit(f"a valgrind run failed (exit {process.returncode})")
        pieces_run = inclusive_counts(outs[False], markers)
        empty_run = inclusive_counts(outs[True], markers)
    print("| piece | instructions per call |")
    print("|---|---:|")
    for name, marker in zip(names[1:], markers[1:], strict=True):
        print(f"| {name} | {(pieces_run[marker] - empty_run[marker]) / N:,.0f} |")


if __name__ == "__main__":
    main()
