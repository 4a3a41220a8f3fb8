"""Train the bundled reference transformer from Python in a few lines.

    python examples/train_reference.py

Ten optimizer steps on the learnable synthetic language; prints the result and leaves the
run directory (config, metrics.jsonl, checkpoints) under ``runs/example``.
"""

from __future__ import annotations

from speedtronic import TrainResult, train_from_config

CONFIG: dict[str, object] = {
    "run": {"name": "example", "device": "cpu", "max_steps": 10, "output_dir": "runs/example"},
    "model": {"vocab_size": 64, "max_seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 64},
    "data": {"synthetic_kind": "learnable", "num_tokens": 256, "micro_batch_size": 2},
    "optimizer": {"lr": 3e-3},
    "scheduler": {"warmup_steps": 2},
    "logging": {"every_steps": 5},
}


def main() -> TrainResult:
    result = train_from_config(CONFIG)
    print(f"steps={result.steps} samples={result.samples} tokens={result.tokens}")
    return result


if __name__ == "__main__":
    main()
