"""Every CUDA path, as in ``benchmarks/gpu_check.py``: one test per check, run the moment
a GPU is available (``python -m pytest tests/gpu``); skipped on CPU-only machines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_check_module import load_gpu_check  # noqa: E402  -- after the path entry above

gpu_check = load_gpu_check()

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", list(gpu_check.CHECKS))
def test_cuda_path(name: str) -> None:
    result = gpu_check.run_check(name, gpu_check.CHECKS[name])
    assert result.ok, f"{name}: {result.error}"
