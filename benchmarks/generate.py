"""Generation and multiple-choice task cost.

generate: per-token time of 256 new tokens (after an 8-token prompt) from the reference
transformer with the KV cache (``forward_cached``: one position per token) versus
recomputing the whole prefix for every token (``use_cache=False``), greedy, interleaved
round by round, process CPU time on one thread. Target (issue 32): the cache >= 5x faster.

tasks: a 1,000-row, 4-choice task scored by ``MultipleChoiceTask``: the forward passes it
issues versus the minimum for its batch size (``ceil(sequences / batch_size)``), and its
time versus scoring the same sequences one forward each. Target: <= 1.2x the passes needed.

    python benchmarks/generate.py [--rounds N] [--markdown]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedtronic.evaluation.tasks import ChoiceRow, MultipleChoiceTask  # noqa: E402
from speedtronic.models.generation import Sampling, generate_ids  # noqa: E402
from speedtronic.models.transformer import ReferenceTransformer  # noqa: E402

NEW_TOKENS = 256
ROWS = 1000
BATCH = 32


def model(d_model: int, n_layer: int, block: int) -> ReferenceTransformer:
    torch.manual_seed(0)
    net = ReferenceTransformer(
        vocab_size=257, block_size=block, n_layer=n_layer, n_head=4, d_model=d_model
    )
    return net.eval()


def per_token_ms(net: ReferenceTransformer, use_cache: bool) -> float:
    sampling = Sampling(max_new_tokens=NEW_TOKENS, temperature=0.0)
    start = time.process_time()
    generate_ids(net, list(range(8)), sampling, use_cache=use_cache)
    return (time.process_time() - start) / NEW_TOKENS * 1e3


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def task_rows() -> list[ChoiceRow]:
    words = ["cat", "dog", "mat", "park", "sun", "moon", "tree", "river"]
    return [
        ChoiceRow(
            f"question {i}: the {words[i % 8]} sat by the",
            tuple(f"{words[(i + j) % 8]} number {j}" for j in range(4)),
            i % 4,
        )
        for i in range(ROWS)
    ]


def task_case(net: ReferenceTransformer, batch: int) -> tuple[float, int]:
    task = MultipleChoiceTask("bench", task_rows(), encode, batch_size=batch, context=128)
    start = time.process_time()
    score = task.score(net, device=torch.device("cpu"))
    return time.process_time() - start, score.forward_passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for d_model, n_layer in ((64, 2), (256, 4)):
        net = model(d_model, n_layer, 8 + NEW_TOKENS)
        cached, full = [], []
        for _ in range(args.rounds):  # interleaved
            cached.append(per_token_ms(net, True))
            full.append(per_token_ms(net, False))
        rows.append(
            (f"generate d={d_model} L={n_layer}, ms/token", cached, full, min(full) / min(cached))
        )
    net = model(64, 2, 128)
    batched, single = [], []
    passes = 0
    for _ in range(args.rounds):
        seconds, passes = task_case(net, BATCH)
        batched.append(seconds)
        single.append(task_case(net, 1)[0])
    needed = math.ceil(ROWS * 4 / BATCH)
    rows.append(
        (f"task 1000x4, s (batch {BATCH} vs 1)", batched, single, min(single) / min(batched))
    )
    head = "| case | fast best | fast median | slow best | slow median | speed-up (best) |"
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print("|---|---:|---:|---:|---:|---:|")
    for name, fast, slow, ratio in rows:
        cells = [name] + [
            f"{v:.3f}"
            for v in (min(fast), statistics.median(fast), min(slow), statistics.median(slow))
        ]
        print(f"| {' | '.join(cells)} | {ratio:.1f}x |")
    print(f"task forward passes: {passes} issued, {needed} needed ({passes / needed:.2f}x)")


if __name__ == "__main__":
    main()
