"""LoRA versus full fine-tuning of the smoke-sized HF Llama (``benchmarks/hf_model.py``'s:
2 layers, hidden 64, vocab 128, sequence 32) and of a wider one (4 layers, hidden 256).

For each model, full fine-tuning (every weight trains) against LoRA r=16 on ``q_proj`` and
``v_proj`` (``speedtronic.models.adapters.apply_lora``, as ``model.adapters.lora`` builds it),
both with AdamW on the smoke data (micro-batch 8):

  optimizer state   bytes of AdamW's state tensors after the first step
  steps/s           optimizer steps per second of process CPU time (one thread), interleaved
                    round by round; best and median
  checkpoint        bytes of ``torch.save({"model": model.state_dict(), "optimizer": ...})``
                    -- a speedtronic checkpoint's two large entries (a LoRA model's
                    ``state_dict()`` holds its adapters and the base's fingerprint only)
  adapter share     adapter parameters / all parameters: the floor of the two ratios above
                    (weights and AdamW's two moments all scale with the parameter count);
                    what a checkpoint holds beyond it is the fingerprint (32 bytes) and
                    torch.save's per-tensor record (~0.4 KB per tensor)

Targets (issue 32): LoRA optimizer state <= 40% of full, steps/s >= 1.0x, checkpoint <= 5%
(below the adapter share of the smoke-sized model at r=16: see docs/performance.md).

    python benchmarks/lora.py [--rounds N] [--steps S]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_model import LLAMA  # noqa: E402
from overhead import make_batches  # noqa: E402

from speedtronic.config.sections import LoraAdapterConfig  # noqa: E402
from speedtronic.models.adapters import apply_lora  # noqa: E402
from speedtronic.models.hf import HFCausalLM, build_hf_causal_lm  # noqa: E402

WIDE = {**LLAMA, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4}
LORA = LoraAdapterConfig(r=16, alpha=32.0, targets=["q_proj", "v_proj"])


def build(config: dict[str, object], lora: bool) -> HFCausalLM:
    torch.manual_seed(0)
    model = build_hf_causal_lm(config=config, vocab_size=128, block_size=32)
    if lora:
        apply_lora(model, LORA)
    return model


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=1e-3)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    batches = make_batches()
    start = time.process_time()
    for step in range(steps):
        batch = batches[step % len(batches)]
        assert isinstance(batch, dict)
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps / (time.process_time() - start)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.tell()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| model | full opt. state | LoRA opt. state | ratio | full steps/s best (median) "
        "| LoRA steps/s best (median) | ratio (best) | full ckpt | LoRA ckpt | ratio "
        "| adapter share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, config in (("smoke Llama (h64, 2 layers)", LLAMA), ("Llama h256, 4 layers", WIDE)):
        models = {kind: build(config, kind == "lora") for kind in ("full", "lora")}
        optimizers = {kind: optimizer_of(model) for kind, model in models.items()}
        speeds: dict[str, list[float]] = {"full": [], "lora": []}
        for _ in range(args.rounds):  # interleaved
            for kind in ("full", "lora"):
                speeds[kind].append(train(models[kind], optimizers[kind], args.steps))
        state = {kind: state_bytes(opt) for kind, opt in optimizers.items()}
        ckpt = {kind: checkpoint_bytes(models[kind], optimizers[kind]) for kind in models}
        share = sum(p.numel() for p in models["lora"].parameters() if p.requires_grad) / sum(
            p.numel() for p in models["full"].parameters()
        )
        best = {kind: max(values) for kind, values in speeds.items()}
        median = {kind: statistics.median(values) for kind, values in speeds.items()}
        print(
            f"| {name} | {state['full']:,} | {state['lora']:,} | "
            f"{state['lora'] / state['full']:.1%} | {best['full']:.1f} ({median['full']:.1f}) | "
            f"{best['lora']:.1f} ({median['lora']:.1f}) | {best['lora'] / best['full']:.2f}x | "
            f"{ckpt['full']:,} | {ckpt['lora']:,} | {ckpt['lora'] / ckpt['full']:.1%} | "
            f"{share:.2%} |"
        )


if __name__ == "__main__":
    main()
