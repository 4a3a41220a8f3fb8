"""``checkpoint``: save the full training state every N steps, at the end, and on SIGTERM.

    callbacks:
      - {name: checkpoint, every_steps: 200, keep_last: 3}

The plugin is on by default (after the configured callbacks) and reads the ``checkpoint:``
section: its keys are the defaults of this plugin's options (``CheckpointOptions``, each
option declared once: the section has every option but ``save_final``), and
``checkpoint: {enabled: false}`` leaves the plugin out unless ``callbacks:`` names it. A
relative ``directory`` is under the run's output directory. The callback is the run's
``ResumeSource``: ``resume: true`` resumes before the fit.

What is saved is ``trainer.state_dict()`` -- model, optimizer, scheduler, grad scaler,
counters, RNG, data position and every callback's state -- so a resumed run continues bit
for bit. Files, the pointer and retention are ``speedtronic.state.checkpoint.CheckpointManager``'s
job; this callback decides *when*.

When a save happens:

* at the ``checkpoint`` event of every step that is a multiple of ``every_steps``;
* at ``fit_end`` when the last completed step was not just saved (``save_final``), and
  always after a SIGTERM/SIGINT stop (``save_on_signal``);
* at ``exception`` (``save_on_exception``, off by default), best effort;
* with ``every_minutes``, also when that many minutes passed since the last save of the fit
  (or its start), by wall clock; every rank decides alike (``wall_clock.Deadline``);
* after a stop by the time budget (``run.max_time``, the ``time_budget`` plugin), always;
* with ``monitor`` (a metric key such as ``eval/loss``) and ``mode`` (``min``/``max``): at
  every step where the monitored value improves on the best so far, and ``best.json`` in the
  directory then names that checkpoint (``CheckpointManager.note_best``); ``keep_last``
  never deletes it. The best value is part of this callback's checkpointed state
  (``state_key: checkpoint``), so it survives a resume. An ``eval/*`` key is read on
  evaluation steps only; a key that is missing where it should be is an error.

Signals (``save_on_signal``): ``speedtronic_callbacks.checkpoint_signals``.

Async save (``async_save``): the state is snapshotted into reused CPU buffers and written by
one background thread while training goes on. Buffers, RNG, counters and callback state are
copied at the save; parameters and optimizer state -- the bulk, which only the optimizer
changes -- are copied by the background thread during the next step's forward and backward,
and this callback waits for that copy at ``before_optimizer_step``. So a callback that
changes parameters in place in a microbatch hook, or in ``before_optimizer_step`` ahead of
this one, must not be combined with async save. A failed write stops the run at the next
step; ``fit_end`` waits until the last checkpoint is on disk.

Distributed runs: the callback runs on every rank (each handles its own signals and takes
part in the stop), but only rank 0 writes -- the ranks hold the same training state. In a
sharded run (``parallel.strategy: fsdp``, ``trainer.sharded_state``) every rank writes its
shard into the step's checkpoint directory and rank 0 commits it (``async_save`` is refused
there, and ``save_on_exception`` does not save: both would need every rank). The
ranks then meet at a barrier, so none runs ahead of (or exits before) a checkpoint that is
not written yet; every rank loads the same file on resume. After a failure rank 0 saves
without the barrier (the other ranks may be gone).

Object storage (``remote: s3://bucket/run1``, any fsspec URL; ``remote_options``: fsspec's
storage options, credentials from the environment): rank 0 hands every committed checkpoint
to a ``speedtronic.state.remote.RemoteMirror``, which claims the prefix for this run
(``owner.json``: another run's prefix stops the fit, exit 2), uploads and verifies each
checkpoint in the background and commits the remote pointer last; ``fit_end`` waits for the
uploads, at most ``remote_final_wait_s`` seconds (saying what it waits for after a few; a
SIGTERM/SIGINT ends the wait at once and the fit as stopped by that signal). On resume
(``fetch_checkpoints``, before the load) a newer remote checkpoint of this run than the
local directory holds is downloaded first -- a fresh machine resumes from the store.
"""

from __future__ import annotations

import logging
import math
import signal
import time
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, cast

from speedtronic.config.declare import keyword_build, plugin
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    CheckpointContext,
    ExceptionContext,
    FitContext,
    FitEndContext,
    MetricsContext,
    OptimizerStepContext,
    TeardownContext,
)
from speedtronic.engine.events import Event
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS, never
from speedtronic.plugins import (
    PluginContext,
    Sections,
)
from speedtronic.state.checkpoint import (
    CheckpointError,
    CheckpointManager,
    checkpoint_step,
    signal_stop_reason,
)
from speedtronic.state.checkpoint_async import AsyncCheckpointWriter
from speedtronic.state.remote import RemoteMirror
from speedtronic.state.remote_store import RemoteStore, RetryPolicy, open_store
from speedtronic.state.resume import FetchedCheckpoint
from speedtronic.state.rng import capture_rng_state
from speedtronic.state.run_lock import RunPaths, resolve_run_path
from speedtronic.state.time_budget import is_time_budget_stop
from speedtronic_callbacks.checkpoint_options import (
    CHECKPOINT_SECTION_SCHEMA,
    DEFAULT_DIRECTORY,
    NO_REMOTE_OPTIONS,
    CheckpointOptions,
    options_errors,
    options_from_section,
    section_errors,
)
from speedtronic_callbacks.checkpoint_remote import (
    fetch,
    start_mirror,
    wait_for_uploads,
)
from speedtronic_callbacks.checkpoint_signals import SaveSignals
from speedtronic_callbacks.monitor import Mode, check_monitor, improves, read_monitored
from speedtronic_callbacks.wall_clock import Deadline

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["CheckpointCallback", "CheckpointOptions"]

logger = logging.getLogger("speedtronic.checkpoint")


def _build(
    cls: type[CheckpointCallback], options: CheckpointOptions, context: PluginContext
) -> CheckpointCallback:
    """A relative ``directory`` is under the run's output directory."""
    directory = resolve_run_path(options.directory, context.output_dir)
    return keyword_build(cls, replace(options, directory=str(directory)))


@plugin(
    "checkpoint",
    options=CheckpointOptions,
    build=_build,
    sections=Sections(
        keys=("checkpoint",),
        schema={"checkpoint": CHECKPOINT_SECTION_SCHEMA},
        to_options=options_from_section,
        errors=section_errors,
    ),
    options_errors=options_errors,
    enabled_by_default=True,
    implied_order=90,  # last: it saves what the others did in the step
)
class CheckpointCallback(Callback):
    """Saves ``trainer.state_dict()`` through a ``CheckpointManager``.

    Build it with a ``directory`` (and the interval/retention options), or hand it an
    existing ``manager`` (the original ``Trainer(checkpoint_manager=...)`` path); the
    manager's ``enabled`` flag switches all saving off. A relative ``directory`` (default
    ``checkpoints``) is under the trainer's ``output_dir``, as from ``run.yaml``: it is
    resolved at ``setup`` (and by ``resume_from``, ``bind_output_dir``). A ``manager``'s
    directory is used as it is.
    """

    # With a monitor it reads the finished record (after every contributor), like a sink.
    metrics_phase: ClassVar[Literal["contribute", "consume"]] = "consume"
    due_when = METRICS_ON_LOGGING_STEPS  # on_metrics only on logging (and evaluation) steps

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        every_steps: int = CheckpointOptions.every_steps,
        keep_last: int | None = CheckpointOptions.keep_last,
        enabled: bool = CheckpointOptions.enabled,
        save_final: bool = CheckpointOptions.save_final,
        save_on_exception: bool = CheckpointOptions.save_on_exception,
        save_on_signal: bool = CheckpointOptions.save_on_signal,
        async_save: bool = CheckpointOptions.async_save,
        manager: CheckpointManager | None = None,
        resume: bool = CheckpointOptions.resume,
        load_callback_state: bool = CheckpointOptions.load_callback_state,
        monitor: str | None = CheckpointOptions.monitor,
        mode: Mode = CheckpointOptions.mode,
        every_minutes: float | None = CheckpointOptions.every_minutes,
        remote: str | None = CheckpointOptions.remote,
        remote_options: Mapping[str, object] = NO_REMOTE_OPTIONS,
        remote_attempts: int = CheckpointOptions.remote_attempts,
        remote_retry: RetryPolicy | None = None,
        remote_final_wait_s: float = CheckpointOptions.remote_final_wait_s,
    ) -> None:
        if every_minutes is not None and not every_minutes > 0:
            raise ValueError(f"every_minutes must be positive or None, got {every_minutes!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if monitor is not None and not monitor:
            raise ValueError("monitor must be a metric key or None, got ''")
        self._relative: Path | None = None  # a directory under the run's output_dir
        if manager is None:
            chosen = Path(DEFAULT_DIRECTORY if directory is None else directory).expanduser()
            self._relative = None if chosen.is_absolute() else chosen
            manager = CheckpointManager(
                chosen, every_steps=every_steps, keep_last=keep_last, enabled=enabled
            )
        elif directory is not None:
            raise ValueError("CheckpointCallback takes a directory or a manager, not both")
        self.manager = manager
        self.resume_requested = resume
        self.load_callback_state = load_callback_state
        self.save_final = save_final
        self.save_on_exception = save_on_exception
        self.save_on_signal = save_on_signal
        self.async_save = async_save
        self.last_saved_step: int | None = None
        self.last_path: Path | None = None
        self.signals = SaveSignals()
        self._writer: AsyncCheckpointWriter | None = None
        # (counters, RNG, data position) at the end of the last step, for save_on_exception.
        self._step_end_state: tuple[dict[str, int], dict[str, object], Mapping[str, int]] | None = (
            None
        )
        self.monitor = monitor
        self.mode: Mode = mode
        self.best_value: float | None = None
        self.best_step: int | None = None
        self._best_pending: int | None = None  # a step whose value is a new best, to save
        if monitor is not None:
            self.state_key = "checkpoint"  # the best value survives resume
        else:  # nothing to watch: no metrics hook, so no rank builds a record for it
            self.due_when = {Event.METRICS: never()}
        self.every_minutes = every_minutes
        self.wall_clock: Deadline | None = None
        """With ``every_minutes``, during a fit: the next save by time (``Deadline``)."""
        self.remote = remote
        # ``remote_retry`` (Python only) sets the backoff too; ``remote_attempts`` the tries.
        self.remote_retry = remote_retry or RetryPolicy(attempts=remote_attempts)
        # Opened here (no connection yet): a missing extra or an unknown URL fails the build.
        self._store: RemoteStore | None = (
            open_store(remote, remote_options) if remote is not None else None
        )
        self.mirror: RemoteMirror | None = None
        """Rank 0's uploader during a fit with ``remote`` (``None`` otherwise)."""
        self.remote_final_wait_s = remote_final_wait_s
        self._take_over = False  # resumed with allow_other_run: the prefix becomes this run's
        self._abandoned_upload = False  # the final wait for uploads ended early

    @property
    def signal_received(self) -> signal.Signals | None:
        """The first SIGTERM/SIGINT of the fit (``save_on_signal``), if one came."""
        return self.signals.received

    # -- ResumeSource ---------------------------------------------------------------------

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """Where this run's checkpoints are (``speedtronic.state.resume.ResumeSource``)."""
        return self.manager

    @property
    def directory(self) -> Path:
        return self.manager.directory

    def earlier_run_files(self) -> list[Path]:
        """Checkpoints (and their pointer) already in the directory this run saves to
        (``speedtronic.state.run_lock.LeavesRunFiles``): a fresh run there would mix with them."""
        if not self.manager.enabled:
            return []
        pointers = [self.manager.pointer_path, self.manager.best_pointer_path]
        return self.manager.checkpoint_paths() + [p for p in pointers if p.is_file()]

    def run_paths(self, output_dir: Path) -> RunPaths:
        """The checkpoint directory, locked for the run (``speedtronic.state.run_lock``)."""
        if not self.manager.enabled:
            return RunPaths()
        directory = self._relative if self._relative is not None else self.manager.directory
        return RunPaths(directories=(resolve_run_path(directory, output_dir),))

    def bind_output_dir(self, output_dir: Path) -> None:
        """Point the manager at the relative ``directory`` under ``output_dir`` (the run's:
        ``setup`` does it, ``resume_from`` before it); a manager handed in is left as it is
        (``speedtronic.state.run_lock.BindsOutputDir``)."""
        if self._relative is not None:
            self.manager.directory = resolve_run_path(self._relative, output_dir)

    # -- state (with a monitor): the best value so far -----------------------------------

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {"monitor": self.monitor, "mode": self.mode}
        if self.best_value is not None and self.best_step is not None:
            state["best_value"], state["best_step"] = self.best_value, self.best_step
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        if state.get("monitor") != self.monitor or state.get("mode") != self.mode:
            return  # another metric or direction: its best says nothing about this one
        value, step = state.get("best_value"), state.get("best_step")
        if isinstance(value, (int, float)) and isinstance(step, int):
            self.best_value, self.best_step = float(value), step

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if self.monitor is None:
            return
        value = read_monitored("checkpoint", self.monitor, ctx)
        if value is None:
            return  # an evaluation metric, and this step did not evaluate
        best = self.best_value
        if best is None:
            best = math.inf if self.mode == "min" else -math.inf
        if improves(value, best, self.mode):
            self.best_value, self.best_step = value, ctx.step
            self._best_pending = ctx.step

    # -- fit lifecycle ------------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self.bind_output_dir(trainer.output_dir)
        if self.monitor is not None:
            check_monitor("checkpoint", self.monitor, trainer)
        self._best_pending = None
        self.signals.reset()
        self._step_end_state = None
        self._abandoned_upload = False
        self.wall_clock = None
        self.last_saved_step = (
            ctx.start_step if self.manager.has_checkpoint(ctx.start_step) else None
        )
        if not self.manager.enabled:
            return
        if self.async_save and trainer.sharded_state:
            raise ValueError(
                "checkpoint: async_save is not supported with parallel.strategy fsdp (every "
                "rank writes its shard of a sharded checkpoint, synchronously); set "
                "async_save: false"
            )
        _warn_about_foreign_checkpoints(self.manager, ctx.start_step, trainer)
        main = trainer.distributed is None or trainer.distributed.is_main
        if self._store is not None and main:
            self.mirror = start_mirror(
                self._store,
                self.manager,
                retry=self.remote_retry,
                run_id=trainer.run_id,
                output_dir=trainer.output_dir,
                take_over=self._take_over,
                wait_s=self.remote_final_wait_s,
            )
        if self.every_minutes is not None:
            self.wall_clock = Deadline(trainer.distributed)
            self._restart_clock(ctx.start_step)
        if self.async_save:
            on_commit = self.mirror.submit if self.mirror is not None else None
            self._writer = AsyncCheckpointWriter(self.manager, on_commit=on_commit)
        if self.save_on_signal:
            self.signals.install(trainer)

    def on_checkpoint(self, trainer: TrainerView, ctx: CheckpointContext) -> None:
        if self._writer is not None:
            self._writer.poll()  # a failed background write stops the run here
        if self.mirror is not None and self.mirror.refusal is not None:
            raise self.mirror.refusal  # the prefix is another run's: stop (exit 2)
        if self.save_on_exception:
            # What a mid-step failure cannot recover from the live trainer: where the data
            # and the RNG stood when the last step completed.
            counters = {"step": ctx.step, "samples": trainer.samples, "tokens": trainer.tokens}
            self._step_end_state = (counters, capture_rng_state(), trainer.data_position())
        best = self._best_pending == ctx.step and self.manager.enabled
        self._best_pending = None
        # Asked every step on every rank (a collective at its decision steps).
        timed = self.wall_clock is not None and self.wall_clock.passed(ctx.step)
        if best or self.manager.should_save(ctx.step) or timed:
            self._save(trainer, ctx.step, trainer.state_dict(), best=best)

    def on_before_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        if self._writer is not None:
            # The async snapshot copies weights and optimizer state during this step's
            # forward/backward; the optimizer must not change them before it is done.
            self._writer.wait_for_snapshot()

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        step = trainer.step
        stopped_for_requeue = self.signal_received is not None or is_time_budget_stop(
            ctx.stop_reason
        )
        wanted = self.save_final or stopped_for_requeue
        if self.manager.enabled and wanted and step > 0 and step != self.last_saved_step:
            self._save(trainer, step, trainer.state_dict())
        if self._writer is not None:
            with self.signals.writing_checkpoint():
                self._writer.wait()  # the run is only over when its checkpoint is on disk
            _barrier(trainer)
        if self.mirror is not None:
            self._flush_remote(ctx)
        if self.signal_received is not None:
            logger.warning(
                "stopped by %s at step %d; checkpoint %s written (resume with --resume)",
                self.signal_received.name,
                step,
                self.last_path,
            )

    def on_exception(self, trainer: TrainerView, ctx: ExceptionContext) -> None:
        if not (self.manager.enabled and self.save_on_exception) or self.signals.abandoned:
            return  # (a save abandoned by a signal is not retried)
        if trainer.sharded_state:
            warnings.warn(
                f"save_on_exception: no checkpoint after the failure at step {ctx.step}: a "
                "sharded checkpoint needs every rank, and after a failure some may be gone",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        try:
            if self._writer is not None:
                self._writer.wait()
            if trainer.step > 0 and trainer.step != self.last_saved_step:
                self._save(
                    trainer, trainer.step, self._state_at_last_step_end(trainer), meet_peers=False
                )
                if self._writer is not None:
                    self._writer.wait()
        except Exception as exc:  # the original error matters more; report ours
            warnings.warn(
                f"saving a checkpoint after the failure at step {ctx.step} failed: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        self.signals.restore()
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        except CheckpointError as exc:
            if ctx.error is None:
                raise
            warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
        finally:
            mirror, self.mirror = self.mirror, None
            if mirror is not None:
                # What a failed fit committed is uploaded too, within the same bound.
                mirror.close(0.0 if self._abandoned_upload else self.remote_final_wait_s)

    # -- saving -------------------------------------------------------------------------

    def _save(
        self,
        trainer: TrainerView,
        step: int,
        state: dict[str, object],
        *,
        meet_peers: bool = True,
        best: bool = False,
    ) -> None:
        """Write ``state`` (rank 0 only), then wait for the other ranks when ``meet_peers``;
        ``best``: ``best.json`` names it (the monitored value improved at ``step``)."""
        path = self.manager.path_for(step)
        main = trainer.distributed is None or trainer.distributed.is_main
        loss = _last_loss(trainer, step, global_mean=meet_peers)  # a collective: every rank
        if main:
            self.manager.note_loss(step, loss)
            if best and self.monitor is not None and self.best_value is not None:
                self.manager.note_best(step, self.monitor, self.mode, self.best_value)
        with self.signals.writing_checkpoint():
            if self._writer is not None and main:
                self._writer.submit(step, state, defer=_changed_only_by_optimizer_step(trainer))
            elif main or trainer.sharded_state:  # sharded: every rank writes its shard
                path = self.manager.save(step, state)
                if self.mirror is not None:  # rank 0; an async write hands it over itself
                    self.mirror.submit(path)
        self.last_saved_step = step
        self.last_path = path
        if self.wall_clock is not None:
            self._restart_clock(step)
        if meet_peers and self._writer is None:
            _barrier(trainer)

    def _restart_clock(self, step: int) -> None:
        """The next save by time: ``every_minutes`` after now (the fit's start, a save)."""
        assert self.wall_clock is not None and self.every_minutes is not None
        self.wall_clock.start_at(time.monotonic() + 60.0 * self.every_minutes, step=step)

    def _flush_remote(self, ctx: FitEndContext) -> None:
        """Wait until the uploads are done, so that a job ending here has its last
        checkpoint in the store -- at most ``remote_final_wait_s`` seconds; a SIGTERM or
        SIGINT meanwhile ends the wait at once and the fit as stopped by it (exit 128 +
        signal) -- ``checkpoint_remote.wait_for_uploads``."""
        assert self.mirror is not None
        before = self.signal_received

        def interrupted() -> signal.Signals | None:
            return self.signal_received if self.signal_received is not before else None

        finished = wait_for_uploads(
            self.mirror,
            seconds=self.remote_final_wait_s,
            directory=self.manager.directory,
            newest=None if self.last_path is None else self.last_path.name,
            interrupted=interrupted,
        )
        self._abandoned_upload = not finished
        received = interrupted()
        if received is not None and ctx.result.stop_reason is None:
            ctx.result.stop_reason = signal_stop_reason(received)

    def fetch_checkpoints(
        self, trainer: TrainerView, *, run_id: str | None, allow_other_run: bool
    ) -> FetchedCheckpoint:
        """Before a resume loads (``speedtronic.state.resume.FetchesCheckpoints``): download
        the newest intact remote checkpoint of this run when it is newer than the local
        directory's, and say which run the prefix belongs to (``checkpoint_remote.fetch``).
        ``allow_other_run`` also lets this run take the prefix over at its first upload."""
        if self._store is None or not self.manager.enabled:
            return FetchedCheckpoint()
        self._take_over = allow_other_run
        return fetch(
            self._store,
            self.manager,
            trainer,
            retry=self.remote_retry,
            run_id=run_id,
            allow_other_run=allow_other_run,
        )

    def _state_at_last_step_end(self, trainer: TrainerView) -> dict[str, object]:
        """The trainer's state, with the counters, RNG and data position of the end of the
        last completed step when the failure happened part-way through the next one (which
        had already pulled batches and drawn random numbers)."""
        state = trainer.state_dict()
        recorded = self._step_end_state
        if recorded is not None and recorded[0]["step"] == trainer.step:
            counters, rng, data = recorded
            live = cast(Mapping[str, int], state["counters"])  # keeps its world size
            state["counters"] = {**live, **counters}
            state["rng"], state["data"] = rng, dict(data)
        return state


def _warn_about_foreign_checkpoints(
    manager: CheckpointManager, start_step: int, trainer: TrainerView
) -> None:
    """A checkpoint newer than the fit's start would count as newer than what this fit
    saves: say what it is. After a resume that fell back past it, it is this run's own
    unreadable checkpoint; otherwise it was never committed or another run wrote it."""
    newest = manager.newest_step()
    if newest is None or newest <= start_step:
        return
    where = (
        f"checkpoint directory {manager.directory} already holds a checkpoint of "
        f"step {newest}, beyond this fit's start step {start_step}"
    )
    resumed = trainer.resumed_from
    if resumed is None:
        message = (
            f"{where}: it is from another run and counts as newer than this run's "
            "checkpoints. Resume it (--resume) or use a fresh checkpoint directory."
        )
    elif newest in {checkpoint_step(item.path.name) for item in resumed.skipped}:
        message = (
            f"{where}: it is this run's newest checkpoint, which could not be read (see "
            f"above), so the fit resumed from {resumed.path.name}; it stays until this "
            "run saves that step again or retention removes it"
        )
    else:
        message = (
            f"{where}: newer than the one the resume loaded ({resumed.path.name}), so it was "
            "never committed (a save cut short) or another run wrote it; it stays until "
            "this run saves that step again or retention removes it"
        )
    warnings.warn(message, UserWarning, stacklevel=2)


def _changed_only_by_optimizer_step(trainer: TrainerView) -> frozenset[int]:
    """Storages of the parameters and the optimizer state: between a step's checkpoint and
    the next optimizer update nothing in the loop writes to them (forward and backward only
    read the weights and write gradients), so an async save may copy them meanwhile.
    Buffers (BatchNorm statistics, ...), callback and RNG state are copied at the save."""
    pointers = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    for value in trainer.optimizer_state_tensors():
        pointers.add(value.untyped_storage().data_ptr())
    return frozenset(pointers)


def _last_loss(trainer: TrainerView, step: int, *, global_mean: bool = False) -> float | None:
    """The training loss of the step being saved (one host sync per save), for the
    checkpoint's record: retention keeps the newest checkpoint whose loss was finite. With
    ``global_mean`` in a distributed run (every rank saving together), the mean over the
    ranks, reduced as the logged ``loss`` is (``RankMetricReducer``), so ``latest.json``
    and the log agree."""
    loss = trainer.last_loss
    if loss is None or loss.numel() != 1:
        return None
    value = float(loss.detach().item())
    context = trainer.distributed
    if global_mean and context is not None and context.world_size > 1:
        import torch
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64, device=context.collective_device)
        dist.all_reduce(total)
        value = float(total.item()) / context.world_size
    if not math.isfinite(value):
        logger.warning(
            "checkpoint of step %d: the loss is %s; it is recorded as non-finite and the "
            "newest checkpoint with a finite loss is kept",
            step,
            value,
        )
    return value


def _barrier(trainer: TrainerView) -> None:
    """Wait for every rank of a distributed run (nothing to wait for in one process)."""
    if trainer.distributed is not None and trainer.distributed.world_size > 1:
        trainer.distributed.barrier()
