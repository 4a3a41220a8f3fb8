"""A rank of the LoRA data-parallel test (tests/test_adapters.py): fits a run given as a
config file under the torchrun environment the test sets."""

from __future__ import annotations

import torch

from speedtronic.runtime import train_from_config


def fit_rank(config: str) -> int:
    torch.set_num_threads(1)
    train_from_config(config)
    return 0
