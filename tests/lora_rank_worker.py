"""Ranks of the LoRA data-parallel tests (tests/test_adapters.py, test_adapters_fsdp.py):
fit a run given as a config file under the torchrun environment the test sets."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from speedtronic.runtime import prepared_fit, train_from_config


def fit_rank(config: str) -> int:
    torch.set_num_threads(1)
    train_from_config(config)
    return 0


def fit_sharded_rank(config: str, report: str, max_steps: int | None, resume: bool) -> int:
    """Fit ``config`` and write to ``report`` (one file per rank) how each adapter
    parameter is held while training: its placements and this rank's local shape."""
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    with prepared_fit(config, max_steps=max_steps, resume=resume) as trainer:
        held = {}
        for name, param in trainer.model.named_parameters():
            if "lora_" in name:
                assert isinstance(param, DTensor), name
                held[name] = {
                    "placements": [repr(p) for p in param.placements],
                    "local": list(param.to_local().shape),
                    "whole": list(param.shape),
                    "trains": param.requires_grad,
                }
        rank = trainer.distributed.rank if trainer.distributed is not None else 0
        Path(f"{report}.rank{rank}.json").write_text(json.dumps(held), encoding="utf-8")
        trainer.fit()
    return 0
