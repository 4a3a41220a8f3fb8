"""Evaluation: the loss of the model on a held-out set, during a fit and on demand.

``evaluate_model`` is the evaluation pass. It runs the raw model (never the DDP or compiled
wrapper) under ``torch.inference_mode()`` in ``model.eval()`` (dropout off), with the run's
autocast, and restores the model's training mode and every random number generator
afterwards, so an evaluation changes nothing the training stream depends on: a run with
evaluation resumes bit for bit like one without.

The loss is averaged by *tokens* for causal-LM batches (integer labels of two or more
dimensions: each batch's mean loss is weighted by its count of labels that are not
``-100``, so padding counts for nothing) and by *samples* otherwise. The sums stay on the
device and are read back once per evaluation (no per-batch host sync); in a distributed run
each rank evaluates its shard and the two sums are all-reduced before the division, so
``eval/loss`` is the token-weighted mean over the whole held-out set.

``Evaluation`` is what a Trainer evaluates during a fit (the held-out data, how often, how
many batches). ``run_step_evaluation`` is what the per-step loop calls on evaluation steps:
it emits ``eval_start`` and ``eval_end`` around the pass and leaves the results in the
training state for the step's metric record.

``Evaluation.parts`` names the parts of a held-out set read part by part (a mixture's
sources, each batch from one of them): each part's token-weighted loss is reported as
``eval/<part>/loss`` beside the whole set's ``eval/loss``, from the same forward passes and
the same one all-reduce.

``Evaluation.tasks`` are downstream tasks (``EvalTask``, e.g. the multiple-choice tasks of
``speedtronic.evaluation.tasks``) scored on the same steps; their metrics
(``eval/<task>/acc``...) join the held-out loss in ``eval_end`` and in the step's record, so
early stopping and the best checkpoint can monitor them like ``eval/loss``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from speedtronic.data.collate import batch_size_and_tokens
from speedtronic.engine.batch import (
    IGNORE_INDEX,
    batch_labels,
    move_to_device,
    resolve_loss,
    run_model,
)
from speedtronic.engine.contexts import EvalEndContext, EvalStartContext
from speedtronic.engine.events import On
from speedtronic.engine.metrics import MetricRecord
from speedtronic.engine.stop_watch import StopTimeoutError
from speedtronic.state.rng import capture_rng_state, restore_rng_state
from speedtronic.systems.precision import PrecisionPlan, autocast_context
from speedtronic.systems.sharding import reshard_model

if TYPE_CHECKING:
    from speedtronic.data.stream import DataPass
    from speedtronic.engine.state import TrainingState
    from speedtronic.engine.trainer import Trainer
    from speedtronic.systems.distributed import DistributedContext

__all__ = [
    "EVAL_LOSS",
    "EVAL_PPL",
    "EvalOutcome",
    "EvalTask",
    "Evaluation",
    "EvaluationError",
    "HeldOutParts",
    "add_eval_results",
    "check_eval_settings",
    "evaluate_model",
    "evaluate_state",
    "is_eval_step",
    "run_step_evaluation",
]

EVAL_LOSS = "eval/loss"
"""The metric key of the held-out loss."""
EVAL_PPL = "eval/ppl"
"""The metric key of the held-out perplexity, ``exp(eval/loss)``."""


class EvaluationError(ValueError):
    """Evaluation cannot run: no held-out data, an empty held-out set, a bad setting."""


@dataclass(frozen=True)
class EvalOutcome:
    """One evaluation's results: ``metrics`` (``eval/loss``, ``eval/ppl``), the number of
    batches this rank evaluated and the total weight (tokens or samples, all ranks)."""

    metrics: Mapping[str, float]
    batches: int
    weight: float


def check_eval_settings(every: int | None, max_batches: int | None) -> None:
    """``EvaluationError`` naming the setting when the cadence or the batch limit is not a
    positive integer."""
    for name, value in (("eval_every", every), ("eval_max_batches", max_batches)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EvaluationError(f"{name} must be a positive integer or None, got {value!r}")


class EvalTask(Protocol):
    """A downstream task scored on evaluation steps beside the held-out loss."""

    def evaluate(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        precision: PrecisionPlan | None,
        distributed: DistributedContext | None,
    ) -> Mapping[str, float]:
        """The task's metrics (``eval/...`` keys), the same on every rank: ranks that share
        ``distributed`` split the work and reduce; ``None`` means this rank does it all.
        Ranks of an FSDP-sharded model must make the same number of forward passes (each
        gathers the shards together).
        The model's mode and every random state must be left as they were."""
        ...


@dataclass(frozen=True)
class HeldOutParts:
    """The parts of a held-out set: ``names`` (every part, the same on every rank) and
    ``of_batch``, the index in ``names`` of the part each of this rank's batches comes
    from, in the order the batches are read."""

    names: tuple[str, ...]
    of_batch: tuple[int, ...]

    def key(self, index: int) -> str:
        """The metric key of part ``index``: ``eval/<name>/loss``."""
        return f"eval/{self.names[index]}/loss"


@dataclass
class Evaluation:
    """What a Trainer evaluates during a fit: ``data`` (any iterable of held-out batches),
    every ``every`` steps (0: evaluation is off) and at the fit's final step, up to
    ``max_batches`` batches each time (``None``: all of them); and the ``tasks`` scored
    on the same steps."""

    data: Iterable[object] | None = None
    every: int = 0
    max_batches: int | None = None
    tasks: Sequence[EvalTask] = field(default_factory=tuple)
    parts: HeldOutParts | None = None

    def __post_init__(self) -> None:
        check_eval_settings(self.every or None, self.max_batches)
        if self.every and self.data is None:
            raise EvaluationError(
                f"eval_every={self.every} needs eval_data, the held-out batches to evaluate"
            )


def is_eval_step(step: int, every: int, target_step: int) -> bool:
    """Whether global step ``step`` evaluates: a multiple of ``every`` or the fit's final
    step (``every`` 0: evaluation is off)."""
    return every > 0 and (step % every == 0 or step == target_step)


def _sum_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _batch_weight(batch: object, samples: int) -> torch.Tensor | int:
    """The weight of a batch's mean loss: its count of real labels for a causal-LM batch
    (a device tensor: no sync), else its number of samples."""
    labels = batch_labels(batch)
    if labels is not None and labels.dim() >= 2 and not labels.is_floating_point():
        return (labels != IGNORE_INDEX).sum()
    return samples


def evaluate_state(
    state: TrainingState,
    batches: DataPass[object],
    max_batches: int | None,
    one_replica: bool,
    parts: HeldOutParts | None = None,
) -> EvalOutcome:
    """``evaluate_model`` on the training state's model as it is now (``Trainer.evaluate``
    and the fit's evaluations): FSDP shards gathered for it and resharded after, and the
    metrics reduced across ranks only when they hold one model replica (``one_replica``; a
    rank that is its own replica evaluates its local model alone)."""
    if state.sharded:  # gather the shards as they are now (``reshard_model``)
        reshard_model(state.model)
    try:
        return evaluate_model(
            state.model,
            batches,
            device=state.device,
            precision=state.precision,
            max_batches=max_batches,
            parts=parts,
            sharded=state.sharded,
            distributed=state.distributed if one_replica else None,
        )
    except StopTimeoutError:
        batches.abandon()  # its workers may be stuck in the dataset's code
        raise
    finally:
        if state.sharded:  # no gathered copy outlives the evaluation
            reshard_model(state.model)


def evaluate_model(
    model: nn.Module,
    data: Iterable[object],
    *,
    device: torch.device,
    precision: PrecisionPlan | None = None,
    max_batches: int | None = None,
    distributed: DistributedContext | None = None,
    parts: HeldOutParts | None = None,
    sharded: bool = False,
) -> EvalOutcome:
    """Evaluate ``model`` on up to ``max_batches`` batches of ``data`` (module docstring);
    with ``parts``, the loss of each part too (``eval/<part>/loss``). ``sharded``: the
    model is FSDP-sharded, whose forwards the ranks make together -- with ``parts`` (whose
    batch counts are known) a rank with fewer batches repeats its last one, unscored,
    until it has made as many forwards as the rank with the most.

    ``EvaluationError`` when the held-out set is empty (on every rank together)."""
    was_training = model.training
    rng = capture_rng_state()
    dtype = _sum_dtype(device)
    total = torch.zeros((), dtype=dtype, device=device)
    weight = torch.zeros((), dtype=dtype, device=device)
    # Per part: its loss sum and weight, on the device like the totals (no host sync).
    part_sums = torch.zeros((len(parts.names) if parts else 0, 2), dtype=dtype, device=device)
    batches = 0
    autocast = (
        autocast_context(precision, device)
        if precision is not None and precision.autocast_enabled
        else contextlib.nullcontext()
    )
    # Agreed before any forward: a collective between them would meet another rank's gather.
    most = _most_batches(parts, distributed, device) if sharded else None
    # Without parts the ranks' batch counts are unknown (a strided share, none dropped, may
    # give one rank a batch more): sharded ranks agree before each forward whether any of
    # them still has a batch, and one that has none makes an unscored forward.
    lockstep = sharded and most is None and distributed is not None and distributed.world_size > 1
    batch: object = None
    model.eval()
    try:
        with torch.inference_mode(), autocast:
            for host_batch in _batches(data, max_batches, device if lockstep else None):
                if host_batch is None:  # lockstep: another rank still has a batch
                    run_model(model, _filler(batch, device))
                    continue
                samples, _ = batch_size_and_tokens(host_batch)
                batch = move_to_device(host_batch, device)
                loss = resolve_loss(run_model(model, batch), batch)
                batch_weight = _batch_weight(batch, samples)
                weighted = loss.detach().to(dtype) * batch_weight
                total += weighted
                weight += batch_weight
                if parts is not None:
                    part = _part_of(parts, batches)
                    part_sums[part, 0] += weighted
                    part_sums[part, 1] += batch_weight
                batches += 1
            for _ in range(batches, batches if most is None else most):
                run_model(model, _filler(batch, device))
    finally:
        model.train(was_training)
        restore_rng_state(rng)
    sums = torch.cat([torch.stack([total, weight]), part_sums.reshape(-1)])
    if distributed is not None and distributed.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(sums)
    values = [float(value) for value in sums.tolist()]  # the one host read
    loss_sum, weight_sum = values[0], values[1]
    if weight_sum <= 0:
        raise EvaluationError(
            "the held-out set is empty: no batch to evaluate (check eval.max_batches, "
            "eval.fraction and the held-out data source)"
        )
    loss_value = loss_sum / weight_sum
    metrics = {EVAL_LOSS: loss_value, EVAL_PPL: _perplexity(loss_value)}
    for index in range(len(parts.names) if parts else 0):
        part_loss, part_weight = values[2 + 2 * index], values[3 + 2 * index]
        if parts is not None and part_weight > 0:  # a part no batch came from has no loss
            metrics[parts.key(index)] = part_loss / part_weight
    return EvalOutcome(MappingProxyType(metrics), batches, weight_sum)


def _batches(
    data: Iterable[object], max_batches: int | None, lockstep_device: torch.device | None
) -> Iterator[object | None]:
    """The batches of ``data``, at most ``max_batches`` (stopping before pulling one that
    would not be used). With ``lockstep_device`` the ranks go round by round: a round
    happens while any rank has a batch, and yields ``None`` on a rank that has none."""
    items = iter(data)
    rounds = 0
    while max_batches is None or rounds < max_batches:
        item = next(items, None)
        if lockstep_device is not None:
            import torch.distributed as dist

            has = torch.tensor([int(item is not None)], dtype=torch.int64, device=lockstep_device)
            dist.all_reduce(has, op=dist.ReduceOp.MAX)
            if not int(has.item()):
                return
        elif item is None:
            return
        rounds += 1
        yield item


def _filler(batch: object, device: torch.device) -> object:
    """An unscored forward's input: this rank's last batch, or one token."""
    if batch is not None:
        return batch
    return {"input_ids": torch.zeros((1, 1), dtype=torch.long, device=device)}


def _most_batches(
    parts: HeldOutParts | None, distributed: DistributedContext | None, device: torch.device
) -> int | None:
    """The most batches any rank reads (``parts`` give each rank's count), or ``None``."""
    if parts is None or distributed is None or distributed.world_size <= 1:
        return None
    import torch.distributed as dist

    most = torch.tensor([len(parts.of_batch)], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _part_of(parts: HeldOutParts, batch: int) -> int:
    if batch >= len(parts.of_batch):
        raise EvaluationError(
            f"the held-out data yielded more batches than its parts name ({len(parts.of_batch)})"
        )
    return parts.of_batch[batch]


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def run_step_evaluation(t: Trainer, step: int) -> None:
    """Evaluate at global step ``step`` of a fit: ``eval_start``, the pass, ``eval_end``;
    the results wait in the training state (``pending_eval``) for this step's metric
    record."""
    plan = t.plan
    due = plan.due_hooks
    if due[On.EVAL_START]:
        plan.emit(t, On.EVAL_START, EvalStartContext(step, t.evaluation.max_batches))
    outcome = t.run_evaluation()
    metrics = MappingProxyType({**outcome.metrics, **_task_metrics(t)})
    t.state.pending_eval = metrics
    if due[On.EVAL_END]:
        ctx = EvalEndContext(step, metrics, outcome.batches, outcome.weight)
        plan.emit(t, On.EVAL_END, ctx)


def _task_metrics(t: Trainer) -> dict[str, float]:
    """The metrics of the evaluation's tasks, the rows split between the ranks of one
    replica (sharded ranks too: a task runs their forwards in lockstep)."""
    state = t.state
    shared = t.forward_path.one_replica(state.callbacks)
    metrics: dict[str, float] = {}
    try:
        for task in t.evaluation.tasks:
            metrics.update(
                task.evaluate(
                    state.model,
                    device=state.device,
                    precision=state.precision,
                    distributed=state.distributed if shared else None,
                )
            )
    finally:
        if state.sharded and t.evaluation.tasks:  # no gathered copy outlives the evaluation
            reshard_model(state.model)
    return metrics


def add_eval_results(state: TrainingState, record: MetricRecord) -> bool:
    """Move this step's evaluation results (``pending_eval``) into its metric record;
    True when there were any."""
    pending, state.pending_eval = state.pending_eval, None
    if pending is None:
        return False
    for key, value in pending.items():
        record.set(key, value)
    return True
