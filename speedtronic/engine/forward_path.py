"""The forward path: the module a microbatch's forward pass calls, and the contexts around it.

One object owns everything between "a batch on the device" and "its model output": the DDP
wrapper of a data-parallel run (``no_sync`` on all but the last microbatch) or the FSDP2
sharding of a ``parallel.strategy: fsdp`` run (``speedtronic.systems.sharding``; no reduce-scatter
on all but the last microbatch), ``torch.compile``
with its fallback to eager when the compiler itself fails, and autocast for mixed precision.
``plain`` is true when none of the contexts is needed, so the loop enters no context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from speedtronic.engine.batch import run_model
from speedtronic.engine.callback import Callback
from speedtronic.engine.notes import Notes
from speedtronic.systems.distributed import (
    DistributedContext,
    ReplicaSync,
    no_sync_on_non_final,
    replica_groups,
    wrap_data_parallel,
)
from speedtronic.systems.precision import PrecisionPlan, autocast_context
from speedtronic.systems.sharding import ShardingError, gradient_sync_on_final, shard_model
from speedtronic.user_warnings import warn

__all__ = ["ForwardPath"]

_GradSyncContext = Callable[[bool], contextlib.AbstractContextManager[object]]


def _no_grad_sync_context(final: bool) -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext()


def _is_compile_failure(exc: BaseException) -> bool:
    """True for failures of the compiler itself, not errors raised by the model's code."""
    try:
        from torch._dynamo import exc as dynamo_exc
    except ImportError:  # pragma: no cover - very old torch
        return False
    if isinstance(exc, dynamo_exc.TorchRuntimeError):
        return False  # the model's own error, surfaced through dynamo
    return isinstance(exc, dynamo_exc.TorchDynamoException)


class ForwardPath:
    """Compile / DDP / autocast / no_sync around the raw ``model`` (see module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        precision: PrecisionPlan,
        device: torch.device,
        distributed: DistributedContext | None,
        *,
        compile: bool,
        notes: Notes | None = None,
    ) -> None:
        self.model = model
        self.precision = precision
        self.device = device
        self.distributed = distributed
        self.compile_requested = compile
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        self.sharded: nn.Module | None = None
        """The FSDP root (the model itself, sharded in place) after ``shard``, else ``None``."""
        self.compiled: nn.Module | None = None
        self.grad_sync_context: _GradSyncContext = _no_grad_sync_context
        self.plain = False
        """No DDP and no autocast: the loop calls ``forward`` without entering contexts."""
        self.notes = notes or Notes()
        """Where the ``compile`` note (2.0's event: enabled, reason) is published."""
        self.gradient_ranks = 1
        """The ranks whose gradients DDP or FSDP averages with this one's (1: none)."""
        self._gradient_group: dist.ProcessGroup | None = None

    @property
    def train_module(self) -> nn.Module:
        """The module the forward pass calls: the DDP wrapper in a data-parallel run, else
        the raw model."""
        return self.ddp if self.ddp is not None else self.model

    def prepare(self, model: nn.Module, callbacks: Sequence[Callback]) -> None:
        """Before a fit: wrap ``model`` in DDP when data-parallel (once per model; a
        collective) unless it is sharded, compile when asked, and decide whether the path
        is ``plain``."""
        self.model = model
        if self.sharded is None:
            self._setup_data_parallel(callbacks)
        self.plain = (
            self.ddp is None and self.sharded is None and not self.precision.autocast_enabled
        )
        self._setup_compile()

    def shard(
        self,
        optimizer: torch.optim.Optimizer,
        callbacks: Sequence[Callback],
        *,
        reshard_after_forward: bool,
        tensor: int = 1,
    ) -> bool:
        """Shard the model with FSDP2 over its replica's ranks (``speedtronic.systems.sharding``;
        a collective) and point ``optimizer`` at the sharded parameters. Returns False,
        leaving the model whole, when the replica is a single process. ``tensor`` > 1:
        split it over a ``(data, tensor)`` mesh first (``speedtronic.systems.tensor_parallel``);
        gradients are then averaged over the data ranks only."""
        context = self.distributed
        # Only a tensor-parallel run loads ``speedtronic.systems.tensor_parallel`` (its plans).
        if tensor > 1 and (context is None or context.world_size % tensor):
            from speedtronic.systems.tensor_parallel import TensorParallelError

            raise TensorParallelError(
                f"parallel.tensor: {tensor} does not divide the world size "
                f"({context.world_size if context is not None else 1} rank(s)); launch under "
                f"torchrun with a multiple of {tensor} ranks, or set parallel.tensor: 1"
            )
        if context is None or context.world_size <= 1:
            return False
        size = self._ranks_per_replica(context, callbacks)
        if size < context.world_size:
            raise ShardingError(
                "parallel.strategy fsdp inside replicas of several ranks (a callback with "
                f"ranks_per_replica={size} of {context.world_size}) is not supported: its "
                "sharded checkpoints would be written by every replica at once; use "
                "parallel.strategy ddp"
            )
        param_dtype = self.precision.dtype if self.precision.is_mixed_precision else None
        data_mesh = None
        if tensor > 1:  # split each layer over the tensor ranks first; FSDP over the data ranks
            from speedtronic.systems.tensor_parallel import apply_tensor_parallel

            data_mesh = apply_tensor_parallel(self.model, optimizer, self.device, tensor)
        self.sharded = shard_model(
            self.model,
            optimizer,
            device=self.device,
            group=None,
            reshard_after_forward=reshard_after_forward,
            param_dtype=param_dtype,
            mesh=data_mesh,
        )
        self.ddp = None
        self.grad_sync_context = gradient_sync_on_final(self.sharded)
        self.gradient_ranks, self._gradient_group = context.world_size, None
        if data_mesh is not None:  # a tensor group's ranks hold the same batch
            self.gradient_ranks, self._gradient_group = data_mesh.size(), data_mesh.get_group()
        self.compiled = None
        return True

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        return autocast_context(self.precision, self.device)

    def forward(self, batch: object) -> object:
        """The model's output for a batch, compiled when compilation is on and works."""
        if self.compiled is None:  # the eager module, without a property call per step
            return run_model(self.ddp if self.ddp is not None else self.model, batch)
        try:
            return run_model(self.compiled, batch)
        except Exception as exc:
            if not _is_compile_failure(exc):
                raise
            reason = f"torch.compile failed ({type(exc).__name__}: {exc})"
            warn(f"{reason}; continuing in eager mode", RuntimeWarning)
            self.notes.publish("compile", {"enabled": False, "reason": reason})
            self.compiled = None
            return run_model(self.train_module, batch)

    def sum_over_gradient_ranks(self, count: int) -> torch.Tensor:
        """``count`` summed over the ranks that average gradients with this one (one small
        all-reduce, left on the collective device: ``speedtronic.engine.loss_tokens``)."""
        context = self.distributed
        device = context.collective_device if context is not None else torch.device("cpu")
        total = torch.tensor([count], dtype=torch.int64, device=device)
        if self.gradient_ranks > 1 and context is not None:
            dist.all_reduce(total, group=self._gradient_group)
        return total[0]

    def _setup_compile(self) -> None:
        if not self.compile_requested or self.compiled is not None:
            return
        try:
            self.compiled = cast(nn.Module, torch.compile(self.train_module))
        except Exception as exc:  # compile unavailable on this platform: stay eager
            reason = f"torch.compile unavailable ({exc})"
            warn(f"{reason}; running eagerly", RuntimeWarning)
            self.notes.publish("compile", {"enabled": False, "reason": reason})
        else:
            self.notes.publish("compile", {"enabled": True, "reason": "compiled"})

    def one_replica(self, callbacks: Sequence[Callback]) -> bool:
        """Whether every rank of a multi-rank world holds the same model replica (DDP over
        the whole world), so per-rank results such as an evaluation's sums may be reduced
        over the world; False when a rank is its own replica."""
        context = self.distributed
        if context is None or context.world_size <= 1:
            return False
        return self._ranks_per_replica(context, callbacks) == context.world_size

    def _ranks_per_replica(self, context: DistributedContext, callbacks: Sequence[Callback]) -> int:
        """Ranks per model replica: the world, unless a ``ReplicaSync`` callback says."""
        sizes = {cb.ranks_per_replica for cb in callbacks if isinstance(cb, ReplicaSync)}
        if len(sizes) > 1:
            raise ValueError(f"callbacks disagree on ranks_per_replica: {sorted(sizes)}")
        return sizes.pop() if sizes else context.world_size

    def _setup_data_parallel(self, callbacks: Sequence[Callback]) -> None:
        context = self.distributed
        if context is None or context.world_size <= 1:
            return
        if self.ddp is not None and self.ddp.module is self.model:
            return
        size = self._ranks_per_replica(context, callbacks)
        self.ddp = None
        self.grad_sync_context = _no_grad_sync_context
        group: dist.ProcessGroup | None = None
        if size > 1:
            group = replica_groups(context, size).replica if size < context.world_size else None
            self.ddp = wrap_data_parallel(self.model, context, group)
            self.grad_sync_context = no_sync_on_non_final(self.ddp)
        self.gradient_ranks, self._gradient_group = size, group
        self.compiled = None  # compile what the forward pass now calls
