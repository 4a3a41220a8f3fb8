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

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

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
from speedtronic_callbacks.diloco.aggregation import NormHistory
from speedtronic_callbacks.diloco.codec import Codec
from speedtronic_callbacks.diloco.collective_exchange import (
    Exchange,
    ReplicaExchange,
    baseline_copy,
)
from speedtronic_callbacks.diloco.collective_state import CollectiveCheckpoint, CollectiveProgress
from speedtronic_callbacks.diloco.eval_keys import global_eval_metrics
from speedtronic_callbacks.diloco.fragments import FragmentPlan, layout_plan
from speedtronic_callbacks.diloco.math import (
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
from speedtronic_callbacks.diloco.outer_round import OuterRound, ReplicaAverage

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView
    from speedtronic.plugins import PluginContext

__all__ = [
    "COLLECTIVE_OPTIONS_SCHEMA",
    "CollectiveDiLoCo",
    "CollectiveDiLoCoOptions",
]


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
        self.robust = robust_settings(self.options)
        self.round = OuterRound(
            self.robust,
            ReplicaAverage(),
            lr=self.options.outer_lr,
            momentum=self.options.outer_momentum,
        )
        """Judge, weights and the outer step of the baseline (its ``norms``: the recent
        pseudo-gradient norms per fragment, ``norm_histories``; its ``optimizer``: the
        outer momentum)."""
        self.replicas = ReplicaExchange(self.options, delta_encoding(self.options), self.round)
        """The transport of a round: the collectives between the replicas."""
        self.progress = CollectiveProgress()
        """The baseline, the rounds so far, the exchanges in flight, layout and plan."""
        self.checkpoint = CollectiveCheckpoint(
            self.options, self.round, self.replicas, self.robust, self.progress
        )
        """Saves and restores ``progress`` with the exchange's and the round's state."""
        self.last_pseudo_grad_norm: float | None = None
        self.global_eval: dict[str, int | float] | None = None
        """This step's evaluation of the global model, until the metric record takes it."""

    @property
    def baseline(self) -> dict[str, torch.Tensor]:
        return self.progress.baseline

    @property
    def outer_steps(self) -> int:
        return self.progress.outer_steps

    @property
    def in_flight(self) -> list[Exchange]:
        return self.progress.in_flight

    @property
    def peak_sync_bytes(self) -> int:
        return self.progress.peak_sync_bytes

    @property
    def layout(self) -> ModelLayout | None:
        return self.progress.layout

    @property
    def plan(self) -> FragmentPlan | None:
        return self.progress.plan

    def state_dict(self) -> dict[str, object]:
        return self.checkpoint.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.checkpoint.load_state_dict(state)

    @classmethod
    def from_options(cls, options: Mapping[str, object], context: PluginContext) -> Self:
        del context
        return cls(CollectiveDiLoCoOptions.from_mapping(options))

    # -- the exchange's figures and state, read through the callback -----------------

    @property
    def streaming(self) -> bool:
        """Whether fragments or overlap are on (not plain DiLoCo)."""
        return self.replicas.streaming

    @property
    def encoding(self) -> Codec:
        """The codec of the pseudo-gradients' exchange (``delta_dtype``; Python may set any
        registered codec before the fit)."""
        return self.replicas.encoding

    @encoding.setter
    def encoding(self, codec: Codec) -> None:
        self.replicas.encoding = codec

    @property
    def bytes_reduced(self) -> int:
        return self.replicas.bytes_reduced

    @property
    def stall_s(self) -> float:
        return self.replicas.stall_s

    @property
    def link_delay_s(self) -> float:
        return self.replicas.link_delay_s

    @link_delay_s.setter
    def link_delay_s(self, seconds: float) -> None:
        self.replicas.link_delay_s = seconds

    @property
    def outliers(self) -> int:
        return self.replicas.outliers

    @property
    def residuals(self) -> list[torch.Tensor | None]:
        return self.replicas.residuals

    @property
    def residual(self) -> torch.Tensor | None:
        return self.replicas.residual

    @property
    def norm_history(self) -> NormHistory:
        return self.replicas.norm_history

    @property
    def norm_histories(self) -> list[NormHistory]:
        return self.replicas.norm_histories

    def _keys(self, fragment: int) -> tuple[str, ...] | None:
        """The global's entries of ``fragment`` (``None`` before ``on_setup``: all)."""
        return None if self.progress.plan is None else self.progress.plan.fragments[fragment]

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self.replicas.context = trainer.distributed
        self.checkpoint.view = trainer
        self.replicas.groups = self._replica_groups(trainer.distributed)
        state = trainer.model.state_dict()
        progress = self.progress
        progress.layout = layout = build_layout(state)
        progress.plan = plan = layout_plan(layout, self.options.fragments, self.options.inner_steps)
        staged = self.checkpoint.take_staged()
        if staged is not None:  # every rank loaded the same checkpoint: already in step
            self.checkpoint.restore(staged, ctx.start_step)
            self.replicas.ensure_residuals(plan, layout)
            if self.streaming or staged.get("replicas") is not None:
                self.checkpoint.restore_streaming(trainer, staged, ctx.start_step)
        elif not progress.baseline:  # a fresh start: every replica starts from rank 0's weights
            self._broadcast_from_rank_zero(state)
            progress.baseline = {key: baseline_copy(state[key]) for key in layout.sync_keys}
        self.replicas.ensure_residuals(plan, layout)
        if self.replicas.work_mark is None:
            self.replicas.work_mark = (trainer.tokens, trainer.samples)
        check_same_layout(
            {key: state[key] for key in layout.sync_keys},
            progress.baseline,
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
        context = self.replicas.context
        if context is None or context.world_size < 2 or self.progress.layout is None:
            return
        keys = self.progress.layout.sync_keys
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

    def on_coordinate(self, trainer: TrainerView, ctx: CoordinateContext) -> None:
        """Apply the exchanges due at this step, then start the fragments due at it (with
        ``overlap_steps`` 0 they are applied at once; with one fragment that is the outer
        round at every multiple of ``inner_steps``)."""
        assert self.progress.plan is not None, "on_setup has not run"
        step = ctx.step
        applied = False
        for exchange in [e for e in self.progress.in_flight if e.apply_at <= step]:
            self.progress.in_flight.remove(exchange)
            self._apply(trainer, exchange)
            applied = True
        for fragment in self.progress.plan.due(step):
            if self.options.overlap_steps == 0:
                started = time.perf_counter()
                if self.progress.plan.count == 1:
                    self.outer_round(trainer)  # the public hook of plain DiLoCo's round
                else:
                    self._round(trainer, self.progress.plan.fragments[fragment], fragment)
                self._stall(started)
                applied = True
            else:
                self.progress.in_flight.append(self._start(trainer, fragment, step))
        if applied and self.options.reset_optimizer:
            trainer.request_optimizer_reset("diloco")

    def _stall(self, started: float) -> None:
        """Count a blocking exchange's time (with the injected link delay) as stall."""
        replicas = self.replicas
        if replicas.link_delay_s > 0:
            time.sleep(max(0.0, started + replicas.link_delay_s - time.perf_counter()))
        replicas.stall_s += time.perf_counter() - started

    def outer_round(self, trainer: TrainerView) -> None:
        """Average the pseudo-gradients, step the global model, load it everywhere."""
        assert self.progress.layout is not None, "on_setup has not run"
        self._round(trainer, self.progress.layout.sync_keys)

    def _round(self, trainer: TrainerView, keys: tuple[str, ...], fragment: int = 0) -> None:
        """A blocking exchange of ``keys`` (the whole model, or fragment ``fragment``):
        average the replicas' pseudo-gradients, step their global, load it into the model."""
        state = trainer.model.state_dict()
        flat = flatten(pseudo_gradient(self.progress.baseline, state, keys), keys)
        before = self.replicas.bytes_reduced
        averaged = self.replicas.exchange(
            flat, trainer, self.progress.baseline, self._keys(fragment), fragment
        )
        self._note_payload(before)
        self._outer_update(state, keys, averaged, None)

    def _note_payload(self, before: int) -> None:
        """Count the payload reduced since ``bytes_reduced`` was ``before`` into the peak."""
        progress = self.progress
        progress.peak_sync_bytes = max(
            progress.peak_sync_bytes, self.replicas.bytes_reduced - before
        )

    def _start(self, trainer: TrainerView, fragment: int, step: int) -> Exchange:
        """Compute the fragment's pseudo-gradient, screen it (a blocking all-gather of a
        few numbers) and start its exchange (async): an all-reduce, or for int8/fp4 the
        all-gathers of the packed codes and scales."""
        assert self.progress.plan is not None
        keys = self.progress.plan.fragments[fragment]
        state = trainer.model.state_dict()
        snapshot = {key: baseline_copy(state[key]) for key in keys}
        flat = flatten(pseudo_gradient(self.progress.baseline, snapshot, keys), keys)
        flat, coefficients = self.replicas.screen(
            flat, trainer, self.progress.baseline, keys, fragment
        )
        exchange = Exchange(
            fragment=fragment,
            started=step,
            apply_at=step + self.options.overlap_steps,
            snapshot=snapshot,
            work=None,
            wire=None,
            result=None,
            started_at=time.perf_counter(),
            kept=self.replicas.kept,
        )
        before = self.replicas.bytes_reduced
        if self.encoding.packed:
            exchange.packed = self.replicas.start_packed(flat, coefficients, fragment)
        else:
            flat = self.replicas.scaled(flat, coefficients)
            exchange.work, exchange.wire = self.replicas.start_average(flat)
            exchange.result = flat if exchange.wire is None else None
        self._note_payload(before)
        return exchange

    def _apply(self, trainer: TrainerView, exchange: Exchange) -> None:
        """Step the fragment's global and load it, keeping the progress since the start."""
        averaged = self.replicas.wait(exchange)
        self.replicas.kept = exchange.kept
        self._outer_update(trainer.model.state_dict(), tuple(exchange.snapshot), averaged, exchange)

    def _outer_update(
        self,
        state: Mapping[str, torch.Tensor],
        keys: tuple[str, ...],
        averaged: torch.Tensor,
        exchange: Exchange | None,
    ) -> None:
        """One outer step of ``keys`` with the mean pseudo-gradient ``averaged`` (none when
        screening left every replica out: ``_kept``); the model gets the new global
        (``exchange`` given: plus the local progress since it started, the delta-carry rule
        ``math.carry``: ``global - (snapshot - current)``)."""
        assert self.progress.layout is not None
        self.last_pseudo_grad_norm = float(averaged.norm())
        if self.replicas.kept:
            shapes = {key: self.progress.layout.wire_shapes[key] for key in keys}
            self.round.step(self.progress.baseline, unflatten(averaged, shapes))
        weights: Mapping[str, torch.Tensor] = self.progress.baseline
        if exchange is not None:
            current = {key: baseline_copy(state[key]) for key in keys}
            weights = carry(
                self.progress.baseline, pseudo_gradient(exchange.snapshot, current, keys)
            )
        with torch.no_grad():
            for key in keys:
                target = state[key]
                target.copy_(weights[key].to(target.device, target.dtype))
        self.progress.outer_steps += 1

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        """Every rank is here: finish the exchanges' communication (applied on schedule by
        the next fit, or kept in the checkpoint)."""
        for exchange in self.progress.in_flight:
            self.replicas.wait(exchange)

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        if ctx.error is not None:
            self.progress.in_flight = []  # a failed run: the peers may be gone

    def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
        """An evaluation right after an outer round measured the global model (every
        replica has just loaded it): reduce the ranks' shares over the whole world into
        ``diloco/eval_global/*``. Every rank evaluates on the same steps, so the one
        all-reduce of two numbers is matched everywhere."""
        if self.streaming or ctx.step % self.options.inner_steps or EVAL_LOSS not in ctx.metrics:
            return  # with fragments or overlap the model is never exactly the global one
        loss = ctx.metrics[EVAL_LOSS]
        context = self.replicas.context
        if context is not None and context.world_size > 1:
            sums = torch.tensor([loss * ctx.weight, ctx.weight], dtype=torch.float64).to(
                context.collective_device
            )
            dist.all_reduce(sums)
            loss_sum, weight_sum = (float(value) for value in sums.tolist())
            loss = loss_sum / weight_sum
        self.global_eval = global_eval_metrics(loss, self.progress.outer_steps)

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        pending, self.global_eval = self.global_eval, None
        if pending is not None:
            for key, value in pending.items():
                ctx.record.set(key, value)
        ctx.record.set("diloco/outer_steps", self.progress.outer_steps)
        ctx.record.set("diloco/bytes_reduced", self.bytes_reduced)
        ctx.record.set("diloco/outliers", self.outliers)
        if self.streaming:
            ctx.record.set("diloco/peak_sync_bytes", self.progress.peak_sync_bytes)
            ctx.record.set("diloco/stall_s", self.stall_s)
        if self.last_pseudo_grad_norm is not None:
            ctx.record.set("diloco/pseudo_grad_norm", self.last_pseudo_grad_norm)
