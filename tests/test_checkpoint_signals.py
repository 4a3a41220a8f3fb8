"""Issue 22, item 7: a second Ctrl-C while a checkpoint is being written.

Cut short inside ``torch.save``, the interrupt used to become "CheckpointError: could not
write .../step_000000000073.pt: RuntimeError: [enforce fail at inline_container.cc:672] .
unexpected pos ..." and exit 2. Now a second signal during a save waits for it (the new
checkpoint is the resume point) and a third abandons it (the previous one is); either way
``speedtronic fit`` exits 130 with no checkpoint error, and ``--resume`` continues from an
intact checkpoint. Real processes (forked ``speedtronic fit``) whose saves are slowed so
that timed signals land in them, many trials with seeded random delays.
"""

from __future__ import annotations

import os
import random
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
import yaml
from cli_runner import run_cli
from forked import Child, Forked, cli_main
from test_checkpoint import sample_state, tiny_trainer
from test_hardening import CLI_CONFIG

from speedtronic.engine.contexts import FitContext, TeardownContext
from speedtronic.state.checkpoint import CheckpointError, CheckpointManager, checkpoint_step
from speedtronic_callbacks.checkpoint import CheckpointCallback

WRITE_PAUSE_S = 0.002
GATE_TIMEOUT_S = 30.0


class SlowWrites:
    """A file handle whose every write first sleeps (``torch.save`` writes record by record)."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle

    def write(self, data: bytes) -> int:
        time.sleep(WRITE_PAUSE_S)
        return self.handle.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.handle, name)


def slow_save_cli(gate: str, *argv: str) -> int:
    """A child's life: ``speedtronic *argv`` whose checkpoint writes are slow (~0.3 s of
    writes) and say on stderr when they start and end; every save after the first also
    waits, its data written but not yet committed, until the file ``gate`` exists. So the
    parent knows a save is in flight while it sends its signals, wherever they land."""
    real_save = torch.save
    saves = [0]

    def slow_save(value: object, handle: BinaryIO, *args: object, **kwargs: object) -> None:
        os.write(2, b"save started\n")
        real_save(value, SlowWrites(handle), *args, **kwargs)  # type: ignore[arg-type]  # a handle
        saves[0] += 1
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while saves[0] > 1 and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        os.write(2, b"save written\n")

    torch.save = slow_save  # type: ignore[assignment]  # this child's torch only
    return cli_main(*argv)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **CLI_CONFIG,
                "run": {"name": "sigint", "device": "cpu", "max_steps": 100_000, "seed": 3},
                "checkpoint": {"every_steps": 3, "keep_last": 2},
                "scheduler": {"warmup_steps": 1},
            }
        )
    )
    return path


def wait_for(child: Child, text: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while child.output.count(text) < count:
        assert child.poll() is None, f"exited {child.poll()} before {text!r}:\n{child.output}"
        assert time.monotonic() < deadline, f"no {text!r} x{count}:\n{child.output}"
        time.sleep(0.005)


def signals_into_a_save(child: Child, gate: Path, rng: random.Random, signals: int) -> None:
    """Once the second save (step 6) is in flight: ``signals`` SIGINTs at seeded random
    moments -- the first asks for a stop, the second is held, a third abandons the save --
    landing in its writes or in its wait at the gate. With two, the save is then let
    finish."""
    wait_for(child, "save started", 2)
    for _ in range(signals):
        time.sleep(rng.uniform(0.0, 0.15))
        child.send_signal(signal.SIGINT)
    if signals == 2:
        time.sleep(0.05)  # handled before the gate opens
        gate.touch()


TRIALS = [3, 2, 3, 2, 3, 2, 2, 3, 2, 3]
"""Signals per trial: 2 = a second one while the save is in flight (it finishes), 3 = a
third one abandons it."""


def test_a_second_sigint_during_a_save_never_breaks_it(
    forked: Forked, tmp_path: Path, config: Path
) -> None:
    rng = random.Random(22)
    trials = list(enumerate(TRIALS))
    for batch in (trials[:5], trials[5:]):  # five children at a time
        children = []
        for trial, signals in batch:
            out, gate = tmp_path / f"out{trial}", tmp_path / f"gate{trial}"
            argv = ("fit", "--config", str(config), "--output-dir", str(out))
            child = forked.start(slow_save_cli, str(gate), *argv, cwd=tmp_path)
            children.append((signals, out, gate, child))
        for signals, _, gate, child in children:
            signals_into_a_save(child, gate, rng, signals)
        for signals, out, _, child in children:
            code = child.wait(timeout=60)
            output = child.output
            assert code == 130, f"{out.name} exited {code}:\n{output}"
            for broken in ("Traceback", "CheckpointError", "could not write", "error:"):
                assert broken not in output, f"{out.name}:\n{output}"
            # Held, the second signal let the save finish: its checkpoint is the resume
            # point. Abandoned by a third, it left the previous one (step 3) in place.
            assert resumable_step(out) == (6 if signals == 2 else 3), output
    for out, steps in (("out0", "5"), ("out1", "8")):  # abandoned at 3; finished at 6
        resumed = run_cli("fit", "--config", str(config), "--output-dir", str(tmp_path / out),
                          "--resume", "--max-steps", steps, cwd=tmp_path)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        assert f"completed steps={steps}" in resumed.stdout
        assert "this run: 2 steps" in resumed.stdout


def resumable_step(out: Path) -> int:
    """The step ``--resume`` would continue from: the committed checkpoint, loaded without
    any warning (nothing damaged is stepped over), with no temp file taken for one."""
    manager = CheckpointManager(out / "checkpoints")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.path == manager.latest_path()
    assert all(checkpoint_step(p.name) is not None for p in manager.checkpoint_paths())
    return loaded.step


# -- the same rules in one process, deterministically ------------------------------------------


@pytest.fixture
def python_sigint_handler() -> Iterator[None]:
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def callback_in_a_fit(tmp_path: Path) -> tuple[CheckpointCallback, object]:
    callback = CheckpointCallback(tmp_path, keep_last=None)
    trainer = tiny_trainer([callback])
    callback.on_setup(trainer, FitContext(0, 10))
    callback.manager.save(1, sample_state(1.0))
    signal.raise_signal(signal.SIGINT)  # the first: stop after this step
    return callback, trainer


@pytest.mark.usefixtures("python_sigint_handler")
def test_a_second_signal_waits_for_the_save_then_interrupts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback, trainer = callback_in_a_fit(tmp_path)
    real_save = callback.manager.save

    def save_hit_by_a_signal(step: int, state: dict[str, object]) -> Path:
        signal.raise_signal(signal.SIGINT)  # held: the save goes on
        return real_save(step, state)

    monkeypatch.setattr(callback.manager, "save", save_hit_by_a_signal)
    with pytest.raises(KeyboardInterrupt):
        callback._save(trainer, 2, sample_state(2.0))  # type: ignore[arg-type]  # a Trainer
    assert callback.manager.latest_path() == callback.manager.path_for(2)  # written first
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed over
    callback.on_teardown(trainer, TeardownContext(0, None))  # type: ignore[arg-type]


@pytest.mark.usefixtures("python_sigint_handler")
def test_a_third_signal_abandons_the_save_as_an_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback, trainer = callback_in_a_fit(tmp_path)

    def save_hit_twice(step: int, state: dict[str, object]) -> Path:
        signal.raise_signal(signal.SIGINT)  # held
        try:
            signal.raise_signal(signal.SIGINT)  # abandons: KeyboardInterrupt in here
        except KeyboardInterrupt as exc:  # which torch's writer turns into its own error
            raise CheckpointError("could not write: RuntimeError: unexpected pos") from exc
        raise AssertionError("the third signal did not interrupt the save")

    monkeypatch.setattr(callback.manager, "save", save_hit_twice)
    with pytest.raises(KeyboardInterrupt):
        callback._save(trainer, 2, sample_state(2.0))  # type: ignore[arg-type]  # a Trainer
    assert callback.manager.latest_path() == callback.manager.path_for(1)
    callback.on_teardown(trainer, TeardownContext(0, None))  # type: ignore[arg-type]
