"""Resume: load the newest readable checkpoint into a trainer before ``fit``.

The runtime calls ``resume_from`` for ``--resume`` / ``checkpoint.resume``. ``max_steps``
stays absolute: a trainer restored at step 6 and fitted to 12 runs steps 7..12, and one
restored at or beyond its target runs nothing.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from speedtronic.state.checkpoint import CheckpointManager, SkippedCheckpoint
from speedtronic.state.run_identity import check_same_run, saved_run
from speedtronic.state.run_lock import BindsOutputDir
from speedtronic.state.training_state import TrainingStateError

if TYPE_CHECKING:
    from speedtronic.engine.trainer import Trainer
    from speedtronic.engine.view import TrainerView

__all__ = ["FetchedCheckpoint", "FetchesCheckpoints", "ResumePoint", "ResumeSource", "resume_from"]

logger = logging.getLogger("speedtronic.checkpoint")


@runtime_checkable
class ResumeSource(Protocol):
    """A plugin that keeps the run's checkpoints and says how to resume from them (the
    checkpoint callback is one). The runtime asks the first such callback of a run; a run
    without one resumes only on ``--resume``, from ``<output_dir>/checkpoints``."""

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """Where the checkpoints are (what ``build_runtime`` returns beside the trainer)."""
        ...

    @property
    def resume_requested(self) -> bool:
        """Resume before the fit even without ``--resume`` (2.0 ``checkpoint.resume``)."""
        ...

    @property
    def load_callback_state(self) -> bool:
        """Restore every callback's saved state on resume."""
        ...


@runtime_checkable
class FetchesCheckpoints(Protocol):
    """A plugin that keeps copies of the run's checkpoints elsewhere (the checkpoint
    callback with ``checkpoint.remote``): before a resume loads, it brings a newer
    checkpoint than the local directory holds into it (a fresh machine's empty directory)."""

    def fetch_checkpoints(
        self, trainer: TrainerView, *, run_id: str | None, allow_other_run: bool
    ) -> FetchedCheckpoint:
        """Fetch what is newer for run ``run_id`` (``None``: a run directory without an
        id); another run's copies are refused unless ``allow_other_run``."""
        ...


@dataclass(frozen=True)
class FetchedCheckpoint:
    """What a ``FetchesCheckpoints`` plugin fetched (``path``, ``None``: nothing) and the
    run its copies belong to (``run_id``): a run directory without an id takes it."""

    path: Path | None = None
    run_id: str | None = None


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed trainer's state came from (``Trainer.resumed_from``): the checkpoint
    ``path`` of ``step``, and the newer ones passed over because they could not be read
    (newest first)."""

    path: Path
    step: int
    skipped: tuple[SkippedCheckpoint, ...] = ()

    def describe(self, base: Path | None = None) -> str:
        """One line: ``resumed from runs/a/checkpoints/step_000000000200.pt (step 200)``,
        or after a fall-back ``... (step 180; step_000000000200.pt is unreadable
        (checksum mismatch: ...))``. Paths inside ``base`` are shown relative to it."""
        shown = self.path
        if base is not None and self.path.is_relative_to(base):
            shown = self.path.relative_to(base)
        notes = [f"step {self.step}", *(_why_skipped(item) for item in self.skipped)]
        return f"resumed from {shown} ({'; '.join(notes)})"


def _why_skipped(item: SkippedCheckpoint) -> str:
    """``step_...pt is unreadable (...)``: the error's words after its path."""
    reason = item.reason
    full = f"{item.path} "
    if full in reason:
        return f"{item.path.name} {reason.split(full, 1)[1]}"
    return f"{item.path.name} was unreadable: {reason}"


def resume_from(
    trainer: Trainer,
    manager: CheckpointManager,
    *,
    load_callback_state: bool = True,
    allow_other_run: bool = False,
) -> Path | None:
    """Restore ``trainer`` from the newest readable checkpoint of ``manager``.

    Returns the checkpoint's path, or ``None`` (with a warning; the trainer is untouched and
    starts fresh) when the directory holds no checkpoint. A truncated newest checkpoint is
    skipped with a warning. Callbacks that keep copies elsewhere (``FetchesCheckpoints``:
    ``checkpoint.remote``) first bring a newer one into the directory; a trainer without a
    run id (a new run directory) takes the id of a checkpoint fetched so.
    ``CheckpointError`` for a checkpoint that cannot be used at all (pickled objects,
    nothing readable); ``TrainingStateError`` naming the file when its content does not
    fit this trainer (model keys or shapes, optimizer groups, format);
    ``OtherRunError`` when another run wrote it (``trainer.run_id`` set and different, see
    ``speedtronic.state.run_identity``) unless ``allow_other_run``. A trainer without a run id
    takes the checkpoint's. With ``load_callback_state`` (the default) every callback's
    saved state is restored: a stateful callback without saved state warns, saved state
    nobody claims is reported. ``trainer.resumed_from`` then says which checkpoint it was
    and which newer ones could not be read (``ResumePoint``; the CLI prints its line).
    """
    for callback in trainer.callbacks:  # where setup would point them: the run's directory
        if isinstance(callback, BindsOutputDir):
            callback.bind_output_dir(trainer.output_dir)
    fetched: list[Path] = []
    for callback in trainer.callbacks:
        if isinstance(callback, FetchesCheckpoints):
            found = callback.fetch_checkpoints(
                trainer, run_id=trainer.run_id, allow_other_run=allow_other_run
            )
            if trainer.run_id is None and found.run_id is not None:
                trainer.run_id = found.run_id  # this run's copies, on a new machine
            if found.path is not None:
                fetched.append(found.path)
    loaded = manager.load_latest_checkpoint()
    if loaded is None:
        warnings.warn(
            f"no checkpoint found in {manager.directory}; starting fresh from step {trainer.step}",
            UserWarning,
            stacklevel=2,
        )
        return None
    if trainer.run_id is None and loaded.path in fetched:
        # This run's own copy in its object store, on a machine where the run directory is
        # new (its id file is elsewhere): the checkpoint's run is this run.
        trainer.run_id = saved_run(loaded.state)[0]
    run_id = check_same_run(
        trainer.run_id,
        trainer.output_dir,
        loaded.state,
        loaded.path,
        allow_other_run=allow_other_run,
    )
    try:
        trainer.load_state_dict(loaded.state, load_callbacks=load_callback_state)
    except KeyError as exc:
        raise TrainingStateError(
            f"cannot resume from {loaded.path}: the checkpoint has no {exc} entry "
            "(not a speedtronic training state?)"
        ) from exc
    except ValueError as exc:  # TrainingStateError, optimizer/sampler mismatches
        # A TrainingStateError keeps its class: an ElasticResumeError, which every rank
        # raises alike, is then still printed once per job.
        kind = type(exc) if isinstance(exc, TrainingStateError) else TrainingStateError
        raise kind(f"cannot resume from {loaded.path}: {exc}") from exc
    trainer.run_id = run_id
    trainer.resumed_from = ResumePoint(loaded.path, trainer.step, loaded.skipped)
    logger.info("%s", trainer.resumed_from.describe())
    return loaded.path
