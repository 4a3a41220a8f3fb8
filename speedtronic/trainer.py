"""The Trainer: owns the training state and runs a fit around ``speedtronic.loop``.

``fit`` emits ``setup -> fit_start -> [global steps] -> fit_end -> teardown`` (on error
``exception`` then ``teardown``); each global step is ``loop.run_global_step``.

Given a ``DistributedContext`` (``speedtronic.distributed``) the trainer trains data-parallel:
DDP around the model (``trainer.model`` stays the raw module), ``no_sync`` on all but the
last microbatch, metrics reduced across ranks on logging steps, callbacks placed by their
``rank_policy``, and a stop requested on any rank honoured by all ranks at the same step.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from speedtronic import __version__
from speedtronic.batch import run_model
from speedtronic.callback import Callback
from speedtronic.checkpoint import CheckpointManager
from speedtronic.contexts import (
    ExceptionContext,
    FitContext,
    FitEndContext,
    TeardownContext,
)
from speedtronic.coordinator import CoordinatorCallback, SyncCoordinator
from speedtronic.data import BatchStream
from speedtronic.dispatch import CallbackPlan, HookFailure, attach_failures
from speedtronic.distributed import (
    DistributedContext,
    RankMetricReducer,
    ReplicaSync,
    agree_on_stop,
    collective_failure,
    no_sync_on_non_final,
    reduce_run_totals,
    replica_groups,
    wrap_data_parallel,
)
from speedtronic.events import On
from speedtronic.loop import run_global_step
from speedtronic.metrics import MetricValue
from speedtronic.plugins import callback_registry
from speedtronic.precision import (
    PrecisionPlan,
    autocast_context,
    make_grad_scaler,
    resolve_device,
    resolve_precision,
)
from speedtronic.profiling import MetricLogger, MetricLoggerCallback
from speedtronic.result import TrainResult
from speedtronic.rng import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig

STATE_FORMAT_VERSION = 1
"""Version of the layout returned by ``Trainer.state_dict`` (stored in checkpoints)."""

LRScheduler = torch.optim.lr_scheduler.LRScheduler


class TrainingStateError(ValueError):
    """A saved training state does not fit this trainer (format, model keys, shapes)."""


@dataclass(frozen=True)
class FitClock:
    """Where a fit started, for invocation-local rates."""

    start_time: float
    start_step: int
    start_samples: int
    start_tokens: int


def _is_compile_failure(exc: BaseException) -> bool:
    """True for failures of the compiler itself, not errors raised by the model's code."""
    try:
        from torch._dynamo import exc as dynamo_exc
    except ImportError:  # pragma: no cover - very old torch
        return False
    if isinstance(exc, dynamo_exc.TorchRuntimeError):
        return False  # the model's own error, surfaced through dynamo
    return isinstance(exc, dynamo_exc.TorchDynamoException)


def _raise_first(failures: Sequence[HookFailure]) -> None:
    """Raise the first hook failure, with the later ones attached as notes."""
    if failures:
        first = failures[0].error
        attach_failures(first, failures[1:])
        raise first


def _legacy_callbacks(
    coordinator: SyncCoordinator | None,
    logger: MetricLogger | None,
    checkpoint_manager: CheckpointManager | None,
) -> list[Callback]:
    """The original constructor arguments, adapted to callbacks (same events, same order)."""
    adapted: list[Callback] = []
    if coordinator is not None:
        adapted.append(CoordinatorCallback(coordinator))
    if logger is not None:
        adapted.append(MetricLoggerCallback(logger))
    if checkpoint_manager is not None:
        # The checkpoint feature is a plugin; the engine finds it by name, never by import.
        factory = cast("Callable[..., Callback]", callback_registry.get("checkpoint"))
        adapted.append(factory(manager=checkpoint_manager))
    return adapted


class Trainer:
    """Trains ``model`` with ``optimizer`` on batches from ``dataloader``.

    ``dataloader`` is any iterable of batches (a ``DataLoader``, a list); it is re-iterated
    forever and its position is part of the training state, so resume is exact.
    ``max_steps`` is an absolute target: a resumed trainer continues up to it.
    """

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
    ) -> None:
        self.config = self._coerce_config(config)
        cfg = self.config
        if device is None:  # a distributed run uses the device of this rank
            device = distributed.device if distributed else (cfg.run.device if cfg else "cpu")
        self.device = resolve_device(device)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stream = dataloader if isinstance(dataloader, BatchStream) else BatchStream(dataloader)
        self.precision = precision or resolve_precision(cfg.precision if cfg else None, self.device)
        self.scaler = make_grad_scaler(self.precision)
        self.accumulation_steps = self._pick(
            accumulation_steps, cfg.accumulation_steps if cfg else None, 1
        )
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        self.grad_clip = (
            grad_clip if grad_clip is not None else (cfg.optimizer.grad_clip if cfg else None)
        )
        self.metrics_every = self._pick(metrics_every, cfg.logging.every_steps if cfg else None, 1)
        self.allow_optimizer_reset = bool(
            self._pick(
                allow_optimizer_reset, cfg.distributed.reset_inner_optimizer if cfg else None, True
            )
        )
        self.max_steps = max_steps if max_steps is not None else (cfg.target_steps if cfg else None)
        self.output_dir = Path(
            output_dir if output_dir is not None else (cfg.run.output_dir if cfg else "runs")
        )
        self.shape_report = shape_report
        self._target_step = self.max_steps or 0
        self.step = start_step
        self.samples = 0
        self.tokens = 0
        self.last_loss: torch.Tensor | None = None
        self.due_records: list[dict[str, MetricValue]] = []
        self.fit_clock = FitClock(time.perf_counter(), start_step, 0, 0)
        self.skipped_steps = 0
        self._stop_reason: str | None = None
        self._agreed_stop: str | None = None
        self._reset_requests: list[str] = []
        self.grad_sync_context: Callable[[bool], contextlib.AbstractContextManager[object]] = (
            lambda final: contextlib.nullcontext()
        )
        self.callbacks: list[Callback] = list(callbacks)
        self.callbacks += _legacy_callbacks(coordinator, logger, checkpoint_manager)
        self.distributed = distributed
        self._ddp: nn.parallel.DistributedDataParallel | None = None
        if self.multi_rank:
            assert distributed is not None
            self.callbacks.append(RankMetricReducer(distributed))  # the last contributor
        self.plan = CallbackPlan(
            self.callbacks,
            rank=distributed.rank if distributed else 0,
            local_rank=distributed.local_rank if distributed else 0,
        )
        self._compile_requested = bool(self._pick(compile, cfg.compile if cfg else None, False))
        self._compiled: nn.Module | None = None
        self.trainable_parameters = [p for p in model.parameters() if p.requires_grad]

    # -- construction helpers --------------------------------------------------------

    @staticmethod
    def _pick(
        explicit: int | bool | None, configured: int | bool | None, default: int | bool
    ) -> int:
        if explicit is not None:
            return int(explicit)
        if configured is not None:
            return int(configured)
        return int(default)

    @staticmethod
    def _coerce_config(
        config: SpeedtronicConfig | Mapping[str, object] | None,
    ) -> SpeedtronicConfig | None:
        if config is None:
            return None
        from speedtronic.config import SpeedtronicConfig

        if isinstance(config, SpeedtronicConfig):
            return config
        return SpeedtronicConfig.from_dict(config)

    # -- public API used by callbacks ------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop cleanly after the current step (``fit_end`` still runs)."""
        if self._stop_reason is None:
            self._stop_reason = reason

    @property
    def stop_requested(self) -> bool:
        """Whether a stop was requested on this rank (see ``stop_reason`` for the outcome)."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """Why the fit stops early. In a multi-rank run a stop requested on any rank takes
        effect on every rank at the next logging step (``agree_on_stop``)."""
        return self._agreed_stop if self.multi_rank else self._stop_reason

    @property
    def multi_rank(self) -> bool:
        """True in a distributed run with more than one rank."""
        return self.distributed is not None and self.distributed.world_size > 1

    def request_optimizer_reset(self, requested_by: str) -> None:
        """Ask for an ``optimizer_reset`` in this step (honoured when resets are allowed)."""
        self._reset_requests.append(requested_by)

    def take_reset_requests(self) -> tuple[str, ...]:
        requested = tuple(self._reset_requests)
        self._reset_requests.clear()
        return requested

    def reset_optimizer_state(self) -> None:
        """Clear the optimizer's per-parameter state (momenta), keeping hyper-parameters."""
        reset = getattr(self.optimizer, "reset_state", None)
        if callable(reset):
            reset()
        else:
            self.optimizer.state = defaultdict(dict)

    def is_metric_due(self, step: int) -> bool:
        return step % self.metrics_every == 0 or step == self.target_step

    def note_skipped_step(self, step: int) -> None:
        self.skipped_steps += 1
        warnings.warn(
            f"step {step}: the fp16 grad scaler skipped the update (overflow); retrying the step",
            RuntimeWarning,
            stacklevel=2,
        )

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

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        return autocast_context(self.precision, self.device)

    @property
    def train_module(self) -> nn.Module:
        """The module the forward pass calls: the DDP wrapper in a data-parallel run, else
        the raw model (``trainer.model``)."""
        return self._ddp if self._ddp is not None else self.model

    def forward(self, batch: object) -> object:
        """The model's output for a batch, compiled when compilation is on and works."""
        if self._compiled is None:
            return run_model(self.train_module, batch)
        try:
            return run_model(self._compiled, batch)
        except Exception as exc:
            if not _is_compile_failure(exc):
                raise
            warnings.warn(
                f"torch.compile failed ({type(exc).__name__}: {exc}); continuing in eager mode",
                RuntimeWarning,
                stacklevel=2,
            )
            self._compiled = None
            return run_model(self.train_module, batch)

    def _setup_compile(self) -> None:
        if not self._compile_requested or self._compiled is not None:
            return
        try:
            self._compiled = cast(nn.Module, torch.compile(self.train_module))
        except Exception as exc:  # compile unavailable on this platform: stay eager
            warnings.warn(
                f"torch.compile unavailable ({exc}); running eagerly", RuntimeWarning, stacklevel=2
            )

    # -- data parallelism ----------------------------------------------------------------

    def _ranks_per_replica(self, context: DistributedContext) -> int:
        """Ranks per model replica: the world, unless a ``ReplicaSync`` callback says."""
        sizes = {cb.ranks_per_replica for cb in self.callbacks if isinstance(cb, ReplicaSync)}
        if len(sizes) > 1:
            raise ValueError(f"callbacks disagree on ranks_per_replica: {sorted(sizes)}")
        return sizes.pop() if sizes else context.world_size

    def _setup_data_parallel(self) -> None:
        """Wrap the model in DDP over its replica (once per model; a collective)."""
        context = self.distributed
        if context is None or not self.multi_rank:
            return
        if self._ddp is not None and self._ddp.module is self.model:
            return
        size = self._ranks_per_replica(context)
        self._ddp = None
        self.grad_sync_context = lambda final: contextlib.nullcontext()
        if size > 1:
            group = replica_groups(context, size).replica if size < context.world_size else None
            self._ddp = wrap_data_parallel(self.model, context, group)
            self.grad_sync_context = no_sync_on_non_final(self._ddp)
        self._compiled = None  # compile what the forward pass now calls

    def _keep_going(self, start_step: int) -> bool:
        """Whether to run another step. A multi-rank run agrees on stopping at logging
        steps only (one tiny all-reduce), so every rank stops at the same step."""
        if self.step >= self._target_step:
            return False
        if not self.multi_rank:
            return self._stop_reason is None
        assert self.distributed is not None
        due = self.step > start_step and self.is_metric_due(self.step)
        if self._agreed_stop is None and due:
            if agree_on_stop(self.distributed, self._stop_reason is not None):
                self._agreed_stop = self._stop_reason or "stop requested on another rank"
        return self._agreed_stop is None

    # -- fit ---------------------------------------------------------------------------

    @property
    def target_step(self) -> int:
        return self._target_step

    def fit(self, max_steps: int | None = None) -> TrainResult:
        """Train until the absolute step ``max_steps`` (or the configured target)."""
        requested = max_steps if max_steps is not None else self.max_steps
        if requested is None or requested <= 0:
            raise ValueError(f"max_steps must be a positive integer, got {requested!r}")
        self._target_step = max(self.step, requested)
        self._stop_reason = None
        self._agreed_stop = None
        self.due_records = []
        start_step = self.step
        fit_ctx = FitContext(start_step, self._target_step)
        self.model.to(self.device)
        self.model.train()
        self._setup_data_parallel()
        self.optimizer.zero_grad(set_to_none=True)
        self._setup_compile()
        self.last_loss = None
        error: BaseException | None = None
        raised: BaseException | None = None
        try:
            self.plan.emit(self, On.SETUP, fit_ctx)
            self.plan.emit(self, On.FIT_START, fit_ctx)
            # Rates and elapsed_s measure training, not one-off setup (opening sinks, etc.).
            self.fit_clock = FitClock(time.perf_counter(), start_step, self.samples, self.tokens)
            while self._keep_going(start_step):
                run_global_step(self, self.step + 1)
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

    # -- state ---------------------------------------------------------------------------

    def callback_states(self) -> dict[str, dict[str, object]]:
        return {cb.state_key: cb.state_dict() for cb in self.callbacks if cb.state_key is not None}

    def state_dict(self) -> dict[str, object]:
        """Everything needed to continue this run exactly (loads with weights_only=True)."""
        config = self.config.to_dict(redact_secrets=True) if self.config is not None else None
        return {
            "format_version": STATE_FORMAT_VERSION,
            "versions": {"speedtronic": __version__, "torch": str(torch.__version__)},
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "counters": {"step": self.step, "samples": self.samples, "tokens": self.tokens},
            "rng": capture_rng_state(),
            "data": self.stream.state_dict(),
            "callbacks": self.callback_states(),
            "config": config,
            "precision": {
                "mode": self.precision.mode,
                "autocast_enabled": self.precision.autocast_enabled,
                "use_scaler": self.precision.use_scaler,
            },
        }

    def load_state_dict(self, state: Mapping[str, object], *, load_callbacks: bool = True) -> None:
        """Restore a ``state_dict``; raises ``TrainingStateError`` naming what does not fit."""
        version = state.get("format_version")
        if version != STATE_FORMAT_VERSION:
            raise TrainingStateError(
                f"unknown training-state format version {version!r} "
                f"(this speedtronic reads version {STATE_FORMAT_VERSION})"
            )
        # Check the model first and load the optimizer (which validates its groups) before
        # touching the weights, so a mismatched checkpoint leaves the trainer as it was.
        weights = cast(Mapping[str, torch.Tensor], state["model"])
        self._check_model(weights)
        self.optimizer.load_state_dict(cast(dict[str, object], state["optimizer"]))
        self.model.load_state_dict(weights)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(cast(dict[str, object], state["scheduler"]))
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(cast(dict[str, object], state["scaler"]))
        counters = cast(Mapping[str, int], state["counters"])
        self.step, self.samples, self.tokens = (
            int(counters["step"]),
            int(counters["samples"]),
            int(counters["tokens"]),
        )
        restore_rng_state(cast(Mapping[str, object] | None, state.get("rng")))
        self._adopt_saved_cuda_rng(state.get("rng"))
        data_state = state.get("data")
        if isinstance(data_state, Mapping):
            self.stream.load_state_dict(cast(Mapping[str, int], data_state))
        if load_callbacks:
            self._load_callback_states(
                cast(Mapping[str, Mapping[str, object]], state.get("callbacks") or {})
            )

    def _adopt_saved_cuda_rng(self, rng: object) -> None:
        """Rank 0 saved the generator of *its* GPU (index 0 on its node); every rank ran the
        same random ops on its own GPU, so that state is the one this rank's GPU needs."""
        if not self.multi_rank or self.device.type != "cuda" or not isinstance(rng, Mapping):
            return
        saved = rng.get("cuda")
        if isinstance(saved, list) and saved and isinstance(saved[0], torch.Tensor):
            torch.cuda.set_rng_state(saved[0], self.device)

    def resume(self, state: Mapping[str, object]) -> None:
        """Original API: restore a checkpoint's state."""
        self.load_state_dict(state)

    def _check_model(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        mismatched = [
            f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(own[k].shape)}"
            for k in own
            if k in weights and tuple(weights[k].shape) != tuple(own[k].shape)
        ]
        problems = []
        if missing:
            problems.append(f"missing keys: {', '.join(missing[:10])}")
        if unexpected:
            problems.append(f"unexpected keys: {', '.join(unexpected[:10])}")
        if mismatched:
            problems.append(f"shape mismatch: {'; '.join(mismatched[:10])}")
        if problems:
            raise TrainingStateError("checkpoint does not match the model: " + " | ".join(problems))

    def _load_callback_states(self, states: Mapping[str, Mapping[str, object]]) -> None:
        known = {cb.state_key: cb for cb in self.callbacks if cb.state_key is not None}
        for key, callback in known.items():
            if key in states:
                callback.load_state_dict(states[key])
            else:
                warnings.warn(
                    f"checkpoint has no state for callback {callback.display_name!r} "
                    f"(state_key {key!r}); it starts fresh",
                    UserWarning,
                    stacklevel=3,
                )
        for key in sorted(set(states) - set(known)):
            warnings.warn(
                f"checkpoint holds state for state_key {key!r} but no callback of this run "
                "uses that key; it is ignored",
                UserWarning,
                stacklevel=3,
            )


TrainingEngine = Trainer
SpeedtronicTrainer = Trainer
