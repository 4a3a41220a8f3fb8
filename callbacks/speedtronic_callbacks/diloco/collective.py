"""Synchronous DiLoCo over ``torch.distributed`` collectives (``diloco`` with ``mode: collective``).

    torchrun --nproc-per-node 8 -m speedtronic fit --config run.yaml

    callbacks:
      - {name: diloco, mode: collective, inner_steps: 500, compression: bf16}

The setting of the DiLoCo paper: the ranks of a torchrun job form *replicas* of
``ranks_per_replica`` consecutive ranks (default 1: every rank is a replica). Inside a
replica the trainer runs ordinary DDP; across replicas nothing is exchanged for
``inner_steps`` (H) optimizer steps. Then, at the ``coordinate`` event of every step that is
a multiple of H, each rank

1. computes its pseudo-gradient ``baseline - current`` in float32 (``math.pseudo_gradient``;
   the baseline is the global model of the last round, kept on the CPU),
2. averages it over the replicas with **one** ``all_reduce`` of one flat buffer, in float32
   or, with ``compression``, bf16/fp16 (half the bytes),
3. applies the same outer Nesterov-SGD step (``math.NesterovOuterOptimizer``) to its
   baseline -- every rank computes the identical new global model -- and loads it into the
   model, and
4. asks for an inner-optimizer reset (``reset_optimizer``).

Communication per optimizer step is therefore ``1/H`` of DDP's gradient all-reduce (``1/2H``
in bf16). Everything else -- metrics, the stop agreement, checkpoints -- is the trainer's
normal distributed machinery.

Evaluation: an evaluation step that ends an outer round evaluates the global model (every
replica has just loaded it); ``on_eval_end`` all-reduces the ranks' token-weighted shares into
``diloco/eval_global/loss``, ``/ppl`` and ``/outer_step`` (``eval/loss`` stays each rank's own).

Checkpoints: the full state (baseline, outer momentum, counters) is saved under
``state_key = "diloco"``. Rank 0 writes the checkpoint, so a checkpoint taken right after a
round (a step that is a multiple of H) holds the state of every rank and resumes exactly.
Between rounds the replicas differ; resuming such a checkpoint gives every replica rank 0's
local weights (the round's other local progress is lost) -- a warning says so. Make
``checkpoint.every_steps`` a multiple of H.

With outer lr 1, momentum 0 and H = 1 the update is exactly the average of the replicas'
new weights: plain data-parallel training (tested against DDP with SGD).

Streaming (``fragments`` P, ``overlap_steps`` tau; docs/distributed.md, "Streaming"): the
synchronised entries are split into P strided fragments (``fragments.plan_fragments``), each
exchanged every H steps at its own offset, so one exchange moves about 1/P of the model.
With tau > 0 the exchange is an asynchronous all-reduce started at the fragment's sync step
and applied tau steps later with the *delta-carry* rule: the fragment's new global plus the
local progress made since the exchange started. With P = 1 and tau = 0 this is exactly the
round above. A streaming run's checkpoints hold every replica's local weights, inner-optimizer
state and in-flight exchange (gathered to rank 0), so they resume exactly at any step.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.distributed as dist
from typing_extensions import Self

from speedtronic.callback import Callback, JSONSchema, RankPolicy
from speedtronic.contexts import (
    CoordinateContext,
    EvalEndContext,
    FitContext,
    FitEndContext,
    MetricsContext,
    TeardownContext,
)
from speedtronic.distributed import DistributedContext, ReplicaGroups, replica_groups
from speedtronic.evaluation import EVAL_LOSS
from speedtronic.filters import METRICS_ON_LOGGING_STEPS
from speedtronic_callbacks.diloco.eval_keys import global_eval_metrics
from speedtronic_callbacks.diloco.fragments import FragmentPlan, layout_plan
from speedtronic_callbacks.diloco.math import (
    NesterovOuterOptimizer,
    check_same_layout,
    pseudo_gradient,
    wire_shape,
)
from speedtronic_callbacks.diloco.model_layout import ModelLayout, build_layout
from speedtronic_callbacks.diloco.options import (
    COLLECTIVE_OPTIONS_SCHEMA,
    CollectiveDiLoCoOptions,
)
from speedtronic_callbacks.diloco.wire import Compression

if TYPE_CHECKING:
    from speedtronic.plugins import PluginContext
    from speedtronic.view import TrainerView

__all__ = [
    "COLLECTIVE_OPTIONS_SCHEMA",
    "CollectiveDiLoCo",
    "CollectiveDiLoCoOptions",
]

logger = logging.getLogger("speedtronic.diloco")

STATE_FORMAT = 1
"""Version of ``CollectiveDiLoCo.state_dict``'s layout."""


def _baseline_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy for the baseline: float32 (complex64 for complex entries)."""
    dtype = torch.complex64 if tensor.is_complex() else torch.float32
    return tensor.detach().to("cpu", dtype, copy=True)


@dataclass
class _Exchange:
    """One fragment's exchange in flight (``overlap_steps`` > 0): started at ``started``,
    applied at ``apply_at``. ``snapshot`` holds this replica's weights of the fragment when
    it started (float32 CPU); ``result`` is the replicas' mean pseudo-gradient once the
    all-reduce has completed."""

    fragment: int
    started: int
    apply_at: int
    snapshot: dict[str, torch.Tensor]
    work: dist.Work | None
    wire: torch.Tensor | None
    result: torch.Tensor | None
    started_at: float


def _as_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The raw bytes of ``tensors``, concatenated (exact for every dtype)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(
        [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    )


def _bytes_into(blob: torch.Tensor, offset: int, target: torch.Tensor) -> int:
    """Copy the bytes of ``blob[offset:]`` into ``target`` in place; the next offset."""
    size = target.numel() * target.element_size()
    chunk = blob[offset : offset + size].clone().view(target.dtype).view(target.shape)
    with torch.no_grad():
        target.copy_(chunk.to(target.device))
    return offset + size


class CollectiveDiLoCo(Callback):
    """Synchronous DiLoCo over collectives (see the module docstring).

    ``bytes_reduced`` counts the payload handed to the outer all-reduce so far (what a
    benchmark compares with DDP's gradient traffic).
    """

    plugin_name: ClassVar[str | None] = "diloco"
    options_schema: ClassVar[JSONSchema] = COLLECTIVE_OPTIONS_SCHEMA
    rank_policy: ClassVar[RankPolicy] = "all"
    due_when = METRICS_ON_LOGGING_STEPS  # on_metrics only on logging steps
    state_key = "diloco"

    def __init__(self, options: CollectiveDiLoCoOptions | None = None, **values: object) -> None:
        if options is not None and values:
            raise TypeError("pass CollectiveDiLoCoOptions or keyword options, not both")
        self.options = options or CollectiveDiLoCoOptions.from_mapping(values)
        self.ranks_per_replica = self.options.ranks_per_replica  # speedtronic ReplicaSync
        self.wire_dtype = Compression(self.options.compression).dtype
        self.outer = NesterovOuterOptimizer(self.options.outer_lr, self.options.outer_momentum)
        self.baseline: dict[str, torch.Tensor] = {}
        self.layout: ModelLayout | None = None
        self.outer_steps = 0
        self.bytes_reduced = 0
        self.last_pseudo_grad_norm: float | None = None
        self._context: DistributedContext | None = None
        self._groups: ReplicaGroups | None = None
        self._staged: Mapping[str, object] | None = None
        self.global_eval: dict[str, int | float] | None = None
        """This step's evaluation of the global model, until the metric record takes it."""
        self.plan: FragmentPlan | None = None
        self.in_flight: list[_Exchange] = []
        self.peak_sync_bytes = 0
        """The largest payload of one exchange (about 1/P of the model with P fragments)."""
        self.stall_s = 0.0
        """Seconds the training thread spent waiting for exchanges (the link's stall)."""
        self.link_delay_s = 0.0
        """Testing and benchmarking aid: an exchange's result is not available until this
        many seconds after it started -- a slow link injected into the transport."""
        self._view: TrainerView | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, object], context: PluginContext) -> Self:
        del context
        return cls(CollectiveDiLoCoOptions.from_mapping(options))

    # -- setup ----------------------------------------------------------------------------

    @property
    def streaming(self) -> bool:
        """Whether fragments or overlap are on (not plain DiLoCo)."""
        return self.options.fragments > 1 or self.options.overlap_steps > 0

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._context = trainer.distributed
        self._view = trainer
        self._groups = self._replica_groups(trainer.distributed)
        state = trainer.model.state_dict()
        self.layout = build_layout(state)
        self.plan = layout_plan(self.layout, self.options.fragments, self.options.inner_steps)
        staged, self._staged = self._staged, None
        if staged is not None:  # every rank loaded the same checkpoint: already in step
            self._restore(staged, ctx.start_step)
            if self.streaming or staged.get("replicas") is not None:
                self._restore_streaming(trainer, staged, ctx.start_step)
        elif not self.baseline:  # a fresh start: every replica starts from rank 0's weights
            self._broadcast_from_rank_zero(state)
            self.baseline = {key: _baseline_copy(state[key]) for key in self.layout.sync_keys}
        check_same_layout(
            {key: state[key] for key in self.layout.sync_keys},
            self.baseline,
            what="diloco baseline",
        )

    def _replica_groups(self, context: DistributedContext | None) -> ReplicaGroups | None:
        if context is None or context.world_size < 2:
            if self.ranks_per_replica != 1:
                raise ValueError(
                    f"diloco: ranks_per_replica={self.ranks_per_replica} needs a distributed "
                    "run with a multiple of that many ranks (launch with torchrun)"
                )
            return None
        return replica_groups(
            context, self.ranks_per_replica, peer_timeout_s=self.options.sync_timeout_s
        )

    def _broadcast_from_rank_zero(self, state: Mapping[str, torch.Tensor]) -> None:
        """Give every replica rank 0's weights (one broadcast)."""
        context = self._context
        if context is None or context.world_size < 2 or self.layout is None:
            return
        keys = self.layout.sync_keys
        flat = torch.cat([state[key].detach().reshape(-1).to(torch.float64) for key in keys])
        flat = flat.to(context.collective_device)
        dist.broadcast(flat, src=0)
        self._unflatten_into(flat, state, keys)

    @staticmethod
    def _unflatten_into(
        flat: torch.Tensor, target: Mapping[str, torch.Tensor], keys: tuple[str, ...]
    ) -> None:
        offset = 0
        with torch.no_grad():
            for key in keys:
                tensor = target[key]
                count = tensor.numel()
                tensor.copy_(flat[offset : offset + count].view(tensor.shape).to(tensor.dtype))
                offset += count

    # -- the outer round ------------------------------------------------------------------

    def on_coordinate(self, trainer: TrainerView, ctx: CoordinateContext) -> None:
        """Apply the exchanges due at this step, then start the fragments due at it (with
        ``overlap_steps`` 0 they are applied at once; with one fragment that is the outer
        round at every multiple of ``inner_steps``)."""
        assert self.plan is not None, "on_setup has not run"
        step = ctx.step
        applied = False
        for exchange in [e for e in self.in_flight if e.apply_at <= step]:
            self.in_flight.remove(exchange)
            self._apply(trainer, exchange)
            applied = True
        for fragment in self.plan.due(step):
            if self.options.overlap_steps == 0:
                started = time.perf_counter()
                self._round(trainer, self.plan.fragments[fragment])
                self._stall(started)
                applied = True
            else:
                self.in_flight.append(self._start(trainer, fragment, step))
        if applied and self.options.reset_optimizer:
            trainer.request_optimizer_reset("diloco")

    def _stall(self, started: float) -> None:
        """Count a blocking exchange's time (with the injected link delay) as stall."""
        if self.link_delay_s > 0:
            time.sleep(max(0.0, started + self.link_delay_s - time.perf_counter()))
        self.stall_s += time.perf_counter() - started

    def outer_round(self, trainer: TrainerView) -> None:
        """Average the pseudo-gradients, step the global model, load it everywhere."""
        assert self.layout is not None, "on_setup has not run"
        self._round(trainer, self.layout.sync_keys)

    def _round(self, trainer: TrainerView, keys: tuple[str, ...]) -> None:
        """A blocking exchange of ``keys`` (the whole model, or one fragment): average the
        replicas' pseudo-gradients, step their global, load it into the model."""
        state = trainer.model.state_dict()
        delta = pseudo_gradient(self.baseline, state, keys)
        flat = torch.cat([delta[key].reshape(-1) for key in keys])
        before = self.bytes_reduced
        averaged = self._average(flat)
        self.peak_sync_bytes = max(self.peak_sync_bytes, self.bytes_reduced - before)
        self._outer_update(state, keys, averaged, None)

    def _start(self, trainer: TrainerView, fragment: int, step: int) -> _Exchange:
        """Compute the fragment's pseudo-gradient and start its all-reduce (async)."""
        assert self.plan is not None
        keys = self.plan.fragments[fragment]
        state = trainer.model.state_dict()
        snapshot = {key: _baseline_copy(state[key]) for key in keys}
        delta = pseudo_gradient(self.baseline, snapshot, keys)
        flat = torch.cat([delta[key].reshape(-1) for key in keys])
        work, wire = self._start_average(flat)
        return _Exchange(
            fragment=fragment,
            started=step,
            apply_at=step + self.options.overlap_steps,
            snapshot=snapshot,
            work=work,
            wire=wire,
            result=flat if wire is None else None,
            started_at=time.perf_counter(),
        )

    def _start_average(self, flat: torch.Tensor) -> tuple[dist.Work | None, torch.Tensor | None]:
        """``_average`` started asynchronously: the work handle and the buffer it reduces
        (``(None, None)`` with a single replica: the mean is ``flat`` itself)."""
        groups = self._groups
        context = self._context
        if groups is None or context is None or groups.num_replicas < 2:
            return None, None
        wire = flat.div(groups.num_replicas).to(context.collective_device, self.wire_dtype)
        work = dist.all_reduce(wire, group=groups.peers, async_op=True)
        size = wire.numel() * wire.element_size()
        self.bytes_reduced += size
        self.peak_sync_bytes = max(self.peak_sync_bytes, size)
        return work, wire

    def _wait(self, exchange: _Exchange) -> torch.Tensor:
        """The exchange's mean pseudo-gradient, waiting for it if needed (stall)."""
        if exchange.result is None:
            started = time.perf_counter()
            if self.link_delay_s > 0:
                time.sleep(max(0.0, exchange.started_at + self.link_delay_s - started))
            assert exchange.work is not None and exchange.wire is not None
            exchange.work.wait()
            exchange.result = exchange.wire.to("cpu", torch.float32)
            exchange.work = exchange.wire = None
            self.stall_s += time.perf_counter() - started
        return exchange.result

    def _apply(self, trainer: TrainerView, exchange: _Exchange) -> None:
        """Step the fragment's global and load it, keeping the progress since the start."""
        averaged = self._wait(exchange)
        self._outer_update(trainer.model.state_dict(), tuple(exchange.snapshot), averaged, exchange)

    def _outer_update(
        self,
        state: Mapping[str, torch.Tensor],
        keys: tuple[str, ...],
        averaged: torch.Tensor,
        exchange: _Exchange | None,
    ) -> None:
        """One outer step of ``keys`` with the mean pseudo-gradient ``averaged``; the model
        gets the new global (``exchange`` given: plus the local progress since it started:
        ``global + (current - snapshot)``)."""
        self.last_pseudo_grad_norm = float(averaged.norm())
        mean_delta: dict[str, torch.Tensor] = {}
        offset = 0
        for key in keys:
            shape = wire_shape(self.baseline[key])
            count = math.prod(shape)
            mean_delta[key] = averaged[offset : offset + count].view(shape)
            offset += count
        self.outer.step(self.baseline, mean_delta)
        with torch.no_grad():
            for key in keys:
                target = state[key]
                source = self.baseline[key]
                if exchange is not None:
                    source = source + (_baseline_copy(target) - exchange.snapshot[key])
                target.copy_(source.to(target.device, target.dtype))
        self.outer_steps += 1

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        """Every rank is here: finish the exchanges' communication (applied on schedule by
        the next fit, or kept in the checkpoint)."""
        for exchange in self.in_flight:
            self._wait(exchange)

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        if ctx.error is not None:
            self.in_flight = []  # a failed run: the peers may be gone

    def _average(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` over the replicas: one all-reduce of the wire dtype."""
        groups = self._groups
        context = self._context
        if groups is None or context is None or groups.num_replicas < 2:
            return flat
        count = groups.num_replicas
        wire = flat.div(count).to(context.collective_device, self.wire_dtype)
        dist.all_reduce(wire, group=groups.peers)
        self.bytes_reduced += wire.numel() * wire.element_size()
        return wire.to("cpu", torch.float32)

    def _restore_streaming(
        self, trainer: TrainerView, state: Mapping[str, object], start_step: int
    ) -> None:
        """Restore the exchanges in flight and this replica's own weights, snapshots and
        inner-optimizer state; warn when the checkpoint cannot give them back."""
        saved = (state.get("fragments", 1), state.get("overlap_steps", 0), state.get("inner_steps"))
        current = (self.options.fragments, self.options.overlap_steps, self.options.inner_steps)
        self.peak_sync_bytes = int(cast(int, state.get("peak_sync_bytes", 0)))
        self.stall_s = float(cast(float, state.get("stall_s", 0.0)))
        entries = state.get("in_flight") or []
        assert isinstance(entries, list) and self.plan is not None
        if entries and saved != current:
            warnings.warn(
                f"diloco: the checkpoint was saved with fragments/overlap_steps/inner_steps "
                f"{saved}, this run uses {current}: the {len(entries)} exchange(s) in flight "
                "are dropped",
                UserWarning,
                stacklevel=3,
            )
            entries = []
        for entry in entries:
            fragment = int(entry["fragment"])
            result = entry["result"]
            assert isinstance(result, torch.Tensor)
            keys = self.plan.fragments[fragment]
            self.in_flight.append(
                _Exchange(
                    fragment=fragment,
                    started=int(entry["started"]),
                    apply_at=int(entry["apply_at"]),
                    snapshot={key: torch.empty_like(self.baseline[key]) for key in keys},
                    work=None,
                    wire=None,
                    result=result.to("cpu", torch.float32),
                    started_at=time.perf_counter(),
                )
            )
        if not self._restore_replica(trainer, state.get("replicas")):
            self.in_flight = []
            warnings.warn(
                f"diloco: the checkpoint of step {start_step} holds no per-replica state for "
                "this run's replicas (saved while the fit was failing, or with another number "
                "of replicas): every replica continues from rank 0's local weights and the "
                "exchanges in flight are dropped",
                UserWarning,
                stacklevel=3,
            )

    def _restore_replica(self, trainer: TrainerView, replicas: object) -> bool:
        """Load this replica's blob into the model, the snapshots and the optimizer state;
        ``False`` when there is none for it or its size does not fit."""
        groups = self._groups
        count = 1 if groups is None else groups.num_replicas
        index = 0 if groups is None else groups.replica_index
        if not isinstance(replicas, list) or len(replicas) != count:
            return False
        blob = replicas[index]
        targets = self._replica_tensors(trainer)
        if not isinstance(blob, torch.Tensor) or blob.numel() != sum(
            t.numel() * t.element_size() for t in targets
        ):
            return False
        offset = 0
        for target in targets:
            offset = _bytes_into(blob, offset, target)
        return True

    # -- metrics --------------------------------------------------------------------------

    def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
        """An evaluation right after an outer round measured the global model (every
        replica has just loaded it): reduce the ranks' shares over the whole world into
        ``diloco/eval_global/*``. Every rank evaluates on the same steps, so the one
        all-reduce of two numbers is matched everywhere."""
        if self.streaming or ctx.step % self.options.inner_steps or EVAL_LOSS not in ctx.metrics:
            return  # with fragments or overlap the model is never exactly the global one
        loss = ctx.metrics[EVAL_LOSS]
        context = self._context
        if context is not None and context.world_size > 1:
            sums = torch.tensor([loss * ctx.weight, ctx.weight], dtype=torch.float64).to(
                context.collective_device
            )
            dist.all_reduce(sums)
            loss_sum, weight_sum = (float(value) for value in sums.tolist())
            loss = loss_sum / weight_sum
        self.global_eval = global_eval_metrics(loss, self.outer_steps)

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        pending, self.global_eval = self.global_eval, None
        if pending is not None:
            for key, value in pending.items():
                ctx.record.set(key, value)
        ctx.record.set("diloco/outer_steps", self.outer_steps)
        ctx.record.set("diloco/bytes_reduced", self.bytes_reduced)
        if self.streaming:
            ctx.record.set("diloco/peak_sync_bytes", self.peak_sync_bytes)
            ctx.record.set("diloco/stall_s", self.stall_s)
        if self.last_pseudo_grad_norm is not None:
            ctx.record.set("diloco/pseudo_grad_norm", self.last_pseudo_grad_norm)

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        if self._staged is not None and not self.baseline:
            return dict(self._staged)
        state: dict[str, object] = {
            "format": STATE_FORMAT,
            "mode": "collective",
            "inner_steps": self.options.inner_steps,
            "outer_steps": self.outer_steps,
            "bytes_reduced": self.bytes_reduced,
            "baseline": dict(self.baseline),
            "outer": self.outer.state_dict(),
        }
        if self.streaming:
            state.update(self._streaming_state())
        return state

    def _streaming_state(self) -> dict[str, object]:
        """The exchanges in flight (their communication finished first: every rank is
        saving) and, per replica, its local weights, in-flight snapshots and inner-optimizer
        state (``replicas``, gathered to every rank; ``None`` when the replicas cannot meet,
        i.e. while the fit is failing)."""
        for exchange in self.in_flight:
            self._wait(exchange)
        replicas: list[torch.Tensor] | None = None
        if self._view is not None:
            blob = self._replica_blob(self._view)
            failing = sys.exc_info()[0] is not None  # called from an exception hook
            groups = self._groups
            if groups is None or groups.num_replicas < 2:
                replicas = [blob]
            elif not failing:
                replicas = self._gather(blob, groups)
        return {
            "fragments": self.options.fragments,
            "overlap_steps": self.options.overlap_steps,
            "peak_sync_bytes": self.peak_sync_bytes,
            "stall_s": self.stall_s,
            "in_flight": [
                {
                    "fragment": e.fragment,
                    "started": e.started,
                    "apply_at": e.apply_at,
                    "result": e.result,
                }
                for e in self.in_flight
            ],
            "replicas": replicas,
        }

    def _replica_tensors(self, trainer: TrainerView) -> list[torch.Tensor]:
        """What differs between replicas: the synchronised weights, the in-flight
        exchanges' snapshots and the inner optimizer's state, in a fixed order."""
        assert self.layout is not None
        state = trainer.model.state_dict()
        tensors = [state[key] for key in self.layout.sync_keys]
        for exchange in self.in_flight:
            tensors.extend(exchange.snapshot.values())
        tensors.extend(trainer.optimizer_state_tensors())
        return tensors

    def _replica_blob(self, trainer: TrainerView) -> torch.Tensor:
        return _as_bytes(self._replica_tensors(trainer))

    def _gather(self, blob: torch.Tensor, groups: ReplicaGroups) -> list[torch.Tensor] | None:
        """Every replica's ``blob``; ``None`` (with a warning) when their sizes differ (an
        optimizer that holds state for different parameters on different replicas)."""
        assert self._context is not None
        device = self._context.collective_device
        sizes = [
            torch.zeros(1, dtype=torch.int64, device=device) for _ in range(groups.num_replicas)
        ]
        size = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
        dist.all_gather(sizes, size, group=groups.peers)
        if len({int(item.item()) for item in sizes}) != 1:
            warnings.warn(
                "diloco: the replicas' states differ in size (their inner optimizers hold state "
                "for different parameters); this checkpoint keeps rank 0's replica only",
                UserWarning,
                stacklevel=3,
            )
            return None
        local = blob.to(device)
        gathered = [torch.empty_like(local) for _ in range(groups.num_replicas)]
        dist.all_gather(gathered, local, group=groups.peers)
        return [tensor.to("cpu") for tensor in gathered]

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        if state.get("mode") != "collective" or state.get("format") != STATE_FORMAT:
            raise ValueError(
                "the checkpoint's diloco state is not from synchronous (collective) DiLoCo "
                f"format {STATE_FORMAT} (mode {state.get('mode')!r}, format "
                f"{state.get('format')!r}); resume it with the mode it was saved with"
            )
        baseline = state.get("baseline")
        if not isinstance(baseline, Mapping) or not all(
            isinstance(key, str) and isinstance(value, torch.Tensor)
            for key, value in baseline.items()
        ):
            raise ValueError("diloco state: 'baseline' must map names to tensors")
        self._staged = state
        self.baseline = {}

    def _restore(self, state: Mapping[str, object], start_step: int) -> None:
        baseline = cast(Mapping[str, torch.Tensor], state["baseline"])
        self.baseline = {key: _baseline_copy(value) for key, value in baseline.items()}
        outer = state.get("outer")
        if isinstance(outer, Mapping):
            self.outer.load_state_dict(outer)
        self.outer_steps = int(cast(int, state.get("outer_steps", 0)))
        self.bytes_reduced = int(cast(int, state.get("bytes_reduced", 0)))
        saved_h = int(cast(int, state.get("inner_steps", self.options.inner_steps)))
        horizon = self.options.inner_steps
        if start_step % horizon and not self.streaming:
            changed = f", saved with inner_steps {saved_h}" if saved_h != horizon else ""
            warnings.warn(
                f"diloco: resuming at step {start_step}, which is not the end of an outer "
                f"round (inner_steps {horizon}{changed}): every replica continues from rank "
                "0's local weights and the other replicas' work since the last round is lost. "
                "Save checkpoints at multiples of inner_steps for an exact resume.",
                UserWarning,
                stacklevel=2,
            )
