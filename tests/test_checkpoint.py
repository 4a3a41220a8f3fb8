"""Checkpoint storage and the checkpoint callback: API, atomicity, retention, pointer
validation, pickle refusal, corrupt-file fallback, final/exception/signal saves, async save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import jsonschema
import pytest
import torch
from forked import Forked
from torch import nn

from speedtronic import Trainer
from speedtronic.config import SpeedtronicConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    FitContext,
    OptimizerStepContext,
    StepContext,
    TeardownContext,
)
from speedtronic.plugins import PluginContext
from speedtronic.state.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    archive_checksum,
    atomic_json_dump,
    atomic_torch_save,
    capture_rng_state,
    checkpoint_step,
    plain_state,
    requeue_exit_code,
    restore_rng_state,
)
from speedtronic.state.checkpoint_async import StateSnapshot
from speedtronic_callbacks.checkpoint import CheckpointCallback

REPO = Path(__file__).resolve().parents[1]


# -- helpers ------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Embedding + linear LM with dropout (so the RNG matters)."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.drop(self.emb(input_ids)))}


def tiny_batches(count: int = 5, vocab: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (count, 2, 7), generator=generator)
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def tiny_trainer(callbacks: list[Callback], *, k: int = 2) -> Trainer:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Trainer(
        model, optimizer, tiny_batches(), device="cpu", callbacks=callbacks, accumulation_steps=k
    )


def sample_state(value: float = 1.0) -> dict[str, object]:
    return {"weights": torch.full((3,), value), "counters": {"step": int(value)}}


def saved_steps(directory: Path) -> list[int]:
    return [checkpoint_step(p.name) or -1 for p in CheckpointManager(directory).checkpoint_paths()]


class Failing(Callback):
    """Raises in ``before_optimizer_step`` of one step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: Trainer, ctx: OptimizerStepContext) -> None:
        if ctx.step == self.step:
            raise RuntimeError(f"boom at step {ctx.step}")


# -- manager API --------------------------------------------------------------------------


def test_names_interval_and_validation(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every_steps=3, keep_last=None)
    assert manager.path_for(12) == tmp_path / "step_000000000012.pt"
    assert [s for s in range(10) if manager.should_save(s)] == [3, 6, 9]
    assert not CheckpointManager(tmp_path, every_steps=3, enabled=False).should_save(3)
    with pytest.raises(ValueError, match="every_steps"):
        CheckpointManager(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="keep_last must be positive or null"):
        CheckpointManager(tmp_path, keep_last=0)
    assert checkpoint_step("step_000000000012.pt") == 12
    for not_a_checkpoint in (".step_000000000012.pt.tmp-99", "step_12.pt.tmp", "latest.json"):
        assert checkpoint_step(not_a_checkpoint) is None


def test_save_writes_checkpoint_then_pointer_and_loads_back(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", keep_last=None)
    assert manager.latest_path() is None and manager.load_latest() is None
    path = manager.save(4, sample_state(4.0))
    assert path == manager.path_for(4)
    pointer = json.loads((tmp_path / "ck" / "latest.json").read_text())
    assert pointer == {
        "step": 4,
        "file": "step_000000000004.pt",
        "checkpoints": {"step_000000000004.pt": {"sha256": archive_checksum(path)}},
    }
    manager.save(8, sample_state(8.0))
    assert manager.latest_path() == manager.path_for(8)
    state = manager.load_latest()
    assert state is not None
    assert torch.equal(state["weights"], torch.full((3,), 8.0))  # type: ignore[arg-type]
    loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 8 and loaded.path == manager.path_for(8)


def test_retention_keeps_newest_and_null_keeps_all(tmp_path: Path) -> None:
    keep_two = CheckpointManager(tmp_path / "a", keep_last=2)
    for step in range(1, 6):
        keep_two.save(step, sample_state(step))
    assert saved_steps(tmp_path / "a") == [4, 5]
    keep_all = CheckpointManager(tmp_path / "b", keep_last=None)
    for step in range(1, 6):
        keep_all.save(step, sample_state(step))
    assert saved_steps(tmp_path / "b") == [1, 2, 3, 4, 5]
    assert keep_all.prune() == []


def test_prune_never_deletes_the_pointer_target(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1)
    atomic_torch_save(sample_state(), tmp_path / "step_000000000100.pt")  # another run's
    manager.save(3, sample_state(3.0))
    assert saved_steps(tmp_path) == [3, 100]
    assert manager.latest_path() == manager.path_for(3)


def test_prune_removes_temp_files_of_dead_processes_only(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".step_000000000002.pt.tmp-{dead.pid}"
    mine = tmp_path / f".step_000000000003.pt.tmp-{os.getpid()}"
    stale.write_bytes(b"partial")
    mine.write_bytes(b"in progress")
    CheckpointManager(tmp_path).prune()
    assert not stale.exists()
    assert mine.exists()


def test_stale_temp_files_with_a_random_suffix_and_absurd_pids_are_cleaned(
    tmp_path: Path,
) -> None:
    # A temp name taken (by a leftover or a planted file) makes a save use
    # ".tmp-<pid>-<random>": its PID still says whose it is. A planted name whose "PID" is
    # beyond any process once made every save fail with an OverflowError from os.kill.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".step_000000000002.pt.tmp-{dead.pid}-0123456789abcdef"
    mine = tmp_path / f".latest.json.tmp-{os.getpid()}-0123456789abcdef"
    absurd = tmp_path / ".step_000000000001.pt.tmp-99999999999999999999"
    huge = tmp_path / ".step_000000000001.pt.tmp-9999999999"
    for path in (stale, mine, absurd, huge):
        path.write_bytes(b"x")
    manager = CheckpointManager(tmp_path)
    manager.save(3, sample_state(3.0))
    assert not stale.exists() and not huge.exists() and mine.exists()
    assert absurd.exists()  # more digits than a PID has: not a name this module writes
    assert manager.latest_path() == manager.path_for(3)


def test_temp_files_and_look_alikes_are_never_checkpoints(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(2, sample_state(2.0))
    (tmp_path / ".step_000000000009.pt.tmp-12345").write_bytes(b"half a checkpoint")
    (tmp_path / "step_000000000010.pt.tmp").write_bytes(b"x")
    (tmp_path / "step_10.pt.bak").write_bytes(b"x")
    (tmp_path / "step_000000000011.pt").mkdir()
    (tmp_path / "latest.json").unlink()  # force a scan
    assert [p.name for p in manager.checkpoint_paths()] == ["step_000000000002.pt"]
    assert manager.latest_path() == manager.path_for(2)


def test_copy_to_directory_and_file(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="no checkpoint to copy"):
        manager.copy_to(tmp_path)
    manager.save(5, sample_state(5.0))
    into_dir = manager.copy_to(tmp_path)
    assert into_dir == tmp_path / "step_000000000005.pt"
    as_file = manager.copy_to(tmp_path / "export.pt")
    assert as_file.read_bytes() == manager.path_for(5).read_bytes() == into_dir.read_bytes()


def test_rng_helpers_are_reexported() -> None:
    state = capture_rng_state()
    first = torch.rand(3)
    restore_rng_state(state)
    assert torch.equal(torch.rand(3), first)


# -- atomicity ------------------------------------------------------------------------------


def test_failed_write_keeps_previous_checkpoint_and_pointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save(1, sample_state(1.0))
    before = manager.path_for(1).read_bytes()
    real_save = torch.save

    def half_then_fail(obj: object, f: object) -> None:
        real_save(obj, f)  # type: ignore[arg-type]  # f is the temp file handle
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(CheckpointError, match="disk full"):
        manager.save(2, sample_state(2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "step_000000000001.pt"]
    assert manager.path_for(1).read_bytes() == before
    assert manager.latest_path() == manager.path_for(1)


def test_write_order_is_fsync_rename_dirsync_then_pointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        log.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        log.append(("rename", f"{Path(src).name}->{Path(dst).name}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    CheckpointManager(tmp_path).save(7, sample_state())
    pid = os.getpid()
    assert log == [
        ("fsync", f".step_000000000007.pt.tmp-{pid}"),
        ("rename", f".step_000000000007.pt.tmp-{pid}->step_000000000007.pt"),
        ("fsync", tmp_path.name),
        ("fsync", f".latest.json.tmp-{pid}"),
        ("rename", f".latest.json.tmp-{pid}->latest.json"),
        ("fsync", tmp_path.name),
    ]


def test_atomic_json_dump_round_trips(tmp_path: Path) -> None:
    atomic_json_dump({"b": 1, "a": [1, 2]}, tmp_path / "x" / "v.json")
    assert json.loads((tmp_path / "x" / "v.json").read_text()) == {"a": [1, 2], "b": 1}
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["v.json"]


# -- security ---------------------------------------------------------------------------------


class RunsCode:
    """Pickles as a call to ``os.system``: loading it with pickle would run a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_with_pickled_object_is_refused(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, sample_state(1.0))
    marker = tmp_path / "pwned"
    torch.save({"model": {}, "payload": RunsCode(marker)}, manager.path_for(2))
    with pytest.raises(UnsafeCheckpointError, match=r"pickled Python object \(posix.system\)"):
        manager.load(manager.path_for(2))
    (tmp_path / "latest.json").unlink()  # the planted file is now the newest
    with pytest.raises(UnsafeCheckpointError, match="step_000000000002.pt"):
        manager.load_latest()
    assert not marker.exists()


def test_saving_an_object_that_would_need_pickle_fails_up_front(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    bad = {"callbacks": {"ema": {"decay": 0.9, "fn": print}}}
    with pytest.raises(CheckpointError, match=r"state\['callbacks'\]\['ema'\]\['fn'\] is a"):
        manager.save(1, bad)
    assert list(tmp_path.iterdir()) == []


def test_plain_state_converts_subclasses_of_plain_types() -> None:
    from collections import OrderedDict, defaultdict
    from enum import IntEnum

    class Mode(IntEnum):
        FAST = 2

    state = plain_state(
        {
            "version": torch.__version__,  # a str subclass
            "mode": Mode.FAST,
            "table": defaultdict(list, {"a": [1]}),
            "ordered": OrderedDict(b=torch.ones(1)),
        }
    )
    assert type(state["version"]) is str and type(state["mode"]) is int
    assert type(state["table"]) is dict and type(state["ordered"]) is OrderedDict


@pytest.mark.parametrize(
    ("pointer", "reason"),
    [
        ({"step": 1, "file": "../outside/step_000000000001.pt"}, "not a checkpoint file name"),
        ({"step": 1, "file": "/etc/step_000000000001.pt"}, "not a checkpoint file name"),
        ({"step": 1, "file": "latest.json"}, "not a checkpoint file name"),
        ({"step": 2, "file": "step_000000000001.pt"}, "does not match"),
        ({"step": 9, "file": "step_000000000009.pt"}, "does not exist"),
        (["step_000000000001.pt"], "JSON object"),
        ("{not json", "not readable JSON"),
    ],
)
def test_tampered_pointer_is_ignored_and_scan_takes_over(
    tmp_path: Path, pointer: object, reason: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save(sample_state(666.0), outside / "step_000000000001.pt")
    manager = CheckpointManager(tmp_path / "ck", keep_last=None)
    manager.save(1, sample_state(1.0))
    manager.save(3, sample_state(3.0))
    text = pointer if isinstance(pointer, str) else json.dumps(pointer)
    (tmp_path / "ck" / "latest.json").write_text(text)
    with pytest.warns(UserWarning, match=f"ignoring checkpoint pointer .*{reason}"):
        loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 3
    assert torch.equal(loaded.state["weights"], torch.full((3,), 3.0))  # type: ignore[arg-type]


def test_symlink_out_of_the_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.pt"
    torch.save(sample_state(666.0), outside)
    manager = CheckpointManager(tmp_path / "ck", keep_last=None)
    manager.save(1, sample_state(1.0))
    manager.path_for(5).symlink_to(outside)
    (tmp_path / "ck" / "latest.json").write_text(
        json.dumps({"step": 5, "file": "step_000000000005.pt"})
    )
    with pytest.warns(UserWarning, match="resolves outside the checkpoint directory"):
        loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 1


# -- corrupt files ------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_unreadable_newest_checkpoint_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save(4, sample_state(4.0))
    manager.save(6, sample_state(6.0))
    newest = manager.path_for(6)
    content = newest.read_bytes()
    newest.write_bytes(
        {"truncate": content[: len(content) // 2], "empty": b"", "garbage": b"\x00junk" * 9}[damage]
    )
    with pytest.raises(CorruptCheckpointError, match="step_000000000006.pt"):
        manager.load(newest)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 4
    messages = [str(w.message) for w in caught]
    assert any("step_000000000006.pt is unreadable" in m for m in messages), messages
    assert any("resuming from step_000000000004.pt" in m for m in messages), messages


def test_no_readable_checkpoint_at_all_is_an_error(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, sample_state())
    manager.path_for(1).write_bytes(b"")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="no readable checkpoint"):
        manager.load_latest()


def test_uncommitted_newer_file_is_ignored_in_favour_of_the_pointer(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save(2, sample_state(2.0))
    # Killed after renaming step 3 but before the pointer moved: the pointer still rules.
    atomic_torch_save(sample_state(3.0), manager.path_for(3))
    loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 2


# -- the callback -------------------------------------------------------------------------------


def test_interval_and_final_saves(tmp_path: Path) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=4, keep_last=None)
    trainer = tiny_trainer([callback])
    trainer.fit(6)
    assert saved_steps(tmp_path) == [4, 6]
    assert callback.last_path == tmp_path / "step_000000000006.pt"
    state = CheckpointManager(tmp_path).load_latest()
    assert state is not None
    assert state["counters"] == {"step": 6, "samples": 24, "tokens": 144, "world_size": 1}


def test_no_final_save_when_disabled_or_already_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_trainer([CheckpointCallback(tmp_path / "a", every_steps=4, save_final=False)]).fit(6)
    assert saved_steps(tmp_path / "a") == [4]
    callback = CheckpointCallback(tmp_path / "b", every_steps=4)
    saves: list[int] = []
    real = callback.manager.save

    def counting_save(step: int, state: Mapping[str, object]) -> Path:
        saves.append(step)
        return real(step, state)

    monkeypatch.setattr(callback.manager, "save", counting_save)
    tiny_trainer([callback]).fit(8)
    assert saves == [4, 8]  # step 8 was saved by the interval, not twice
    tiny_trainer([CheckpointCallback(tmp_path / "c", every_steps=4, enabled=False)]).fit(6)
    assert not (tmp_path / "c").exists()


def test_save_on_exception_keeps_the_last_completed_steps_data_position(tmp_path: Path) -> None:
    k = 2
    callback = CheckpointCallback(tmp_path, every_steps=100, save_on_exception=True)
    trainer = tiny_trainer([callback, Failing(step=3)], k=k)
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.fit(10)
    state = CheckpointManager(tmp_path).load_latest()
    assert state is not None
    assert state["counters"] == {"step": 2, "samples": 8, "tokens": 48, "world_size": 1}
    # The failing step had already pulled K batches; the checkpoint must not skip them.
    # (5 batches per epoch: 3 * K = 6 pulled is epoch 1, batch 1.)
    assert trainer.stream.state_dict() == {"epoch": 1, "batches_in_epoch": 1}
    assert state["data"] == {"epoch": 0, "batches_in_epoch": 2 * k}


def test_no_save_on_exception_by_default(tmp_path: Path) -> None:
    trainer = tiny_trainer([CheckpointCallback(tmp_path, every_steps=100), Failing(step=2)])
    with pytest.raises(RuntimeError):
        trainer.fit(5)
    assert saved_steps(tmp_path) == []


def test_warns_about_newer_checkpoints_of_another_run(tmp_path: Path) -> None:
    atomic_torch_save(sample_state(), tmp_path / "step_000000000050.pt")
    with pytest.warns(UserWarning, match="already holds a checkpoint of step 50"):
        tiny_trainer([CheckpointCallback(tmp_path, every_steps=100)]).fit(1)


def test_options_fall_back_to_the_2_0_section(tmp_path: Path) -> None:
    """Options left out come from the 2.0 ``checkpoint:`` section (the plugin's
    ``options_from_legacy``, which the runtime applies to every entry)."""
    config = SpeedtronicConfig.from_dict(
        {"checkpoint": {"every_steps": 7, "keep_last": None, "async_save": True}}
    )
    context = PluginContext(config=config, output_dir=tmp_path, device=torch.device("cpu"))

    def build(options: dict[str, object]) -> CheckpointCallback:
        merged = CheckpointCallback.options_from_legacy(config.to_dict(), options)
        assert merged is not None
        return CheckpointCallback.from_options(merged, context)

    from_config = build({})
    assert from_config.directory == tmp_path / "checkpoints"
    assert (from_config.manager.every_steps, from_config.manager.keep_last) == (7, None)
    assert from_config.async_save and from_config.save_final and from_config.save_on_signal
    explicit = build({"directory": str(tmp_path / "abs"), "every_steps": 3, "keep_last": 1})
    assert explicit.directory == tmp_path / "abs"
    assert (explicit.manager.every_steps, explicit.manager.keep_last) == (3, 1)
    relative = build({"directory": "ck", "save_final": False})
    assert relative.directory == tmp_path / "ck" and not relative.save_final


def test_options_schema_is_valid_and_strict() -> None:
    schema = CheckpointCallback.options_schema
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"every_steps": 10, "keep_last": None, "async_save": True})
    assert not validator.is_valid({"every_step": 10})
    assert not validator.is_valid({"keep_last": 0})


def test_manager_or_directory(tmp_path: Path) -> None:
    manager = CheckpointManager("x")
    given = CheckpointCallback(manager=manager)
    assert given.manager is manager
    given.bind_output_dir(tmp_path)
    assert manager.directory == Path("x")  # a manager handed in is used as it is
    # Without either: ``checkpoints`` under the run's output directory (issue 25, item 6:
    # this was "needs a directory or a manager" although the Trainer had an output_dir).
    default = CheckpointCallback()
    assert default.run_paths(tmp_path).directories == (tmp_path / "checkpoints",)
    default.bind_output_dir(tmp_path)
    assert default.directory == tmp_path / "checkpoints"
    absolute = CheckpointCallback(tmp_path / "elsewhere")
    absolute.bind_output_dir(tmp_path / "run")
    assert absolute.directory == tmp_path / "elsewhere"
    with pytest.raises(ValueError, match="not both"):
        CheckpointCallback("x", manager=manager)


# -- async save ---------------------------------------------------------------------------------


def test_async_save_writes_what_sync_save_writes(tmp_path: Path) -> None:
    tiny_trainer([CheckpointCallback(tmp_path / "sync", every_steps=2)]).fit(5)
    tiny_trainer([CheckpointCallback(tmp_path / "async", every_steps=2, async_save=True)]).fit(5)
    assert saved_steps(tmp_path / "sync") == saved_steps(tmp_path / "async") == [2, 4, 5]
    for step in (2, 4, 5):
        name = f"step_{step:012d}.pt"
        a = torch.load(tmp_path / "sync" / name, weights_only=True)
        b = torch.load(tmp_path / "async" / name, weights_only=True)
        for key in ("model", "counters", "data", "optimizer"):
            assert str(a[key]) == str(b[key]), key


class StateAt(Callback):
    """Deep-copies the trainer's state at the ``checkpoint`` event of one step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.model: dict[str, torch.Tensor] = {}

    def on_checkpoint(self, trainer: Trainer, ctx: object) -> None:
        if getattr(ctx, "step", None) == self.step:
            self.model = {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_async_snapshot_is_isolated_from_later_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=2, async_save=True, keep_last=None)
    real_save = callback.manager.save
    write_started = threading.Event()

    def slow_save(step: int, state: dict[str, object]) -> Path:
        write_started.set()
        time.sleep(0.2)  # training goes on meanwhile and changes the live weights
        return real_save(step, state)

    monkeypatch.setattr(callback.manager, "save", slow_save)
    witness = StateAt(2)
    tiny_trainer([witness, callback]).fit(3)
    assert write_started.is_set()
    saved = torch.load(tmp_path / "step_000000000002.pt", weights_only=True)["model"]
    assert all(torch.equal(saved[k], witness.model[k]) for k in witness.model)


def test_async_write_error_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    callback = CheckpointCallback(tmp_path, every_steps=1, async_save=True)

    def broken(step: int, state: dict[str, object]) -> Path:
        raise OSError("No space left on device")

    monkeypatch.setattr(callback.manager, "save", broken)
    recorder: list[int] = []

    class Steps(Callback):
        def on_step_end(self, trainer: Trainer, ctx: object) -> None:
            recorder.append(trainer.step)

    with pytest.raises(CheckpointError, match="asynchronous save of step 1 failed.*No space"):
        tiny_trainer([Steps(), callback]).fit(10)
    assert max(recorder) <= 2  # surfaced on the next step, not at the end


def test_snapshot_keeps_shared_storage_and_reuses_buffers() -> None:
    embedding = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = embedding.weight  # tied
    state = {"emb": embedding.state_dict(), "head": head.state_dict(), "n": 3}
    snapshot = StateSnapshot()
    first = snapshot.take(state)
    assert first.ready is None and first.deferred == []  # CPU, nothing deferred
    emb, tied = first.state["emb"]["weight"], first.state["head"]["weight"]  # type: ignore[index]
    assert emb.untyped_storage().data_ptr() == tied.untyped_storage().data_ptr()
    assert emb.untyped_storage().data_ptr() != embedding.weight.untyped_storage().data_ptr()
    assert torch.equal(emb, embedding.weight.detach())
    with torch.no_grad():
        embedding.weight.add_(1.0)
    assert not torch.equal(emb, embedding.weight.detach())  # a copy, not a view
    second = snapshot.take(state)
    again = second.state["emb"]["weight"]  # type: ignore[index]
    assert again.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()
    assert torch.equal(again, embedding.weight.detach())


def test_snapshot_defers_only_the_named_storages() -> None:
    weight, buffer = torch.ones(4), torch.zeros(2)
    snapshot = StateSnapshot().take(
        {"w": weight, "b": buffer}, defer=frozenset({weight.untyped_storage().data_ptr()})
    )
    weight.add_(1.0)  # still allowed: the deferred copy has not run
    buffer.add_(5.0)  # the buffer was copied at take()
    snapshot.complete()
    assert torch.equal(snapshot.state["w"], torch.full((4,), 2.0))  # type: ignore[arg-type]
    assert torch.equal(snapshot.state["b"], torch.zeros(2))  # type: ignore[arg-type]


# -- signals ------------------------------------------------------------------------------------


def test_requeue_exit_codes() -> None:
    assert requeue_exit_code("signal SIGTERM") == 143
    assert requeue_exit_code("signal SIGINT") == 130
    assert requeue_exit_code("early stopping") is None
    assert requeue_exit_code(None) is None


@pytest.fixture
def default_signal_handlers() -> Iterator[None]:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture()
def python_sigint_handler() -> Iterator[None]:
    """Python's own Ctrl-C handler, whatever an earlier test or plugin left installed (the
    test below used to depend on it and failed when another handler was in place)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("default_signal_handlers", "python_sigint_handler")
def test_first_signal_stops_cleanly_second_interrupts(tmp_path: Path) -> None:
    callback = CheckpointCallback(tmp_path)
    trainer = tiny_trainer([callback])
    previous = signal.getsignal(signal.SIGINT)
    callback.on_setup(trainer, FitContext(0, 10))
    signal.raise_signal(signal.SIGINT)
    assert trainer.stop_requested and callback.signal_received is signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)  # the previous handler runs again
    callback.on_teardown(trainer, TeardownContext(0, None))
    assert signal.getsignal(signal.SIGINT) is previous


@pytest.mark.usefixtures("python_sigint_handler")
def test_second_signal_reaches_the_previous_handler_every_time(tmp_path: Path) -> None:
    # The previous handler runs inside our handler's frame, so Ctrl-C twice interrupts at
    # once and deterministically (it used to re-raise the signal and occasionally missed).
    for _ in range(50):
        callback = CheckpointCallback(tmp_path)
        trainer = tiny_trainer([callback])
        callback.on_setup(trainer, FitContext(0, 10))
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        callback.on_teardown(trainer, TeardownContext(0, None))


def test_second_signal_is_ignored_when_it_was_ignored_before(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        callback = CheckpointCallback(tmp_path)
        trainer = tiny_trainer([callback])
        callback.on_setup(trainer, FitContext(0, 10))
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # handed to SIG_IGN: nothing happens
        assert trainer.stop_requested
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        callback.on_teardown(trainer, TeardownContext(0, None))
    finally:
        signal.signal(signal.SIGINT, previous)


def sigterm_child(directory: str) -> int:
    """The process ``test_sigterm_saves_and_exits_with_requeue_code`` stops with SIGTERM."""

    class Report(Callback):
        def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
            print("step", trainer.step, flush=True)
            time.sleep(0.02)

    result = tiny_trainer([Report(), CheckpointCallback(directory, every_steps=1000)]).fit(100000)
    print("restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    print("final", result.steps, result.stop_reason, flush=True)
    return requeue_exit_code(result.stop_reason) or 0


def test_sigterm_saves_and_exits_with_requeue_code(tmp_path: Path, forked: Forked) -> None:
    # A process of its own (forked from the suite's preloaded server: tests/forked.py), so the
    # signal, the handler's restore and the exit code are the real ones.
    child = forked.start(sigterm_child, str(tmp_path / "ck"), cwd=REPO)
    child.wait_for_output("step 3\n", timeout=60)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    rest = child.output.split("step 3\n", 1)[1]
    final = next(line for line in rest.splitlines() if line.startswith("final"))
    _, steps, reason = final.split(" ", 2)
    assert reason == "signal SIGTERM"
    assert "restored True" in rest
    manager = CheckpointManager(tmp_path / "ck")
    assert [p.name for p in manager.checkpoint_paths()] == [f"step_{int(steps):012d}.pt"]
    state = manager.load_latest()
    assert state is not None and state["counters"]["step"] == int(steps)  # type: ignore[index]


def test_no_signal_handlers_outside_the_main_thread(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tiny_trainer([CheckpointCallback(tmp_path)]).fit(2)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == [] and saved_steps(tmp_path) == [2]
    assert signal.getsignal(signal.SIGTERM) is before
