"""Issue 22: what someone who can write the checkpoint directory can and cannot do.

Nothing loaded runs code -- a pickle planted in any place a load unpickles (a sharded
checkpoint's bytes and tensor records inside a ``.distcp`` shard, its ``.metadata`` and
``state.pt``, a plain ``.pt``) is refused with every checksum rewritten to match, through
resume, ``fit --resume`` and ``evaluate --checkpoint``, and never stepped over for an older
checkpoint. No write leaves the directory -- symlinks (or files) planted at the temp names a
save uses, at a sharded save's temp directory or at a checkpoint's own name are never
followed or truncated, and the save still succeeds. (The fuzzing of the DCP metadata and
manifest is in test_fuzz.py; the 2-rank resume of a planted record in test_fsdp.py.)
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from planted_payloads import payload, plant_file, plant_in_record, rehash
from test_fsdp import make_trainer, resume
from test_hardening import CLI_CONFIG, fit_cli_config

from speedtronic.state.atomic_io import atomic_write_text
from speedtronic.state.checkpoint import (
    POINTER_NAME,
    CheckpointManager,
    UnsafeCheckpointError,
    archive_checksum,
)
from speedtronic.state.sharded_checkpoint import MANIFEST_NAME, STATE_NAME

torch.set_num_threads(1)

BYTES_RECORD = "optimizer.param_groups.0.lr"
TENSOR_RECORD = "model.head.weight"


def sharded_run(directory: Path) -> Path:
    """A one-process FSDP run that saved sharded checkpoints at steps 5 and 10; the newest."""
    make_trainer("fsdp", directory=directory).fit(10)
    return directory / "step_000000000010.dcp"


def plant(place: str, directory: Path, marker: Path) -> Path:
    """Plant a payload in ``place`` of the newest checkpoint of ``directory``, hashes
    rewritten to match; returns the file it is in."""
    if place == "plain .pt":
        make_trainer("ddp", directory=directory).fit(10)
        newest = directory / "step_000000000010.pt"
        state = torch.load(newest, weights_only=True)
        newest.write_bytes(payload(marker, wrapped=state))
        pointer = json.loads((directory / POINTER_NAME).read_text())
        pointer["checkpoints"][newest.name]["sha256"] = archive_checksum(newest)
        (directory / POINTER_NAME).write_text(json.dumps(pointer))
        return newest
    newest = sharded_run(directory)
    if place == "bytes record":
        return plant_in_record(newest, BYTES_RECORD, payload(marker))
    if place == "tensor record":
        return plant_in_record(newest, TENSOR_RECORD, payload(marker))
    if place == ".metadata":
        return plant_file(newest, ".metadata", payload(marker))
    state = torch.load(newest / STATE_NAME, weights_only=True)
    return plant_file(newest, STATE_NAME, payload(marker, wrapped=state))


@pytest.mark.parametrize(
    "place", ["bytes record", "tensor record", ".metadata", "state.pt", "plain .pt"]
)
def test_a_pickle_planted_anywhere_a_load_unpickles_is_refused_never_run(
    tmp_path: Path, place: str
) -> None:
    marker = tmp_path / "pwned"
    planted = plant(place, tmp_path / "ck", marker)
    strategy = "ddp" if place == "plain .pt" else "fsdp"
    trainer = make_trainer(strategy, directory=tmp_path / "ck")
    with pytest.raises(UnsafeCheckpointError, match="could run arbitrary code") as caught:
        resume(trainer)
    assert str(planted) in str(caught.value) and "(posix.system)" in str(caught.value)
    assert not marker.exists()
    # Refused, not stepped over: the older checkpoint (step 5) was not loaded instead.
    assert trainer.step == 0


SHARDED_CLI_CONFIG = {
    **CLI_CONFIG,
    "run": {"name": "planted", "device": "cpu", "max_steps": 10, "seed": 3},
    "scheduler": {"warmup_steps": 1},
    "parallel": {"strategy": "fsdp"},
}


def test_fit_resume_and_evaluate_refuse_a_pickle_in_a_shard_with_exit_2(tmp_path: Path) -> None:
    config, out = fit_cli_config(tmp_path, SHARDED_CLI_CONFIG)
    marker = tmp_path / "pwned"
    newest = out / "checkpoints" / "step_000000000010.dcp"
    shard = plant_in_record(newest, BYTES_RECORD, payload(marker))
    resumed = run_cli("fit", "--config", str(config), "--output-dir", str(out), "--resume",
                      "--max-steps", "15", cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 2, resumed.stderr
    assert f"speedtronic: error: refusing to load {shard} (record '{BYTES_RECORD}')" in (
        resumed.stderr
    )
    assert "Traceback" not in resumed.stderr and "steps=15" not in resumed.stdout
    for named in ([], ["--checkpoint", str(newest)]):
        evaluated = run_cli("evaluate", "--config", str(config), "--set",
                            f"run.output_dir={out}", *named, cwd=tmp_path)  # fmt: skip
        assert evaluated.returncode == 2, evaluated.stderr
        assert f"refusing to load {shard}" in evaluated.stderr
    assert not marker.exists()


# -- no write leaves the directory ------------------------------------------------------------


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A file outside the run that a redirected save would overwrite."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    path = outside / "precious.bin"
    path.write_bytes(b"precious data\n" * 100)
    return path


def plant_links(directory: Path, names: list[str], target: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    links = [directory / name for name in names]
    for link in links:
        link.symlink_to(target)
    return links


def test_symlinks_planted_at_temp_names_are_never_followed(tmp_path: Path, precious: Path) -> None:
    before = precious.read_bytes()
    directory = tmp_path / "ck"
    pid = os.getpid()
    links = plant_links(
        directory,
        [f".step_000000000005.pt.tmp-{pid}", f".latest.json.tmp-{pid}", f".best.json.tmp-{pid}"],
        precious,
    )
    (directory / f".step_000000000006.pt.tmp-{pid}").write_bytes(b"someone's file")
    manager = CheckpointManager(directory, keep_last=None)
    manager.note_best(5, "eval/loss", "min", 1.5)
    state = {"model": {"w": torch.arange(4.0)}, "counters": {"step": 5}}
    manager.save(5, state)
    manager.save(6, state)
    assert precious.read_bytes() == before
    assert all(link.is_symlink() and link.resolve() == precious for link in links)
    assert (directory / f".step_000000000006.pt.tmp-{pid}").read_bytes() == b"someone's file"
    loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 6
    best = manager.read_best()
    assert best is not None and best.step == 5
    # The shared atomic writer (config, metrics rewrites, hub files) takes the same care.
    target = directory / "run.yaml"
    plant_links(directory, [f".run.yaml.tmp-{pid}"], precious)
    atomic_write_text(target, "run: {}\n")
    assert target.read_text() == "run: {}\n" and precious.read_bytes() == before


def test_a_symlink_at_a_checkpoint_name_is_replaced_not_followed(
    tmp_path: Path, precious: Path
) -> None:
    before = precious.read_bytes()
    directory = tmp_path / "ck"
    plant_links(directory, ["step_000000000005.pt", POINTER_NAME], precious)
    CheckpointManager(directory).save(5, {"model": {"w": torch.ones(2)}, "counters": {}})
    assert precious.read_bytes() == before
    assert not (directory / "step_000000000005.pt").is_symlink()
    assert json.loads((directory / POINTER_NAME).read_text())["file"] == "step_000000000005.pt"


def test_a_sharded_save_never_writes_through_a_planted_directory_link(
    tmp_path: Path, precious: Path
) -> None:
    before = precious.read_bytes()
    outside = precious.parent
    directory = tmp_path / "ck"
    pid = os.getpid()
    # The temp directory of the step-5 save, the aside name of a re-save, and the final
    # name of step 10 all lead out of the directory.
    plant_links(
        directory,
        [f".step_000000000005.dcp.tmp-{pid}", "step_000000000010.dcp"],
        outside,
    )
    trainer = make_trainer("fsdp", directory=directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the planted step 10 looks like another run's
        trainer.fit(10)
    assert sorted(p.name for p in outside.iterdir()) == ["precious.bin"]
    assert precious.read_bytes() == before
    newest = directory / "step_000000000010.dcp"
    assert newest.is_dir() and not newest.is_symlink()
    again = make_trainer("fsdp", directory=directory)
    assert resume(again) == newest and again.step == 10
    # A copy of a sharded checkpoint takes the same care at its destination.
    export = tmp_path / "export"
    plant_links(export, [f".step_000000000010.dcp.tmp-{pid}"], outside)
    assert CheckpointManager(directory).copy_to(export) == export / newest.name
    assert sorted(p.name for p in outside.iterdir()) == ["precious.bin"]
    rehash_free = json.loads((export / newest.name / MANIFEST_NAME).read_text())
    assert set(rehash_free["files"]) == {".metadata", "__0_0.distcp", STATE_NAME}


@pytest.mark.parametrize(
    ("name", "kind"),
    [("__0_0.distcp", "symlink"), ("__0_0.distcp", "fifo"), (MANIFEST_NAME, "fifo")],
)
def test_a_shard_or_manifest_that_is_no_regular_file_is_not_read(
    tmp_path: Path, precious: Path, name: str, kind: str
) -> None:
    # A link is not followed out of the directory; a FIFO is not opened for reading (that
    # would wait for a writer forever): either is damage, and the older checkpoint loads.
    newest = sharded_run(tmp_path / "ck")
    planted = newest / name
    if kind == "symlink":
        moved = precious.parent / "shard.distcp"
        planted.rename(moved)
        planted.symlink_to(moved)
        rehash(newest)  # the manifest lists what the link leads to
    else:
        planted.unlink()
        os.mkfifo(planted)
    started = time.perf_counter()
    with pytest.warns(UserWarning, match="falling back to the previous checkpoint"):
        loaded = CheckpointManager(tmp_path / "ck").load_latest_checkpoint()
    assert loaded is not None and loaded.step == 5
    assert time.perf_counter() - started < 30


def test_hub_files_are_written_through_the_atomic_writer(tmp_path: Path, precious: Path) -> None:
    from speedtronic.distributed import HubClient, load_safetensors, save_safetensors
    from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport

    before = precious.read_bytes()
    cache = tmp_path / "cache"
    hub = HubClient("team/run", transport=DirectoryTransport(tmp_path / "hub"), cache_dir=cache)
    hub.create_repo()
    remote = hub.upload_delta({"w": torch.ones(2)}, node_id="n1", local_step=5, base_outer_step=0)
    (cache / "downloads" / remote).parent.mkdir(parents=True)
    saved, downloaded = plant_links(cache, ["saved.safetensors", f"downloads/{remote}"], precious)
    save_safetensors({"w": torch.zeros(3)}, saved)
    assert torch.equal(load_safetensors(saved)["w"], torch.zeros(3))
    assert hub.download(remote) == downloaded and not downloaded.is_symlink()
    assert precious.read_bytes() == before


UNPICKLERS = {
    "torch.load",
    "torch.serialization.load",
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "dcp.load",
    "torch.distributed.checkpoint.load",
}
"""Calls that unpickle (or run DCP's loader), by the dotted name they are called with."""


def test_the_restricted_loader_is_the_only_unpickling_call_in_the_code() -> None:
    """A guard for the rule itself: ``torch.load`` is called in ``safe_load.py`` alone, and
    DCP's loader (whose default planner unpickles with ``weights_only=False``) is imported
    only by ``dcp_io.py``, which runs it with the restricted reader and planner."""
    import ast

    root = Path(__file__).resolve().parent.parent
    found: dict[str, list[str]] = {}
    for source in sorted([*root.glob("speedtronic/**/*.py"), *root.glob("callbacks/**/*.py")]):
        where = str(source.relative_to(root))
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (
                "state_dict_loader" in (node.module or "")
                or node.module in ("torch", "pickle", "torch.serialization")
                and any(alias.name in ("load", "loads", "Unpickler") for alias in node.names)
            ):
                found.setdefault(where, []).append(f"from {node.module} import")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in UNPICKLERS:
                found.setdefault(where, []).append(ast.unparse(node.func))
    assert found == {
        "speedtronic/state/dcp_io.py": [
            "from torch.distributed.checkpoint.state_dict_loader import"
        ],
        "speedtronic/state/safe_load.py": ["torch.load"],
    }
