"""The ranks' agreement on the micro-batch after a mid-run out-of-memory error under DDP.

With ``data.micro_batch_size: auto`` on several DDP ranks, a rank that runs out of memory
must not leave the others waiting in DDP's gradient all-reduce. So every microbatch of a
step -- the last one too -- runs its forward under ``no_sync()``: nothing leaves the rank.
After the last microbatch's forward (a forward hook on the DDP module) each rank joins one
``all_reduce`` (MIN) of a one-element int tensor, read on the host: the micro-batch it wants,
its current one when all went well. A rank that ran out of memory earlier in the step joins
the same all-reduce from the recovery (``engine.oom_retry``) with the smaller size it wants
(0 when even 1 sample did not fit). When the minimum is the current size, the hook arms DDP's
reducer (``arm_gradient_sync``) and the last backward all-reduces the gradients as DDP always
does; otherwise the ranks that fitted raise ``RanksShrink`` and every rank drops the step and
runs it again at the agreed size.

The backward of the last microbatch is past the agreement: its all-reduce may already be in
flight on the other ranks, so an out-of-memory error there cannot be recovered (the recovery
ends the run naming it). DDP's buffer broadcast (``broadcast_buffers``, a collective at the
start of a step's first forward) is turned off: a rank that runs out of memory before that
forward would otherwise leave the others in the broadcast. Each rank keeps its own buffers,
which for buffers the model computes the same way on every rank (rotary tables, masks)
changes nothing; docs/scale-out.md says what it means for running statistics.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from speedtronic.systems.distributed import arm_gradient_sync

__all__ = ["RanksShrink", "StepAgreement", "step_agreement"]


class RanksShrink(Exception):
    """Another rank ran out of memory in this step: every rank runs it again at ``micro``
    (0: one rank cannot fit even 1 sample)."""

    def __init__(self, micro: int) -> None:
        super().__init__(f"the ranks agreed on a micro-batch of {micro}")
        self.micro = micro


class StepAgreement:
    """The per-step agreement of one DDP module (module docstring)."""

    def __init__(self, ddp: DistributedDataParallel, device: torch.device) -> None:
        self.ddp = ddp
        self.device = device
        self.micro = 0
        """The micro-batch the ranks run now (``OomRecovery`` keeps it current)."""
        self.armed = False
        """The last backward of the step syncs: an OOM from here on cannot be recovered."""
        self._final = False
        ddp.broadcast_buffers = False  # module docstring: a collective before any OOM check
        ddp.register_forward_hook(self._after_forward)

    def grad_sync_context(self, final: bool) -> contextlib.AbstractContextManager[object]:
        """``ForwardPath.grad_sync_context``: every forward under ``no_sync``; the last
        one's hook decides whether its backward syncs."""
        self._final = final
        self.armed = False
        return self.ddp.no_sync()

    def agree(self, wanted: int) -> int:
        """The smallest micro-batch any rank wants (one MIN all-reduce, read on the host)."""
        size = torch.tensor([wanted], dtype=torch.int64, device=self.device)
        dist.all_reduce(size, op=dist.ReduceOp.MIN)
        return int(size.item())

    def _after_forward(self, module: nn.Module, args: object, output: object) -> None:
        if not self._final or not torch.is_grad_enabled():
            return
        self._final = False  # once per step: an evaluation forward afterwards is left alone
        agreed = self.agree(self.micro)
        if agreed != self.micro:
            raise RanksShrink(agreed)
        arm_gradient_sync(self.ddp)
        self.armed = True


_AGREEMENTS: weakref.WeakKeyDictionary[DistributedDataParallel, StepAgreement] = (
    weakref.WeakKeyDictionary()
)


def step_agreement(ddp: DistributedDataParallel, device: torch.device) -> StepAgreement:
    """The agreement of ``ddp`` (one per DDP module: its hook is registered once, however
    many fits run on it)."""
    agreement = _AGREEMENTS.get(ddp)
    if agreement is None:
        agreement = _AGREEMENTS[ddp] = StepAgreement(ddp, device)
    return agreement
