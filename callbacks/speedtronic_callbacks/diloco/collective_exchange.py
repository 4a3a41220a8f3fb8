"""The replicas' exchange of collective DiLoCo (``collective``): screening, weighting and
averaging one fragment's pseudo-gradients across the replicas through the run's codec.

A cast codec (fp32/bf16/fp16) averages with **one** ``all_reduce`` of one flat buffer in
its dtype; a block codec (int8/fp4) all-gathers every replica's packed codes and scales
and decodes and combines them in float32, keeping the local quantisation residual for the
next round (error feedback). Before either, one all-gather of a few numbers per replica
(norm, tokens, samples, codec) screens outliers and weights the replicas by work through
the ``OuterRound`` the exchange shares with its owner (policy ``ReplicaAverage``). With
``overlap_steps`` the exchange is started asynchronously (``Exchange``) and waited for
when it is applied.

``ReplicaExchange`` is a component ``CollectiveDiLoCo`` holds (``replicas``): the
transport of a round, as the hub's files are the master's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from speedtronic.systems.distributed import DistributedContext, ReplicaGroups
from speedtronic_callbacks.diloco.aggregation import NormHistory
from speedtronic_callbacks.diloco.codec import BLOCK_SIZE, BlockCodec, CastCodec, Codec, Packed
from speedtronic_callbacks.diloco.codecs import registered_codecs
from speedtronic_callbacks.diloco.fragments import FragmentPlan, fragment_name
from speedtronic_callbacks.diloco.math import StateDict
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.options import CollectiveDiLoCoOptions
from speedtronic_callbacks.diloco.outer_round import Contribution, OuterRound, share_by_work

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["Exchange", "ReplicaExchange", "baseline_copy"]

logger = logging.getLogger("speedtronic.diloco")


def baseline_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy for the baseline: float32 (complex64 for complex entries)."""
    dtype = torch.complex64 if tensor.is_complex() else torch.float32
    return tensor.detach().to("cpu", dtype, copy=True)


@dataclass
class Exchange:
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


class ReplicaExchange:
    """The replicas' exchange, held by ``CollectiveDiLoCo``: the collectives' transport of
    one fragment's pseudo-gradients (screening numbers, the average or the packed
    gathers) and what it keeps across rounds -- the error-feedback residuals, the work
    counters at the last round, the bytes and stall it counted. The round itself (judge,
    weights, outer step) is the ``OuterRound`` it shares with its owner."""

    def __init__(
        self, options: CollectiveDiLoCoOptions, encoding: Codec, round_: OuterRound
    ) -> None:
        self.options = options
        self.encoding = encoding
        self.round = round_
        self.residuals: list[torch.Tensor | None] = [None] * options.fragments
        """Per fragment: what int8/fp4 dropped from this replica's last pseudo-gradient of
        it (error feedback)."""
        self.work_mark: tuple[int, int] | None = None
        """The trainer's tokens and samples at the last round."""
        self.kept = True
        """Whether the last screening kept any replica (``False``: no outer step)."""
        self.outliers = 0
        """Pseudo-gradients clipped or left out as outliers so far (all replicas)."""
        self.bytes_reduced = 0
        self.stall_s = 0.0
        """Seconds the training thread spent waiting for exchanges (the link's stall)."""
        self.link_delay_s = 0.0
        """Testing and benchmarking aid: an exchange's result is not available until this
        many seconds after it started -- a slow link injected into the transport."""
        self.context: DistributedContext | None = None
        self.groups: ReplicaGroups | None = None

    @property
    def wire_dtype(self) -> torch.dtype:
        """What the float all-reduce sends: a cast codec's dtype, else float32."""
        encoding = self.encoding
        return encoding.dtype if isinstance(encoding, CastCodec) else torch.float32

    @property
    def streaming(self) -> bool:
        """Whether fragments or overlap are on (not plain DiLoCo)."""
        return self.options.fragments > 1 or self.options.overlap_steps > 0

    def _replica_index(self) -> int:
        return 0 if self.groups is None else self.groups.replica_index

    def exchange(
        self,
        flat: torch.Tensor,
        trainer: TrainerView,
        baseline: StateDict,
        keys: Sequence[str] | None,
        fragment: int = 0,
    ) -> torch.Tensor:
        """The replicas' screened, work-weighted mean pseudo-gradient of ``fragment`` (0:
        the whole model without fragments), through the ``delta_dtype`` encoding. Every
        rank computes the same coefficients from the same gathered numbers; when every
        replica was left out the mean is zero and ``kept`` is false (no outer step: the
        replicas return to the global model). ``baseline`` is the global model, ``keys``
        the fragment's entries of it (``None``: all)."""
        flat, coefficients = self.screen(flat, trainer, baseline, keys, fragment)
        if self.encoding.packed:
            return self.finish_packed(self.start_packed(flat, coefficients, fragment))
        return self.average(self.scaled(flat, coefficients))

    def scaled(self, flat: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
        """This replica's share of the float all-reduce: ``flat`` times its coefficient
        (``flat`` itself when every coefficient is 1: the plain mean, bit for bit)."""
        if all(value == 1.0 for value in coefficients):
            return flat
        return flat * coefficients[self._replica_index()]

    def screen(
        self,
        flat: torch.Tensor,
        trainer: TrainerView,
        baseline: StateDict,
        keys: Sequence[str] | None,
        fragment: int,
    ) -> tuple[torch.Tensor, list[float]]:
        """Add ``fragment``'s error-feedback residual (int8/fp4), gather every replica's
        numbers and judge them against ``fragment``'s own norm history (a fragment's norm
        is not comparable with another fragment's): the pseudo-gradient to send and every
        replica's coefficient. Sets ``kept``."""
        residual = self.residuals[fragment]
        if self.encoding.packed and self.options.error_feedback and residual is not None:
            if residual.numel() == flat.numel():
                flat = flat + residual
        name = fragment_name(fragment, self.options.fragments)
        stats = self.gather_stats(flat, trainer)
        norms = [row[0] for row in stats]
        contributions = [Contribution(norm) for norm in norms]
        screening = self.round.judge(name, contributions, baseline, keys)
        if self.options.weight_by_work:
            share_by_work(
                contributions, [int(row[1]) for row in stats], [int(row[2]) for row in stats]
            )
        coefficients = self.round.weights(contributions)
        self.round.record(name, screening.applied_norms(norms))
        self.kept = screening.kept > 0
        self.outliers += len(screening.outliers)
        if screening.outliers:
            logger.warning(
                "diloco: replica(s) %s sent pseudo-gradient norms %s above the bound %s "
                "(outlier_policy %s)",
                list(screening.outliers),
                [f"{norms[i]:.4g}" for i in screening.outliers],
                screening.bound,
                self.round.norms.settings.policy,
            )
        return flat, coefficients

    def gather_stats(self, flat: torch.Tensor, trainer: TrainerView) -> list[list[float]]:
        """Every replica's ``[norm, tokens, samples, encoding]`` since the last round (one
        all-gather of four float64 numbers); replicas with another ``delta_dtype`` are a
        clear error on every rank instead of a hang in the data exchange."""
        mark = self.work_mark or (0, 0)
        work = (trainer.tokens - mark[0], trainer.samples - mark[1])
        self.work_mark = (trainer.tokens, trainer.samples)
        codes = list(registered_codecs())
        local = torch.tensor(
            [
                float(torch.linalg.vector_norm(flat, dtype=torch.float64)),
                *work,
                codes.index(self.encoding),
            ],
            dtype=torch.float64,
        )
        groups, context = self.groups, self.context
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

    def start_average(self, flat: torch.Tensor) -> tuple[dist.Work | None, torch.Tensor | None]:
        """``_average`` started asynchronously: the work handle and the buffer it reduces
        (``(None, None)`` with a single replica: the mean is ``flat`` itself)."""
        groups = self.groups
        context = self.context
        if groups is None or context is None or groups.num_replicas < 2:
            return None, None
        wire = flat.div(groups.num_replicas).to(context.collective_device, self.wire_dtype)
        work = dist.all_reduce(wire, group=groups.peers, async_op=True)
        self.bytes_reduced += wire.numel() * wire.element_size()
        return work, wire

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` over the replicas: one all-reduce of the wire dtype."""
        groups = self.groups
        context = self.context
        if groups is None or context is None or groups.num_replicas < 2:
            return flat
        count = groups.num_replicas
        wire = flat.div(count).to(context.collective_device, self.wire_dtype)
        dist.all_reduce(wire, group=groups.peers)
        self.bytes_reduced += wire.numel() * wire.element_size()
        return wire.to("cpu", torch.float32)

    def start_packed(
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
        groups, context = self.groups, self.context
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

    def finish_packed(self, gather: _PackedGather) -> torch.Tensor:
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

    def wait(self, exchange: Exchange) -> torch.Tensor:
        """The exchange's mean pseudo-gradient, waiting for it if needed (stall)."""
        if exchange.result is None:
            started = time.perf_counter()
            if self.link_delay_s > 0:
                time.sleep(max(0.0, exchange.started_at + self.link_delay_s - started))
            if exchange.packed is not None:
                exchange.result = self.finish_packed(exchange.packed)
                exchange.packed = None
            else:
                assert exchange.work is not None and exchange.wire is not None
                exchange.work.wait()
                exchange.result = exchange.wire.to("cpu", torch.float32)
                exchange.work = exchange.wire = None
            self.stall_s += time.perf_counter() - started
        return exchange.result

    def _block_codec(self) -> BlockCodec:
        assert isinstance(self.encoding, BlockCodec), "a packed exchange needs a block codec"
        return self.encoding

    def ensure_residuals(self, plan: FragmentPlan, layout: ModelLayout) -> None:
        """With fragments or overlap and int8/fp4 error feedback, every fragment's residual
        exists from the start (zeros): it is per-replica state, part of the replicas'
        checkpoint blob, which needs fixed sizes."""
        if not (self.streaming and self.encoding.packed and self.options.error_feedback):
            return
        for fragment, keys in enumerate(plan.fragments):
            count = sum(math.prod(layout.wire_shapes[key]) for key in keys)
            residual = self.residuals[fragment]
            if residual is None or residual.numel() != count:
                self.residuals[fragment] = torch.zeros(count, dtype=torch.float32)

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
        return [self.round.history(fragment_name(p, count)) for p in range(count)]
