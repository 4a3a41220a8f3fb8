"""Trainer cost on a Hugging Face model: ``hf_causal_lm`` under speedtronic's Trainer versus a
hand-written PyTorch loop over the same ``transformers`` model and batches.

The model is a smoke-sized Llama (``LlamaForCausalLM``: 2 layers, hidden 64, 4 heads with 2
K/V heads, vocab 128, sequence 32), built by ``build_hf_causal_lm`` exactly as
``model: {name: hf_causal_lm, ...}`` builds it; the batches are the smoke data's
(``LearnableLanguageDataset``, micro-batch 8, K=2 accumulation). The hand loop calls the raw
``LlamaForCausalLM`` without labels and takes the cross-entropy of its logits against the
already-shifted labels -- the correct objective, written by hand -- with AdamW, the same
warmup+cosine schedule (``overhead.optimizer_for``), and the loss written to a file every 10
steps; the Trainer side is ``overhead.trainer_run`` with this model.

  trainer_bare      Trainer(HFCausalLM(...)), no callbacks, metrics due every 10 steps
  trainer_defaults  the same with console (to a file) and metrics.jsonl sinks

Runs are interleaved in ABBA order; the table shows the median steps/s of each side, the
median of the per-round paired ratios and the ratio of the best runs. Target (issue 23):
Trainer >= 0.97x the hand loop's steps/s.

    python benchmarks/hf_model.py --rounds 7 --clock cpu     # --markdown for docs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overhead  # noqa: E402
from overhead import (  # noqa: E402
    CLOCKS,
    STEPS,
    K,
    default_callbacks,
    make_batches,
    optimizer_for,
    trainer_run,
)

from speedtronic.models.hf import HFCausalLM, build_hf_causal_lm  # noqa: E402

LOG_EVERY = 10
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 88,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def make_model() -> HFCausalLM:
    torch.manual_seed(0)
    return build_hf_causal_lm(config=LLAMA, vocab_size=128, block_size=32)


def hand_loop(batches: list[object], out: Path) -> float:
    raw = make_model().hf  # the plain transformers model
    opt, sched = optimizer_for(raw)
    raw.train()
    start = overhead.clock()
    with (out / "hand.log").open("w") as log:
        position = 0
        for step in range(1, STEPS + 1):
            total = torch.zeros(())
            for _ in range(K):
                batch = batches[position % len(batches)]
                position += 1
                assert isinstance(batch, dict)
                logits = raw(input_ids=batch["input_ids"], use_cache=False).logits
                loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
                (loss / K).backward()
                total += loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if step % LOG_EVERY == 0:
                log.write(f"step {step} loss {(total / K).item():.4f}\n")
    return STEPS / (overhead.clock() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    args = parser.parse_args()
    overhead.clock = CLOCKS[args.clock]  # both sides read the one clock
    torch.set_num_threads(1)
    batches = make_batches()
    cases: dict[str, tuple[Callable[[Path], float], Callable[[Path], float]]] = {
        "trainer_bare": (
            lambda d: hand_loop(batches, d),
            lambda d: trainer_run(batches, lambda _: [], LOG_EVERY, d, make_model),
        ),
        "trainer_defaults": (
            lambda d: hand_loop(batches, d),
            lambda d: trainer_run(batches, default_callbacks, LOG_EVERY, d, make_model),
        ),
    }
    rows = []
    for name, (hand, ours) in cases.items():
        if args.case and name not in args.case:
            continue
        hand_rates: list[float] = []
        our_rates: list[float] = []
        hand(Path(tempfile.mkdtemp()))  # warm-up both paths once
        ours(Path(tempfile.mkdtemp()))
        for round_index in range(args.rounds):
            # ABBA order: neither side always runs first (allocator and cache warmth).
            pair = [(hand, hand_rates), (ours, our_rates)]
            for run, rates in pair if round_index % 2 == 0 else reversed(pair):
                rates.append(run(Path(tempfile.mkdtemp())))
        paired = statistics.median(o / h for h, o in zip(hand_rates, our_rates, strict=True))
        best = max(our_rates) / max(hand_rates)
        rows.append(
            (name, statistics.median(hand_rates), statistics.median(our_rates), paired, best)
        )
    if args.markdown:
        print(
            "| case | hand-written steps/s (median) | Trainer steps/s (median) "
            "| paired ratio (median) | best-of-N ratio |"
        )
        print("|---|---:|---:|---:|---:|")
        for name, h, o, paired, best in rows:
            print(f"| {name} | {h:.1f} | {o:.1f} | {paired:.3f} | {best:.3f} |")
    else:
        for name, h, o, paired, best in rows:
            print(
                f"{name:<18} hand {h:7.1f} steps/s   trainer {o:7.1f} steps/s   "
                f"paired ratio {paired:.3f}   best-of-{args.rounds} ratio {best:.3f}"
            )


if __name__ == "__main__":
    main()
