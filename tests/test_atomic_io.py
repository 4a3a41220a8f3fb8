"""speedtronic.state.atomic_io: the one helper that replaces a file atomically and durably."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from speedtronic.state.atomic_io import atomic_write, atomic_write_bytes, atomic_write_text


def test_writes_and_replaces_creating_missing_directories(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "file.json"
    atomic_write_text(target, "one\r\n")
    assert target.read_bytes() == b"one\r\n"
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "file.bin"
    atomic_write_bytes(target, b"old")

    def fail(handle: object) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]


@pytest.mark.skipif(os.name != "posix", reason="umask is POSIX")
def test_new_files_follow_the_umask_like_open(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "shared.bin", b"x")
    finally:
        os.umask(previous)
    assert (tmp_path / "shared.bin").stat().st_mode & 0o777 == 0o644
