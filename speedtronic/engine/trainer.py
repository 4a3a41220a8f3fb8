"""The engine's Trainer: a training state, the parts that run a step over it, and ``fit``.

``fit`` emits ``setup -> fit_start -> [global steps] -> fit_end -> teardown`` (on error
``exception`` then ``teardown``); each global step is ``loop.run_global_step``.

This class is ``speedtronic.Trainer``. It runs on resolved values: the model, the optimizer
and the data, the callbacks, a ``TrainerSettings`` (``speedtronic.engine.settings``) and an
``Evaluation``; the keywords users write (``Trainer(model, opt, data, metrics_every=10)``)
replace values of the settings (``speedtronic.engine.keywords``). It knows no config: the run's
config is held as an object that turns itself into plain data (``config``), for checkpoints
and sinks. 2.0's constructor arguments and members live in ``speedtronic.compat``, reached
through ``speedtronic.engine.compat_route`` only when they are used.

Its parts: ``state`` (``speedtronic.engine.state.TrainingState``: model, optimizer,
scheduler, scaler, data stream, callbacks, counters, requests -- what the loop changes and a
checkpoint holds), ``plan`` (which hooks run for each event), ``forward_path`` (DDP/FSDP,
compile, autocast), ``settings``, ``evaluation`` and ``notes``. The members of the state and
the settings are also the Trainer's own attributes under the names plugins and users read
(``trainer.step`` is ``trainer.state.step``), so the Trainer satisfies ``TrainerView``.

Given a ``DistributedContext`` (``speedtronic.systems.distributed``) the trainer trains
data-parallel: DDP around the model (``trainer.model`` stays the raw module), ``no_sync`` on
all but the last microbatch, metrics reduced across ranks on logging steps, callbacks placed
by their ``rank_policy``, and a stop requested on any rank honoured by all ranks at the same
step.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, TypeVar, Unpack, overload

import torch
from torch import nn

from speedtronic.data import BatchStream, EpochLimitReached
from speedtronic.data.stream import DataPass
from speedtronic.engine.batch_layout import (
    LAYOUT_KEY,
    apply_layout,
    current_layout,
    resume_layout,
)
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    ExceptionContext,
    FitContext,
    FitEndContext,
    TeardownContext,
)
from speedtronic.engine.dispatch import CallbackPlan, HookFailure, attach_failures
from speedtronic.engine.evaluation import EvalOutcome, Evaluation, EvaluationError, evaluate_state
from speedtronic.engine.events import On
from speedtronic.engine.forward_path import ForwardPath
from speedtronic.engine.keywords import TrainerKeywords, TrainerType, resolve_settings
from speedtronic.engine.loop import run_global_step
from speedtronic.engine.members import TrainerMembers
from speedtronic.engine.notes import Notes
from speedtronic.engine.rank_metrics import RankMetricReducer
from speedtronic.engine.result import TrainResult
from speedtronic.engine.settings import TrainerSettings
from speedtronic.engine.state import FitClock, LRScheduler, TrainingState
from speedtronic.engine.stop_watch import STOP_GRACE_S, StopWatch
from speedtronic.state.training_state import STATE_FORMAT_VERSION as STATE_FORMAT_VERSION
from speedtronic.state.training_state import TrainingStateError as TrainingStateError
from speedtronic.state.training_state import (
    callback_states,
    capture_training_state,
    restore_training_state,
)
from speedtronic.systems.distributed import (
    DistributedContext,
    agree_on_stop,
    collective_failure,
    reduce_run_totals,
)
from speedtronic.systems.precision import make_grad_scaler, resolve_precision
from speedtronic.systems.sharding import find_shard_blocks
from speedtronic.user_warnings import warn

if TYPE_CHECKING:
    from speedtronic.state.resume import ResumePoint
    from speedtronic.systems.shapes import ShapeReport

__all__ = ["LRScheduler", "Trainer", "TrainingStateError"]

_GLOBAL_STEP_CODE = run_global_step.__code__
T = TypeVar("T")


def _raise_first(failures: Sequence[HookFailure]) -> None:
    """Raise the first hook failure, with the later ones attached as notes."""
    if failures:
        first = failures[0].error
        attach_failures(first, failures[1:])
        raise first


def _fit_result(
    state: TrainingState,
    start_step: int,
    last_loss: torch.Tensor | None,
    stop_reason: str | None,
    batch_sharers: int,
) -> TrainResult:
    """The result of a fit that started at ``start_step``; in a multi-rank run the loss is
    the mean over ranks and the sample and token counts are the totals of all ranks
    (``batch_sharers``: ranks training on one batch, the tensor-parallel degree)."""
    loss = last_loss if state.step > start_step else None
    samples, tokens = state.samples, state.tokens
    if state.multi_rank:
        assert state.distributed is not None
        mean_loss, samples, tokens = reduce_run_totals(
            state.distributed, loss, samples, tokens, batch_sharers
        )
        final_loss = mean_loss
    else:
        final_loss = float(loss.item()) if loss is not None else None
    return TrainResult(
        steps=state.step,
        samples=samples,
        tokens=tokens,
        final_loss=final_loss,
        elapsed_s=time.perf_counter() - state.fit_clock.start_time,
        metrics=list(state.due_records),
        stop_reason=stop_reason,
    )


def _new_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Iterable[object],
    scheduler: LRScheduler | None,
    settings: TrainerSettings,
    distributed: DistributedContext | None,
    run_config: Mapping[str, object] | None,
    start_step: int,
) -> TrainingState:
    """A new trainer's state at ``start_step``: its stream over ``data``, the precision
    resolved for the device and a grad scaler where the precision needs one."""
    precision = settings.precision or resolve_precision(None, settings.device)
    stream = data if isinstance(data, BatchStream) else BatchStream(data)
    if settings.max_epochs is not None:
        stream.max_epochs = settings.max_epochs
    return TrainingState(
        model=model,
        optimizer=optimizer,
        stream=stream,
        precision=precision,
        device=settings.device,
        scheduler=scheduler,
        scaler=make_grad_scaler(precision),
        output_dir=settings.output_dir,
        run_config=run_config,
        distributed=distributed,
        sharded=settings.parallel == "fsdp",
        tensor=settings.tensor,
        step=start_step,
        fit_clock=FitClock(time.perf_counter(), start_step, 0, 0),
    )


def _shard(
    forward_path: ForwardPath,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    callbacks: Sequence[Callback],
    settings: TrainerSettings,
) -> None:
    """FSDP2 over the ranks; on a single process the model stays one whole shard."""
    if not forward_path.shard(
        optimizer,
        callbacks,
        reshard_after_forward=settings.reshard_after_forward,
        tensor=settings.tensor,
    ):
        find_shard_blocks(model)  # a model torchrun could not shard fails here too
        warn(
            "parallel.strategy fsdp on a single process: the model is one whole shard "
            "(not sharded); checkpoints are still written sharded (DCP) and resume on "
            "any number of ranks",
            UserWarning,
        )


def _ranks_keep_going(state: TrainingState, start_step: int, logging_step: bool) -> bool:
    """Whether the ranks of a multi-rank run go on: they agree on stopping at logging
    steps only (one tiny all-reduce), so every rank stops at the same step."""
    assert state.distributed is not None
    requests = state.requests
    if requests.agreed_stop is None and state.step > start_step and logging_step:
        if agree_on_stop(state.distributed, requests.stop_reason is not None):
            requests.agreed_stop = requests.stop_reason or "stop requested on another rank"
    return requests.agreed_stop is None


class Trainer(TrainerMembers, metaclass=TrainerType):
    """Trains ``model`` with ``optimizer`` on batches from ``data`` (the module docstring
    says what it is made of).

    ``data`` is any iterable of batches (a ``DataLoader``, a list); it is re-iterated
    forever and its position is part of the training state, so resume is exact.
    ``max_steps`` is an absolute target: a resumed trainer continues up to it.
    ``max_epochs`` also ends the fit when the data stream would start that epoch; a global
    step the last epoch cannot fill is not taken. The other keywords (``device``,
    ``precision``, ``accumulation_steps``, ``grad_clip``, ``compile``, ``metrics_every``,
    ``allow_optimizer_reset``, ``output_dir``, ``parallel``) replace values of ``settings``;
    ``eval_data``, ``eval_every`` and ``eval_max_batches`` describe the ``evaluation``.
    ``run_config`` is the run's config as plain data, secrets redacted (checkpoints record
    it; sinks log it), or set ``config``. ``stop_grace_s`` bounds how long a requested stop
    waits for a batch that does not come (``speedtronic.engine.stop_watch``; set it on an
    instance or on the class).
    """

    stop_grace_s: float = STOP_GRACE_S
    shape_report: ShapeReport | None = None
    """The run's startup shape check (``validate_startup_shapes``), where the runtime made one."""

    @overload
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Iterable[object],
        *,
        callbacks: Sequence[Callback] = (),
        max_steps: int | None = None,
        start_step: int = 0,
        scheduler: LRScheduler | None = None,
        settings: TrainerSettings | None = None,
        evaluation: Evaluation | None = None,
        distributed: DistributedContext | None = None,
        run_config: Mapping[str, object] | None = None,
    ) -> None: ...
    @overload
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Iterable[object],
        *,
        callbacks: Sequence[Callback] = (),
        max_steps: int | None = None,
        start_step: int = 0,
        scheduler: LRScheduler | None = None,
        settings: TrainerSettings | None = None,
        evaluation: Evaluation | None = None,
        distributed: DistributedContext | None = None,
        run_config: Mapping[str, object] | None = None,
        **keywords: Unpack[TrainerKeywords],
    ) -> None: ...
    def __init__(  # type: ignore[misc]  # the keywords form: TrainerType resolves them first
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Iterable[object],
        *,
        callbacks: Sequence[Callback] = (),
        max_steps: int | None = None,
        start_step: int = 0,
        scheduler: LRScheduler | None = None,
        settings: TrainerSettings | None = None,
        evaluation: Evaluation | None = None,
        distributed: DistributedContext | None = None,
        run_config: Mapping[str, object] | None = None,
    ) -> None:
        self.settings = settings = resolve_settings(settings, distributed, {})
        self.evaluation = evaluation or Evaluation()
        self.max_steps = max_steps
        """The target ``fit()`` trains up to when it is given none."""
        self._notes = Notes()
        self.resumed_from: ResumePoint | None = None
        """The checkpoint this trainer's state was restored from by ``resume_from`` (its
        path, step and the newer checkpoints that could not be read); ``None``: not resumed."""
        self.state = _new_state(
            model, optimizer, data, scheduler, settings, distributed, run_config, start_step
        )
        self.state.target_step = max_steps or 0
        precision, device = self.state.precision, self.state.device
        # The engine's own callbacks come after the run's: the rank reducer is the last
        # contributor to the metric record.
        self._engine_callbacks: list[Callback] = (
            [RankMetricReducer(distributed, settings.tensor)]
            if self.state.multi_rank and distributed
            else []
        )
        self.plan = self._plan_for([*callbacks, *self._engine_callbacks])
        self._in_loop = False
        self._stop_watch: StopWatch | None = None
        self._held_out_pass: DataPass[object] | None = None  # the evaluation reading now
        self.forward_path = ForwardPath(
            model, precision, device, distributed, compile=settings.compile, notes=self._notes
        )
        if self.state.sharded:
            _shard(self.forward_path, model, optimizer, self.callbacks, settings)
        self.state.trainable_parameters = [p for p in model.parameters() if p.requires_grad]

    def _plan_for(self, callbacks: Sequence[Callback]) -> CallbackPlan:
        """The plan of ``callbacks`` on this rank; they become the state's callbacks."""
        distributed = self.state.distributed
        plan = CallbackPlan(
            callbacks,
            rank=distributed.rank if distributed else 0,
            local_rank=distributed.local_rank if distributed else 0,
        )
        self.state.callbacks = list(callbacks)
        return plan

    def add_callbacks(self, callbacks: Sequence[Callback]) -> None:
        """Add ``callbacks`` after the run's others (before the engine's own) and plan the
        events again. Added during a fit, they are called from the next event on."""
        run_callbacks = self.callbacks[: len(self.callbacks) - len(self._engine_callbacks)]
        self.plan = self._plan_for([*run_callbacks, *callbacks, *self._engine_callbacks])

    # -- public API used by callbacks ------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop cleanly after the current step (``fit_end`` still runs). Requested on the
        main thread during the loop, the stop also gives up on a batch that does not come
        within ``stop_grace_s`` seconds (``speedtronic.engine.stop_watch``)."""
        self.state.requests.request_stop(reason)
        if self._in_loop and self._stop_watch is None:
            self._stop_watch = StopWatch.arm(
                self.state.stream,
                self.stop_grace_s,
                reason,
                self.step_in_progress,
                self._reading_held_out,
            )

    @property
    def step_in_progress(self) -> int:
        """The global step the loop is running now (``TrainerView.step_in_progress``). Read
        from the stack (the ``step`` of ``run_global_step``'s frame), so the loop pays nothing
        for it; only the thread that runs the loop sees it (``step + 1`` elsewhere)."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code is _GLOBAL_STEP_CODE:
                step = frame.f_locals.get("step")
                if isinstance(step, int):
                    return step
            frame = frame.f_back
        return self.state.step + 1

    def _reading_held_out(self) -> DataPass[object] | None:
        return self._held_out_pass

    def _end_stop_watch(self) -> None:
        """Disarm the stop watch; when it gave up on a batch, stop the data workers now."""
        watch, self._stop_watch = self._stop_watch, None
        self._in_loop = False
        if watch is not None:
            watch.disarm()
            if watch.fired:
                self.state.stream.abandon()

    @property
    def stop_requested(self) -> bool:
        """Whether a stop was requested on this rank (see ``stop_reason`` for the outcome)."""
        return self.state.requests.stop_reason is not None

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The mean microbatch loss of the last completed step, detached (a 0-d device
        tensor). Detached here, on the first read, rather than every step in the loop."""
        state = self.state
        loss = state.step_loss
        if loss is not None and loss.requires_grad:
            # Keep the detached tensor: later reads are free and the graph's nodes go now.
            loss = state.step_loss = loss.detach()
        return loss

    @property
    def stop_reason(self) -> str | None:
        """Why the fit stops early. In a multi-rank run a stop requested on any rank takes
        effect on every rank at the next logging step (``agree_on_stop``)."""
        requests = self.state.requests
        return requests.agreed_stop if self.state.multi_rank else requests.stop_reason

    def request_optimizer_reset(self, requested_by: str) -> None:
        """Ask for an ``optimizer_reset`` in this step (honoured when resets are allowed)."""
        self.state.requests.request_reset(requested_by)

    def take_reset_requests(self) -> tuple[str, ...]:
        return self.state.requests.take_resets()

    def reset_optimizer_state(self) -> None:
        """Clear the optimizer's per-parameter state (momenta), keeping hyper-parameters."""
        optimizer = self.state.optimizer
        reset = getattr(optimizer, "reset_state", None)
        if callable(reset):
            reset()
        else:
            optimizer.state = defaultdict(dict)

    def is_metric_due(self, step: int) -> bool:
        """Logging steps: every ``metrics_every`` steps, evaluation steps, the final step."""
        if step % self.settings.metrics_every == 0 or step == self.state.target_step:
            return True
        every = self.evaluation.every
        return every > 0 and step % every == 0

    def note_skipped_step(self, step: int) -> None:
        self.state.skipped_steps += 1
        warn(
            f"step {step}: the fp16 grad scaler skipped the update (overflow); retrying the step",
            RuntimeWarning,
        )

    # -- forward ---------------------------------------------------------------------

    @property
    def train_module(self) -> nn.Module:
        """The module the forward pass calls: the DDP wrapper in a data-parallel run, else
        the raw model (``trainer.model``)."""
        return self.forward_path.train_module

    # -- fit ---------------------------------------------------------------------------

    def fit(self, max_steps: int | None = None) -> TrainResult:
        """Train until the absolute step ``max_steps`` (or the configured target)."""
        state = self.state
        requested = max_steps if max_steps is not None else self.max_steps
        if requested is None or requested <= 0:
            raise ValueError(f"max_steps must be a positive integer, got {requested!r}")
        state.target_step = max(state.step, requested)
        state.requests.begin_fit()
        state.due_records = []
        state.pending_eval = None
        start_step = state.step
        fit_ctx = FitContext(start_step, state.target_step)
        state.model.to(state.device)
        state.model.train()
        self.forward_path.prepare(state.model, state.callbacks)
        path = self.forward_path
        state.plain_step = path.plain and path.gradient_ranks == 1 and state.scaler is None
        state.moves_batches = state.device.type != "cpu"
        state.optimizer.zero_grad(set_to_none=True)
        state.step_loss = None
        error: BaseException | None = None
        raised: BaseException | None = None
        try:
            self.plan.emit(self, On.SETUP, fit_ctx)
            self.plan.emit(self, On.FIT_START, fit_ctx)
            # Rates and elapsed_s measure training, not one-off setup (opening sinks, etc.).
            state.fit_clock = FitClock(time.perf_counter(), start_step, state.samples, state.tokens)
            self._in_loop = True
            try:
                requests, multi_rank = state.requests, state.multi_rank
                # ``micro_batch_size: auto`` wraps each step; otherwise the loop runs bare
                # (and the recovery's module is not loaded).
                run_step = run_global_step
                if self.settings.auto_micro_batch:
                    from speedtronic.engine.oom_retry import OomRecovery

                    run_step = OomRecovery(self, state).run_step
                # One process: the target and a stop request decide (spelled out, no call
                # per step); ranks agree first.
                while state.step < state.target_step and (
                    _ranks_keep_going(state, start_step, self.is_metric_due(state.step))
                    if multi_rank
                    else requests.stop_reason is None
                ):
                    run_step(self, state, state.step + 1)
            except EpochLimitReached:
                # The data ran out mid-step (or before it): drop the unfinished step.
                state.optimizer.zero_grad(set_to_none=True)
            self._end_stop_watch()
            result = _fit_result(
                self.state, start_step, self.last_loss, self.stop_reason, self.settings.tensor
            )
            # Every fit_end hook runs (the final checkpoint is saved even when a callback
            # before it fails); the first failure then fails the fit.
            _raise_first(
                self.plan.emit_isolated(self, On.FIT_END, FitEndContext(result, self.stop_reason))
            )
            return result
        except BaseException as exc:
            error = raised = exc
            failures = self.plan.emit_isolated(
                self, On.EXCEPTION, ExceptionContext(exc, state.step)
            )
            attach_failures(exc, failures)
            failure = collective_failure(exc, state.distributed)
            if failure is not None:
                raised = failure
                raise failure from exc
            raise
        finally:
            self._end_stop_watch()
            failures = self.plan.emit_isolated(
                self, On.TEARDOWN, TeardownContext(state.step, error)
            )
            if raised is not None:
                attach_failures(raised, failures)  # the fit's own error stays the one raised
            else:
                _raise_first(failures)

    # -- evaluation ----------------------------------------------------------------------

    def run_evaluation(self, data: Iterable[object] | None = None) -> EvalOutcome:
        """Evaluate the model on ``data`` (default: the trainer's ``eval_data``), up to
        ``eval_max_batches`` batches; see ``speedtronic.engine.evaluation.evaluate_state``."""
        source = self.evaluation.data if data is None else data
        if source is None:
            raise EvaluationError(
                "no held-out data to evaluate: pass data to evaluate() or eval_data to Trainer"
            )
        # Read through a DataPass, whose waits the stop watch bounds as it bounds the
        # training stream's (a SIGTERM while the held-out data hangs still ends the run).
        batches = self._held_out_pass = DataPass(source)
        try:
            one_replica = self.forward_path.one_replica(self.state.callbacks)
            parts = self.evaluation.parts if data is None else None
            return evaluate_state(
                self.state, batches, self.evaluation.max_batches, one_replica, parts
            )
        finally:
            self._held_out_pass = None

    def evaluate(self, data: Iterable[object] | None = None) -> dict[str, float]:
        """The held-out metrics of the model as it is now: ``{"eval/loss": ...,
        "eval/ppl": ...}``. Changes no training state (model mode, RNG, data position);
        emits no events (``eval_start``/``eval_end`` belong to evaluations inside a fit)."""
        self.state.model.to(self.state.device)
        return dict(self.run_evaluation(data).metrics)

    # -- state ---------------------------------------------------------------------------

    def callback_states(self) -> dict[str, dict[str, object]]:
        """Every stateful callback's ``state_dict()``, by ``state_key``."""
        return callback_states(self.state.callbacks)

    def state_dict(self) -> dict[str, object]:
        """Everything needed to continue this run exactly (loads with weights_only=True)."""
        state = capture_training_state(self.state)
        layout = current_layout(self)
        if layout is not None:  # what an elastic resume keeps (``engine.batch_layout``)
            state[LAYOUT_KEY] = layout.to_dict()
        return state

    def load_state_dict(self, state: Mapping[str, object], *, load_callbacks: bool = True) -> None:
        """Restore a ``state_dict``; raises ``TrainingStateError`` naming what does not fit.
        On another number of data-parallel ranks the saved global batch is kept
        (``speedtronic.engine.batch_layout``)."""
        layout, before = resume_layout(self, state), current_layout(self)
        if layout is None and self.settings.auto_micro_batch:
            from speedtronic.engine.oom_retry import auto_resume_layout

            layout = auto_resume_layout(self, state)  # the size an OOM chose
        if layout is not None:
            apply_layout(self, layout)
        try:
            restore_training_state(self.state, state, load_callbacks=load_callbacks)
        except BaseException:
            if layout is not None and before is not None:
                apply_layout(self, before)  # a refused checkpoint leaves the trainer as it was
            raise
