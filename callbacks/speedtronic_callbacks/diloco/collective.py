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
2. gathers every replica's pseudo-gradient norm and token/sample count (one all-gather of
   a few numbers) to screen outliers and weight by work (``aggregation``), then averages
   the pseudo-gradients with **one** ``all_reduce`` of one flat buffer, in float32 or, with
   ``delta_dtype``, bf16/fp16 (half the bytes) -- or, for ``int8``/``fp4``, one
   all-gather of every replica's packed codes and scales, decoded and averaged in float32
   (with ``error_feedback`` the local quantisation residual joins the next round),
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
With tau > 0 the exchange is an asynchronous all-reduce (int8/fp4: asynchronous all-gathers
of the packed codes and scales, after the blocking all-gather of the screening numbers)
started at the fragment's sync step and applied tau steps later with the *delta-carry*
rule: the fragment's new global plus the local progress made since the exchange started.
With P = 1 and tau = 0 this is exactly the round above. Screening and error feedback are
per fragment (a norm history and a residual each). A streaming run's checkpoints hold every
replica's local weights, inner-optimizer state, residuals and in-flight exchange (gathered
to rank 0), so they resume exactly at any step.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.distributed as dist
from typing_extensions import Self

from speedtronic.engine.callback import Callback, JSONSchema, RankPolicy
from speedtronic.engine.contexts import (
    CoordinateContext,
    EvalEndContext,
    FitContext,
    FitEndContext,
    MetricsContext,
    TeardownContext,
)
from speedtronic.engine.evaluation import EVAL_LOSS
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS
from speedtronic.systems.distributed import DistributedContext, ReplicaGroups, replica_groups
from speedtronic_callbacks.diloco.aggregation import (
    NormHistory,
    Screens,
    replica_weights,
    state_norm,
)
from speedtronic_callbacks.diloco.codec import BLOCK_SIZE, BlockCodec, CastCodec, Packed
from speedtronic_callbacks.diloco.codecs import registered_codecs
from speedtronic_callbacks.diloco.eval_keys import global_eval_metrics
from speedtronic_callbacks.diloco.fragments import FragmentPlan, fragment_name, layout_plan
from speedtronic_callbacks.diloco.math import (
    NesterovOuterOptimizer,
    carry,
    check_same_layout,
    flatten,
    pseudo_gradient,
    unflatten,
)
from speedtronic_callbacks.diloco.model_layout import ModelLayout, build_layout
from speedtronic_callbacks.diloco.options import (
    COLLECTIVE_OPTIONS_SCHEMA,
    CollectiveDiLoCoOptions,
    delta_encoding,
    robust_settings,
)

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView
    from speedtronic.plugins import PluginContext

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
    kept: bool = True
    """Whether screening kept any replica (``False``: no outer step for this exchange)."""
    packed: _PackedGather | None = None
    """int8/fp4: the all-gathers in flight (instead of ``work`` and ``wire``)."""


@dataclass
class _PackedGather:
    """An int8/fp4 exchange's all-gathers: their work handles (none with one replica),
    every replica's packed codes and scales (filled when the handles complete), the
    replicas' coefficients and the number of values packed."""

    handles: list[dist.Work]
    sent: list[torch.Tensor]
    """This replica's codes and scales on the collective device, alive until the handles
    complete."""
    codes: list[torch.Tensor]
    scales: list[torch.Tensor]
    coefficients: list[float]
    values: int


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
    optimizer_decay_norms_and_biases: ClassVar[bool | None] = False  # docs/distributed.md

    def __init__(self, options: CollectiveDiLoCoOptions | None = None, **values: object) -> None:
        if options is not None and values:
            raise TypeError("pass CollectiveDiLoCoOptions or keyword options, not both")
        self.options = options or CollectiveDiLoCoOptions.from_mapping(values)
        self.ranks_per_replica = self.options.ranks_per_replica  # speedtronic ReplicaSync
        self.encoding = delta_encoding(self.options)
        self.wire_dtype = (
            self.encoding.dtype if isinstance(self.encoding, CastCodec) else torch.float32
        )
        self.robust = robust_settings(self.options)
        self.screens = Screens(self.robust)
        """The recent pseudo-gradient norms, per fragment (``norm_histories``)."""
        self.residuals: list[torch.Tensor | None] = [None] * self.options.fragments
        """Per fragment: what int8/fp4 dropped from this replica's last pseudo-gradient of
        it (error feedback)."""
        self._work_mark: tuple[int, int] | None = None
        self._kept = True
        self.outliers = 0
        """Pseudo-gradients clipped or left out as outliers so far (all replicas)."""
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
            self._ensure_residuals()
            if self.streaming or staged.get("replicas") is not None:
                self._restore_streaming(trainer, staged, ctx.start_step)
        elif not self.baseline:  # a fresh start: every replica starts from rank 0's weights
            self._broadcast_from_rank_zero(state)
            self.baseline = {key: _baseline_copy(state[key]) for key in self.layout.sync_keys}
        self._ensure_residuals()
        if self._work_mark is None:
            self._work_mark = (trainer.tokens, trainer.samples)
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
                if self.plan.count == 1:
                    self.outer_round(trainer)  # the public hook of plain DiLoCo's round
                else:
                    self._round(trainer, self.plan.fragments[fragment], fragment)
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

    def _round(self, trainer: TrainerView, keys: tuple[str, ...], fragment: int = 0) -> None:
        """A blocking exchange of ``keys`` (the whole model, or fragment ``fragment``):
        average the replicas' pseudo-gradients, step their global, load it into the model."""
        state = trainer.model.state_dict()
        flat = flatten(pseudo_gradient(self.baseline, state, keys), keys)
        before = self.bytes_reduced
        averaged = self._exchange(flat, trainer, fragment)
        self.peak_sync_bytes = max(self.peak_sync_bytes, self.bytes_reduced - before)
        self._outer_update(state, keys, averaged, None)

    def _start(self, trainer: TrainerView, fragment: int, step: int) -> _Exchange:
        """Compute the fragment's pseudo-gradient, screen it (a blocking all-gather of a
        few numbers) and start its exchange (async): an all-reduce, or for int8/fp4 the
        all-gathers of the packed codes and scales."""
        assert self.plan is not None
        keys = self.plan.fragments[fragment]
        state = trainer.model.state_dict()
        snapshot = {key: _baseline_copy(state[key]) for key in keys}
        flat = flatten(pseudo_gradient(self.baseline, snapshot, keys), keys)
        flat, coefficients = self._screen(flat, trainer, fragment)
        exchange = _Exchange(
            fragment=fragment,
            started=step,
            apply_at=step + self.options.overlap_steps,
            snapshot=snapshot,
            work=None,
            wire=None,
            result=None,
            started_at=time.perf_counter(),
            kept=self._kept,
        )
        before = self.bytes_reduced
        if self.encoding.packed:
            exchange.packed = self._start_packed(flat, coefficients, fragment)
        else:
            flat = self._scaled(flat, coefficients)
            exchange.work, exchange.wire = self._start_average(flat)
            exchange.result = flat if exchange.wire is None else None
        self.peak_sync_bytes = max(self.peak_sync_bytes, self.bytes_reduced - before)
        return exchange

    def _start_average(self, flat: torch.Tensor) -> tuple[dist.Work | None, torch.Tensor | None]:
        """``_average`` started asynchronously: the work handle and the buffer it reduces
        (``(None, None)`` with a single replica: the mean is ``flat`` itself)."""
        groups = self._groups
        context = self._context
        if groups is None or context is None or groups.num_replicas < 2:
            return None, None
        wire = flat.div(groups.num_replicas).to(context.collective_device, self.wire_dtype)
        work = dist.all_reduce(wire, group=groups.peers, async_op=True)
        self.bytes_reduced += wire.numel() * wire.element_size()
        return work, wire

    def _wait(self, exchange: _Exchange) -> torch.Tensor:
        """The exchange's mean pseudo-gradient, waiting for it if needed (stall)."""
        if exchange.result is None:
            started = time.perf_counter()
            if self.link_delay_s > 0:
                time.sleep(max(0.0, exchange.started_at + self.link_delay_s - started))
            if exchange.packed is not None:
                exchange.result = self._finish_packed(exchange.packed)
                exchange.packed = None
            else:
                assert exchange.work is not None and exchange.wire is not None
                exchange.work.wait()
                exchange.result = exchange.wire.to("cpu", torch.float32)
                exchange.work = exchange.wire = None
            self.stall_s += time.perf_counter() - started
        return exchange.result

    def _apply(self, trainer: TrainerView, exchange: _Exchange) -> None:
        """Step the fragment's global and load it, keeping the progress since the start."""
        averaged = self._wait(exchange)
        self._kept = exchange.kept
        self._outer_update(trainer.model.state_dict(), tuple(exchange.snapshot), averaged, exchange)

    def _outer_update(
        self,
        state: Mapping[str, torch.Tensor],
        keys: tuple[str, ...],
        averaged: torch.Tensor,
        exchange: _Exchange | None,
    ) -> None:
        """One outer step of ``keys`` with the mean pseudo-gradient ``averaged`` (none when
        screening left every replica out: ``_kept``); the model gets the new global
        (``exchange`` given: plus the local progress since it started, the delta-carry rule
        ``math.carry``: ``global - (snapshot - current)``)."""
        assert self.layout is not None
        self.last_pseudo_grad_norm = float(averaged.norm())
        if self._kept:
            shapes = {key: self.layout.wire_shapes[key] for key in keys}
            self.outer.step(self.baseline, unflatten(averaged, shapes))
        weights: Mapping[str, torch.Tensor] = self.baseline
        if exchange is not None:
            current = {key: _baseline_copy(state[key]) for key in keys}
            weights = carry(self.baseline, pseudo_gradient(exchange.snapshot, current, keys))
        with torch.no_grad():
            for key in keys:
                target = state[key]
                target.copy_(weights[key].to(target.device, target.dtype))
        self.outer_steps += 1

    # -- encoding, screening and weighting (docs/distributed.md) ------------------------

    def _exchange(
        self, flat: torch.Tensor, trainer: TrainerView, fragment: int = 0
    ) -> torch.Tensor:
        """The replicas' screened, work-weighted mean pseudo-gradient of ``fragment`` (0:
        the whole model without fragments), through the ``delta_dtype`` encoding. Every
        rank computes the same coefficients from the same gathered numbers; when every
        replica was left out the mean is zero and ``_kept`` is false (no outer step: the
        replicas return to the global model)."""
        flat, coefficients = self._screen(flat, trainer, fragment)
        if self.encoding.packed:
            return self._finish_packed(self._start_packed(flat, coefficients, fragment))
        return self._average(self._scaled(flat, coefficients))

    def _scaled(self, flat: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
        """This replica's share of the float all-reduce: ``flat`` times its coefficient
        (``flat`` itself when every coefficient is 1: the plain mean, bit for bit)."""
        if all(value == 1.0 for value in coefficients):
            return flat
        return flat * coefficients[self._replica_index()]

    def _screen(
        self, flat: torch.Tensor, trainer: TrainerView, fragment: int
    ) -> tuple[torch.Tensor, list[float]]:
        """Add ``fragment``'s error-feedback residual (int8/fp4), gather every replica's
        numbers and judge them against ``fragment``'s own norm history (a fragment's norm
        is not comparable with another fragment's): the pseudo-gradient to send and every
        replica's coefficient. Sets ``_kept``."""
        residual = self.residuals[fragment]
        if self.encoding.packed and self.options.error_feedback and residual is not None:
            if residual.numel() == flat.numel():
                flat = flat + residual
        name = fragment_name(fragment, self.options.fragments)
        stats = self._gather_stats(flat, trainer)
        norms = [row[0] for row in stats]
        keys = None if self.plan is None else self.plan.fragments[fragment]
        screening = self.screens.judge(name, norms, partial(state_norm, self.baseline, keys))
        coefficients = replica_weights(
            screening,
            [int(row[1]) for row in stats],
            [int(row[2]) for row in stats],
            weight_by_work=self.options.weight_by_work,
        )
        self.screens.record(name, screening.applied_norms(norms))
        self._kept = screening.kept > 0
        self.outliers += len(screening.outliers)
        if screening.outliers:
            logger.warning(
                "diloco: replica(s) %s sent pseudo-gradient norms %s above the bound %s "
                "(outlier_policy %s)",
                list(screening.outliers),
                [f"{norms[i]:.4g}" for i in screening.outliers],
                screening.bound,
                self.robust.policy,
            )
        return flat, coefficients

    @property
    def residual(self) -> torch.Tensor | None:
        """The error-feedback residual of fragment 0 (the whole model without fragments)."""
        return self.residuals[0]

    @property
    def norm_history(self) -> NormHistory:
        """The norm history of fragment 0 (the whole model without fragments)."""
        return self.norm_histories[0]

    @property
    def norm_histories(self) -> list[NormHistory]:
        """Per fragment (one without fragments): the recent pseudo-gradient norms."""
        count = self.options.fragments
        return [self.screens.history(fragment_name(p, count)) for p in range(count)]

    def _replica_index(self) -> int:
        return 0 if self._groups is None else self._groups.replica_index

    def _gather_stats(self, flat: torch.Tensor, trainer: TrainerView) -> list[list[float]]:
        """Every replica's ``[norm, tokens, samples, encoding]`` since the last round (one
        all-gather of four float64 numbers); replicas with another ``delta_dtype`` are a
        clear error on every rank instead of a hang in the data exchange."""
        mark = self._work_mark or (0, 0)
        work = (trainer.tokens - mark[0], trainer.samples - mark[1])
        self._work_mark = (trainer.tokens, trainer.samples)
        codes = list(registered_codecs())
        local = torch.tensor(
            [
                float(torch.linalg.vector_norm(flat, dtype=torch.float64)),
                *work,
                codes.index(self.encoding),
            ],
            dtype=torch.float64,
        )
        groups, context = self._groups, self._context
        if groups is None or context is None or groups.num_replicas < 2:
            return [local.tolist()]
        device_local = local.to(context.collective_device)
        rows = [torch.zeros_like(device_local) for _ in range(groups.num_replicas)]
        dist.all_gather(rows, device_local, group=groups.peers)
        stats = [row.cpu().tolist() for row in rows]
        used = sorted({codes[int(row[3])].name for row in stats if 0 <= row[3] < len(codes)})
        if used != [self.encoding.name]:
            raise ValueError(
                f"diloco: the replicas use different delta_dtype values ({used}); every "
                "rank must be configured with the same one"
            )
        return stats

    def _start_packed(
        self, flat: torch.Tensor, coefficients: list[float], fragment: int
    ) -> _PackedGather:
        """int8/fp4: pack ``flat`` (keeping what the packing dropped as ``fragment``'s
        residual) and start the all-gathers of every replica's codes and scales (async)."""
        packed = self._block_codec().pack(flat)
        if self.options.error_feedback:
            kept = coefficients[self._replica_index()] > 0
            self.residuals[fragment] = (
                flat - packed.codec.unpack(packed) if kept else torch.zeros_like(flat)
            )
        groups, context = self._groups, self._context
        gather = _PackedGather([], [], [packed.codes], [packed.scales], coefficients, flat.numel())
        if groups is None or context is None or groups.num_replicas < 2:
            return gather
        gather.codes, gather.scales = [], []
        for part, rows in ((packed.codes, gather.codes), (packed.scales, gather.scales)):
            local = part.to(context.collective_device)
            gather.sent.append(local)
            rows.extend(torch.empty_like(local) for _ in range(groups.num_replicas))
            gather.handles.append(dist.all_gather(rows, local, group=groups.peers, async_op=True))
            self.bytes_reduced += local.numel() * local.element_size()
        return gather

    def _finish_packed(self, gather: _PackedGather) -> torch.Tensor:
        """Wait for ``_start_packed``'s all-gathers; decode every replica's pseudo-gradient
        and combine them as ``sum(c_i * delta_i) / replicas`` in float32, in replica order."""
        for handle in gather.handles:
            handle.wait()
        gather.handles, gather.sent = [], []
        total = torch.zeros(gather.values, dtype=torch.float32)
        codec = self._block_codec()
        rows = zip(gather.codes, gather.scales, gather.coefficients, strict=True)
        for codes, scales, coefficient in rows:
            if coefficient:
                packed = Packed(codec, gather.values, BLOCK_SIZE, codes.cpu(), scales.cpu())
                total.add_(codec.unpack(packed), alpha=coefficient)
        return total.div_(len(gather.coefficients))

    def _block_codec(self) -> BlockCodec:
        assert isinstance(self.encoding, BlockCodec), "a packed exchange needs a block codec"
        return self.encoding

    def _ensure_residuals(self) -> None:
        """With fragments or overlap and int8/fp4 error feedback, every fragment's residual
        exists from the start (zeros): it is per-replica state, part of the replicas'
        checkpoint blob, which needs fixed sizes."""
        if not (self.streaming and self.encoding.packed and self.options.error_feedback):
            return
        assert self.plan is not None and self.layout is not None
        for fragment, keys in enumerate(self.plan.fragments):
            count = sum(math.prod(self.layout.wire_shapes[key]) for key in keys)
            residual = self.residuals[fragment]
            if residual is None or residual.numel() != count:
                self.residuals[fragment] = torch.zeros(count, dtype=torch.float32)

    def _robust_state(self) -> dict[str, object]:
        """The checkpointed part of encoding and screening: the error-feedback residual,
        the recent norms and the work counters at the last round; with fragments, those
        of every fragment too (``fragment_residuals``, ``fragment_norm_history``)."""
        state: dict[str, object] = {
            "residual": self.residual,
            "norm_history": self.norm_history.to_list(),
            "work_mark": None if self._work_mark is None else list(self._work_mark),
            "outliers": self.outliers,
        }
        if self.options.fragments > 1:
            state["fragment_residuals"] = list(self.residuals)
            state["fragment_norm_history"] = [h.to_list() for h in self.norm_histories]
        return state

    def _restore_robust(self, state: Mapping[str, object]) -> None:
        count = self.options.fragments
        residuals: object = [state.get("residual")]
        histories: object = [state.get("norm_history")]
        if count > 1:  # a checkpoint of another number of fragments starts them afresh
            residuals = state.get("fragment_residuals") or [None] * count
            histories = state.get("fragment_norm_history") or [None] * count
        if not (isinstance(residuals, list) and isinstance(histories, list)):
            raise ValueError("diloco state: fragment residuals and norm histories must be lists")
        if len(residuals) != count or len(histories) != count:
            residuals, histories = [None] * count, [None] * count
        self.residuals = [
            item.detach().to("cpu", torch.float32).clone()
            if isinstance(item, torch.Tensor)
            else None
            for item in residuals
        ]
        self.screens.histories = {
            fragment_name(p, count): NormHistory.from_state(self.robust.window, item)
            for p, item in enumerate(histories)
        }
        mark = state.get("work_mark")
        if isinstance(mark, list) and len(mark) == 2:
            self._work_mark = (int(mark[0]), int(mark[1]))
        self.outliers = int(cast(int, state.get("outliers", 0)))

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
                    kept=bool(entry.get("kept", True)),
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
        ctx.record.set("diloco/outliers", self.outliers)
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
            **self._robust_state(),
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
                    "kept": e.kept,
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
        tensors.extend(residual for residual in self.residuals if residual is not None)
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
        self._restore_robust(state)
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
