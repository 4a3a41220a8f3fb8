"""Shared pieces of the Hugging Face model and export tests: tiny transformers configs, a
run.yaml writer, and the logits of a model (``import transformers`` costs seconds: the
tests build few, tiny models)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from torch import nn

VOCAB = 64
BLOCK = 16

LLAMA: dict[str, object] = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}
"""A two-layer GQA Llama, a few thousand parameters."""


def run_config(
    tmp_path: Path,
    model: dict[str, object],
    *,
    name: str = "run",
    steps: int = 4,
    **sections: object,
) -> Path:
    """A short CPU run on the learnable synthetic language, checkpointed and evaluated
    every 2 steps; ``sections`` replace or add top-level sections."""
    config: dict[str, object] = {
        "run": {"device": "cpu", "max_steps": steps, "output_dir": str(tmp_path / name)},
        "model": {"vocab_size": VOCAB, "max_seq_len": BLOCK, **model},
        "data": {"synthetic_kind": "learnable", "num_tokens": 256, "micro_batch_size": 4},
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "logging": {"console": False, "jsonl": True},
        "checkpoint": {"every_steps": 2, "keep_last": None},
        "eval": {"every_steps": 2, "max_batches": 2},
        **sections,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``model``'s logits for ``input_ids`` in eval mode, whatever it returns."""
    model.eval()
    with torch.no_grad():
        output = model(input_ids)
    found = output["logits"] if isinstance(output, dict) else output.logits
    assert isinstance(found, torch.Tensor)
    return found
