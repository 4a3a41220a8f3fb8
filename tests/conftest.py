"""Test-wide settings: one thread (2-core CI machines), deterministic, offline W&B."""

from __future__ import annotations

import os

import torch

torch.set_num_threads(1)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")
