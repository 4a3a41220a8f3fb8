"""How much memory the tensors on a device hold, from the allocator's own counters."""

from __future__ import annotations

import torch

__all__ = ["memory_usage_bytes"]


def memory_usage_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes currently allocated by tensors on ``device`` (the default accelerator when
    ``None``): CUDA allocator counter, MPS current allocation, ``None`` on CPU.

    These are host-side allocator statistics; reading them does not synchronise.
    """
    if device is None:
        if torch.cuda.is_available():
            return int(torch.cuda.memory_allocated())
        if torch.backends.mps.is_available():
            return int(torch.mps.current_allocated_memory())
        return None
    resolved = torch.device(device)
    if resolved.type == "cuda":
        return int(torch.cuda.memory_allocated(resolved))
    if resolved.type == "mps":
        return int(torch.mps.current_allocated_memory())
    return None
