"""Issue 12, item 10 and issue 22, item 8: a hung data loader must not make SIGTERM a no-op,
the training stream's or the held-out set's.

The first SIGTERM asks for a stop after the current step. When that step waits for a batch
that never comes, the stop gives up on it after ``run.stop_grace_s`` seconds (on a Python
``Trainer``: ``stop_grace_s``): the fit fails with ``StopTimeoutError`` (``speedtronic fit``
exits 1 saying so), the periodic checkpoints stay, and no DataLoader worker is left behind.
A step that computes (rather than waits for data) is never cut short, and the final
checkpoint of a clean stop is unchanged.
"""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from forked import Forked, cli_main
from torch import nn
from torch.utils.data import DataLoader, Dataset

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.data import build_dataloader
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import MicrobatchContext, StepContext
from speedtronic.engine.stop_watch import StopTimeoutError
from speedtronic.engine.view import TrainerView
from speedtronic.state.checkpoint import CheckpointManager, checkpoint_step
from speedtronic_callbacks.checkpoint import CheckpointCallback

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 1.0
SLACK_S = 15.0  # interpreter exit and a loaded 2-core machine; the grace is what is bounded


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (from /proc: psutil is no dependency)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


HANGING_MODULE = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from speedtronic.data import register_dataset
    from speedtronic.data.synthetic import SyntheticTokenDataset

    MARKER = Path(__file__).with_name("worker.pid")

    class Hanging(SyntheticTokenDataset):
        def __getitem__(self, index):
            if index >= 4:  # batches 1 and 2 (of 2 samples) come; batch 3 never does
                MARKER.write_text(str(os.getpid()))
                time.sleep(3600)
            return super().__getitem__(index)

    @register_dataset("hanging")
    def hanging(request):
        return Hanging(num_samples=64, block_size=request.block_size,
                       vocab_size=request.vocab_size, seed=request.seed)
    """
)

CONFIG = textwrap.dedent(
    """
    imports: [hanging_data]
    run: {name: hang, device: cpu, max_steps: 50, seed: 3, output_dir: out, stop_grace_s: GRACE}
    model: {vocab_size: 32, max_seq_len: 8, n_layer: 1, n_head: 2, d_model: 16}
    data: {dataset: hanging, micro_batch_size: 2, num_workers: 1}
    scheduler: {warmup_steps: 1}
    logging: {every_steps: 1, console: false}
    checkpoint: {every_steps: 1}
    """
).replace("GRACE", str(GRACE_S))  # run.stop_grace_s: the bound this test checks


def test_sigterm_stops_a_fit_whose_worker_hangs_and_leaves_no_worker(
    tmp_path: Path, forked: Forked
) -> None:
    (tmp_path / "hanging_data.py").write_text(HANGING_MODULE)
    (tmp_path / "run.yaml").write_text(CONFIG)
    # A process of its own (forked from the suite's preloaded server: tests/forked.py): the
    # signal, its DataLoader worker and its exit are real.
    child = forked.start(cli_main, "fit", "--config", "run.yaml", cwd=tmp_path)
    marker = tmp_path / "worker.pid"
    try:
        deadline = time.monotonic() + 120
        while not marker.is_file() or not marker.read_text():
            assert child.poll() is None, child.output
            assert time.monotonic() < deadline, "the worker never reached the hanging batch"
            time.sleep(0.05)
        worker = int(marker.read_text())
        checkpoints = tmp_path / "out" / "checkpoints"
        while len(list(checkpoints.glob("step_*.pt"))) < 2:  # steps 1 and 2 are done
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # the main process now waits for batch 3
        assert alive(worker)
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=GRACE_S + SLACK_S)
        took = time.monotonic() - sent
    finally:
        child.kill()  # if it still runs
    err = child.output  # stdout and stderr
    assert child.returncode == 1, err
    assert took < GRACE_S + SLACK_S
    assert "received SIGTERM: stopping after step 3" in err
    assert (
        "speedtronic: error: StopTimeoutError: stop requested (signal SIGTERM) during step 3" in err
    )
    assert f"did not come within {GRACE_S:g} s" in err and "no final checkpoint" in err
    assert "Traceback" not in err
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker), "the hung DataLoader worker was left behind"
    manager = CheckpointManager(checkpoints)
    assert [checkpoint_step(p.name) for p in manager.checkpoint_paths()][-1] == 2
    assert manager.latest_path() == manager.path_for(2)


HANGING_EVAL_MODULE = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from speedtronic.data import register_dataset
    from speedtronic.data.synthetic import SyntheticTokenDataset

    MARKER = Path(__file__).with_name("eval.pid")

    class HangingHeldOut(SyntheticTokenDataset):
        def __getitem__(self, index):
            MARKER.write_text(str(os.getpid()))  # the held-out set's first item never comes
            time.sleep(3600)

    @register_dataset("hanging_held_out")
    def hanging_held_out(request):
        return HangingHeldOut(num_samples=8, block_size=request.block_size,
                              vocab_size=request.vocab_size, seed=request.seed)
    """
)


@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_while_the_held_out_data_hangs_ends_the_run(
    tmp_path: Path, forked: Forked, workers: int
) -> None:
    # Issue 22, item 8: the evaluation of step 4 waits for a held-out batch that never comes;
    # SIGTERM printed "stopping after step 4" and the run went on forever. The stop watch now
    # bounds that wait too: exit 1 within the grace, step 3 the newest checkpoint.
    (tmp_path / "hanging_eval.py").write_text(HANGING_EVAL_MODULE)
    config = (
        CONFIG.replace("[hanging_data]", "[hanging_eval]")
        .replace("dataset: hanging, micro_batch_size: 2, num_workers: 1", "micro_batch_size: 2, "
                 f"num_workers: {workers}")
    )  # fmt: skip
    config += "eval: {every_steps: 4, dataset: hanging_held_out}\n"
    (tmp_path / "run.yaml").write_text(config)
    child = forked.start(cli_main, "fit", "--config", "run.yaml", cwd=tmp_path)
    marker = tmp_path / "eval.pid"
    try:
        deadline = time.monotonic() + 120
        while not marker.is_file() or not marker.read_text():
            assert child.poll() is None, child.output
            assert time.monotonic() < deadline, "the evaluation never started"
            time.sleep(0.05)
        assert int(marker.read_text()) == child.pid  # the held-out set loads in the main process
        time.sleep(0.3)
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=GRACE_S + SLACK_S)
        took = time.monotonic() - sent
    finally:
        child.kill()  # if it still runs
    err = child.output
    assert child.returncode == 1, err
    assert took < GRACE_S + SLACK_S
    assert "received SIGTERM: stopping after step 4" in err
    assert (
        "StopTimeoutError: stop requested (signal SIGTERM) during step 4, but the held-out "
        f"batch its evaluation was waiting for did not come within {GRACE_S:g} s" in err
    )
    assert "Traceback" not in err
    manager = CheckpointManager(tmp_path / "out" / "checkpoints")
    assert manager.latest_path() == manager.path_for(3)  # step 4 never completed


# -- in process: the watch itself ---------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batches(count: int) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 16, (count, 2, 7), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


class HangsAfter:
    """Yields ``good`` batches, then blocks (in the main thread: no workers) until released."""

    def __init__(self, good: int) -> None:
        self.good = batches(good)
        self.waiting = threading.Event()
        self.release = threading.Event()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        yield from self.good
        self.waiting.set()
        self.release.wait(60)  # stands for a loader that never delivers
        yield from self.good


def trainer_on(data: Iterable[object], callbacks: list[Callback], k: int = 1) -> Trainer:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = Trainer(
        model, optimizer, data, device="cpu", callbacks=callbacks, accumulation_steps=k
    )
    trainer.stop_grace_s = 0.4
    return trainer


def sigterm_when(event: threading.Event) -> threading.Thread:
    """SIGTERM to the main thread once ``event`` is set (as a scheduler would send it)."""

    def send() -> None:
        if event.wait(60):
            time.sleep(0.05)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def default_signal_handlers() -> Iterator[None]:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.usefixtures("default_signal_handlers")
def test_a_stop_while_waiting_for_a_batch_gives_up_after_the_grace(tmp_path: Path) -> None:
    data = HangsAfter(good=3)
    alarm_before = signal.getsignal(signal.SIGALRM)
    timer_before = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout may have one running
    checkpoint = CheckpointCallback(tmp_path / "ck", every_steps=2)
    trainer = trainer_on(data, [checkpoint])
    sender = sigterm_when(data.waiting)
    started = time.monotonic()
    with pytest.raises(StopTimeoutError, match=r"during step 4, .* within 0\.4 s"):
        trainer.fit(1000)
    assert time.monotonic() - started < 10
    sender.join()
    data.release.set()
    assert trainer.step == 3
    assert checkpoint.manager.latest_path() == checkpoint.manager.path_for(2)  # no final save
    assert signal.getsignal(signal.SIGALRM) is alarm_before  # the watch is gone
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    assert interval == timer_before[1] and delay <= timer_before[0]
    assert (delay > 0) == (timer_before[0] > 0)  # a timer (pytest-timeout's) is untouched
    assert not [t for t in threading.enumerate() if t.name == "speedtronic-stop-watch"]
    assert trainer.stream.state_dict() == {"epoch": 0, "batches_in_epoch": 3}  # resumable


@pytest.mark.usefixtures("default_signal_handlers")
def test_a_stop_while_the_held_out_workers_hang_stops_them(tmp_path: Path) -> None:
    # The evaluation of step 2 reads a DataLoader whose two workers hang in the dataset's
    # code: the watch gives up on the held-out batch and the workers are stopped at once.
    marker = tmp_path / "worker.pid"
    held_out = DataLoader(_Hangs(str(marker)), batch_size=2, num_workers=2)
    checkpoint = CheckpointCallback(tmp_path / "ck", every_steps=1)
    trainer = trainer_on(batches(4), [checkpoint])
    trainer.eval_data, trainer.eval_every = held_out, 2
    reached = threading.Event()

    def wait_for_the_marker() -> None:
        while not marker.is_file():
            time.sleep(0.05)
        reached.set()

    threading.Thread(target=wait_for_the_marker, daemon=True).start()
    sender = sigterm_when(reached)
    with pytest.raises(StopTimeoutError, match=r"during step 2, but the held-out batch"):
        trainer.fit(4)
    sender.join()
    worker = int(marker.read_text())
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker), "a hung held-out worker was left behind"
    assert checkpoint.manager.latest_path() == checkpoint.manager.path_for(1)
    assert not [t for t in threading.enumerate() if t.name == "speedtronic-stop-watch"]


class SlowStepAfterStop(Callback):
    """Requests a stop at ``step`` and then computes (sleeps) far longer than the grace."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        if ctx.step == self.step:
            trainer.request_stop("test stop")
            time.sleep(self.seconds)


@pytest.mark.usefixtures("default_signal_handlers")
def test_a_step_that_computes_is_never_cut_short(tmp_path: Path) -> None:
    checkpoint = CheckpointCallback(tmp_path / "ck", every_steps=100)
    trainer = trainer_on(batches(4), [SlowStepAfterStop(2, seconds=1.0), checkpoint])
    result = trainer.fit(1000)
    assert result.stop_reason == "test stop" and result.steps == 2
    assert checkpoint.manager.latest_path() == checkpoint.manager.path_for(2)  # final save


class SlowData:
    """Every batch after the first takes ``seconds`` to come (slow, but it comes)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for index, batch in enumerate(batches(8)):
            if index:
                time.sleep(self.seconds)
            yield batch


class StopInFirstMicrobatch(Callback):
    def on_microbatch_end(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        if ctx.step == 1 and ctx.index == 0:
            trainer.request_stop("test stop")


@pytest.mark.usefixtures("default_signal_handlers")
def test_a_slow_batch_that_comes_within_the_grace_is_waited_for() -> None:
    # The stop comes after the first of three microbatches; the other two take 0.15 s each
    # to load (under the 0.4 s grace), so step 1 completes and the fit stops cleanly.
    trainer = trainer_on(SlowData(0.15), [StopInFirstMicrobatch()], k=3)
    result = trainer.fit(1000)
    assert result.stop_reason == "test stop" and result.steps == 1


class _Hangs(Dataset[object]):
    """Every item hangs, after writing the loading process's pid to ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> object:
        Path(self.marker).write_text(str(os.getpid()))
        time.sleep(3600)
        raise AssertionError("unreachable")


def load_from_a_hung_worker(marker: str) -> None:
    """The process the next test kills: it waits for a batch its one worker never sends."""
    config = load_config({"data": {"micro_batch_size": 2, "num_workers": 1}})
    next(iter(build_dataloader(config.data, dataset=_Hangs(marker))))


def test_a_hung_worker_exits_when_its_process_is_killed(tmp_path: Path, forked: Forked) -> None:
    # Nothing can run in a SIGKILLed process (nor in one a SIGTERM kills without a handler,
    # e.g. with checkpointing off -- the same case for the worker): the worker notices that
    # its parent is gone by itself. The process is forked from the suite's preloaded server.
    sig = signal.SIGKILL
    marker = tmp_path / "worker.pid"
    child = forked.start(load_from_a_hung_worker, str(marker), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not marker.is_file() or not marker.read_text():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        worker = int(marker.read_text())
        assert alive(worker)
        child.send_signal(sig)
        assert child.wait(timeout=30) == -sig
    finally:
        child.kill()  # if it still runs
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker), "the hung DataLoader worker outlived its process"
