"""The Trainer: owns the training state and runs a fit around ``speedtronic.engine.loop``.

``fit`` emits ``setup -> fit_start -> [global steps] -> fit_end -> teardown`` (on error
``exception`` then ``teardown``); each global step is ``loop.run_global_step``.

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
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic.compat.trainer_args import coerce_config, legacy_callbacks, resolve_settings
from speedtronic.config.sections import ParallelConfig
from speedtronic.data import BatchStream, EpochLimitReached
from speedtronic.data.stream import DataPass
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    ExceptionContext,
    FitContext,
    FitEndContext,
    TeardownContext,
)
from speedtronic.engine.dispatch import CallbackPlan, HookFailure, attach_failures
from speedtronic.engine.evaluation import (
    EvalOutcome,
    EvaluationError,
    check_eval_settings,
    evaluate_model,
)
from speedtronic.engine.events import On
from speedtronic.engine.forward_path import ForwardPath
from speedtronic.engine.loop import run_global_step
from speedtronic.engine.metrics import MetricValue
from speedtronic.engine.notes import Notes
from speedtronic.engine.result import TrainResult
from speedtronic.engine.step_state import FitClock as FitClock
from speedtronic.engine.step_state import StepRequests
from speedtronic.engine.stop_watch import STOP_GRACE_S, StopTimeoutError, StopWatch
from speedtronic.state.training_state import STATE_FORMAT_VERSION as STATE_FORMAT_VERSION
from speedtronic.state.training_state import TrainingStateError as TrainingStateError
from speedtronic.state.training_state import capture_training_state, restore_training_state
from speedtronic.systems.distributed import (
    DistributedContext,
    RankMetricReducer,
    agree_on_stop,
    collective_failure,
    reduce_run_totals,
)
from speedtronic.systems.precision import (
    PrecisionPlan,
    make_grad_scaler,
)
from speedtronic.systems.sharding import find_shard_blocks, reshard_model
from speedtronic.user_warnings import warn

if TYPE_CHECKING:
    from speedtronic.compat.coordinator import SyncCoordinator
    from speedtronic.compat.metric_logger import MetricLogger
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.state.checkpoint import CheckpointManager
    from speedtronic.state.resume import ResumePoint

LRScheduler = torch.optim.lr_scheduler.LRScheduler
_GLOBAL_STEP_CODE = run_global_step.__code__


def _parallel_settings(
    given: ParallelConfig | Mapping[str, object] | None, config: SpeedtronicConfig | None
) -> tuple[str, bool]:
    """``(strategy, reshard_after_forward)`` of ``parallel=`` as given (a mapping is
    validated), else of the config, else ddp -- without building a section for the default
    (validating one costs a plugin scan on first use)."""
    section = config.parallel if given is None and config is not None else given
    if section is None:
        return "ddp", True
    if not isinstance(section, ParallelConfig):
        section = ParallelConfig.from_dict(section)
    return section.strategy, section.reshard_after_forward


def _raise_first(failures: Sequence[HookFailure]) -> None:
    """Raise the first hook failure, with the later ones attached as notes."""
    if failures:
        first = failures[0].error
        attach_failures(first, failures[1:])
        raise first


class Trainer:
    """Trains ``model`` with ``optimizer`` on batches from ``dataloader``.

    ``dataloader`` is any iterable of batches (a ``DataLoader``, a list); it is re-iterated
    forever and its position is part of the training state, so resume is exact.
    ``max_steps`` is an absolute target: a resumed trainer continues up to it.
    ``max_epochs`` (default ``run.max_epochs`` of the config) also ends the fit when the
    data stream would start that epoch; a global step the last epoch cannot fill is not
    taken.
    ``stop_grace_s`` bounds how long a requested stop waits for a batch that does not come
    (``speedtronic.engine.stop_watch``; set it on an instance or on the class).
    """

    stop_grace_s: float = STOP_GRACE_S

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataloader: Iterable[object],
        *,
        device: str | torch.device | None = None,
        config: SpeedtronicConfig | Mapping[str, object] | None = None,
        scheduler: LRScheduler | None = None,
        precision: PrecisionPlan | None = None,
        callbacks: Sequence[Callback] = (),
        coordinator: SyncCoordinator | None = None,
        max_steps: int | None = None,
        start_step: int = 0,
        accumulation_steps: int | None = None,
        grad_clip: float | None = None,
        compile: bool | None = None,
        metrics_every: int | None = None,
        allow_optimizer_reset: bool | None = None,
        output_dir: str | Path | None = None,
        shape_report: object | None = None,
        distributed: DistributedContext | None = None,
        logger: MetricLogger | None = None,
        checkpoint_manager: CheckpointManager | None = None,
        max_epochs: int | None = None,
        eval_data: Iterable[object] | None = None,
        eval_every: int | None = None,
        eval_max_batches: int | None = None,
        parallel: ParallelConfig | Mapping[str, object] | None = None,
    ) -> None:
        check_eval_settings(eval_every, eval_max_batches)
        if eval_every is not None and eval_data is None:
            raise EvaluationError(
                f"eval_every={eval_every} needs eval_data, the held-out batches to evaluate"
            )
        self.config = coerce_config(config)
        settings = resolve_settings(
            self.config,
            device=device,
            precision=precision,
            accumulation_steps=accumulation_steps,
            grad_clip=grad_clip,
            metrics_every=metrics_every,
            allow_optimizer_reset=allow_optimizer_reset,
            max_steps=max_steps,
            output_dir=output_dir,
            compile=compile,
            distributed=distributed,
        )
        if settings.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {settings.accumulation_steps}")
        self.device = settings.device
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stream = dataloader if isinstance(dataloader, BatchStream) else BatchStream(dataloader)
        if max_epochs is None and self.config is not None:
            max_epochs = self.config.run.max_epochs
        if max_epochs is not None:
            if isinstance(max_epochs, bool) or not isinstance(max_epochs, int) or max_epochs < 1:
                raise ValueError(f"max_epochs must be a positive integer, got {max_epochs!r}")
            self.stream.max_epochs = max_epochs
        self.precision = settings.precision
        self.scaler = make_grad_scaler(self.precision)
        self.accumulation_steps = settings.accumulation_steps
        self.grad_clip = settings.grad_clip
        self.metrics_every = settings.metrics_every
        self.allow_optimizer_reset = settings.allow_optimizer_reset
        self.max_steps = settings.max_steps
        self.output_dir = settings.output_dir
        self.run_id: str | None = None
        """Which run this trainer continues (``speedtronic.state.run_identity``): recorded in
        every checkpoint it saves. ``build_runtime`` sets it from the run directory; ``None``
        (a trainer built in Python) records nothing and resumes any checkpoint."""
        self.resumed_from: ResumePoint | None = None
        """The checkpoint this trainer's state was restored from by ``resume_from`` (its
        path, step and the newer checkpoints that could not be read); ``None``: not resumed."""
        self.shape_report = shape_report
        self.target_step = self.max_steps or 0
        """The absolute step this fit trains up to (set by ``fit``)."""
        self.step = start_step
        self.samples = 0
        self.tokens = 0
        self.step_loss: torch.Tensor | None = None
        """The last completed step's loss as the loop left it: with one microbatch still
        attached to its (already freed) graph, like a hand-written loop's ``loss``; read it
        through ``last_loss``."""
        self.due_records: list[dict[str, MetricValue]] = []
        self.fit_clock = FitClock(time.perf_counter(), start_step, 0, 0)
        self.skipped_steps = 0
        self.requests = StepRequests()
        self._in_loop = False
        self._stop_watch: StopWatch | None = None
        self._held_out_pass: DataPass[object] | None = None  # the evaluation reading now
        self.callbacks: list[Callback] = list(callbacks)
        self._notes = Notes()
        self.callbacks += legacy_callbacks(coordinator, logger, checkpoint_manager, self._notes)
        self.logger = logger
        """The 2.0 ``MetricLogger`` given as ``logger=`` (``build_runtime`` gives one), else
        ``None``; 2.0 code attaches hooks with ``trainer.logger.hooks.append(hook)``."""
        self.distributed = distributed
        self.multi_rank = distributed is not None and distributed.world_size > 1
        """True in a distributed run with more than one rank (fixed for the trainer's life)."""
        if self.multi_rank:
            assert distributed is not None
            self.callbacks.append(RankMetricReducer(distributed))  # the last contributor
        self.plan = CallbackPlan(
            self.callbacks,
            rank=distributed.rank if distributed else 0,
            local_rank=distributed.local_rank if distributed else 0,
        )
        self.forward_path = ForwardPath(
            model,
            self.precision,
            self.device,
            distributed,
            compile=settings.compile,
            notes=self._notes,
        )
        self.parallel_strategy, reshard_after_forward = _parallel_settings(parallel, self.config)
        """``parallel.strategy``: ``ddp`` or ``fsdp``."""
        self._sharded_state = self.parallel_strategy == "fsdp"
        if self._sharded_state and not self.forward_path.shard(
            optimizer, self.callbacks, reshard_after_forward=reshard_after_forward
        ):
            find_shard_blocks(model)  # a model torchrun could not shard fails here too
            warn(
                "parallel.strategy fsdp on a single process: the model is one whole shard "
                "(not sharded); checkpoints are still written sharded (DCP) and resume on "
                "any number of ranks",
                UserWarning,
            )
        self.trainable_parameters = [p for p in model.parameters() if p.requires_grad]
        self.eval_data = eval_data
        self.eval_every = eval_every or 0
        """Steps between evaluations during a fit (0: off); the final step evaluates too."""
        self.eval_max_batches = eval_max_batches
        self.pending_eval: Mapping[str, float] | None = None
        """This step's evaluation results until the metric record takes them."""

    # -- construction helpers --------------------------------------------------------

    # -- public API used by callbacks ------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop cleanly after the current step (``fit_end`` still runs). Requested on the
        main thread during the loop, the stop also gives up on a batch that does not come
        within ``stop_grace_s`` seconds (``speedtronic.engine.stop_watch``)."""
        self.requests.request_stop(reason)
        if self._in_loop and self._stop_watch is None:
            self._stop_watch = StopWatch.arm(
                self.stream,
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
        return self.step + 1

    def _reading_held_out(self) -> DataPass[object] | None:
        return self._held_out_pass

    def _end_stop_watch(self) -> None:
        """Disarm the stop watch; when it gave up on a batch, stop the data workers now."""
        watch, self._stop_watch = self._stop_watch, None
        self._in_loop = False
        if watch is not None:
            watch.disarm()
            if watch.fired:
                self.stream.abandon()

    @property
    def stop_requested(self) -> bool:
        """Whether a stop was requested on this rank (see ``stop_reason`` for the outcome)."""
        return self.requests.stop_reason is not None

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The mean microbatch loss of the last completed step, detached (a 0-d device
        tensor). Detached here, on the first read, rather than every step in the loop."""
        loss = self.step_loss
        if loss is not None and loss.requires_grad:
            # Keep the detached tensor: later reads are free and the graph's nodes go now.
            loss = self.step_loss = loss.detach()
        return loss

    @property
    def stop_reason(self) -> str | None:
        """Why the fit stops early. In a multi-rank run a stop requested on any rank takes
        effect on every rank at the next logging step (``agree_on_stop``)."""
        requests = self.requests
        return requests.agreed_stop if self.multi_rank else requests.stop_reason

    def request_optimizer_reset(self, requested_by: str) -> None:
        """Ask for an ``optimizer_reset`` in this step (honoured when resets are allowed)."""
        self.requests.request_reset(requested_by)

    @property
    def reset_requested(self) -> bool:
        """Whether a callback asked for an optimizer reset in this step."""
        return bool(self.requests.resets)

    def take_reset_requests(self) -> tuple[str, ...]:
        return self.requests.take_resets()

    def reset_optimizer_state(self) -> None:
        """Clear the optimizer's per-parameter state (momenta), keeping hyper-parameters."""
        reset = getattr(self.optimizer, "reset_state", None)
        if callable(reset):
            reset()
        else:
            self.optimizer.state = defaultdict(dict)

    def is_metric_due(self, step: int) -> bool:
        """Logging steps: every ``metrics_every`` steps, evaluation steps, the final step."""
        if step % self.metrics_every == 0 or step == self.target_step:
            return True
        return self.eval_every > 0 and step % self.eval_every == 0

    def note_skipped_step(self, step: int) -> None:
        self.skipped_steps += 1
        warn(
            f"step {step}: the fp16 grad scaler skipped the update (overflow); retrying the step",
            RuntimeWarning,
        )

    @property
    def sharded_state(self) -> bool:
        """Whether the training state is sharded (``parallel.strategy: fsdp``): checkpoints
        are DCP directories every rank writes its shard of
        (``speedtronic.state.sharded_checkpoint``), also on a single process, so they resume on
        any number of ranks."""
        return self._sharded_state

    @property
    def notes(self) -> Notes:
        """The run's board of optional named notes (``speedtronic.engine.notes``)."""
        return self._notes

    @property
    def raw_model(self) -> nn.Module:
        return self.model

    # -- the TrainerView members that are not plain attributes ---------------------------

    @property
    def param_groups(self) -> list[dict[str, object]]:
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """Every tensor in the optimizer's per-parameter state."""
        return [
            value
            for per_param in self.optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        ]

    @property
    def precision_mode(self) -> str:
        return self.precision.mode

    @property
    def uses_grad_scaler(self) -> bool:
        return self.scaler is not None

    @property
    def run_config(self) -> Mapping[str, object] | None:
        """The config as plain data, secrets redacted (``None`` without a config)."""
        return self.config.to_dict(redact_secrets=True) if self.config is not None else None

    def data_position(self) -> Mapping[str, int]:
        return self.stream.state_dict()

    def skip_update(self) -> None:
        """Drop this step's gradients: the optimizer step that follows is a no-op."""
        self.optimizer.zero_grad(set_to_none=True)

    # -- forward ---------------------------------------------------------------------

    @property
    def train_module(self) -> nn.Module:
        """The module the forward pass calls: the DDP wrapper in a data-parallel run, else
        the raw model (``trainer.model``)."""
        return self.forward_path.train_module

    # -- fit ---------------------------------------------------------------------------

    def _ranks_keep_going(self, start_step: int) -> bool:
        """Whether the ranks of a multi-rank run go on: they agree on stopping at logging
        steps only (one tiny all-reduce), so every rank stops at the same step."""
        assert self.distributed is not None
        due = self.step > start_step and self.is_metric_due(self.step)
        requests = self.requests
        if requests.agreed_stop is None and due:
            if agree_on_stop(self.distributed, requests.stop_reason is not None):
                requests.agreed_stop = requests.stop_reason or "stop requested on another rank"
        return requests.agreed_stop is None

    # -- fit ---------------------------------------------------------------------------

    def fit(self, max_steps: int | None = None) -> TrainResult:
        """Train until the absolute step ``max_steps`` (or the configured target)."""
        requested = max_steps if max_steps is not None else self.max_steps
        if requested is None or requested <= 0:
            raise ValueError(f"max_steps must be a positive integer, got {requested!r}")
        self.target_step = max(self.step, requested)
        self.requests.begin_fit()
        self.due_records = []
        self.pending_eval = None
        start_step = self.step
        fit_ctx = FitContext(start_step, self.target_step)
        self.model.to(self.device)
        self.model.train()
        self.forward_path.prepare(self.model, self.callbacks)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_loss = None
        error: BaseException | None = None
        raised: BaseException | None = None
        try:
            self.plan.emit(self, On.SETUP, fit_ctx)
            self.plan.emit(self, On.FIT_START, fit_ctx)
            # Rates and elapsed_s measure training, not one-off setup (opening sinks, etc.).
            self.fit_clock = FitClock(time.perf_counter(), start_step, self.samples, self.tokens)
            self._in_loop = True
            try:
                requests, multi_rank = self.requests, self.multi_rank
                # One process: the target and a stop request decide (spelled out, no call
                # per step); ranks agree first.
                while self.step < self.target_step and (
                    self._ranks_keep_going(start_step)
                    if multi_rank
                    else requests.stop_reason is None
                ):
                    run_global_step(self, self.step + 1)
            except EpochLimitReached:
                # The data ran out mid-step (or before it): drop the unfinished step.
                self.optimizer.zero_grad(set_to_none=True)
            self._end_stop_watch()
            result = self._result(start_step)
            # Every fit_end hook runs (the final checkpoint is saved even when a callback
            # before it fails); the first failure then fails the fit.
            _raise_first(
                self.plan.emit_isolated(self, On.FIT_END, FitEndContext(result, self.stop_reason))
            )
            return result
        except BaseException as exc:
            error = raised = exc
            failures = self.plan.emit_isolated(self, On.EXCEPTION, ExceptionContext(exc, self.step))
            attach_failures(exc, failures)
            failure = collective_failure(exc, self.distributed)
            if failure is not None:
                raised = failure
                raise failure from exc
            raise
        finally:
            self._end_stop_watch()
            failures = self.plan.emit_isolated(self, On.TEARDOWN, TeardownContext(self.step, error))
            if raised is not None:
                attach_failures(raised, failures)  # the fit's own error stays the one raised
            else:
                _raise_first(failures)

    train = fit

    def _result(self, start_step: int) -> TrainResult:
        """The fit's result; in a multi-rank run the loss is the mean over ranks and the
        sample and token counts are the totals of all ranks."""
        loss = self.last_loss if self.step > start_step else None
        samples, tokens = self.samples, self.tokens
        if self.multi_rank:
            assert self.distributed is not None
            mean_loss, samples, tokens = reduce_run_totals(self.distributed, loss, samples, tokens)
            final_loss = mean_loss
        else:
            final_loss = float(loss.item()) if loss is not None else None
        return TrainResult(
            steps=self.step,
            samples=samples,
            tokens=tokens,
            final_loss=final_loss,
            elapsed_s=time.perf_counter() - self.fit_clock.start_time,
            metrics=list(self.due_records),
            stop_reason=self.stop_reason,
        )

    # -- evaluation ----------------------------------------------------------------------

    def run_evaluation(self, data: Iterable[object] | None = None) -> EvalOutcome:
        """Evaluate the model on ``data`` (default: the trainer's ``eval_data``), up to
        ``eval_max_batches`` batches; see ``speedtronic.engine.evaluation.evaluate_model``."""
        source = self.eval_data if data is None else data
        if source is None:
            raise EvaluationError(
                "no held-out data to evaluate: pass data to evaluate() or eval_data to Trainer"
            )
        # Read through a DataPass, whose waits the stop watch bounds as it bounds the
        # training stream's (a SIGTERM while the held-out data hangs still ends the run).
        batches = self._held_out_pass = DataPass(source)
        if self.sharded_state:  # gather the shards as they are now (``reshard_model``)
            reshard_model(self.model)
        try:
            return evaluate_model(
                self.model,
                batches,
                device=self.device,
                precision=self.precision,
                max_batches=self.eval_max_batches,
                # Ranks reduce their shards' sums only when they hold one model replica; a
                # rank that is its own replica evaluates its local model alone.
                distributed=(
                    self.distributed if self.forward_path.one_replica(self.callbacks) else None
                ),
            )
        except StopTimeoutError:
            batches.abandon()  # its workers may be stuck in the dataset's code
            raise
        finally:
            self._held_out_pass = None
            if self.sharded_state:  # no gathered copy outlives the evaluation
                reshard_model(self.model)

    def evaluate(self, data: Iterable[object] | None = None) -> dict[str, float]:
        """The held-out metrics of the model as it is now: ``{"eval/loss": ...,
        "eval/ppl": ...}``. Changes no training state (model mode, RNG, data position);
        emits no events (``eval_start``/``eval_end`` belong to evaluations inside a fit)."""
        self.model.to(self.device)
        return dict(self.run_evaluation(data).metrics)

    # -- state ---------------------------------------------------------------------------

    def callback_states(self) -> dict[str, dict[str, object]]:
        return {cb.state_key: cb.state_dict() for cb in self.callbacks if cb.state_key is not None}

    def state_dict(self) -> dict[str, object]:
        """Everything needed to continue this run exactly (loads with weights_only=True)."""
        return capture_training_state(self)

    def load_state_dict(self, state: Mapping[str, object], *, load_callbacks: bool = True) -> None:
        """Restore a ``state_dict``; raises ``TrainingStateError`` naming what does not fit."""
        restore_training_state(self, state, load_callbacks=load_callbacks)

    def resume(self, state: Mapping[str, object]) -> None:
        """Original API: restore a checkpoint's state."""
        self.load_state_dict(state)


TrainingEngine = Trainer
SpeedtronicTrainer = Trainer
