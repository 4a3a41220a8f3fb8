"""Issue 12 hardening: damaged, tampered or hostile checkpoint directories and run
directories get a clear error or a safe fall-back, never a crash or a silent loss."""

from __future__ import annotations

import errno
import json
import os
import pickle
import struct
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli as speedtronic_cli
from planted_payloads import RunsCode

from speedtronic import Trainer
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import OptimizerStepContext
from speedtronic.state.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    archive_checksum,
    checkpoint_step,
)
from speedtronic_callbacks.checkpoint import CheckpointCallback


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
    if os.name != "posix" or os.geteuid() == 0:
        pytest.skip("needs POSIX permissions as a non-root user")
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, sizable_state(1.0))
    manager.save(2, sizable_state(2.0))
    manager.path_for(2).chmod(0)
    try:
        with pytest.raises(CheckpointError, match="cannot read checkpoint .*step_000000000002"):
            manager.load_latest_checkpoint()
    finally:
        manager.path_for(2).chmod(0o644)


# -- 6. checksums: a flipped bit or a swapped file is damage, not data -------------------------


def flip_float_in_tensor_data(path: Path, value: float) -> None:
    """Change one stored float ``value`` (little-endian float32) into NaN, in place."""
    content = bytearray(path.read_bytes())
    offset = content.find(struct.pack("<f", value))
    assert offset > 0, "value not found in the file"
    content[offset : offset + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(content))


def test_flipped_float_in_the_newest_checkpoint_falls_back(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(4, sizable_state(4.0))
    manager.save(6, sizable_state(6.0))
    flip_float_in_tensor_data(manager.path_for(6), 9.0)  # layer3.weight of step 6
    with pytest.raises(CorruptCheckpointError, match="step_000000000006.pt .*CRC-32"):
        manager.load(manager.path_for(6))
    loaded, messages = load_quietly(manager)
    assert loaded is not None and loaded.step == 4  # type: ignore[attr-defined]
    assert any("resuming from step_000000000004.pt" in m for m in messages), messages


def test_flipped_float_is_caught_without_a_pointer_too(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(4, sizable_state(4.0))
    manager.save(6, sizable_state(6.0))
    flip_float_in_tensor_data(manager.path_for(6), 9.0)
    manager.pointer_path.unlink()
    loaded, _ = load_quietly(manager)
    assert loaded is not None and loaded.step == 4  # type: ignore[attr-defined]


def test_a_valid_but_swapped_file_fails_its_recorded_checksum(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(4, sizable_state(4.0))
    manager.save(6, sizable_state(6.0))
    other = CheckpointManager(tmp_path / "other")
    other.save(6, sizable_state(66.0))  # a complete checkpoint of another run
    manager.path_for(6).write_bytes(other.path_for(6).read_bytes())
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        manager.load(manager.path_for(6))
    loaded, messages = load_quietly(manager)
    assert loaded is not None and loaded.step == 4  # type: ignore[attr-defined]


def test_pointer_records_the_checksum_of_every_kept_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (2, 4, 6):
        manager.save(step, sizable_state(float(step)))
    records = json.loads(manager.pointer_path.read_text())["checkpoints"]
    for step in (4, 6):
        name = manager.path_for(step).name
        assert records[name]["sha256"] == archive_checksum(manager.path_for(step))
    # Older records survive while their files do, so a fall-back is verified too.
    manager.save(8, sizable_state(8.0))
    records = json.loads(manager.pointer_path.read_text())["checkpoints"]
    assert set(records) >= {manager.path_for(6).name, manager.path_for(8).name}
    assert manager.path_for(2).name not in records


def test_saves_store_crc32s_even_when_torch_is_told_not_to(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    torch.serialization.set_crc32_options(False)
    try:
        manager.save(1, sizable_state(1.0))
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.serialization.get_crc32_options() is True
    loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 1


# -- 7. pickled objects of any protocol are unsafe, never "unreadable" ---------------------------


def planted_payloads(marker: Path) -> dict[str, object]:
    return {
        "flat": {"model": {}, "payload": RunsCode(marker)},
        "nested": {"model": {"a": [1, (2, {"deep": [RunsCode(marker)]})]}},
    }


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("shape", ["flat", "nested"])
def test_pickled_object_of_any_protocol_is_refused_not_stepped_over(
    tmp_path: Path, protocol: int, shape: str
) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save(1, sizable_state(1.0))
    marker = tmp_path / "pwned"
    planted = manager.path_for(2)
    torch.save(planted_payloads(marker)[shape], planted, pickle_protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match=r"step_000000000002.pt.*\(posix.system\)"):
        manager.load(planted)
    manager.pointer_path.unlink()  # the planted file is now the newest
    with pytest.raises(UnsafeCheckpointError, match="step_000000000002.pt"):
        manager.load_latest_checkpoint()
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_a_bare_pickle_file_is_refused_too(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    planted = tmp_path / "step_000000000002.pt"
    planted.write_bytes(pickle.dumps({"x": RunsCode(marker)}, protocol=protocol))
    with pytest.raises(UnsafeCheckpointError, match=r"\(posix.system\)"):
        CheckpointManager(tmp_path).load(planted)
    assert not marker.exists()


def test_truncated_pickle_stream_is_damage_not_tampering(tmp_path: Path) -> None:
    planted = tmp_path / "step_000000000002.pt"
    planted.write_bytes(pickle.dumps({"x": list(range(100))}, protocol=2)[:40])
    with pytest.raises(CorruptCheckpointError):
        CheckpointManager(tmp_path).load(planted)


# -- 8. a NaN run never loses its last finite checkpoint -------------------------------------


def test_retention_keeps_the_newest_checkpoint_with_a_finite_loss(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(2, sizable_state(2.0), loss=1.5)
    for step in (4, 6, 8):
        manager.save(step, sizable_state(float(step)), loss=float("nan"))
    assert [p.name for p in manager.checkpoint_paths()] == [
        "step_000000000002.pt",
        "step_000000000006.pt",
        "step_000000000008.pt",
    ]
    records = json.loads(manager.pointer_path.read_text())["checkpoints"]
    assert records["step_000000000008.pt"]["loss"] == "nan"
    assert records["step_000000000008.pt"]["finite_loss"] is False
    assert records["step_000000000002.pt"] == {
        "sha256": archive_checksum(manager.path_for(2)),
        "loss": 1.5,
        "finite_loss": True,
    }
    manager.save(10, sizable_state(10.0), loss=0.5)  # finite again: the old one may go
    assert [p.name for p in manager.checkpoint_paths()] == [
        "step_000000000008.pt",
        "step_000000000010.pt",
    ]


def recorded_and_present(manager: CheckpointManager) -> tuple[list[str], list[str]]:
    """The file names ``latest.json`` records, and those of the checkpoints on disk."""
    records = json.loads(manager.pointer_path.read_text())["checkpoints"]
    return sorted(records), [p.name for p in manager.checkpoint_paths()]


def test_the_pointer_never_records_a_checkpoint_retention_deleted(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.note_best(1, "eval/loss", "min", 0.5)  # kept while it is the best
    for step in range(1, 6):
        if step == 4:
            manager.note_best(4, "eval/loss", "min", 0.4)  # step 1 is no longer kept
        manager.save(step, sizable_state(float(step)))
        recorded, present = recorded_and_present(manager)
        assert recorded == present, step
    assert [checkpoint_step(name) for name in present] == [4, 5]
    # prune() on its own (a smaller keep_last) rewrites the pointer before deleting.
    assert CheckpointManager(tmp_path, keep_last=1).prune() == []  # step 4 is the best
    shrunk = CheckpointManager(tmp_path, keep_last=1)
    shrunk.best_pointer_path.unlink()
    assert shrunk.prune() == [shrunk.path_for(4)]
    assert recorded_and_present(shrunk) == (["step_000000000005.pt"], ["step_000000000005.pt"])


def test_a_crash_between_pointer_and_deletion_loses_no_finite_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(2, sizable_state(2.0), loss=1.5)
    manager.save(4, sizable_state(4.0), loss=float("nan"))

    def crash(path: Path) -> None:
        raise KeyboardInterrupt  # the process dies between the pointer and the deletion

    monkeypatch.setattr("speedtronic.state.checkpoint._remove", crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(6, sizable_state(6.0), loss=float("nan"))
    monkeypatch.undo()
    recorded, present = recorded_and_present(manager)
    assert set(recorded) <= set(present)  # the pointer records no missing file
    assert present == ["step_000000000002.pt", "step_000000000004.pt", "step_000000000006.pt"]
    # The leftover (step 4, its record already dropped) is not taken for a finite one:
    # the next prune deletes it and keeps step 2, the last finite checkpoint.
    assert CheckpointManager(tmp_path, keep_last=1).prune() == [manager.path_for(4)]
    assert recorded_and_present(manager) == (
        ["step_000000000002.pt", "step_000000000006.pt"],
        ["step_000000000002.pt", "step_000000000006.pt"],
    )


class PoisonWeights(Callback):
    """Fills the weights with NaN after the optimizer step of ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_optimizer_step(self, trainer: Trainer, ctx: OptimizerStepContext) -> None:
        if ctx.step == self.step:
            with torch.no_grad():
                for parameter in trainer.model.parameters():
                    parameter.fill_(float("nan"))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_that_turns_nan_keeps_its_last_finite_checkpoint(
    tmp_path: Path, async_save: bool
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, object]:
            return {"logits": self.net(input_ids)}

    tokens = torch.randint(0, 16, (6, 2, 5))
    batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    checkpoint = CheckpointCallback(
        tmp_path, every_steps=1, keep_last=1, save_on_signal=False, async_save=async_save
    )
    lm = LM()
    optimizer = torch.optim.SGD(lm.parameters(), lr=0.1)
    trainer = Trainer(lm, optimizer, batches, callbacks=[PoisonWeights(2), checkpoint])
    trainer.fit(5)
    manager = CheckpointManager(tmp_path)
    assert [checkpoint_step(p.name) for p in manager.checkpoint_paths()] == [2, 5]
    records = json.loads(manager.pointer_path.read_text())["checkpoints"]
    assert records["step_000000000005.pt"]["finite_loss"] is False
    assert records["step_000000000002.pt"]["finite_loss"] is True


# -- 11. junk names, hostile states, absurd pointers ----------------------------------------------


def test_a_junk_step_name_takes_no_keep_last_slot(tmp_path: Path) -> None:
    junk = tmp_path / "step_999999999999999999999.pt"
    junk.write_bytes(b"junk")
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        manager.save(step, sizable_state(float(step)))
    assert [checkpoint_step(p.name) for p in manager.checkpoint_paths()] == [2, 3]
    assert junk.exists()  # not ours: neither counted nor deleted
    loaded, _ = load_quietly(manager)
    assert loaded is not None and loaded.step == 3  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="step must be in"):
        manager.path_for(10**12)


def test_files_newer_than_the_pointer_take_no_keep_last_slot(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    (tmp_path / "step_999999999999.pt").write_bytes(b"junk with a plausible name")
    for step in (1, 2, 3):
        manager.save(step, sizable_state(float(step)))
    assert [checkpoint_step(p.name) for p in manager.checkpoint_paths()] == [2, 3, 999999999999]


def self_referential() -> dict[str, object]:
    inner: dict[str, object] = {"w": torch.ones(1)}
    inner["me"] = inner
    return {"callbacks": {"ema": inner}}


def deeply_nested(depth: int) -> dict[str, object]:
    state: dict[str, object] = {"leaf": 1}
    for _ in range(depth):
        state = {"a": state}
    return {"callbacks": state}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (self_referential(), r"state\['callbacks'\]\['ema'\]\['me'\] refers back to "
                             r"state\['callbacks'\]\['ema'\] \(a cycle\)"),
        (deeply_nested(5000), r"state\['callbacks'\]\['a'\].* is nested more than 100"),
    ],
    ids=["cycle", "5000-deep"],
)  # fmt: skip
def test_a_hostile_state_is_refused_at_save_naming_the_key(
    tmp_path: Path, state: dict[str, object], message: str
) -> None:
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        manager.save(1, state)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 200_000 + b"]" * 200_000,
        b'{"file": ' * 200_000 + b"1" + b"}" * 200_000,
        b'{"step": ' + b"[" * 900 + b"]" * 900 + b', "file": "step_000000000001.pt"}',
        b"\xff\xfe not utf-8",
        b" " * (17 * 1024 * 1024),
    ],
    ids=["deep-list", "deep-object", "deep-step", "not-utf-8", "huge"],
)
def test_an_absurd_pointer_is_ignored_with_a_warning(tmp_path: Path, content: bytes) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save(1, sizable_state(1.0))
    manager.save(3, sizable_state(3.0))
    manager.pointer_path.write_bytes(content)
    with pytest.warns(UserWarning, match="ignoring checkpoint pointer"):
        loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 3
    manager.save(5, sizable_state(5.0))  # and saving goes on, replacing it
    assert manager.latest_path() == manager.path_for(5)


# -- 9. a full disk says so ------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_says_no_space_left_and_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save(1, sizable_state(1.0))
    real_save = torch.save

    def fill_the_disk(obj: object, f: object, **options: object) -> None:
        real_save({"partial": torch.ones(8)}, f)  # type: ignore[arg-type]  # the temp handle
        raise RuntimeError("PytorchStreamWriter failed writing file") from OSError(
            code, os.strerror(code)
        )

    monkeypatch.setattr(torch, "save", fill_the_disk)
    with pytest.raises(CheckpointError) as caught:
        manager.save(2, sizable_state(2.0))
    message = str(caught.value)
    assert message.startswith("no space left on device: could not write ")
    assert str(manager.path_for(2)) in message and "free there" in message
    assert manager.latest_path() == manager.path_for(1)  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "step_000000000001.pt"]


# -- the reproductions, through the CLI ----------------------------------------------------

CLI_CONFIG = {
    "run": {"name": "harden", "device": "cpu", "max_steps": 40, "seed": 3},
    "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
    "logging": {"every_steps": 5, "console": False},
    "checkpoint": {"every_steps": 5, "keep_last": 2},
}


def fit_cli_config(tmp_path: Path, config: dict[str, object] = CLI_CONFIG) -> tuple[Path, Path]:
    """``speedtronic fit`` of ``config`` into ``tmp_path/out``: the config file and ``out``."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    first = speedtronic_cli("fit", "--config", str(path), "--output-dir", str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    return path, out


def test_cli_resumes_past_a_truncated_newest_checkpoint_and_refuses_a_planted_pickle(
    tmp_path: Path,
) -> None:
    config, out = fit_cli_config(tmp_path)
    newest = out / "checkpoints" / "step_000000000040.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    resumed = speedtronic_cli("fit", "--config", str(config), "--output-dir", str(out),
                              "--resume", "--max-steps", "45", cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step_000000000035.pt" in resumed.stderr
    assert "steps=45" in resumed.stdout
    planted = out / "checkpoints" / "step_000000000050.pt"
    torch.save({"model": {}, "x": RunsCode(tmp_path / "pwned")}, planted, pickle_protocol=4)
    (out / "checkpoints" / "latest.json").unlink()
    refused = speedtronic_cli("fit", "--config", str(config), "--output-dir", str(out),
                              "--resume", "--max-steps", "50", cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "refusing to load" in refused.stderr and str(planted) in refused.stderr
    assert not (tmp_path / "pwned").exists()


def test_cli_retention_leaves_no_record_of_a_deleted_checkpoint_in_the_pointer(
    tmp_path: Path,
) -> None:
    _, out = fit_cli_config(tmp_path)
    recorded, present = recorded_and_present(CheckpointManager(out / "checkpoints"))
    assert recorded == present == ["step_000000000035.pt", "step_000000000040.pt"]
