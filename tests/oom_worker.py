"""One rank of an out-of-memory recovery run (``tests/test_oom_retry.py``).

The OOM is injected by a forward pre-hook on the model: a batch of more than ``limit``
samples raises ``torch.OutOfMemoryError`` on ``failing_rank`` (every rank when -1), as a
device that is too small would. The rank writes ``<out>/<tag>-rank<r>.pt``: the weights after
the fit, the layout it ended with and how many OOMs it raised.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speedtronic.runtime import build_runtime  # noqa: E402


def inject_oom(model: nn.Module, limit: int, raised: list[int], after: int = 0) -> None:
    """Make ``model`` raise ``torch.OutOfMemoryError`` on batches over ``limit`` samples,
    from its forward call number ``after`` on (a device that fills up mid-run)."""
    calls = [0]

    def pre_hook(_: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        first = args[0] if args else next(iter(kwargs.values()))
        assert isinstance(first, torch.Tensor)
        calls[0] += 1
        if calls[0] > after and first.shape[0] > limit:
            raised.append(first.shape[0])
            raise torch.OutOfMemoryError(f"injected: {first.shape[0]} samples > {limit}")

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def inject_backward_oom(model: nn.Module, raised: list[int], after: int) -> None:
    """Make ``model``'s backward pass number ``after + 1`` raise ``torch.OutOfMemoryError``
    (from a gradient hook on its first parameter)."""
    calls = [0]
    weight = next(model.parameters())

    def hook(grad: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == after + 1:
            raised.append(calls[0])
            raise torch.OutOfMemoryError("injected in the backward pass")

    weight.register_hook(hook)


def oom_rank(
    out: str,
    tag: str,
    raw_config: str,
    resume: bool,
    limit: int,
    failing: int,
    after: int = 0,
    backward: bool = False,
) -> int:
    """Train ``raw_config`` (JSON) on this rank with an OOM above ``limit`` samples (in the
    backward pass number ``after + 1`` instead when ``backward``)."""
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    trainer, _ = build_runtime(json.loads(raw_config), resume=resume)
    raised: list[int] = []
    if failing in (-1, rank) and backward:
        inject_backward_oom(trainer.state.model, raised, after)
    elif failing in (-1, rank):
        inject_oom(trainer.state.model, limit, raised, after)
    trainer.fit()
    source = trainer.state.stream.source
    report = {
        "weights": {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()},
        "layout": [source.batch_size, trainer.settings.accumulation_steps],  # type: ignore[attr-defined]  # a DataLoader
        "raised": raised,
    }
    torch.save(report, Path(out, f"{tag}-rank{rank}.pt"))
    return 0
