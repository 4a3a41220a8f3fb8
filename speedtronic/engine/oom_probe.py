"""The first-step micro-batch search of ``data.micro_batch_size: auto`` under FSDP2 on
several ranks.

FSDP gathers a unit's parameters (all-gather) in its pre-forward and reduces its gradients
(reduce-scatter) in its post-backward. A rank that runs out of memory between two of those
collectives leaves the others waiting in the next one, so the search keeps them out of the
tries altogether:

* before a try, every rank gathers every unit's parameters (``FSDPModule.unshard``) -- at the
  point of the search with the least memory in use, all ranks together;
* during the try, no unit reshards after its forward (so the backward gathers nothing) and no
  gradient is reduced (``set_requires_gradient_sync(False)``): the forward and backward of
  the try issue no collective, and an out-of-memory error anywhere in them is the rank's own;
* after the try, FSDP's iteration state is reset (``reset_iter_state``: the parameters
  resharded), the try's unreduced gradients dropped, and the ranks join one ``all_reduce``
  (MAX) of "this rank ran out of memory". Every rank tries the same sizes in the same order
  (the whole step, then halving), so they leave the search after the same number of
  collectives, at the largest size that fitted on all of them.

The try holds every unit's parameters and their unreduced gradients unsharded: more than a
step of the run holds (one unit gathered at a time, gradients reduced to shards), so the size
found leaves that headroom. Before the first gather each rank checks that the unsharded
parameters fit in what its device has free, and the ranks agree on it (one MIN all-reduce):
an out-of-memory error inside FSDP's own all-gather would leave the other ranks in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["fsdp_can_probe", "fsdp_probe", "gather_room"]


def fsdp_can_probe() -> bool:
    """Whether this torch's FSDP2 can drop a failed iteration (``reset_iter_state``)."""
    return hasattr(FSDPModule, "reset_iter_state")


def _units(model: nn.Module) -> list[FSDPModule]:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _unsharded_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters gathered whole (a sharded parameter's shape is the
    whole one's)."""
    return sum(param.numel() * param.element_size() for param in model.parameters())


def gather_room(model: nn.Module, device: torch.device) -> str:
    """Why this rank cannot gather every parameter of ``model`` ("" when it can: always
    off CUDA, where nothing reports the free memory)."""
    if device.type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    needed = _unsharded_bytes(model)
    if needed <= free:
        return ""
    return (
        f"{device} has {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free) and the "
        f"gathered parameters need {needed / 2**30:.1f} GiB"
    )


def _drop_unreduced_gradients(units: list[FSDPModule]) -> None:
    """The try's gradients FSDP keeps unsharded under no-sync (on its private parameter
    records: no public call clears them, and the next synchronised backward would add them
    to the step's)."""
    for unit in units:
        state = unit._get_fsdp_state()
        for group in state._fsdp_param_groups:
            for record in group.fsdp_params:
                record.unsharded_accumulated_grad = None
                unsharded = getattr(record, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


@contextmanager
def _collective_free(root: FSDPModule, reshard_after_forward: bool) -> Iterator[None]:
    """Within: no unit reshards after forward, no gradient is reduced. Restores the run's
    settings (the root keeps its parameters after forward; the units ``reshard_after_forward``)."""
    root.set_reshard_after_forward(False)
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for unit in _units(root):  # type: ignore[arg-type]  # an FSDPModule is an nn.Module
            if unit is not root:
                unit.set_reshard_after_forward(reshard_after_forward, recurse=False)
        root.set_requires_gradient_sync(True)


def fsdp_probe(
    root: FSDPModule,
    micro: int,
    reshard_after_forward: bool,
    attempt: Callable[[int], str],
    smaller: Callable[[int], int],
    device: torch.device,
) -> tuple[int, str]:
    """The largest size from ``micro`` down (``smaller`` of the last) that every rank fits,
    0 when not even 1 does, and this rank's last error. ``attempt(size)`` runs one try's
    forward and backward and returns its out-of-memory message ("" when it fitted)."""
    units = _units(root)  # type: ignore[arg-type]  # an FSDPModule is an nn.Module
    # What FSDP does at the root's first forward (finding the root and its units, the
    # device's streams), done before the first gather: reset_iter_state reshards only the
    # units the root knows, and the search's first gather precedes any forward.
    root._get_fsdp_state()._lazy_init()
    error = ""
    with _collective_free(root, reshard_after_forward):
        while True:
            for unit in units:
                unit.unshard()
            error = attempt(micro)
            root.reset_iter_state()
            _drop_unreduced_gradients(units)
            failed = torch.tensor([1 if error else 0], dtype=torch.int64, device=device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if not int(failed.item()):
                return micro, error
            if micro == 1:
                return 0, error
            micro = smaller(micro)
