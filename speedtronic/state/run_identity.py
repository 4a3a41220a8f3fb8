"""Which run wrote a checkpoint: a run id, kept in the run directory and in every checkpoint.

A run gets an id when it starts fresh (``new_run_id``: the UTC start time and eight random hex
digits, ``20250601T120000Z-1a2b3c4d``) and keeps it across resumes: the id lives in the run
directory (``<output_dir>/.speedtronic-run-id``, written by the launching process) and the
trainer records it in every checkpoint it saves (the training state's ``run`` entry: the id
and the run directory). On resume, ``check_same_run`` compares the checkpoint's id with the
run's: a checkpoint another run wrote -- two runs that shared a ``checkpoint.directory``, a
config pointed at someone else's checkpoints -- is refused with ``OtherRunError`` naming both
runs, unless the caller asks for it (``--resume-from-other-run``). That holds for a run
directory where no run started yet too (a new ``--output-dir`` pointed at existing
checkpoints), except when the checkpoint names that very directory (its id file was lost:
the run takes the checkpoint's id back). A checkpoint without an id (written before run ids)
is anyone's.
"""

from __future__ import annotations

import datetime
import re
import secrets
import warnings
from collections.abc import Mapping
from pathlib import Path

from speedtronic.state.atomic_io import atomic_write_text
from speedtronic.state.run_lock import RunDirectoryError

__all__ = [
    "RUN_ID_NAME",
    "RUN_STATE_KEY",
    "OtherRunError",
    "check_same_run",
    "is_run_id",
    "new_run_id",
    "read_run_id",
    "write_run_id",
]

RUN_ID_NAME = ".speedtronic-run-id"
"""The file in a run directory that holds the run's id."""
RUN_STATE_KEY = "run"
"""The training state's entry ``{"id": ..., "output_dir": ...}``: which run saved it."""
OTHER_RUN_FLAG = "--resume-from-other-run"

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class OtherRunError(RunDirectoryError):
    """The checkpoint to resume was written by another run."""


def is_run_id(text: object) -> bool:
    """Whether ``text`` has the form of a run id (letters, digits, ``._-``; at most 128)."""
    return isinstance(text, str) and _RUN_ID.fullmatch(text) is not None


def new_run_id() -> str:
    """A fresh id: the UTC time and 32 random bits (unique, and sortable by start time)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{now}-{secrets.token_hex(4)}"


def read_run_id(output_dir: Path) -> str | None:
    """The id recorded in ``output_dir`` (``None``: none, or one that is not an id, which is
    ignored with a warning -- the run then adopts its checkpoint's)."""
    path = output_dir / RUN_ID_NAME
    try:
        with path.open("rb") as handle:
            raw = handle.read(256)
    except (FileNotFoundError, NotADirectoryError):
        return None
    text = raw.decode("utf-8", errors="replace").strip()
    if _RUN_ID.fullmatch(text):
        return text
    warnings.warn(f"ignoring {path}: it does not hold a run id", UserWarning, stacklevel=2)
    return None


def write_run_id(output_dir: Path, run_id: str) -> None:
    """Record ``run_id`` in ``output_dir`` (atomically; the launching process only)."""
    atomic_write_text(output_dir / RUN_ID_NAME, run_id + "\n")


def saved_run(state: Mapping[str, object]) -> tuple[str | None, str | None]:
    """``(id, run directory)`` of the run that saved ``state`` (``None`` where not recorded)."""
    entry = state.get(RUN_STATE_KEY)
    if not isinstance(entry, Mapping):
        return None, None
    run_id, directory = entry.get("id"), entry.get("output_dir")
    return (
        run_id if isinstance(run_id, str) else None,
        directory if isinstance(directory, str) else None,
    )


def check_same_run(
    run_id: str | None,
    output_dir: Path,
    state: Mapping[str, object],
    path: Path,
    *,
    allow_other_run: bool = False,
) -> str | None:
    """The run id to continue with after resuming ``state`` (read from checkpoint ``path``):
    ``run_id`` when the checkpoint is this run's or names no run; the checkpoint's id when
    this run directory has none but is the one the checkpoint names (its id file was lost).
    Any other run's checkpoint is ``OtherRunError`` unless ``allow_other_run`` (then a
    warning, and the run keeps ``run_id``: ``None`` asks the caller for a new one)."""
    theirs, their_directory = saved_run(state)
    if theirs is None or theirs == run_id:
        return run_id
    if run_id is None and their_directory == str(output_dir):
        return theirs
    where = f", run directory {their_directory}" if their_directory else ""
    ours = (
        f"run id {run_id}, run directory {output_dir}"
        if run_id is not None
        else f"run directory {output_dir}, where no run has started yet"
    )
    if not allow_other_run:
        raise OtherRunError(
            f"cannot resume from {path}: it was written by another run (run id {theirs}{where}), "
            f"not by this one ({ours}); resuming would continue that run's weights as this "
            "run's. Resume that run from its own run directory, give this run a checkpoint "
            f"directory of its own, or pass {OTHER_RUN_FLAG} (resume_other_run=True in Python) "
            "to continue from it anyway"
        )
    warnings.warn(
        f"resuming from {path}, a checkpoint of another run (run id {theirs}{where}), as "
        f"asked ({OTHER_RUN_FLAG}); from here on its checkpoints are this run's",
        UserWarning,
        stacklevel=3,
    )
    return run_id
