"""Issue 12 hardening: damaged, tampered or hostile checkpoint directories and run
directories get a clear error or a safe fall-back, never a crash or a silent loss."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from speedtronic.checkpoint import CheckpointManager, CorruptCheckpointError


def sizable_state(value: float) -> dict[str, object]:
    """A state whose file is large enough to be cut at many interesting places."""
    return {
        "model": {f"layer{i}.weight": torch.full((64, 64), value + i) for i in range(4)},
        "optimizer": {"state": {0: {"exp_avg": torch.full((256,), value)}}, "groups": [0.1]},
        "counters": {"step": int(value)},
    }


def load_quietly(manager: CheckpointManager) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = manager.load_latest_checkpoint()
    return loaded, [str(w.message) for w in caught]


# -- 1. a truncated newest checkpoint falls back to the previous one ----------------------


@pytest.mark.parametrize("fraction", [0.02, 0.1, 0.25, 0.5, 0.75, 0.9, 0.98, 0.999])
def test_truncated_newest_checkpoint_falls_back_at_every_cut(
    tmp_path: Path, fraction: float
) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(35, sizable_state(35.0))
    manager.save(40, sizable_state(40.0))
    newest = manager.path_for(40)
    content = newest.read_bytes()
    newest.write_bytes(content[: max(1, int(len(content) * fraction))])
    with pytest.raises(CorruptCheckpointError, match="step_000000000040.pt"):
        manager.load(newest)
    loaded, messages = load_quietly(manager)
    assert loaded is not None and loaded.step == 35  # type: ignore[attr-defined]
    assert any("step_000000000040.pt is unreadable" in m for m in messages), messages


def test_an_unreadable_file_is_an_error_not_a_fall_back(tmp_path: Path) -> None:
    import os

    if os.name != "posix" or os.geteuid() == 0:
        pytest.skip("needs POSIX permissions as a non-root user")
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, sizable_state(1.0))
    manager.save(2, sizable_state(2.0))
    manager.path_for(2).chmod(0)
    try:
        from speedtronic.checkpoint import CheckpointError

        with pytest.raises(CheckpointError, match="cannot read checkpoint .*step_000000000002"):
            manager.load_latest_checkpoint()
    finally:
        manager.path_for(2).chmod(0o644)
