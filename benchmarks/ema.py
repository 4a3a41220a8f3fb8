"""EMA and profiler cost: a fit with the ``ema`` callback, and one with a ``profiler`` whose
window lies past the fit, against the same fit without either.

The smoke model (configs/smoke.yaml: the reference transformer, 66,880 parameters, micro-batch
8, K=2, AdamW) on the same pre-collated batches as ``benchmarks/overhead.py``. Cases, run in
interleaved rounds (each round runs every case once, in a rotating order):

  plain          ``Trainer.fit`` of STEPS steps, no callbacks
  plain again    the same fit once more: the spread between two identical cases is the
                 machine's noise, the band the other ratios must be read in
  ema            the same with ``EMA(0.999)``: one fused ``_foreach_lerp_`` per step
  profiler idle  the same with ``Profiler(start_step=STEPS + 1)``: due on no step of the fit,
                 so the loop never calls it (the target: nothing measurable)

Counted, not timed: the Python and C function calls per step of each case (``sys.setprofile``
over a fit of 40 steps minus one of 20, so setup cancels out), which the machine's load does
not change -- the idle profiler adds none, the EMA its hook and its foreach call.

Also timed apart: the EMA update alone (its ``after_optimizer_step`` hook, 2,000 calls on the
trained model), in µs per call, next to the step time -- the hook's own share of a step,
without the fit-to-fit noise of a shared machine.

Times are process CPU time (one thread): on a busy machine wall-clock ratios move by several
percent between rounds, CPU time far less. The table gives the best and the median round.

Target (issue 26): the EMA costs <= 2% of the step time; the idle profiler nothing measurable.

    python benchmarks/ema.py              # prints a table; --markdown for docs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overhead import K, make_batches, make_model  # noqa: E402

from speedtronic import Callback, Trainer  # noqa: E402
from speedtronic.engine.contexts import OptimizerStepContext  # noqa: E402
from speedtronic_callbacks.ema import EMA  # noqa: E402
from speedtronic_callbacks.profiler import Profiler  # noqa: E402

STEPS = 100
HOOK_CALLS = 2000


def smoke_trainer(batches: list[object], callbacks: list[Callback], steps: int) -> Trainer:
    """The smoke model's Trainer (metrics due at the end only: no sink, no logging cost)."""
    model = make_model()
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        batches,
        device="cpu",
        callbacks=callbacks,
        max_steps=steps,
        accumulation_steps=K,
        metrics_every=steps,
    )


def fit(batches: list[object], callbacks: list[Callback]) -> float:
    """CPU seconds per step of a fit of STEPS steps."""
    trainer = smoke_trainer(batches, callbacks, STEPS)
    start = time.process_time()
    trainer.fit()
    return (time.process_time() - start) / STEPS


CASES: dict[str, Callable[[], list[Callback]]] = {
    "plain": lambda: [],
    "plain again": lambda: [],  # the same fit: how far two identical cases drift apart here
    "ema": lambda: [EMA(0.999)],
    "profiler idle": lambda: [Profiler(start_step=STEPS + 1)],
}


def calls_per_step(batches: list[object], callbacks: Callable[[], list[Callback]]) -> float:
    """Function calls (Python and C) per step of a fit, setup and teardown cancelled out."""

    def counted(steps: int) -> int:
        trainer = smoke_trainer(batches, callbacks(), steps)
        calls = [0]

        def profile(frame: object, event: str, arg: object) -> None:
            if event in ("call", "c_call"):
                calls[0] += 1

        sys.setprofile(profile)
        try:
            trainer.fit()
        finally:
            sys.setprofile(None)
        return calls[0]

    counted(5)  # first-use imports happen here, not in the counts
    return (counted(40) - counted(20)) / 20


def hook_cost(batches: list[object]) -> float:
    """CPU seconds of one EMA update on the smoke model, after a short fit binds it."""
    ema = EMA(0.999)
    trainer = smoke_trainer(batches, [ema], 2)
    trainer.fit()
    ctx = OptimizerStepContext(3)
    start = time.process_time()
    for _ in range(HOOK_CALLS):
        ema.on_after_optimizer_step(trainer, ctx)
    return (time.process_time() - start) / HOOK_CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = make_batches()
    names = list(CASES)
    fit(batches, [])  # warm up (allocator, first-step imports)
    times: dict[str, list[float]] = {name: [] for name in names}
    hooks: list[float] = []
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            times[name].append(fit(batches, CASES[name]()))
        hooks.append(hook_cost(batches))
    best = {name: min(values) for name, values in times.items()}
    median = {name: statistics.median(values) for name, values in times.items()}
    calls = {name: calls_per_step(batches, CASES[name]) for name in names}
    rows = [
        (
            name,
            f"{1e3 * best[name]:.2f}",
            f"{1e3 * median[name]:.2f}",
            f"{best[name] / best['plain']:.3f}x",
            f"{median[name] / median['plain']:.3f}x",
            f"{calls[name]:.0f}",
        )
        for name in names
    ]
    hook_best, hook_median = min(hooks), statistics.median(hooks)
    rows.append(
        (
            "ema update alone (per step)",
            f"{1e3 * hook_best:.3f}",
            f"{1e3 * hook_median:.3f}",
            f"{100 * hook_best / best['plain']:.2f}% of a step",
            f"{100 * hook_median / median['plain']:.2f}% of a step",
            "",
        )
    )
    header = (
        "case",
        "best ms/step",
        "median ms/step",
        "best vs plain",
        "median vs plain",
        "calls/step",
    )
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|---|---|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        print("  ".join(f"{h:>18}" for h in header))
        for row in rows:
            print("  ".join(f"{cell:>18}" for cell in row))
    print(f"\n{args.rounds} interleaved rounds of {STEPS} steps, process CPU time, 1 thread")


if __name__ == "__main__":
    main()
