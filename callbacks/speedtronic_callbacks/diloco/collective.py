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
        averaged = self._average(flat)
        self.last_pseudo_grad_norm = float(averaged.norm())
        offset = 0
        mean_delta: dict[str, torch.Tensor] = {}
        for key in keys:
            shape = delta[key].shape
            count = delta[key].numel()
            mean_delta[key] = averaged[offset : offset + count].view(shape)
            offset += count
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
