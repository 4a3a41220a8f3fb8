"""One rank of an out-of-memory recovery run (``tests/test_oom_retry.py``).

The OOM is injected by a forward pre-hook on the model (on its middle FSDP unit with
``middle``): a batch of more than ``limit``
samples raises ``torch.OutOfMemoryError`` on ``failing_rank`` (every rank when -1), as a
device that is too small would. The rank writes ``<out>/<tag>-rank<r>.pt``: the weights after
the fit, the layout it ended with and how many OOMs it raised.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
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


def inject_backward_oom(model: nn.Module, raised: list[int], after: int, output: bool) -> None:
    """Make ``model``'s backward pass number ``after + 1`` raise ``torch.OutOfMemoryError``
    (from a gradient hook on its first parameter; with ``output``, on the gradient of the
    model's output -- under FSDP, before any unit's pre-backward gathers its parameters, the
    gathered parameters' gradients being out of reach of the sharded ones)."""
    calls = [0]

    def hook(grad: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == after + 1:
            raised.append(calls[0])
            raise torch.OutOfMemoryError("injected in the backward pass")

    if not output:
        next(model.parameters()).register_hook(hook)
        return

    def on_output(_: nn.Module, args: object, result: object) -> None:
        first = next(iter(result.values())) if isinstance(result, dict) else result
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(hook)

    model.register_forward_hook(on_output)


def middle_unit(model: nn.Module) -> nn.Module:
    """The middle one of ``model``'s FSDP units below the root (each ``fully_shard``ed
    block)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    assert len(units) >= 2, units
    return units[len(units) // 2]


def local(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a state-dict value (a DTensor's shard under FSDP)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    return value.detach().clone()


_COUNTED = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast")


def count_collectives() -> dict[str, int]:
    """Count this process's calls of the collectives FSDP and the recovery issue (torch's
    ``dist.<name>`` wrapped; FSDP looks them up on the module at each call)."""
    import torch.distributed as dist

    counts = dict.fromkeys(_COUNTED, 0)

    def counting(name: str, function: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    for name in _COUNTED:
        if hasattr(dist, name):
            setattr(dist, name, counting(name, getattr(dist, name)))
    return counts


def oom_rank(
    out: str,
    tag: str,
    raw_config: str,
    resume: bool,
    limit: int,
    failing: int,
    after: int = 0,
    backward: bool = False,
    middle: bool = False,
) -> int:
    """Train ``raw_config`` (JSON) on this rank with an OOM above ``limit`` samples (in the
    backward pass number ``after + 1`` instead when ``backward``)."""
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    collectives = count_collectives()
    trainer, _ = build_runtime(json.loads(raw_config), resume=resume)
    raised: list[int] = []
    if failing in (-1, rank) and backward:
        inject_backward_oom(trainer.state.model, raised, after, middle)
    elif failing in (-1, rank):
        target = middle_unit(trainer.state.model) if middle else trainer.state.model
        inject_oom(target, limit, raised, after)
    trainer.fit()
    source = trainer.state.stream.source
    report = {
        "weights": {k: local(v) for k, v in trainer.state.model.state_dict().items()},
        "layout": [source.batch_size, trainer.settings.accumulation_steps],  # type: ignore[attr-defined]  # a DataLoader
        "raised": raised,
        "collectives": collectives,
    }
    torch.save(report, Path(out, f"{tag}-rank{rank}.pt"))
    return 0
