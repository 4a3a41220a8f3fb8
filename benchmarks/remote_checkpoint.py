"""Object-store checkpoints: how long ``checkpoint.remote`` holds the training thread per save.

The state is the one ``benchmarks/checkpoint.py`` saves (the reference transformer after one
AdamW step; ``--layers`` makes it smaller). The store is a real S3 API on loopback: a
``moto`` server in a child process (as an object store is another machine: its request
handling does not share this process's interpreter), reached through ``s3fs``. Fit segments
run interleaved (alternating which goes first; the first round is a warm-up and dropped),
each with a save every ``--every`` steps:

    python benchmarks/remote_checkpoint.py              # prints a markdown table
    python benchmarks/remote_checkpoint.py --layers 2 --rounds 7

Rows (each "blocked" is the time the checkpoint callback holds the training thread per save,
``benchmarks/checkpoint.py``'s ``TimedCheckpoint``):
  sync local        the synchronous local save: the reference every ratio divides by
  sync + remote     the same save with ``remote: s3://...``: the upload is handed to the
                    mirror's thread after the local commit; "extra" is the added stall
                    (the issue's bound: at most 5% of the synchronous local save)
  async + remote    ``async_save: true`` with ``remote``: the snapshot only, the write and
                    the upload both in the background
  hand-over         the time ``RemoteMirror.submit`` takes on the training thread (with
                    ``async_save`` the writer thread calls it: zero)
  wall-time rows    the extra wall time per save over segments without checkpoints: it also
                    counts the background threads (write, hashing, upload, read-back
                    verification) competing with training for cores

Each segment ends with ``fit_end``, which waits for the uploads (outside the timed region:
the segment clock stops at the last step's end), so every save of every segment is uploaded
and verified, and no upload of one segment overlaps the next.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import torch
from checkpoint import SegmentClock, TimedCheckpoint

from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import FitContext
from speedtronic.engine.trainer import Trainer
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.state.remote import parse_remote_pointer, read_remote_pointer
from speedtronic.state.remote_store import open_store

MODES = ("none", "sync local", "sync + remote", "async + remote")


class HandOffTimed(TimedCheckpoint):
    """``TimedCheckpoint`` that also times the hand-over to the upload thread on the
    training thread (``RemoteMirror.submit``; with ``async_save`` the writer thread calls it,
    so it costs the training thread nothing)."""

    handoff = 0.0

    def on_setup(self, trainer: Trainer, ctx: FitContext) -> None:
        super().on_setup(trainer, ctx)
        mirror = self.mirror
        if mirror is None:
            return
        submit = mirror.submit
        main = threading.main_thread()

        def timed_submit(path: Path) -> None:
            start = time.perf_counter()
            submit(path)
            if threading.current_thread() is main:
                self.handoff += time.perf_counter() - start

        mirror.submit = timed_submit  # type: ignore[method-assign]  # observe the hand-over
        if self._writer is not None:
            self._writer.on_commit = timed_submit


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_s3(port: int) -> subprocess.Popen[bytes]:
    """``moto_server`` on loopback in a child process; returns once it answers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).read()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("the moto server did not start")


def make_trainer(callbacks: list[Callback], layers: int) -> Trainer:
    """``benchmarks/checkpoint.py``'s trainer with ``layers`` blocks, after one AdamW step."""
    torch.manual_seed(0)
    model = ReferenceTransformer(
        vocab_size=8192, block_size=64, n_layer=layers, n_head=8, d_model=512, d_ff=2048
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 8192, (1, 33))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "parallel.strategy fsdp on a single process")
        trainer = Trainer(model, optimizer, [batch], device="cpu", callbacks=callbacks)
    trainer.fit(1)
    return trainer


def run(
    directory: Path, endpoint: str, rounds: int, layers: int, segment: int, every: int
) -> list[tuple[str, float, float, str]]:
    options = {"endpoint_url": endpoint}
    open_store("s3://bench", options).fs.mkdir("bench")
    clocks: dict[str, SegmentClock] = {}
    checkpoints: dict[str, HandOffTimed] = {}
    trainers: dict[str, Trainer] = {}
    for index, mode in enumerate(MODES):
        clocks[mode] = SegmentClock()
        callbacks: list[Callback] = [clocks[mode]]
        if mode != "none":
            checkpoints[mode] = HandOffTimed(
                directory / f"mode{index}",
                every_steps=every,
                keep_last=1,
                save_final=False,
                save_on_signal=False,
                async_save=mode.startswith("async"),
                remote=f"s3://bench/mode{index}" if mode.endswith("remote") else None,
                remote_options=options,
            )
            callbacks.append(checkpoints[mode])
        trainers[mode] = make_trainer(callbacks, layers)
    state = trainers["none"].state_dict()
    mib = sum(t.numel() * t.element_size() for t in _tensors(state)) / 2**20
    print(
        f"state {mib:.0f} MiB, {segment} steps per segment, a save every {every}, "
        f"{rounds} rounds (+1 warm-up)"
    )
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    blocked: dict[str, list[float]] = {mode: [] for mode in checkpoints}
    handoff: dict[str, list[float]] = {mode: [] for mode in checkpoints}
    saves = segment // every
    for rnd in range(rounds + 1):
        order = list(MODES) if rnd % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            os.sync()
            callback = checkpoints.get(mode)
            if callback is not None:
                callback.blocked = callback.handoff = 0.0
            trainers[mode].fit(trainers[mode].step + segment)
            seconds[mode].append(clocks[mode].seconds)
            if callback is not None:
                blocked[mode].append(callback.blocked / saves)
                handoff[mode].append(callback.handoff / saves)
                if callback.remote is not None:
                    check_uploaded(callback, options)
    med = {mode: statistics.median(values[1:]) for mode, values in seconds.items()}
    best = {mode: min(values[1:]) for mode, values in blocked.items()}
    held = {mode: statistics.median(values[1:]) for mode, values in blocked.items()}
    reference = held["sync local"]
    slowdown = {mode: max(0.0, med[mode] - med["none"]) / saves for mode in checkpoints}
    rows = [
        (
            "sync local: blocked per save",
            reference,
            1.0,
            f"best {best['sync local']:.3f} s; the reference",
        ),
    ]
    extra = held["sync + remote"] - reference
    rows.append(
        (
            "sync + remote: blocked per save",
            held["sync + remote"],
            held["sync + remote"] / reference,
            f"best {best['sync + remote']:.3f} s; extra over sync local {extra * 1e3:+.1f} ms "
            f"= {extra / reference:+.1%} (bound: 5%)",
        )
    )
    rows.append(
        (
            "async + remote: blocked per save",
            held["async + remote"],
            held["async + remote"] / reference,
            f"best {best['async + remote']:.4f} s (bound: 5% of sync local)",
        )
    )
    for mode in ("sync + remote", "async + remote"):
        moved = statistics.median(handoff[mode][1:])
        rows.append(
            (
                f"{mode}: hand-over to the upload thread",
                moved,
                moved / reference,
                f"on the training thread, per save; max {max(handoff[mode][1:]) * 1e6:.0f} us",
            )
        )
    for mode in checkpoints:
        rows.append(
            (
                f"{mode}: wall-time slowdown per save",
                slowdown[mode],
                slowdown[mode] / reference,
                f"a step takes {med['none'] / segment:.3f} s",
            )
        )
    return rows


def check_uploaded(callback: HandOffTimed, options: dict[str, object]) -> None:
    """The segment's last save is what the remote pointer names (every upload verified)."""
    assert callback.remote is not None and callback.last_path is not None
    data = read_remote_pointer(open_store(callback.remote, options))
    pointer, problem = parse_remote_pointer(data or b"")
    if pointer is None or pointer.target != callback.last_path.name:
        raise SystemExit(
            f"{callback.remote}: the upload of {callback.last_path.name} "
            f"did not land ({problem or pointer})"
        )


def _tensors(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, list | tuple):
        return [t for value in state for t in _tensors(value)]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (8: ~350 MiB)")
    parser.add_argument("--segment", type=int, default=6, help="steps per fit segment")
    parser.add_argument("--every", type=int, default=3, help="a save every N steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Dummy credentials, as a user would set them in the environment.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = start_s3(port)
    base = Path(tempfile.mkdtemp(prefix="speedtronic-remote-bench-", dir=args.dir))
    try:
        rows = run(
            base, f"http://127.0.0.1:{port}", args.rounds, args.layers, args.segment, args.every
        )
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(base, ignore_errors=True)
    print()
    print("| case | median (s) | ratio to the sync local save | note |")
    print("|---|---:|---:|---|")
    for name, value, ratio, note in rows:
        print(f"| {name} | {value:.6f} | {ratio:.5f} | {note} |")


if __name__ == "__main__":
    main()
