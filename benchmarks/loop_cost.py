"""The Trainer's own per-step work, counted instead of timed: Python bytecodes, Python calls
and C calls per step beyond a hand-written loop, on the scalar model of ``overhead.py``.

Counts do not depend on how busy the machine is, so they show a loop change's effect where
the timings of ``overhead.py`` drown in a shared VM's noise. They are per step, from the
difference between a 200- and a 400-step run (setup and teardown cancel out), after a
warm-up run (first-call imports and caches).

    python benchmarks/loop_cost.py            # 0 and 20 no-op callbacks
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch

from speedtronic import Callback, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from overhead import SCALAR_CASE, no_op_callbacks, scalar_batches  # noqa: E402


@dataclass
class Counts:
    bytecodes: int = 0
    python_calls: int = 0
    c_calls: int = 0

    def minus(self, other: Counts, steps: int) -> tuple[float, float, float]:
        return (
            (self.bytecodes - other.bytecodes) / steps,
            (self.python_calls - other.python_calls) / steps,
            (self.c_calls - other.c_calls) / steps,
        )


def counted(run: Callable[[int], None], steps: int) -> Counts:
    counts = Counts()

    def trace(frame: FrameType, event: str, arg: object) -> object:
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts.bytecodes += 1
        elif event == "call":
            counts.python_calls += 1
        return trace

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "c_call":
            counts.c_calls += 1

    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        run(steps)
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return counts


def per_step(run: Callable[[int], None]) -> tuple[float, float, float]:
    counted(run, 50)  # warm-up
    return counted(run, 400).minus(counted(run, 200), 200)


def hand_loop(steps: int) -> None:
    model = SCALAR_CASE.make_model()
    optimizer = SCALAR_CASE.make_optimizer(model)
    batches = scalar_batches()
    for step in range(1, steps + 1):
        x, y = batches[(step - 1) % len(batches)]
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:  # what a logging step costs the hand loop: read and format
            _ = f"{loss.item():.4f}"


def trainer_loop(
    callbacks: int, extra: Callable[[], list[Callback]] = list
) -> Callable[[int], None]:
    """The Trainer over the hand loop's model and batches, with ``callbacks`` no-op
    callbacks and those ``extra()`` makes (fresh ones for every fit)."""

    def run(steps: int) -> None:
        model = SCALAR_CASE.make_model()
        with tempfile.TemporaryDirectory() as out:
            Trainer(
                model,
                SCALAR_CASE.make_optimizer(model),
                scalar_batches(),
                device="cpu",
                callbacks=[*no_op_callbacks(callbacks), *extra()],
                max_steps=steps,
                metrics_every=100,
                output_dir=Path(out),
            ).fit()

    return run


def main() -> None:
    torch.set_num_threads(1)
    hand = per_step(hand_loop)
    print(f"hand-written loop: {hand[0]:.0f} bytecodes, {hand[1]:.1f} Python calls per step")
    print("| callbacks | extra bytecodes/step | extra Python calls/step | extra C calls/step |")
    print("|---:|---:|---:|---:|")
    for callbacks in (0, 20):
        ours = per_step(trainer_loop(callbacks))
        extra = [o - h for o, h in zip(ours, hand, strict=True)]
        print(f"| {callbacks} | {extra[0]:.0f} | {extra[1]:.1f} | {extra[2]:.1f} |")


if __name__ == "__main__":
    main()
