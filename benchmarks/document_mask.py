"""Document-masked training steps versus unmasked ones on the reference transformer (CPU).

Both sides train the same model (4 layers, d_model 128, 4 heads, sequence 512, micro-batch
4) with AdamW on the same windows of packed documents (lengths 20-300 tokens, an
end-of-document id after each). The masked side computes the ``position_ids`` of each batch
(``speedtronic.data.documents.document_positions``, what the loader does with
``data.document_mask``) and passes them to the model, which then attends block-causally
through the kernel of ``--kernel`` (``model.options.document_attention``: ``auto`` is
SDPA with a boolean mask on the CPU, flex_attention on CUDA); the unmasked side takes the
``is_causal`` path. Rounds alternate ABBA; the table shows the median and best steps/s of
each (per CPU second of the one-thread process on the CPU -- the machine is shared -- per
wall second on CUDA) and the ratio. Target (issue 31): masked >= 0.9x unmasked.

    python benchmarks/document_mask.py --rounds 6 --steps 8      # --markdown for docs
    python benchmarks/document_mask.py --device cuda --kernel flex
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedtronic.data.documents import document_positions  # noqa: E402
from speedtronic.models.transformer import ReferenceTransformer  # noqa: E402

SEQ, BATCH, VOCAB, EOS = 512, 4, 512, 0


def packed_batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    stream: list[int] = []
    while len(stream) < count * BATCH * (SEQ + 1):
        length = int(torch.randint(20, 300, (1,), generator=generator))
        stream += torch.randint(1, VOCAB, (length,), generator=generator).tolist() + [EOS]
    flat = torch.tensor(stream[: count * BATCH * (SEQ + 1)])
    return list(flat.view(count, BATCH, SEQ + 1))


def make_model(kernel: str, device: str) -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        n_layer=4,
        n_head=4,
        d_model=128,
        d_ff=512,
        document_attention=kernel,
    ).to(device)


def seconds(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def run(masked: bool, batches: list[torch.Tensor], kernel: str, device: str) -> float:
    """Steps per second over ``batches`` (after one warm-up step): on the CPU per CPU second
    of one thread, so the step's work whatever else the shared machine runs."""
    model = make_model(kernel, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(window: torch.Tensor) -> None:
        inputs, labels = window[:, :-1], window[:, 1:]
        # on the host, as the loader computes them, then moved with the batch
        positions = document_positions(inputs, EOS).to(device) if masked else None
        inputs, labels = inputs.to(device), labels.to(device)
        loss = model(inputs, labels=labels, position_ids=positions)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(batches[0])
    start = seconds(device)
    for window in batches:
        step(window)
    return len(batches) / (seconds(device) - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--kernel", choices=("auto", "sdpa", "flex"), default="auto")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = packed_batches(args.steps)
    results: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for masked in order:
            results[masked].append(run(masked, batches, args.kernel, args.device))
    mask_bytes = BATCH * SEQ * SEQ  # one bool per (query, key) pair, shared by the layers
    rows = [
        ("unmasked (`is_causal`)", results[False]),
        ("document mask", results[True]),
    ]
    ratio_median = statistics.median(results[True]) / statistics.median(results[False])
    ratio_best = max(results[True]) / max(results[False])
    if args.markdown:
        print("| steps | median steps/s | best steps/s |")
        print("|---|---|---|")
        for name, values in rows:
            print(f"| {name} | {statistics.median(values):.2f} | {max(values):.2f} |")
        print(f"| ratio | {ratio_median:.3f}x | {ratio_best:.3f}x |")
    else:
        for name, values in rows:
            print(f"{name:24s} median {statistics.median(values):.2f}  best {max(values):.2f}")
        print(f"ratio: median {ratio_median:.3f}x  best {ratio_best:.3f}x")
    print(f"mask: {mask_bytes / 2**20:.2f} MiB per forward ({BATCH}x{SEQ}x{SEQ} bool)")


if __name__ == "__main__":
    main()
