"""What collective DiLoCo (``collective``) keeps in a checkpoint and how it resumes.

The full state (baseline, outer momentum, counters, error-feedback residuals and norm
histories) is saved under ``state_key = "diloco"``; a streaming run also saves the
exchanges in flight and every replica's local weights, snapshots and inner-optimizer state
(gathered to every rank), so it resumes exactly at any step.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from speedtronic.systems.distributed import ReplicaGroups
from speedtronic_callbacks.diloco.aggregation import NormHistory, RobustSettings
from speedtronic_callbacks.diloco.collective_exchange import (
    Exchange,
    ReplicaExchange,
    baseline_copy,
)
from speedtronic_callbacks.diloco.fragments import FragmentPlan, fragment_name
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.options import CollectiveDiLoCoOptions
from speedtronic_callbacks.diloco.outer_round import OuterRound

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["STATE_FORMAT", "CollectiveCheckpoint", "CollectiveProgress"]

STATE_FORMAT = 1
"""Version of ``CollectiveDiLoCo.state_dict``'s layout."""


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


@dataclass
class CollectiveProgress:
    """The round state that ``CollectiveDiLoCo`` advances and its checkpoint saves and
    restores: one object both hold (as ``progress``)."""

    baseline: dict[str, torch.Tensor] = field(default_factory=dict)
    """The global model's synchronised entries (empty before ``on_setup`` or while a
    loaded checkpoint waits for it)."""
    outer_steps: int = 0
    in_flight: list[Exchange] = field(default_factory=list)
    """Streaming: the exchanges started and not applied yet."""
    peak_sync_bytes: int = 0
    """The largest payload of one exchange (about 1/P of the model with P fragments)."""
    layout: ModelLayout | None = None
    plan: FragmentPlan | None = None


class CollectiveCheckpoint:
    """The checkpoint of ``CollectiveDiLoCo`` (held as its ``checkpoint``):
    ``state_dict``, ``load_state_dict`` (which stages the state) and the restores that
    ``on_setup`` runs once every rank has loaded it (``take_staged``, ``restore``,
    ``restore_streaming``). ``view`` is the trainer a streaming state gathers from."""

    def __init__(
        self,
        options: CollectiveDiLoCoOptions,
        round: OuterRound,
        replicas: ReplicaExchange,
        robust: RobustSettings,
        progress: CollectiveProgress,
    ) -> None:
        self.options = options
        self.round = round
        self.replicas = replicas
        self.robust = robust
        self.progress = progress
        self.view: TrainerView | None = None
        self._staged: Mapping[str, object] | None = None

    def take_staged(self) -> Mapping[str, object] | None:
        """The state ``load_state_dict`` staged (once; ``None``: nothing loaded)."""
        staged, self._staged = self._staged, None
        return staged

    def state_dict(self) -> dict[str, object]:
        if self._staged is not None and not self.progress.baseline:
            return dict(self._staged)
        state: dict[str, object] = {
            "format": STATE_FORMAT,
            "mode": "collective",
            "inner_steps": self.options.inner_steps,
            "outer_steps": self.progress.outer_steps,
            "bytes_reduced": self.replicas.bytes_reduced,
            "baseline": dict(self.progress.baseline),
            "outer": self.round.optimizer.state_dict(),
            **self._robust_state(),
        }
        if self.replicas.streaming:
            state.update(self._streaming_state())
        return state

    def _robust_state(self) -> dict[str, object]:
        """The checkpointed part of encoding and screening: the error-feedback residual,
        the recent norms and the work counters at the last round; with fragments, those
        of every fragment too (``fragment_residuals``, ``fragment_norm_history``)."""
        state: dict[str, object] = {
            "residual": self.replicas.residual,
            "norm_history": self.replicas.norm_history.to_list(),
            "work_mark": None if self.replicas.work_mark is None else list(self.replicas.work_mark),
            "outliers": self.replicas.outliers,
        }
        if self.options.fragments > 1:
            state["fragment_residuals"] = list(self.replicas.residuals)
            state["fragment_norm_history"] = [h.to_list() for h in self.replicas.norm_histories]
        return state

    def _streaming_state(self) -> dict[str, object]:
        """The exchanges in flight (their communication finished first: every rank is
        saving) and, per replica, its local weights, in-flight snapshots and inner-optimizer
        state (``replicas``, gathered to every rank; ``None`` when the replicas cannot meet,
        i.e. while the fit is failing)."""
        for exchange in self.progress.in_flight:
            self.replicas.wait(exchange)
        replicas: list[torch.Tensor] | None = None
        if self.view is not None:
            blob = self._replica_blob(self.view)
            failing = sys.exc_info()[0] is not None  # called from an exception hook
            groups = self.replicas.groups
            if groups is None or groups.num_replicas < 2:
                replicas = [blob]
            elif not failing:
                replicas = self._gather(blob, groups)
        return {
            "fragments": self.options.fragments,
            "overlap_steps": self.options.overlap_steps,
            "peak_sync_bytes": self.progress.peak_sync_bytes,
            "stall_s": self.replicas.stall_s,
            "in_flight": [
                {
                    "fragment": e.fragment,
                    "started": e.started,
                    "apply_at": e.apply_at,
                    "result": e.result,
                    "kept": e.kept,
                }
                for e in self.progress.in_flight
            ],
            "replicas": replicas,
        }

    def _replica_tensors(self, trainer: TrainerView) -> list[torch.Tensor]:
        """What differs between replicas: the synchronised weights, the in-flight
        exchanges' snapshots and the inner optimizer's state, in a fixed order."""
        assert self.progress.layout is not None
        state = trainer.model.state_dict()
        tensors = [state[key] for key in self.progress.layout.sync_keys]
        for exchange in self.progress.in_flight:
            tensors.extend(exchange.snapshot.values())
        tensors.extend(residual for residual in self.replicas.residuals if residual is not None)
        tensors.extend(trainer.optimizer_state_tensors())
        return tensors

    def _replica_blob(self, trainer: TrainerView) -> torch.Tensor:
        return _as_bytes(self._replica_tensors(trainer))

    def _gather(self, blob: torch.Tensor, groups: ReplicaGroups) -> list[torch.Tensor] | None:
        """Every replica's ``blob``; ``None`` (with a warning) when their sizes differ (an
        optimizer that holds state for different parameters on different replicas)."""
        assert self.replicas.context is not None
        device = self.replicas.context.collective_device
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
        self.progress.baseline = {}

    def restore(self, state: Mapping[str, object], start_step: int) -> None:
        baseline = cast(Mapping[str, torch.Tensor], state["baseline"])
        self.progress.baseline = {key: baseline_copy(value) for key, value in baseline.items()}
        outer = state.get("outer")
        if isinstance(outer, Mapping):
            self.round.optimizer.load_state_dict(outer)
        self.progress.outer_steps = int(cast(int, state.get("outer_steps", 0)))
        self.replicas.bytes_reduced = int(cast(int, state.get("bytes_reduced", 0)))
        self._restore_robust(state)
        saved_h = int(cast(int, state.get("inner_steps", self.options.inner_steps)))
        horizon = self.options.inner_steps
        if start_step % horizon and not self.replicas.streaming:
            changed = f", saved with inner_steps {saved_h}" if saved_h != horizon else ""
            warnings.warn(
                f"diloco: resuming at step {start_step}, which is not the end of an outer "
                f"round (inner_steps {horizon}{changed}): every replica continues from rank "
                "0's local weights and the other replicas' work since the last round is lost. "
                "Save checkpoints at multiples of inner_steps for an exact resume.",
                UserWarning,
                stacklevel=2,
            )

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
        self.replicas.residuals = [
            item.detach().to("cpu", torch.float32).clone()
            if isinstance(item, torch.Tensor)
            else None
            for item in residuals
        ]
        self.round.norms.histories = {
            fragment_name(p, count): NormHistory.from_state(self.robust.window, item)
            for p, item in enumerate(histories)
        }
        mark = state.get("work_mark")
        if isinstance(mark, list) and len(mark) == 2:
            self.replicas.work_mark = (int(mark[0]), int(mark[1]))
        self.replicas.outliers = int(cast(int, state.get("outliers", 0)))

    def restore_streaming(
        self, trainer: TrainerView, state: Mapping[str, object], start_step: int
    ) -> None:
        """Restore the exchanges in flight and this replica's own weights, snapshots and
        inner-optimizer state; warn when the checkpoint cannot give them back."""
        saved = (state.get("fragments", 1), state.get("overlap_steps", 0), state.get("inner_steps"))
        current = (self.options.fragments, self.options.overlap_steps, self.options.inner_steps)
        self.progress.peak_sync_bytes = int(cast(int, state.get("peak_sync_bytes", 0)))
        self.replicas.stall_s = float(cast(float, state.get("stall_s", 0.0)))
        entries = state.get("in_flight") or []
        assert isinstance(entries, list) and self.progress.plan is not None
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
            keys = self.progress.plan.fragments[fragment]
            self.progress.in_flight.append(
                Exchange(
                    fragment=fragment,
                    started=int(entry["started"]),
                    apply_at=int(entry["apply_at"]),
                    snapshot={key: torch.empty_like(self.progress.baseline[key]) for key in keys},
                    work=None,
                    wire=None,
                    result=result.to("cpu", torch.float32),
                    started_at=time.perf_counter(),
                    kept=bool(entry.get("kept", True)),
                )
            )
        if not self._restore_replica(trainer, state.get("replicas")):
            self.progress.in_flight = []
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
        groups = self.replicas.groups
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
