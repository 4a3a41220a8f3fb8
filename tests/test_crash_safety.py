"""Crash safety: a training process that saves every step is SIGKILLed at random moments.

After every kill the checkpoint directory must resume: ``load_latest`` returns a complete,
loadable checkpoint, the pointer names a real checkpoint, and a temp file left by a write
that was cut short is never taken for a checkpoint. Each trial's child resumes from what the
previous one left, so resume-after-kill is exercised too.

Children are forked from the suite's fork server, which has already imported torch
(``tests/forked.py``), so a trial costs milliseconds of start-up instead of a fresh interpreter.
"""

from __future__ import annotations

import os
import random
import signal
import time
import warnings
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import torch
from forked import Forked
from torch import nn

from speedtronic import Trainer
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.state.checkpoint import POINTER_NAME, CheckpointManager, checkpoint_step
from speedtronic.state.resume import resume_from
from speedtronic_callbacks.checkpoint import CheckpointCallback

TRIALS = 24
KEEP_LAST = 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.emb(input_ids))}


def tiny_trainer(callbacks: list[Callback]) -> Trainer:
    torch.manual_seed(0)
    model = TinyLM()
    tokens = torch.randint(0, 16, (4, 2, 9), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Trainer(model, optimizer, batches, device="cpu", callbacks=callbacks)


class SignalReady(Callback):
    """Sets an event once this process has completed (and saved) a step."""

    def __init__(self, ready: EventType) -> None:
        self.ready = ready

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        if not self.ready.is_set():
            self.ready.set()


def train_until_killed(directory: str, ready: EventType) -> None:
    """Child process: resume from ``directory`` and train forever, saving every step."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # "no checkpoint found" on the first trial
    callback = CheckpointCallback(
        directory, every_steps=1, keep_last=KEEP_LAST, save_on_signal=False
    )
    trainer = tiny_trainer([callback, SignalReady(ready)])
    resume_from(trainer, callback.manager)
    trainer.fit(10**9)


def check_directory(directory: Path) -> int:
    """Assert the directory resumes; returns the step it resumes from."""
    manager = CheckpointManager(directory, keep_last=KEEP_LAST)
    for path in manager.checkpoint_paths():
        assert checkpoint_step(path.name) is not None and not path.name.startswith(".")
    loaded = manager.load_latest_checkpoint()  # would warn and fall back on a torn file
    assert loaded is not None
    counters = loaded.state["counters"]
    assert isinstance(counters, dict) and counters["step"] == loaded.step
    pointer = directory / POINTER_NAME
    if pointer.exists():
        assert manager.latest_path() == loaded.path
    fresh = tiny_trainer([])
    fresh.load_state_dict(loaded.state)  # the whole state fits a new trainer
    assert fresh.step == loaded.step
    return loaded.step


def test_sigkill_at_random_moments_never_breaks_resume(tmp_path: Path, forked: Forked) -> None:
    directory = tmp_path / "ck"
    chooser = random.Random(20240601)
    steps: list[int] = []
    torn_writes = 0
    deadline = time.monotonic() + 50
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn checkpoint would be a fallback warning
        for _ in range(TRIALS):
            ready = forked.context.Event()
            child = forked.start(train_until_killed, str(directory), ready)
            assert ready.wait(timeout=30), "the child never completed a step"
            time.sleep(chooser.uniform(0.0, 0.08))
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
            torn_writes += any(".tmp-" in p.name for p in directory.iterdir())
            steps.append(check_directory(directory))
            assert time.monotonic() < deadline, "crash-safety test is too slow"
    assert steps == sorted(steps) and steps[-1] > steps[0]  # each child resumed and progressed
    print(f"steps after each kill: {steps}; kills that tore a write: {torn_writes}/{TRIALS}")
