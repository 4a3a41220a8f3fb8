"""The per-step loop: one global step of K microbatches, and the events around it.

This is the only place that runs forward/backward/optimizer work. Read it top to bottom
next to ``speedtronic/events.py``: the order of ``emit`` calls here *is* the event contract.
Nothing here reads a device value back to the host; the loss stays a device tensor until
a metric is due.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from speedtronic.batch import move_to_device, resolve_loss
from speedtronic.contexts import (
    BackwardContext,
    CheckpointContext,
    CoordinateContext,
    MetricsContext,
    MicrobatchContext,
    OptimizerResetContext,
    OptimizerStepContext,
    SchedulerContext,
    StepContext,
)
from speedtronic.data.collate import batch_size_and_tokens
from speedtronic.evaluation import add_eval_results, is_eval_step, run_step_evaluation
from speedtronic.events import On
from speedtronic.metrics import MetricRecord
from speedtronic.sharding import global_grad_norm

if TYPE_CHECKING:
    from speedtronic.trainer import Trainer


def run_global_step(t: Trainer, step: int) -> bool:
    """Run global step number ``step``. Returns False when the grad scaler skipped the
    update (fp16 overflow): the step is not counted and will be retried.

    Events nobody is due to hear this step are not emitted and their contexts are not built
    (``due`` holds this step's hooks per event): the loop's own cost stays a few µs."""
    plan = t.plan
    target_step, metrics_every, eval_every = t.target_step, t.metrics_every, t.eval_every
    plan.begin_step(step, target_step, metrics_every, eval_every)
    due = plan.due_hooks
    k = t.accumulation_steps
    step_ctx: StepContext | None = None  # shared by step_start and step_end (immutable)
    if due[On.STEP_START]:
        step_ctx = StepContext(step, k)
        plan.emit(t, On.STEP_START, step_ctx)

    loss_sum = _accumulate_microbatches(t, step, k)

    scaler = t.scaler
    plain_update = scaler is None and t.grad_clip is None  # no unscale, no clipping
    grad_norm = None if plain_update else _prepare_gradients(t)
    if due[On.BEFORE_OPTIMIZER_STEP]:
        plan.emit(t, On.BEFORE_OPTIMIZER_STEP, OptimizerStepContext(step, False, grad_norm))
    if scaler is None:
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        skipped = False
    else:
        skipped = _scaled_optimizer_step(t, scaler)
    if due[On.AFTER_OPTIMIZER_STEP]:
        plan.emit(t, On.AFTER_OPTIMIZER_STEP, OptimizerStepContext(step, skipped, grad_norm))
    if skipped:
        t.note_skipped_step(step)
        if due[On.STEP_END]:
            plan.emit(t, On.STEP_END, step_ctx or StepContext(step, k))
        return False

    t.step = step
    t.last_loss = loss_sum if k == 1 else loss_sum / k
    if t.scheduler is not None:
        t.scheduler.step()
    if due[On.AFTER_SCHEDULER_STEP]:
        lrs = tuple([float(group["lr"]) for group in t.optimizer.param_groups])
        plan.emit(t, On.AFTER_SCHEDULER_STEP, SchedulerContext(step, lrs))

    if due[On.COORDINATE]:
        plan.emit(t, On.COORDINATE, CoordinateContext(step))
    if t.requests.resets:
        _maybe_reset_optimizer(t, step)
    evaluated = bool(eval_every) and is_eval_step(step, eval_every, target_step)
    if evaluated:
        run_step_evaluation(t, step)  # eval_start, the pass, eval_end

    # The record is built only when a metrics hook is due or the step is a logging step
    # (``Trainer.is_metric_due``, spelled out: this runs every step; evaluation steps are
    # logging steps).
    if due[On.METRICS] or evaluated or step % metrics_every == 0 or step == target_step:
        _emit_metrics(t, step, t.last_loss, grad_norm)
    if due[On.CHECKPOINT]:
        plan.emit(t, On.CHECKPOINT, CheckpointContext(step))
    if due[On.STEP_END]:
        plan.emit(t, On.STEP_END, step_ctx or StepContext(step, k))
    return True


def _accumulate_microbatches(t: Trainer, step: int, k: int) -> torch.Tensor:
    """Forward/backward K microbatches; returns the sum of their unscaled losses (detached)."""
    plan = t.plan
    due = plan.due_hooks
    listens_mb = bool(due[On.MICROBATCH_START] or due[On.MICROBATCH_END])
    listens_bw = bool(due[On.BEFORE_BACKWARD] or due[On.AFTER_BACKWARD])
    stream, device, path = t.stream, t.device, t.forward_path
    # On the CPU there is nowhere to move a batch to: skip walking it tensor by tensor.
    moves = device.type != "cpu"
    loss_sum: torch.Tensor | None = None
    for index in range(k):
        batch = next(stream)
        samples, tokens = batch_size_and_tokens(batch)  # before the move: no device sync
        if moves:
            batch = move_to_device(batch, device)
        t.samples += samples
        t.tokens += tokens
        mb_ctx = MicrobatchContext(step, index, k, batch) if listens_mb else None
        if mb_ctx is not None:
            plan.emit(t, On.MICROBATCH_START, mb_ctx)
        if path.plain:  # no DDP, no autocast: no context managers to enter
            loss = _forward_backward(t, batch, step, index, k, listens_bw, autocast=False)
        else:
            with path.grad_sync_context(index == k - 1):
                loss = _forward_backward(t, batch, step, index, k, listens_bw, autocast=True)
        detached = loss.detach()
        loss_sum = detached if loss_sum is None else loss_sum + detached
        if mb_ctx is not None:
            plan.emit(t, On.MICROBATCH_END, mb_ctx)
    assert loss_sum is not None  # k >= 1 is enforced by the Trainer
    return loss_sum


def _forward_backward(
    t: Trainer, batch: object, step: int, index: int, k: int, listens_bw: bool, *, autocast: bool
) -> torch.Tensor:
    """One microbatch's forward and backward; returns its unscaled loss."""
    path = t.forward_path
    if autocast:
        with path.autocast():
            output = path.forward(batch)
    else:
        output = path.forward(batch)
    loss = resolve_loss(output, batch)
    backward_ctx = BackwardContext(step, index, k, loss) if listens_bw else None
    if backward_ctx is not None:
        t.plan.emit(t, On.BEFORE_BACKWARD, backward_ctx)
    scaled = loss if k == 1 else loss / k  # x / 1 is x: skip the op (bitwise the same grads)
    if t.scaler is not None:
        scaled = t.scaler.scale(scaled)
    scaled.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    if backward_ctx is not None:
        t.plan.emit(t, On.AFTER_BACKWARD, backward_ctx)
    return loss


def _prepare_gradients(t: Trainer) -> torch.Tensor | None:
    """Unscale fp16 gradients, then clip; returns the total norm when clipping."""
    if t.scaler is not None:
        t.scaler.unscale_(t.optimizer)
    if t.grad_clip is None:
        return None
    norm = torch.nn.utils.clip_grad_norm_(t.trainable_parameters, t.grad_clip)
    # Over FSDP-sharded gradients the norm is a DTensor whose value is the global norm.
    return global_grad_norm(norm) if t.sharded_state else norm


def _scaled_optimizer_step(t: Trainer, scaler: torch.amp.GradScaler) -> bool:
    """The fp16 step through the grad scaler; True when it skipped the step (overflow)."""
    scale_before = scaler.get_scale()  # one host read, fp16 on CUDA only
    scaler.step(t.optimizer)
    scaler.update()
    t.optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale_before


def _maybe_reset_optimizer(t: Trainer, step: int) -> None:
    requested = t.take_reset_requests()
    if not requested or not t.allow_optimizer_reset:
        return
    t.plan.emit(t, On.OPTIMIZER_RESET, OptimizerResetContext(step, requested))
    t.reset_optimizer_state()


def _emit_metrics(
    t: Trainer, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None
) -> None:
    record = MetricRecord(step)
    elapsed = max(time.perf_counter() - t.fit_clock.start_time, 1e-9)
    record.set("loss", loss)
    groups = t.optimizer.param_groups
    record.set("lr", float(groups[0]["lr"]))
    for index, group in enumerate(groups[1:], start=1):
        if group["lr"] != groups[0]["lr"]:
            record.set(f"lr/group{index}", float(group["lr"]))
    if grad_norm is not None:
        record.set("grad_norm", grad_norm)
    clock = t.fit_clock
    record.set("steps_per_sec", (step - clock.start_step) / elapsed)
    record.set("samples_per_sec", (t.samples - clock.start_samples) / elapsed)
    record.set("tokens_per_sec", (t.tokens - clock.start_tokens) / elapsed)
    record.set("samples", t.samples)
    record.set("tokens", t.tokens)
    record.set("micro_batches", t.accumulation_steps)
    record.set("elapsed_s", elapsed)
    evaluated = t.pending_eval is not None and add_eval_results(t, record)
    due = t.is_metric_due(step)
    t.plan.emit(t, On.METRICS, MetricsContext(step, due, record, evaluated))
    if due:
        t.due_records.append(record.values())
