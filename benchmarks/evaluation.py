"""Evaluation cost: an evaluation of B batches versus a hand-written ``inference_mode`` loop
over the same model and batches, and a fit whose evaluation is configured but never due
versus the same fit without evaluation.

Same model and batches as ``benchmarks/overhead.py`` (the smoke-sized reference transformer,
micro-batch 8). Cases, interleaved round by round:

  hand loop        ``model.eval()``; ``inference_mode``; ``model(**batch)["loss"]`` summed
                   per batch; one ``.item()`` at the end -- what a user would write
  evaluate_model   ``speedtronic.engine.evaluation.evaluate_model`` on the same B batches
                   (token-weighted sums on the device, one read back, RNG restored)
  fit, no eval     ``Trainer.fit`` of STEPS steps without evaluation
  fit, eval idle   the same fit with ``eval_every`` larger than the fit: no step evaluates
                   but the final one, which evaluates a single batch (about a third of a
                   training step, ~0.3% of the fit) -- the cost of evaluation being *on*

Times are process CPU time (one thread): on a busy machine wall-clock ratios move by
+-20% from round to round, CPU time far less.

Target (issue 11): evaluate_model <= 1.1x the hand loop; "eval idle" ~1.0x "no eval".

    python benchmarks/evaluation.py              # prints a table; --markdown for docs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overhead import make_batches, make_model  # noqa: E402

from speedtronic import Trainer  # noqa: E402
from speedtronic.engine.evaluation import evaluate_model  # noqa: E402

EVAL_BATCHES = 32
FIT_STEPS = 100


def hand_eval(model: torch.nn.Module, batches: list[object]) -> float:
    model.eval()
    start = time.process_time()
    total = torch.zeros(())
    with torch.inference_mode():
        for batch in batches:
            assert isinstance(batch, dict)
            total += model(**batch)["loss"]
    total.item()
    elapsed = time.process_time() - start
    model.train()
    return elapsed


def framework_eval(model: torch.nn.Module, batches: list[object]) -> float:
    start = time.process_time()
    evaluate_model(model, batches, device=torch.device("cpu"))
    return time.process_time() - start


def fit(batches: list[object], eval_every: int | None) -> float:
    model = make_model()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        batches,
        device="cpu",
        max_steps=FIT_STEPS,
        metrics_every=FIT_STEPS,
        eval_data=batches[:1] if eval_every else None,
        eval_every=eval_every,
    )
    start = time.process_time()
    trainer.fit()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = make_batches()[:EVAL_BATCHES]
    model = make_model()
    hand_eval(model, batches)  # warm up
    framework_eval(model, batches)
    times: dict[str, list[float]] = {"hand": [], "eval": [], "fit": [], "fit_idle": []}
    for _ in range(args.rounds):
        times["hand"].append(hand_eval(model, batches))
        times["eval"].append(framework_eval(model, batches))
        times["fit"].append(fit(batches, None))
        times["fit_idle"].append(fit(batches, 10 * FIT_STEPS))
    hand = statistics.median(times["hand"])
    ours = statistics.median(times["eval"])
    plain = statistics.median(times["fit"])
    idle = statistics.median(times["fit_idle"])
    rows = [
        ("hand inference_mode loop", f"{1e3 * hand / EVAL_BATCHES:.3f} ms/batch", "1.00x"),
        ("evaluate_model", f"{1e3 * ours / EVAL_BATCHES:.3f} ms/batch", f"{ours / hand:.2f}x"),
        ("fit, no evaluation", f"{1e3 * plain / FIT_STEPS:.3f} ms/step", "1.00x"),
        ("fit, eval not due", f"{1e3 * idle / FIT_STEPS:.3f} ms/step", f"{idle / plain:.2f}x"),
    ]
    if args.markdown:
        print("| case | time | ratio |\n|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        for name, value, ratio in rows:
            print(f"{name:<30} {value:>16} {ratio:>7}")


if __name__ == "__main__":
    main()
