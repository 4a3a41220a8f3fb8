"""Every directory the project installs as a unit goes through one swap
(``speedtronic.state.directory_swap.swap_in``), and each user gets its restore: when the
rename that installs the new directory fails, the old one is back under its name and
nothing is left beside it. Checked through the export, ``prepare``'s publish, the sharded
checkpoint writer and the object-store fetch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from speedtronic.data.shard_output import publish
from speedtronic.models.export import ExportError, export_model
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.state import remote_fetch, sharded_checkpoint
from speedtronic.state.directory_swap import DirectorySwapError, swap_in

torch.set_num_threads(1)


def fail_installing(monkeypatch: pytest.MonkeyPatch, target: Path) -> None:
    """The rename of a new directory onto ``target`` fails (a full disk); moving the old
    one aside and back still works."""
    rename = os.rename

    def failing(source: object, destination: object) -> None:
        if Path(str(destination)) == target and ".tmp-old" not in str(source):
            raise OSError(28, "No space left on device")
        rename(source, destination)  # type: ignore[arg-type]  # os.rename's path types

    monkeypatch.setattr(os, "rename", failing)


def contents(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def set_aside(parent: Path) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if ".tmp-old" in path.name)


def old_and_new(tmp_path: Path, name: str) -> tuple[Path, Path]:
    target = tmp_path / name
    target.mkdir()
    (target / "kept.bin").write_bytes(b"old")
    staging = tmp_path / f".{name}.staging"
    staging.mkdir()
    (staging / "kept.bin").write_bytes(b"new")
    return target, staging


def test_an_export_whose_swap_fails_leaves_the_earlier_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ReferenceTransformer(vocab_size=64, n_layer=1, n_head=2, d_model=16)
    output = tmp_path / "hf"
    export_model(model, output)
    before = contents(output)
    fail_installing(monkeypatch, output)
    with pytest.raises(ExportError, match="cannot write it: No space left on device"):
        export_model(model, output, overwrite=True)
    monkeypatch.undo()
    assert contents(output) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]


def test_a_prepared_set_whose_swap_fails_stays_the_old_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output, staging = old_and_new(tmp_path, "shards")
    (output / "index.json").write_text("{}")  # publish locks the set's manifest
    fail_installing(monkeypatch, output)
    with pytest.raises(OSError, match="No space left"):
        publish(staging, output, replacing=True)
    monkeypatch.undo()
    assert contents(output) == {"index.json": b"{}", "kept.bin": b"old"}
    assert set_aside(tmp_path) == []
    publish(staging, output, replacing=True)
    assert contents(output) == {"kept.bin": b"new"} and not staging.exists()


@pytest.mark.parametrize("user", ["sharded_checkpoint", "remote_fetch"])
def test_a_checkpoint_directory_whose_swap_fails_keeps_the_local_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user: str
) -> None:
    # The sharded writer's install and the object-store fetch's commit of a .dcp directory.
    install = (
        sharded_checkpoint._replace_directory
        if user == "sharded_checkpoint"
        else remote_fetch._commit
    )
    target, staging = old_and_new(tmp_path, "step_000000000005.dcp")
    fail_installing(monkeypatch, target)
    with pytest.raises(OSError, match="No space left"):
        install(staging, target)
    monkeypatch.undo()
    assert contents(target) == {"kept.bin": b"old"} and set_aside(tmp_path) == []
    install(staging, target)
    assert contents(target) == {"kept.bin": b"new"} and set_aside(tmp_path) == []


@pytest.mark.parametrize("planted", ["file", "link"])
def test_any_entry_moves_a_leftover_file_or_link_aside_without_following_it(
    tmp_path: Path, planted: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"precious")
    target = tmp_path / "step.dcp"
    if planted == "link":
        target.symlink_to(outside)
    else:
        target.write_bytes(b"leftover")
    staging = tmp_path / ".staging"
    staging.mkdir()
    (staging / "new.bin").write_bytes(b"new")
    with pytest.raises(DirectorySwapError, match="changed while it was written"):
        swap_in(staging, target, what="checkpoint")  # only a directory is replaced
    swap_in(staging, target, what="checkpoint", any_entry=True)
    assert not target.is_symlink() and contents(target) == {"new.bin": b"new"}
    assert contents(outside) == {"precious.bin": b"precious"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["outside", "step.dcp"]
