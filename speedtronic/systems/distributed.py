"""Data-parallel training on ``torch.distributed``: process group, DDP, rank-aware metrics.

Launch any run under ``torchrun`` and it trains data-parallel with the same config::

    torchrun --nproc-per-node 2 -m speedtronic fit --config run.yaml

``setup_distributed`` reads the torchrun environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), picks the device of the local rank and the
backend (NCCL for CUDA, gloo otherwise) and initialises the default process group with the
configured timeout (``distributed.timeout_s``): a collective that waits longer than that for
a peer raises instead of hanging. Without those variables a run is a single process; with
only some of them it is a ``DistributedSetupError`` naming the missing ones.

The ``Trainer`` then wraps its model in ``DistributedDataParallel`` (``trainer.model`` stays
the raw module, so checkpoints and callbacks see plain parameter names), skips the gradient
all-reduce on every microbatch but the last (``no_sync``), reduces the logged loss and
throughput across ranks on logging steps only, and makes every rank stop at the same step
(``agree_on_stop``). Callbacks run where their ``rank_policy`` says
(``speedtronic.engine.dispatch``).

*Replicas*: by default all ranks form one data-parallel replica. A callback that keeps
several replicas in step itself (synchronous DiLoCo) implements ``ReplicaSync``; the trainer
then runs DDP only inside each group of ``ranks_per_replica`` consecutive ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from speedtronic.systems.precision import resolve_device

__all__ = [
    "TORCHRUN_VARIABLES",
    "CollectiveError",
    "DistributedContext",
    "DistributedSetupError",
    "LaunchEnvironment",
    "ReplicaGroups",
    "ReplicaSync",
    "agree_on_stop",
    "arm_gradient_sync",
    "choose_backend",
    "collective_failure",
    "read_launch_environment",
    "reduce_run_totals",
    "replica_groups",
    "setup_distributed",
    "teardown_distributed",
    "wrap_data_parallel",
]


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The variables torchrun sets for every worker; all of them or none must be present."""

Backend = Literal["gloo", "nccl"]


class DistributedSetupError(RuntimeError):
    """The launch environment or the process group cannot be set up (the message says why)."""


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank crashed, was killed or did not answer in time."""


# -- the launch environment ---------------------------------------------------------------


@dataclass(frozen=True)
class LaunchEnvironment:
    """What torchrun (or any launcher using its variables) tells this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def _int_variable(environ: Mapping[str, str], name: str, minimum: int) -> int:
    raw = environ[name]
    try:
        value = int(raw)
    except ValueError:
        raise DistributedSetupError(f"${name}={raw!r} is not an integer") from None
    if value < minimum:
        raise DistributedSetupError(f"${name}={value} must be >= {minimum}")
    return value


def read_launch_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment | None:
    """The torchrun variables of ``environ`` (default ``os.environ``), or ``None`` when none
    is set. A half-set environment raises ``DistributedSetupError`` naming what is missing."""
    env = os.environ if environ is None else environ
    present = [name for name in TORCHRUN_VARIABLES if env.get(name, "") != ""]
    if not present:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in present]
    if missing:
        raise DistributedSetupError(
            f"incomplete torch.distributed launch environment: {', '.join(present)} "
            f"set but {', '.join(missing)} missing. Launch with torchrun (which sets all of "
            f"{', '.join(TORCHRUN_VARIABLES)}), set the missing ones, or unset them all "
            "for a single-process run"
        )
    world_size = _int_variable(env, "WORLD_SIZE", 1)
    rank = _int_variable(env, "RANK", 0)
    local_rank = _int_variable(env, "LOCAL_RANK", 0)
    local_world_size = (
        _int_variable(env, "LOCAL_WORLD_SIZE", 1) if env.get("LOCAL_WORLD_SIZE") else world_size
    )
    port = _int_variable(env, "MASTER_PORT", 1)
    if rank >= world_size:
        raise DistributedSetupError(f"$RANK={rank} is not below $WORLD_SIZE={world_size}")
    if local_rank >= local_world_size:
        raise DistributedSetupError(
            f"$LOCAL_RANK={local_rank} is not below $LOCAL_WORLD_SIZE={local_world_size}"
        )
    return LaunchEnvironment(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=env["MASTER_ADDR"],
        master_port=port,
    )


# -- the context ------------------------------------------------------------------------


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in a distributed run (``trainer.distributed``)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    timeout_s: float
    local_world_size: int = 1
    owns_group: bool = True
    """Whether ``setup_distributed`` created the process group (and teardown destroys it)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that writes checkpoints and logs."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: one process per node (the one that downloads a remote checkpoint)."""
        return self.local_rank == 0

    @property
    def collective_device(self) -> torch.device:
        """Where tensors handed to a collective must live (the GPU for NCCL)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        """Wait until every rank gets here (raises after ``timeout_s`` without them)."""
        if self.backend == "nccl" and self.device.index is not None:
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()


def choose_backend(device: torch.device) -> Backend:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def _device_for_local_rank(requested: str | torch.device, local_rank: int) -> torch.device:
    """The requested device, with CUDA pinned to GPU ``local_rank`` (one GPU per process)."""
    device = resolve_device(requested)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DistributedSetupError(
            f"local rank {local_rank} needs GPU {local_rank} but only {count} are visible; "
            "start at most one process per GPU (torchrun --nproc-per-node)"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def setup_distributed(
    device: str | torch.device,
    *,
    timeout_s: float,
    environ: Mapping[str, str] | None = None,
) -> DistributedContext | None:
    """Join the process group described by the torchrun environment; ``None`` outside one.

    A process group that is already initialised (by the caller) is reused and left for
    the caller to destroy. Otherwise the default group is created with a ``timeout_s``
    collective timeout and destroyed by ``teardown_distributed`` (or at exit).
    """
    if timeout_s <= 0:
        raise DistributedSetupError(f"distributed timeout must be > 0 s, got {timeout_s}")
    if dist.is_available() and dist.is_initialized():
        return _context_of_existing_group(device, timeout_s, environ)
    launch = read_launch_environment(environ)
    if launch is None:
        return None
    if not dist.is_available():
        raise DistributedSetupError("this PyTorch build has no torch.distributed support")
    resolved = _device_for_local_rank(device, launch.local_rank)
    backend = choose_backend(resolved)
    options: dict[str, object] = {}
    if backend == "nccl":
        options["device_id"] = resolved  # eager NCCL init: errors show up here, not later
    try:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{_host_for_url(launch.master_addr)}:{launch.master_port}",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **options,  # type: ignore[arg-type]  # device_id is a torch.device
        )
    except (RuntimeError, ValueError) as exc:
        raise DistributedSetupError(
            f"rank {launch.rank}/{launch.world_size}: cannot join the process group at "
            f"{launch.master_addr}:{launch.master_port} ({backend}) within {timeout_s:g} s: {exc}"
        ) from exc
    context = DistributedContext(
        rank=launch.rank,
        world_size=launch.world_size,
        local_rank=launch.local_rank,
        backend=backend,
        device=resolved,
        timeout_s=float(timeout_s),
        local_world_size=launch.local_world_size,
        owns_group=True,
    )
    atexit.register(teardown_distributed, context)
    return context


def _host_for_url(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _context_of_existing_group(
    device: str | torch.device, timeout_s: float, environ: Mapping[str, str] | None
) -> DistributedContext:
    env = os.environ if environ is None else environ
    local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    backend = dist.get_backend()
    resolved = _device_for_local_rank(device, local_rank)
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=str(backend),
        device=resolved,
        timeout_s=float(timeout_s),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE") or dist.get_world_size()),
        owns_group=False,
    )


def teardown_distributed(context: DistributedContext | None) -> None:
    """Destroy the process group ``setup_distributed`` created (idempotent)."""
    if context is None or not context.owns_group:
        return
    if dist.is_available() and dist.is_initialized():
        # Free unreachable DDP reducers (and the collective work they hold) while the group
        # and the interpreter are alive; dropped at interpreter shutdown they can abort it.
        gc.collect()
        dist.destroy_process_group()
    _REPLICA_GROUPS.clear()


# -- replicas -------------------------------------------------------------------------------


@runtime_checkable
class ReplicaSync(Protocol):
    """A callback that keeps model replicas in step itself (synchronous DiLoCo).

    Ranks ``[k * n, (k + 1) * n)`` (``n = ranks_per_replica``) form replica ``k``: the
    trainer runs DDP inside each replica (none when ``n == 1``) and the callback averages
    across replicas.
    """

    ranks_per_replica: int


@dataclass(frozen=True)
class ReplicaGroups:
    """The process groups of a replica layout (``None`` stands for the whole world)."""

    ranks_per_replica: int
    replica: dist.ProcessGroup | None
    """This rank's replica, the DDP group (``None``: the world, or no DDP when the replica
    is a single rank)."""
    peers: dist.ProcessGroup | None
    """The ranks at this rank's position in every replica, the cross-replica group
    (``None``: the world; unused when there is a single replica)."""
    replica_index: int
    num_replicas: int


_REPLICA_GROUPS: dict[tuple[int, float], ReplicaGroups] = {}


def replica_groups(
    context: DistributedContext, ranks_per_replica: int, *, peer_timeout_s: float | None = None
) -> ReplicaGroups:
    """The groups for replicas of ``ranks_per_replica`` consecutive ranks (created once).

    Every rank must call this with the same arguments in the same order (creating a group
    is itself a collective). ``peer_timeout_s`` gives the cross-replica group its own
    collective timeout.
    """
    world = context.world_size
    if ranks_per_replica < 1 or world % ranks_per_replica:
        raise DistributedSetupError(
            f"ranks_per_replica={ranks_per_replica} must be >= 1 and divide the world size {world}"
        )
    timeout = peer_timeout_s if peer_timeout_s is not None else context.timeout_s
    key = (ranks_per_replica, float(timeout))
    cached = _REPLICA_GROUPS.get(key)
    if cached is not None:
        return cached
    count = world // ranks_per_replica
    replica_ranks = [
        list(range(k * ranks_per_replica, (k + 1) * ranks_per_replica)) for k in range(count)
    ]
    peer_ranks = [list(range(p, world, ranks_per_replica)) for p in range(ranks_per_replica)]
    # ``None`` is the default (world) group: used when it already is the right group.
    replica = (
        _subgroup(context, replica_ranks, context.timeout_s)
        if 1 < ranks_per_replica < world
        else None
    )
    needs_own_peers = count > 1 and (ranks_per_replica > 1 or timeout != context.timeout_s)
    peers = _subgroup(context, peer_ranks, timeout) if needs_own_peers else None
    groups = ReplicaGroups(
        ranks_per_replica=ranks_per_replica,
        replica=replica,
        peers=peers,
        replica_index=context.rank // ranks_per_replica,
        num_replicas=count,
    )
    _REPLICA_GROUPS[key] = groups
    return groups


def _subgroup(
    context: DistributedContext, partition: Sequence[Sequence[int]], timeout_s: float
) -> dist.ProcessGroup:
    """This rank's group of ``partition`` (every group is created, on every rank)."""
    mine: dist.ProcessGroup | None = None
    for ranks in partition:
        group = dist.new_group(ranks=list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
        if context.rank in ranks:
            mine = group
    assert mine is not None  # the partition covers every rank
    return mine


# -- DDP ----------------------------------------------------------------------------------


def wrap_data_parallel(
    model: nn.Module, context: DistributedContext, group: dist.ProcessGroup | None = None
) -> DistributedDataParallel:
    """``model`` (already on ``context.device``) in DDP over ``group`` (default: world).

    Construction broadcasts rank 0's parameters and buffers, so every replica starts from
    the same weights whatever each process initialised.
    """
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group)


def no_sync_on_non_final(
    ddp: DistributedDataParallel,
) -> Callable[[bool], contextlib.AbstractContextManager[object]]:
    """A ``ForwardPath.grad_sync_context``: accumulate locally, all-reduce on the last
    microbatch."""

    def context(final: bool) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext() if final else ddp.no_sync()

    return context


def arm_gradient_sync(ddp: DistributedDataParallel) -> None:
    """Make the next backward all-reduce ``ddp``'s gradients although its forward ran under
    ``no_sync()``: the two reducer calls DDP's own forward makes when it syncs, for a caller
    that decides only after the forward whether to sync (``engine.oom_agreement``). Valid
    for the DDP ``wrap_data_parallel`` builds: no unused-parameter search, no static graph,
    so the forward's output needs no marking."""
    ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_forward()
    ddp.reducer.prepare_for_backward([])


# -- collectives used by the trainer --------------------------------------------------------


def agree_on_stop(context: DistributedContext, wants_stop: bool) -> bool:
    """True on every rank when any rank wants to stop (one tiny all-reduce)."""
    flag = torch.tensor(
        [1 if wants_stop else 0], dtype=torch.int32, device=context.collective_device
    )
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def reduce_run_totals(
    context: DistributedContext,
    loss: torch.Tensor | None,
    samples: int,
    tokens: int,
    batch_sharers: int = 1,
) -> tuple[float | None, int, int]:
    """The mean loss over ranks (``None`` when there is none) and the total sample and
    token counts, in one all-reduce. ``loss`` must be given on every rank or on none.
    ``batch_sharers``: ranks that train on the same batch (a tensor-parallel group), whose
    counts are one batch's, not several."""
    local = torch.tensor(
        [0.0 if loss is None else float(loss.detach().item()), float(samples), float(tokens)],
        dtype=torch.float64,
        device=context.collective_device,
    )
    dist.all_reduce(local)
    total_loss, total_samples, total_tokens = local.tolist()
    mean_loss = None if loss is None else total_loss / context.world_size
    return (
        mean_loss,
        int(round(total_samples / batch_sharers)),
        int(round(total_tokens / batch_sharers)),
    )


class SameOnEveryRankError(RuntimeError):
    """An error every rank of a job raises alike (a refused setting, say): the CLI prints
    it on rank 0 only, so a job reports it once rather than once per rank."""


def collective_failure(
    exc: BaseException, context: DistributedContext | None
) -> CollectiveError | None:
    """A ``CollectiveError`` explaining ``exc`` when it is a failed collective, else ``None``."""
    if context is None or context.world_size < 2 or isinstance(exc, CollectiveError):
        return None
    text = str(exc)
    is_collective = isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError)
        and ("gloo" in text or "NCCL" in text or "Connection closed by peer" in text)
    )
    if not is_collective:
        return None
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return CollectiveError(
        f"rank {context.rank}/{context.world_size}: a collective operation failed -- a peer "
        f"rank crashed, was killed, or did not answer within distributed.timeout_s="
        f"{context.timeout_s:g} s (check the other ranks' logs): {first_line}"
    )
