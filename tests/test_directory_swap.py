"""``speedtronic.state.directory_swap``: a directory replaced as a unit -- the new one in,
the old one gone; on any failure (the writer's, the last check's, the swap's own) the old
one is still there under its name and nothing is left beside it; links are never
followed."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from speedtronic.state import directory_swap
from speedtronic.state.directory_swap import DirectorySwapError, replace_directory


def files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.iterdir())}


def write(content: str) -> Callable[[Path], str]:
    def fill(staging: Path) -> str:
        (staging / "a.txt").write_text(content)
        return content

    return fill


def test_a_directory_is_created_then_replaced(tmp_path: Path) -> None:
    target = tmp_path / "out"
    assert replace_directory(target, write("one")) == "one"
    (target / "old-only.txt").write_text("goes with the old directory")
    replace_directory(target, write("two"))
    assert files(target) == {"a.txt": "two"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failure_keeps_the_old_directory_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out"
    replace_directory(target, write("old"))

    def broken(staging: Path) -> None:
        (staging / "half.txt").write_text("half")
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="the writer failed"):
        replace_directory(target, broken)

    def changed(existing: Path) -> None:
        raise DirectorySwapError(f"{existing} changed")

    with pytest.raises(DirectorySwapError, match="changed"):
        replace_directory(target, write("new"), still_replaceable=changed)
    # The rename that installs the new directory fails: the old one is renamed back.
    rename = os.rename

    def failing(source: object, destination: object) -> None:
        staging = ".tmp-" in str(source) and ".tmp-old" not in str(source)
        if staging and Path(str(destination)) == target:
            raise OSError(28, "No space left on device")
        rename(source, destination)  # type: ignore[arg-type]  # os.rename's path types

    monkeypatch.setattr(directory_swap.os, "rename", failing)
    with pytest.raises(OSError, match="No space left"):
        replace_directory(target, write("new"))
    monkeypatch.undo()
    assert files(target) == {"a.txt": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_links_and_non_directories_are_refused_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep.txt").write_text("keep")
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "dangling").symlink_to(tmp_path / "absent")
    (tmp_path / "file").write_text("a file")
    for name, message in (
        ("link", "is a symbolic link; name a real directory"),
        ("dangling", "is a symbolic link (dangling)"),
        ("file", "exists and is not a directory"),
        ("file/below", f"{tmp_path / 'file'} is not a directory"),
        (".", "does not name a directory of its own"),
    ):
        with pytest.raises(DirectorySwapError, match=re.escape(message)):
            replace_directory(Path(name), write("x"), what="out")
    assert files(real) == {"keep.txt": "keep"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file", "link", "real"]
