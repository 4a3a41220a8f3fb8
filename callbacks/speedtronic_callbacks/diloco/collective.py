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
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.distributed as dist
from typing_extensions import Self

from speedtronic.callback import Callback, JSONSchema, RankPolicy
from speedtronic.contexts import CoordinateContext, EvalEndContext, FitContext, MetricsContext
from speedtronic.distributed import DistributedContext, ReplicaGroups, replica_groups
from speedtronic.evaluation import EVAL_LOSS
from speedtronic.filters import METRICS_ON_LOGGING_STEPS
from speedtronic_callbacks.diloco.aggregation import (
    MIN_REFERENCE,
    NormHistory,
    replica_coefficients,
    state_norm,
)
from speedtronic_callbacks.diloco.encoding import BLOCK_SIZE, Encoding, Packed, pack, unpack
from speedtronic_callbacks.diloco.eval_keys import global_eval_metrics
from speedtronic_callbacks.diloco.math import (
    NesterovOuterOptimizer,
    check_same_layout,
    pseudo_gradient,
)
from speedtronic_callbacks.diloco.model_layout import ModelLayout, build_layout
from speedtronic_callbacks.diloco.options import (
    COLLECTIVE_OPTIONS_SCHEMA,
    CollectiveDiLoCoOptions,
    delta_encoding,
    robust_settings,
)

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
        self.wire_dtype = torch.float32 if self.encoding.packed else self.encoding.float_dtype
        self.robust = robust_settings(self.options)
        self.norm_history = NormHistory(self.robust.window)
        self.residual: torch.Tensor | None = None
        """What int8/fp4 dropped from this replica's last pseudo-gradient (error feedback)."""
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

    @classmethod
    def from_options(cls, options: Mapping[str, object], context: PluginContext) -> Self:
        del context
        return cls(CollectiveDiLoCoOptions.from_mapping(options))

    # -- setup ----------------------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._context = trainer.distributed
        self._groups = self._replica_groups(trainer.distributed)
        state = trainer.model.state_dict()
        self.layout = build_layout(state)
        staged, self._staged = self._staged, None
        if staged is not None:  # every rank loaded the same checkpoint: already in step
            self._restore(staged, ctx.start_step)
        elif not self.baseline:  # a fresh start: every replica starts from rank 0's weights
            self._broadcast_from_rank_zero(state)
            self.baseline = {key: _baseline_copy(state[key]) for key in self.layout.sync_keys}
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
        if ctx.step % self.options.inner_steps:
            return
        self.outer_round(trainer)
        if self.options.reset_optimizer:
            trainer.request_optimizer_reset("diloco")

    def outer_round(self, trainer: TrainerView) -> None:
        """Average the pseudo-gradients, step the global model, load it everywhere."""
        assert self.layout is not None, "on_setup has not run"
        keys = self.layout.sync_keys
        state = trainer.model.state_dict()
        delta = pseudo_gradient(self.baseline, state, keys)
        flat = torch.cat([delta[key].reshape(-1) for key in keys])
        averaged = self._exchange(flat, trainer)
        self.last_pseudo_grad_norm = float(averaged.norm())
        offset = 0
        mean_delta: dict[str, torch.Tensor] = {}
        for key in keys:
            shape = delta[key].shape
            count = delta[key].numel()
            mean_delta[key] = averaged[offset : offset + count].view(shape)
            offset += count
        if self._kept:
            self.outer.step(self.baseline, mean_delta)
        with torch.no_grad():
            for key in keys:
                target = state[key]
                source = self.baseline[key]
                if target.is_complex():
                    target.copy_(source.to(target.device))
                else:
                    target.copy_(source.to(target.device, target.dtype))
        self.outer_steps += 1

    # -- encoding, screening and weighting (docs/distributed.md) ------------------------

    def _exchange(self, flat: torch.Tensor, trainer: TrainerView) -> torch.Tensor:
        """The replicas' screened, work-weighted mean pseudo-gradient, through the
        ``delta_dtype`` encoding. Every rank computes the same coefficients from the same
        gathered numbers; when every replica was left out the mean is zero and
        ``_kept`` is false (no outer step: the replicas return to the global model)."""
        if self.encoding.packed and self.options.error_feedback and self.residual is not None:
            flat = flat + self.residual
        stats = self._gather_stats(flat, trainer)
        norms = [row[0] for row in stats]
        model_norm = None
        if len(self.norm_history.norms) + len(norms) < MIN_REFERENCE:
            model_norm = state_norm(self.baseline)
        coefficients, screening = replica_coefficients(
            norms,
            [int(row[1]) for row in stats],
            [int(row[2]) for row in stats],
            self.norm_history,
            self.robust,
            weight_by_work=self.options.weight_by_work,
            model_norm=model_norm,
        )
        self.norm_history.record(screening.applied_norms(norms))
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
        mine = coefficients[self._replica_index()]
        if self.encoding.packed:
            return self._average_packed(flat, coefficients)
        if all(value == 1.0 for value in coefficients):
            return self._average(flat)  # the plain mean, bit for bit as without screening
        return self._average(flat * mine)

    def _replica_index(self) -> int:
        return 0 if self._groups is None else self._groups.replica_index

    def _gather_stats(self, flat: torch.Tensor, trainer: TrainerView) -> list[list[float]]:
        """Every replica's ``[norm, tokens, samples, encoding]`` since the last round (one
        all-gather of four float64 numbers); replicas with another ``delta_dtype`` are a
        clear error on every rank instead of a hang in the data exchange."""
        mark = self._work_mark or (0, 0)
        work = (trainer.tokens - mark[0], trainer.samples - mark[1])
        self._work_mark = (trainer.tokens, trainer.samples)
        codes = list(Encoding)
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
        used = sorted({codes[int(row[3])].value for row in stats if 0 <= row[3] < len(codes)})
        if used != [self.encoding.value]:
            raise ValueError(
                f"diloco: the replicas use different delta_dtype values ({used}); every "
                "rank must be configured with the same one"
            )
        return stats

    def _average_packed(self, flat: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
        """int8/fp4: every replica's packed codes and scales are all-gathered, decoded and
        combined as ``sum(c_i * delta_i) / replicas`` in float32, in replica order."""
        packed = pack(flat, self.encoding)
        if self.options.error_feedback:
            kept = coefficients[self._replica_index()] > 0
            self.residual = flat - unpack(packed) if kept else torch.zeros_like(flat)
        groups, context = self._groups, self._context
        received = [(packed.codes, packed.scales)]
        if groups is not None and context is not None and groups.num_replicas >= 2:
            gathered: list[list[torch.Tensor]] = []
            for part in (packed.codes, packed.scales):
                local = part.to(context.collective_device)
                rows = [torch.empty_like(local) for _ in range(groups.num_replicas)]
                dist.all_gather(rows, local, group=groups.peers)
                gathered.append([row.cpu() for row in rows])
                self.bytes_reduced += local.numel() * local.element_size()
            received = list(zip(gathered[0], gathered[1], strict=True))
        total = torch.zeros(flat.numel(), dtype=torch.float32)
        for (codes, scales), coefficient in zip(received, coefficients, strict=True):
            if coefficient:
                values = unpack(Packed(self.encoding, flat.numel(), BLOCK_SIZE, codes, scales))
                total.add_(values, alpha=coefficient)
        return total.div_(len(coefficients))

    def _robust_state(self) -> dict[str, object]:
        """The checkpointed part of encoding and screening: the error-feedback residual,
        the recent norms and the work counters at the last round."""
        return {
            "residual": self.residual,
            "norm_history": self.norm_history.to_list(),
            "work_mark": None if self._work_mark is None else list(self._work_mark),
            "outliers": self.outliers,
        }

    def _restore_robust(self, state: Mapping[str, object]) -> None:
        residual = state.get("residual")
        self.residual = (
            residual.detach().to("cpu", torch.float32).clone()
            if isinstance(residual, torch.Tensor)
            else None
        )
        self.norm_history = NormHistory.from_state(self.robust.window, state.get("norm_history"))
        mark = state.get("work_mark")
        if isinstance(mark, list) and len(mark) == 2:
            self._work_mark = (int(mark[0]), int(mark[1]))
        self.outliers = int(cast(int, state.get("outliers", 0)))

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

    # -- metrics --------------------------------------------------------------------------

    def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
        """An evaluation right after an outer round measured the global model (every
        replica has just loaded it): reduce the ranks' shares over the whole world into
        ``diloco/eval_global/*``. Every rank evaluates on the same steps, so the one
        all-reduce of two numbers is matched everywhere."""
        if ctx.step % self.options.inner_steps or EVAL_LOSS not in ctx.metrics:
            return
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
        if self.last_pseudo_grad_norm is not None:
            ctx.record.set("diloco/pseudo_grad_norm", self.last_pseudo_grad_norm)

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        if self._staged is not None and not self.baseline:
            return dict(self._staged)
        return {
            "format": STATE_FORMAT,
            "mode": "collective",
            "inner_steps": self.options.inner_steps,
            "outer_steps": self.outer_steps,
            "bytes_reduced": self.bytes_reduced,
            "baseline": dict(self.baseline),
            "outer": self.outer.state_dict(),
            **self._robust_state(),
        }

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
        if start_step % horizon:
            changed = f", saved with inner_steps {saved_h}" if saved_h != horizon else ""
            warnings.warn(
                f"diloco: resuming at step {start_step}, which is not the end of an outer "
                f"round (inner_steps {horizon}{changed}): every replica continues from rank "
                "0's local weights and the other replicas' work since the last round is lost. "
                "Save checkpoints at multiples of inner_steps for an exact resume.",
                UserWarning,
                stacklevel=2,
            )
