"""The per-step loop: one global step of K microbatches, and the events around it.

This is the only place that runs forward/backward/optimizer work. Read it top to bottom
next to ``speedtronic/engine/events.py``: the order of ``emit`` calls here *is* the event contract.
Nothing here reads a device value back to the host; the loss stays a device tensor until
a metric is due.

Every function takes the trainer ``t`` -- what hooks receive (``TrainerView``), with the
callback plan, the forward path and the settings -- and its training state ``s``
(``speedtronic.engine.state``), the model, optimizer, data and counters the step changes.
Both come in as arguments and the members read every step are taken into locals once: an
attribute is a lookup per read.
"""

from __future__ import annotations

import time
from math import prod
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from speedtronic.data.collate import batch_size_and_tokens
from speedtronic.engine.batch import move_to_device, resolve_loss, run_model
from speedtronic.engine.contexts import (
    BackwardContext,
    CheckpointContext,
    CoordinateContext,
    MetricsContext,
    MicrobatchContext,
    OptimizerResetContext,
    OptimizerStepContext,
    SchedulerContext,
    StepContext,
    new_context,
)
from speedtronic.engine.evaluation import add_eval_results, is_eval_step, run_step_evaluation
from speedtronic.engine.events import On
from speedtronic.engine.loss_tokens import (
    NOTHING_TO_LEARN,
    Divisor,
    StepWeights,
    nothing_to_learn,
    step_weights,
)
from speedtronic.engine.metrics import MetricRecord, MetricValue
from speedtronic.systems.sharding import global_grad_norm

if TYPE_CHECKING:
    from speedtronic.engine.dispatch import EventHooks, HookTable, StepHooks
    from speedtronic.engine.forward_path import ForwardPath
    from speedtronic.engine.state import TrainingState
    from speedtronic.engine.trainer import Trainer


def run_global_step(t: Trainer, s: TrainingState, step: int) -> bool:
    """Run global step number ``step``. Returns False when the grad scaler skipped the
    update (fp16 overflow): the step is not counted and will be retried.

    ``due`` holds this step's hooks per event (their filters applied). An event nobody is
    due to hear is not emitted and its context is not built; the others' hooks are called
    right here rather than through ``CallbackPlan.emit`` -- a call saved per event, typed
    the same way (``HookTable``). The loop's own cost stays a few µs per step."""
    settings = t.settings
    target_step, metrics_every, eval_every = (
        s.target_step,
        settings.metrics_every,
        t.evaluation.every,
    )
    plan = t.plan
    if plan.filtered:  # without filters every step has the same hooks due: no call
        plan.begin_step(step, target_step, metrics_every, eval_every)
    k = settings.accumulation_steps
    if k == 1 and s.plain_step and settings.grad_clip is None:
        if plan.step_idle:
            _lean_step(t, s, step, target_step, metrics_every, eval_every, ())
            return True
        # ``micro_batch_size: auto`` recognises an out-of-memory error by the frame of
        # ``_accumulate_microbatches`` (``oom_retry``): its steps stay on that path.
        if not settings.auto_micro_batch:
            if plan.step_metrics_only:  # sinks on a logging step: nothing else to call
                hooks = plan.step_hooks.metrics_hooks
                _lean_step(t, s, step, target_step, metrics_every, eval_every, hooks)
            else:
                hooks_due = plan.step_hooks
                _one_batch_step(t, s, step, hooks_due, target_step, metrics_every, eval_every)
            return True
    due = plan.due_hooks
    step_ctx: StepContext | None = None  # shared by step_start and step_end (immutable)
    if start_hooks := due[On.STEP_START]:
        step_ctx = new_context(StepContext, (step, k))
        for start_hook in start_hooks:
            start_hook(t, step_ctx)

    step_loss = _accumulate_microbatches(t, s, due, step, k)

    scaler, grad_clip, optimizer = s.scaler, settings.grad_clip, s.optimizer
    plain_update = scaler is None and grad_clip is None  # no unscale, no clipping
    grad_norm = None if plain_update else _prepare_gradients(s, grad_clip)
    before_ctx: OptimizerStepContext | None = None
    if before_hooks := due[On.BEFORE_OPTIMIZER_STEP]:
        before_ctx = new_context(OptimizerStepContext, (step, False, grad_norm, step_loss))
        for before_hook in before_hooks:
            before_hook(t, before_ctx)
    if scaler is None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        skipped = False
    else:
        skipped = _scaled_optimizer_step(optimizer, scaler)
    if after_hooks := due[On.AFTER_OPTIMIZER_STEP]:
        # Unless the scaler skipped the update, "after" has the fields of "before": share it.
        if before_ctx is None or skipped:
            after_ctx = new_context(OptimizerStepContext, (step, skipped, grad_norm, step_loss))
        else:
            after_ctx = before_ctx
        for after_hook in after_hooks:
            after_hook(t, after_ctx)
    if skipped:
        t.note_skipped_step(step)
        if end_hooks := due[On.STEP_END]:
            end_ctx = step_ctx or new_context(StepContext, (step, k))
            for end_hook in end_hooks:
                end_hook(t, end_ctx)
        return False

    s.step = step
    s.step_loss = step_loss
    if s.scheduler is not None:
        s.scheduler.step()
    if scheduler_hooks := due[On.AFTER_SCHEDULER_STEP]:
        _after_scheduler_step(t, step, scheduler_hooks, optimizer)

    if coordinate_hooks := due[On.COORDINATE]:
        coordinate_ctx = new_context(CoordinateContext, (step,))
        for coordinate_hook in coordinate_hooks:
            coordinate_hook(t, coordinate_ctx)
    if s.requests.resets:
        _maybe_reset_optimizer(t, step)
    evaluated = eval_every != 0 and is_eval_step(step, eval_every, target_step)
    if evaluated:
        run_step_evaluation(t, step)  # eval_start, the pass, eval_end

    # The record is built only when a metrics hook is due or the step is a logging step
    # (``Trainer.is_metric_due``, spelled out: this runs every step; evaluation steps are
    # logging steps).
    metrics_hooks = due[On.METRICS]
    logged = evaluated or step % metrics_every == 0 or step == target_step
    if metrics_hooks or logged:
        _emit_metrics(t, s, step, s.step_loss, grad_norm, logged, metrics_hooks)
    if checkpoint_hooks := due[On.CHECKPOINT]:
        checkpoint_ctx = new_context(CheckpointContext, (step,))
        for checkpoint_hook in checkpoint_hooks:
            checkpoint_hook(t, checkpoint_ctx)
    if end_hooks := due[On.STEP_END]:
        end_ctx = step_ctx or new_context(StepContext, (step, k))
        for end_hook in end_hooks:
            end_hook(t, end_ctx)
    return True


def _lean_step(
    t: Trainer,
    s: TrainingState,
    step: int,
    target_step: int,
    metrics_every: int,
    eval_every: int,
    metrics_hooks: EventHooks[MetricsContext],
) -> None:
    """``run_global_step`` for the common step on which no hook is due to hear an in-step
    event (``CallbackPlan.step_idle``) but ``metrics_hooks`` (``step_metrics_only``: sinks
    on a logging step): one microbatch on one rank through the plain forward path, a plain
    update (no scaler, no clipping; ``TrainingState.plain_step``). The same work in the same
    order, without the hook tables, the other contexts or the K-microbatch bookkeeping: the
    loop's own cost on a run without per-step callbacks."""
    batch = next(s.stream)
    # The batch protocol's common case spelled out, a call saved per function: an
    # ``(inputs, labels)`` pair whose inputs are a tensor of at least one dimension counts
    # as ``batch_size_and_tokens`` counts it, goes to the model as ``run_model`` passes it,
    # and a 0-d tensor output is the loss as ``resolve_loss`` takes it.
    pair = type(batch) is tuple and len(batch) == 2
    if pair and type(inputs := batch[0]) is Tensor and (shape := inputs.shape):  # type: ignore[index]  # pair: a tuple
        samples, tokens = shape[0], prod(shape)  # before the move: no device sync
    else:
        samples, tokens = batch_size_and_tokens(batch)
    if s.moves_batches:
        batch = move_to_device(batch, s.device)
    s.samples += samples
    s.tokens += tokens
    path = t.forward_path
    # Eager and plain: the model itself (``ForwardPath.forward`` adds a call for compile).
    if path.compiled is not None:
        output = path.forward(batch)
    elif pair:
        output = path.model(*batch)  # type: ignore[misc]  # pair: a tuple of two
    else:
        output = run_model(path.model, batch)
    loss = output if type(output) is Tensor and output.ndim == 0 else resolve_loss(output, batch)
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    optimizer = s.optimizer
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    s.step = step
    s.step_loss = loss
    if s.scheduler is not None:
        s.scheduler.step()
    if s.requests.resets:
        _maybe_reset_optimizer(t, step)
    if eval_every and is_eval_step(step, eval_every, target_step):
        run_step_evaluation(t, step)  # eval_start, the pass, eval_end
        _emit_metrics(t, s, step, s.step_loss, None, True, metrics_hooks)
    elif step % metrics_every == 0 or step == target_step:
        _emit_metrics(t, s, step, s.step_loss, None, True, metrics_hooks)
    elif metrics_hooks:  # an unfiltered metrics hook: a record on every step
        _emit_metrics(t, s, step, s.step_loss, None, False, metrics_hooks)


def _one_batch_step(
    t: Trainer,
    s: TrainingState,
    step: int,
    hooks: StepHooks,
    target_step: int,
    metrics_every: int,
    eval_every: int,
) -> None:
    """``run_global_step`` for a step of one plain microbatch on one rank with a plain
    update (as ``_lean_step``) on which hooks are due: the same events with the same
    contexts in the same order as the K-microbatch path, without its bookkeeping (the loss
    divisors, the list of losses, the gradient-sync context, the scaler and clipping
    branches). The step's hooks come unpacked from ``CallbackPlan.step_hooks``, one tuple
    for all events; each listened event's context is built once and shared by its hooks
    (and by the event that closes it: step, microbatch, optimizer step)."""
    (
        step_start,
        mb_start,
        before_bw,
        after_bw,
        mb_end,
        before_opt,
        after_opt,
        after_scheduler,
        coordinate,
        metrics,
        checkpoint,
        step_end,
    ) = hooks
    step_ctx: StepContext | None = None
    if step_start:
        step_ctx = new_context(StepContext, (step, 1))
        for start_hook in step_start:
            start_hook(t, step_ctx)
    batch = next(s.stream)
    # The batch protocol's common case spelled out as in ``_lean_step``.
    pair = type(batch) is tuple and len(batch) == 2
    if pair and type(inputs := batch[0]) is Tensor and (shape := inputs.shape):  # type: ignore[index]  # pair: a tuple
        samples, tokens = shape[0], prod(shape)  # before the move: no device sync
    else:
        samples, tokens = batch_size_and_tokens(batch)
    if s.moves_batches:
        batch = move_to_device(batch, s.device)
    s.samples += samples
    s.tokens += tokens
    mb_ctx: MicrobatchContext | None = None
    if mb_start or mb_end:
        mb_ctx = new_context(MicrobatchContext, (step, 0, 1, batch))
        for mb_start_hook in mb_start:
            mb_start_hook(t, mb_ctx)
    path = t.forward_path
    if path.compiled is not None:
        output = path.forward(batch)
    elif pair:
        output = path.model(*batch)  # type: ignore[misc]  # pair: a tuple of two
    else:
        output = run_model(path.model, batch)
    loss = output if type(output) is Tensor and output.ndim == 0 else resolve_loss(output, batch)
    if before_bw or after_bw:
        backward_ctx = new_context(BackwardContext, (step, 0, 1, loss))
        for before_bw_hook in before_bw:
            before_bw_hook(t, backward_ctx)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        for after_bw_hook in after_bw:
            after_bw_hook(t, backward_ctx)
    else:
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    if mb_ctx is not None:
        for mb_end_hook in mb_end:
            mb_end_hook(t, mb_ctx)
    optimizer = s.optimizer
    optimizer_ctx: OptimizerStepContext | None = None
    if before_opt:
        optimizer_ctx = new_context(OptimizerStepContext, (step, False, None, loss))
        for before_hook in before_opt:
            before_hook(t, optimizer_ctx)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if after_opt:
        # No scaler: never skipped, so "after" has the fields of "before": share it.
        after_ctx = optimizer_ctx or new_context(OptimizerStepContext, (step, False, None, loss))
        for after_hook in after_opt:
            after_hook(t, after_ctx)
    s.step = step
    s.step_loss = loss
    if s.scheduler is not None:
        s.scheduler.step()
    if after_scheduler:  # ``_after_scheduler_step`` spelled out: a call saved
        groups = optimizer.param_groups
        lrs = (float(groups[0]["lr"]),) if len(groups) == 1 else _group_lrs(groups)
        scheduler_ctx = new_context(SchedulerContext, (step, lrs))
        for scheduler_hook in after_scheduler:
            scheduler_hook(t, scheduler_ctx)
    if coordinate:
        coordinate_ctx = new_context(CoordinateContext, (step,))
        for coordinate_hook in coordinate:
            coordinate_hook(t, coordinate_ctx)
    if s.requests.resets:
        _maybe_reset_optimizer(t, step)
    evaluated = eval_every != 0 and is_eval_step(step, eval_every, target_step)
    if evaluated:
        run_step_evaluation(t, step)  # eval_start, the pass, eval_end
    logged = evaluated or step % metrics_every == 0 or step == target_step
    if metrics or logged:
        _emit_metrics(t, s, step, s.step_loss, None, logged, metrics)
    if checkpoint:
        checkpoint_ctx = new_context(CheckpointContext, (step,))
        for checkpoint_hook in checkpoint:
            checkpoint_hook(t, checkpoint_ctx)
    if step_end:
        end_ctx = step_ctx or new_context(StepContext, (step, 1))
        for end_hook in step_end:
            end_hook(t, end_ctx)


def _after_scheduler_step(
    t: Trainer,
    step: int,
    hooks: EventHooks[SchedulerContext],
    optimizer: torch.optim.Optimizer,
) -> None:
    """``after_scheduler_step`` with each param group's learning rate."""
    groups = optimizer.param_groups
    # One group is the common case: a list comprehension costs a function call.
    lrs = (float(groups[0]["lr"]),) if len(groups) == 1 else _group_lrs(groups)
    scheduler_ctx = new_context(SchedulerContext, (step, lrs))
    for hook in hooks:
        hook(t, scheduler_ctx)


def _group_lrs(groups: list[dict[str, Any]]) -> tuple[float, ...]:
    """The learning rate of each of several param groups."""
    return tuple([float(group["lr"]) for group in groups])


def _accumulate_microbatches(
    t: Trainer, s: TrainingState, due: HookTable, step: int, k: int
) -> torch.Tensor:
    """Forward/backward K microbatches; returns the step's loss: with K=1 the one loss as
    the model returned it (``Trainer.last_loss`` detaches it when read, so a step costs no
    extra tensor op: a ``detach`` is ~3,900 instructions, ``loop_pieces.py``), else the mean
    over this rank's loss-bearing tokens. Each microbatch's loss is divided so that the
    gradient is the mean over the step's loss-bearing tokens, all microbatches and ranks
    together (``speedtronic.engine.loss_tokens``): for that the K batches are taken at once."""
    mb_start, mb_end = due[On.MICROBATCH_START], due[On.MICROBATCH_END]
    before_bw, after_bw = due[On.BEFORE_BACKWARD], due[On.AFTER_BACKWARD]
    stream, device, path, scaler = s.stream, s.device, t.forward_path, s.scaler
    # On the CPU there is nowhere to move a batch to: skip walking it tensor by tensor.
    moves = s.moves_batches
    batches: list[object] | None = None
    weights: StepWeights | None = None
    if k > 1 or path.gradient_ranks > 1:  # one microbatch on one rank: its mean is the step's
        batches = [next(stream) for _ in range(k)]
        weights = step_weights(batches, path.gradient_ranks, path.sum_over_gradient_ranks)
    plain_divisor = None if k == 1 else k  # without weights: loss / K (none for K = 1)
    # Unequal counts on this rank: the reported loss is their weighted mean, not sum / K.
    losses: list[torch.Tensor] | None = None if weights is None or weights.uniform else []
    loss_sum: torch.Tensor | None = None
    for index in range(k):
        batch = next(stream) if batches is None else batches[index]
        samples, tokens = batch_size_and_tokens(batch)  # before the move: no device sync
        if moves:
            batch = move_to_device(batch, device)
        s.samples += samples
        s.tokens += tokens
        mb_ctx: MicrobatchContext | None = None
        if mb_start or mb_end:
            mb_ctx = new_context(MicrobatchContext, (step, index, k, batch))
            for hook in mb_start:
                hook(t, mb_ctx)
        divisor = plain_divisor if weights is None else weights.divisors[index]
        if path.plain:  # no DDP, no autocast: no context managers to enter
            loss = _forward_backward(
                t, path, scaler, batch, step, index, k, divisor, before_bw, after_bw, False
            )
        else:
            with path.grad_sync_context(index == k - 1):
                loss = _forward_backward(
                    t, path, scaler, batch, step, index, k, divisor, before_bw, after_bw, True
                )
        if k == 1:
            loss_sum = loss
        else:
            detached = loss.detach()
            loss_sum = detached if loss_sum is None else loss_sum + detached
            if losses is not None:
                losses.append(detached)
        if mb_ctx is not None:
            for hook in mb_end:
                hook(t, mb_ctx)
    assert loss_sum is not None  # k >= 1 is enforced by the Trainer
    if losses is not None and weights is not None:
        return weights.mean(losses)
    return loss_sum if k == 1 else loss_sum / k


def _forward_backward(
    t: Trainer,
    path: ForwardPath,
    scaler: torch.amp.GradScaler | None,
    batch: object,
    step: int,
    index: int,
    k: int,
    divisor: Divisor | None,
    before_bw: EventHooks[BackwardContext],
    after_bw: EventHooks[BackwardContext],
    autocast: bool,
) -> torch.Tensor:
    """One microbatch's forward and backward; returns its unscaled loss (``path`` and
    ``scaler`` come from the caller's locals: read once per step, not per microbatch;
    ``divisor`` scales the loss for the step's token mean, ``K`` when the counts agree)."""
    if autocast:
        with path.autocast():
            output = path.forward(batch)
    else:
        output = path.forward(batch)
    loss = resolve_loss(output, batch)
    if divisor is NOTHING_TO_LEARN:  # no loss-bearing label: a zero, never the model's 0/0
        loss, scaled = nothing_to_learn(output, loss, t.trainable_parameters)
    else:  # None: one microbatch on one rank, x / 1 is x: skip the op (bitwise the same grads)
        scaled = loss if divisor is None else loss / divisor
    if scaler is not None:
        scaled = scaler.scale(scaled)
    if not (before_bw or after_bw):
        scaled.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return loss
    backward_ctx = new_context(BackwardContext, (step, index, k, loss))
    for hook in before_bw:
        hook(t, backward_ctx)
    scaled.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    for hook in after_bw:
        hook(t, backward_ctx)
    return loss


def _prepare_gradients(s: TrainingState, grad_clip: float | None) -> torch.Tensor | None:
    """Unscale fp16 gradients, then clip; returns the total norm when clipping."""
    if s.scaler is not None:
        s.scaler.unscale_(s.optimizer)
    if grad_clip is None:
        return None
    norm = torch.nn.utils.clip_grad_norm_(s.trainable_parameters, grad_clip)
    # Over FSDP-sharded gradients the norm is a DTensor whose value is the global norm.
    return global_grad_norm(norm) if s.sharded else norm


def _scaled_optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
    """The fp16 step through the grad scaler; True when it skipped the step (overflow)."""
    scale_before = scaler.get_scale()  # one host read, fp16 on CUDA only
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale_before


def _maybe_reset_optimizer(t: Trainer, step: int) -> None:
    requested = t.take_reset_requests()
    if not requested or not t.settings.allow_optimizer_reset:
        return
    t.plan.emit(t, On.OPTIMIZER_RESET, OptimizerResetContext(step, requested))
    t.reset_optimizer_state()


def _with_group_lrs(
    values: dict[str, MetricValue], groups: list[dict[str, Any]]
) -> dict[str, MetricValue]:
    """``values`` with ``lr/group<i>`` after ``lr`` for each param group after the first
    whose learning rate differs from the first's."""
    lr = groups[0]["lr"]
    extra = [
        (f"lr/group{index}", float(group["lr"]))
        for index, group in enumerate(groups[1:], start=1)
        if group["lr"] != lr
    ]
    if not extra:
        return values
    items = list(values.items())
    return dict(items[:2] + extra + items[2:])  # after "step" and "lr"


def _emit_metrics(
    t: Trainer,
    s: TrainingState,
    step: int,
    loss: torch.Tensor,
    grad_norm: torch.Tensor | None,
    due: bool,
    hooks: EventHooks[MetricsContext],
) -> None:
    """Build step ``step``'s record and call the ``metrics`` hooks due in this step with it;
    ``due``: a logging step (``Trainer.is_metric_due``, which the caller has worked out:
    ``evaluated or step % metrics_every == 0 or step == target_step``), whose record the
    loop keeps. The record is built in one call (``MetricRecord.of``), in the key order a
    ``set`` per key gives: ``step``, the learning rates, the rates and counters, then the
    tensors (``loss``, ``grad_norm``), read when a sink asks."""
    clock = s.fit_clock
    elapsed = time.perf_counter() - clock.start_time
    if 1e-9 > elapsed:  # max(elapsed, 1e-9) without the builtin's generic call
        elapsed = 1e-9
    groups = s.optimizer.param_groups
    samples, tokens = s.samples, s.tokens
    values: dict[str, MetricValue] = {
        "step": step,
        "lr": float(groups[0]["lr"]),
        "steps_per_sec": (step - clock.start_step) / elapsed,
        "samples_per_sec": (samples - clock.start_samples) / elapsed,
        "tokens_per_sec": (tokens - clock.start_tokens) / elapsed,
        "samples": samples,
        "tokens": tokens,
        "micro_batches": t.settings.accumulation_steps,
        "elapsed_s": elapsed,
    }
    if len(groups) > 1:
        values = _with_group_lrs(values, groups)
    tensors = {"loss": loss} if grad_norm is None else {"loss": loss, "grad_norm": grad_norm}
    record = MetricRecord.of(step, values, tensors)
    evaluated = s.pending_eval is not None and add_eval_results(s, record)
    if hooks:
        metrics_ctx = new_context(MetricsContext, (step, due, record, evaluated))
        for hook in hooks:
            hook(t, metrics_ctx)
    if due:
        s.due_records.append(record.values())
