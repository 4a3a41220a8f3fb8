"""speedtronic.state.atomic_io: the one helper that replaces a file atomically and durably."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from speedtronic.state.append_io import (
    PlantedLinkError,
    open_to_append,
    refuse_planted_link,
    system_path,
)
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


# -- speedtronic.state.append_io: appends never go through a planted link --------------------


def test_open_to_append_appends_to_regular_files_and_refuses_links(tmp_path: Path) -> None:
    target = tmp_path / "log.txt"
    for line in ("one\n", "two\n"):
        with open_to_append(target) as handle:
            handle.write(line)
    assert target.read_text() == "one\ntwo\n"
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    for name, leads_to in (("to-a-file", outside), ("dangling", tmp_path / "created?")):
        link = tmp_path / name
        link.symlink_to(leads_to)
        with pytest.raises(
            PlantedLinkError, match=re.escape(f"it is a symbolic link (to {leads_to})")
        ):
            open_to_append(link, read=True)
        with pytest.raises(PlantedLinkError):
            refuse_planted_link(link)
    assert outside.read_text() == "precious\n" and not (tmp_path / "created?").exists()


@pytest.mark.skipif(not Path("/dev/fd").is_dir(), reason="needs /dev and /proc (Linux)")
def test_the_systems_own_links_are_followed_and_world_writable_folders_are_not_trusted() -> None:
    assert system_path(Path("/dev/null")) and system_path(Path("/dev/stdout"))
    assert system_path(Path("/dev/fd/1")) and system_path(Path("/proc/self/fd/1"))
    with open_to_append(Path("/dev/null")) as handle:
        handle.write("gone\n")
    assert not system_path(Path("/tmp/metrics.jsonl"))  # anyone may write /tmp
    if Path("/dev/shm").is_dir():  # sticky and world-writable: a link there is anyone's
        assert not system_path(Path("/dev/shm/metrics.jsonl"))
