"""Resume: load the newest readable checkpoint into a trainer before ``fit``.

The runtime calls ``resume_from`` for ``--resume`` / ``checkpoint.resume``. ``max_steps``
stays absolute: a trainer restored at step 6 and fitted to 12 runs steps 7..12, and one
restored at or beyond its target runs nothing.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.checkpoint import CheckpointManager
from speedtronic.trainer import TrainingStateError

if TYPE_CHECKING:
    from speedtronic.trainer import Trainer

__all__ = ["resume_from"]

logger = logging.getLogger("speedtronic.checkpoint")


def resume_from(
    trainer: Trainer, manager: CheckpointManager, *, load_callback_state: bool = True
) -> Path | None:
    """Restore ``trainer`` from the newest readable checkpoint of ``manager``.

    Returns the checkpoint's path, or ``None`` (with a warning; the trainer is untouched and
    starts fresh) when the directory holds no checkpoint. A truncated newest checkpoint is
    skipped with a warning. ``CheckpointError`` for a checkpoint that cannot be used at all
    (pickled objects, nothing readable); ``TrainingStateError`` naming the file when its
    content does not fit this trainer (model keys or shapes, optimizer groups, format).
    With ``load_callback_state`` (the default) every callback's saved state is restored:
    a stateful callback without saved state warns, saved state nobody claims is reported.
    """
    loaded = manager.load_latest_checkpoint()
    if loaded is None:
        warnings.warn(
            f"no checkpoint found in {manager.directory}; starting fresh from step {trainer.step}",
            UserWarning,
            stacklevel=2,
        )
        return None
    try:
        trainer.load_state_dict(loaded.state, load_callbacks=load_callback_state)
    except KeyError as exc:
        raise TrainingStateError(
            f"cannot resume from {loaded.path}: the checkpoint has no {exc} entry "
            "(not a speedtronic training state?)"
        ) from exc
    except ValueError as exc:  # TrainingStateError, optimizer/sampler mismatches
        raise TrainingStateError(f"cannot resume from {loaded.path}: {exc}") from exc
    logger.info("resumed from %s at step %d", loaded.path, trainer.step)
    return loaded.path
