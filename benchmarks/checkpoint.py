"""Checkpoint cost: speedtronic's save/load of a full training state versus raw torch.save/load.

The state is ``trainer.state_dict()`` of a 29M-parameter reference transformer after one
AdamW step (weights + two moment buffers, ~350 MiB). Cases run interleaved in one process,
rotating which goes first; each row reports the median and best time, and the throughput
ratio against its raw baseline (1.00 = as fast as raw; higher is faster) as the median of the
per-round ratios and as best against best, with the load average when the rows were taken.

Baselines are what a user would write without the library: for a save, ``torch.save`` of the
same state to a temporary file in the same kind of directory on the same filesystem, an fsync
of it and an ``os.replace`` onto the final name (a save that survives a crash and never leaves
a torn file, the strongest a user writes: no directory fsync, no checksum, no pointer); for a
load ``torch.load(path, weights_only=True)`` (the safe load; speedtronic adds the integrity
check on top). Every save case starts after an ``os.sync()`` (no dirty pages of the previous
case left to write) and writes a new file; old files are deleted outside the timed region.

    python benchmarks/checkpoint.py                 # prints a markdown table
    python benchmarks/checkpoint.py --no-async      # the save and load rows only
    python benchmarks/checkpoint.py --profile 3     # where a save's time goes (cProfile)
    python benchmarks/checkpoint.py --paired-saves --repeats 15  # the save row alone, ABBA
    python benchmarks/checkpoint.py --paired-saves --torch-crc   # ... as it runs without isal
    python benchmarks/checkpoint.py --dir /scratch  # put the files on another disk
    python benchmarks/checkpoint.py --device cuda   # state on the GPU (pinned async copies)

Rows:
  save              trainer.state_dict() + CheckpointManager.save: plain-state check, temp
                    file, torch.save with the records' CRC-32s taken by ISA-L as the bytes
                    are written and stored in the archive, SHA-256 of the zip record index,
                    fsync, rename, directory fsync, then latest.json the same way; vs
                    trainer.state_dict() + torch.save to a temp file + fsync + os.replace
                    (the same durability for the file; CPU-time ratio beside it), and vs a
                    bare torch.save (page cache only: what durability costs); also the save
                    as it runs without isal (torch computes the CRC-32s, as every save did
                    before ISA-L took them over) against the same baseline
  load              CheckpointManager.load_latest_checkpoint() (pointer validation, the
                    integrity check: record-index checksum and every record's CRC-32, then
                    torch.load weights_only) vs torch.load(path, weights_only=True), same file
  async vs sync     interleaved fit segments (6 steps, a save every 3) with async save,
                    synchronous save and no checkpoints: "blocked" is the time the checkpoint
                    callback holds the training thread per save; "save step + next step" is
                    the extra wall time of the saving step and the one after it, paired with
                    the same steps without checkpoints (the async copy's wait and the
                    background write competing with training for cores and disk);
                    "slowdown" is the extra wall time of whole segments per save
  prune             deleting one old checkpoint (retention), relative to a save
  sharded (--sharded) the same state as a one-process FSDP run saves it: a DCP directory
                    (CheckpointManager.save: DCP's save through speedtronic's exclusive,
                    no-follow writer, state.pt, the manifest's SHA-256s, rename, pointer) vs
                    a raw dcp.save of the tensors (fsynced, no manifest); load (verify every
                    file's SHA-256 and the records, state.pt, then DCP's load through the
                    restricted reader and planner into the model and optimizer) vs a raw
                    dcp.load of the same directory
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from unittest import mock

import torch

from speedtronic import Trainer
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    CheckpointContext,
    FitContext,
    OptimizerStepContext,
    StepContext,
)
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.state import archive
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic_callbacks.checkpoint import CheckpointCallback


def make_trainer(
    callbacks: list[Callback] | None = None, device: str = "cpu", strategy: str = "ddp"
) -> Trainer:
    """The reference transformer after one AdamW step (so the moment buffers exist);
    ``strategy="fsdp"``: its state as sharded (DCP) checkpoints save it, in one process."""
    torch.manual_seed(0)
    model = ReferenceTransformer(
        vocab_size=8192, block_size=64, n_layer=8, n_head=8, d_model=512, d_ff=2048
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 8192, (1, 33))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "parallel.strategy fsdp on a single process")
        trainer = Trainer(
            model,
            optimizer,
            [batch],
            device=device,
            callbacks=callbacks or [],
            parallel={"strategy": strategy},
        )
    trainer.fit(1)
    return trainer


def state_bytes(state: object) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


Row = tuple[str, float, float, float, float, str]
"""case, median s, best s, paired-median ratio, best-of-N ratio, note (with the load average)."""


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f}"


def compare(name: str, ours: list[float], base: list[float], note: str) -> Row:
    """Throughput ratio base/ours per round (paired; rounds after the warm-up), its median,
    and the ratio of the best rounds."""
    ours, base = ours[1:], base[1:]
    paired = statistics.median(b / o for o, b in zip(ours, base, strict=True))
    return (name, statistics.median(ours), min(ours), paired, min(base) / min(ours), note)


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def raw_save(state: dict[str, object], path: Path, *, durable: bool) -> None:
    """The baseline: ``torch.save``; ``durable``: to a temporary file, fsynced, renamed onto
    ``path`` (what a user writes for a save that survives a crash)."""
    if not durable:
        torch.save(state, path)
        return
    temporary = path.with_name(f".{path.name}.tmp")
    torch.save(state, temporary)
    fd = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)


def save_torch_crc(manager: CheckpointManager, step: int, trainer: Trainer) -> None:
    """``manager.save`` as it runs where ``isal`` is missing: torch computes the CRC-32s."""
    with mock.patch.object(archive, "fast_crc32", lambda: False):
        manager.save(step, trainer.state_dict())


def run(directory: Path, repeats: int, device: str) -> list[Row]:
    trainer = make_trainer(device=device)
    state = trainer.state_dict()
    size_mb = state_bytes(state) / 2**20
    params = sum(p.numel() for p in trainer.model.parameters()) / 1e6
    print(f"model {params:.1f}M parameters on {device}, state {size_mb:.0f} MiB, {repeats} repeats")

    # Every case writes a new file into its own directory on the same filesystem, and old
    # files are deleted outside the timed region, so no case pays for freeing another's
    # blocks; pruning is timed on its own.
    manager = CheckpointManager(directory / "ours", keep_last=None)
    torch_crc_manager = CheckpointManager(directory / "ours_torch_crc", keep_last=None)
    raw_directory = directory / "raw"
    raw_directory.mkdir()
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # this process's CPU time: less moved by other jobs
    loads: list[float] = []  # the 1-minute load average at each round

    def record(name: str, action: Callable[[], object]) -> None:
        os.sync()  # start every case with no dirty pages left by the previous one
        started = time.process_time()
        times.setdefault(name, []).append(timed(action))
        cpu.setdefault(name, []).append(time.process_time() - started)

    def cpu_ratio(ours: str, base: str) -> str:
        pairs = zip(cpu[ours][1:], cpu[base][1:], strict=True)
        return f"CPU-time ratio {statistics.median(b / o for o, b in pairs):.2f} (paired)"

    def cases(step: int) -> list[tuple[str, Callable[[], object]]]:
        raw, raw_atomic = raw_directory / f"raw_{step}.pt", raw_directory / f"atomic_{step}.pt"
        return [
            ("save", lambda: manager.save(step, trainer.state_dict())),
            ("save_torch_crc", lambda: save_torch_crc(torch_crc_manager, step, trainer)),
            ("raw", lambda: raw_save(trainer.state_dict(), raw, durable=False)),
            ("raw_atomic", lambda: raw_save(trainer.state_dict(), raw_atomic, durable=True)),
            ("load", manager.load_latest_checkpoint),
            (
                "load_raw",
                lambda: torch.load(manager.path_for(step), map_location="cpu", weights_only=True),
            ),
        ]

    for rep in range(repeats + 1):  # the first round warms up and is dropped
        saves_then_loads = cases(rep + 1)
        shift = rep % 4  # rotate which case of each kind goes first
        saves, loads_ = saves_then_loads[:4], saves_then_loads[4:]
        saves = saves[shift:] + saves[:shift]
        loads_ = loads_[rep % 2 :] + loads_[: rep % 2]
        if rep:
            loads.append(os.getloadavg()[0])
        for name, action in saves + loads_:
            record(name, action)
        manager.keep_last = torch_crc_manager.keep_last = 1
        record("prune", manager.prune)
        torch_crc_manager.prune()
        manager.keep_last = torch_crc_manager.keep_last = None
        for leftover in raw_directory.glob("*.pt"):
            leftover.unlink()

    busy = f"{load_note()} (1 min: {min(loads):.1f}-{max(loads):.1f} over the rounds)"
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return [
        compare(
            "save vs torch.save + fsync + rename",
            times["save"],
            times["raw_atomic"],
            f"temp file + fsync + os.replace {med['raw_atomic']:.3f} s (best "
            f"{min(times['raw_atomic'][1:]):.3f}; same durability for the file); "
            f"{cpu_ratio('save', 'raw_atomic')}; {busy}",
        ),
        compare(
            "save with torch's CRC-32s vs torch.save + fsync + rename",
            times["save_torch_crc"],
            times["raw_atomic"],
            f"where isal is missing; {cpu_ratio('save_torch_crc', 'raw_atomic')}; {busy}",
        ),
        compare(
            "save vs torch.save (no fsync)",
            times["save"],
            times["raw"],
            f"raw {med['raw']:.3f} s (page cache only: the price of durability); {busy}",
        ),
        compare(
            "load vs torch.load",
            times["load"],
            times["load_raw"],
            f"torch.load(weights_only=True) {med['load_raw']:.3f} s; "
            f"{cpu_ratio('load', 'load_raw')}; {busy}",
        ),
        (
            "prune one old checkpoint",
            med["prune"],
            min(times["prune"][1:]),
            med["prune"] / med["save"],
            min(times["prune"][1:]) / min(times["save"][1:]),
            f"ratio = prune / save; {busy}",
        ),
    ]


def paired_saves(directory: Path, rounds: int, *, torch_crc: bool = False) -> list[Row]:
    """The save against its baseline alone, the two back to back in ABBA order (a drift of
    the machine's load within a round hits both alike): the robust form of the save row on
    a busy machine. ``torch_crc``: the save as it runs without isal."""
    trainer = make_trainer()
    manager = CheckpointManager(directory / "paired", keep_last=None)
    raw_directory = directory / "paired_raw"
    raw_directory.mkdir()
    times: dict[str, list[float]] = {"save": [], "raw_atomic": []}
    cpu: dict[str, list[float]] = {"save": [], "raw_atomic": []}
    loads: list[float] = []
    for rnd in range(rounds + 1):  # the first round warms up and is dropped
        step = rnd + 1
        arms: list[tuple[str, Callable[[], object]]] = [
            (
                "save",
                partial(save_torch_crc, manager, step, trainer)
                if torch_crc
                else partial(lambda s: manager.save(s, trainer.state_dict()), step),
            ),
            (
                "raw_atomic",
                partial(
                    lambda s: raw_save(
                        trainer.state_dict(), raw_directory / f"atomic_{s}.pt", durable=True
                    ),
                    step,
                ),
            ),
        ]
        loads.append(os.getloadavg()[0])
        for name, action in arms if rnd % 2 else arms[::-1]:
            os.sync()
            started = time.process_time()
            times[name].append(timed(action))
            cpu[name].append(time.process_time() - started)
        manager.keep_last = 1
        manager.prune()
        manager.keep_last = None
        for leftover in raw_directory.glob("*.pt"):
            leftover.unlink()
    pairs = zip(cpu["save"][1:], cpu["raw_atomic"][1:], strict=True)
    cpu_paired = statistics.median(b / o for o, b in pairs)
    return [
        compare(
            f"save{' with torch CRC-32s' if torch_crc else ''} vs torch.save + fsync + rename, "
            "ABBA pairs",
            times["save"],
            times["raw_atomic"],
            f"baseline median {statistics.median(times['raw_atomic'][1:]):.3f} s, best "
            f"{min(times['raw_atomic'][1:]):.3f} s; CPU-time ratio {cpu_paired:.2f} (paired); "
            f"load 1 min {min(loads[1:]):.1f}-{max(loads[1:]):.1f} over the rounds",
        )
    ]


_PHASES = (
    ("trainer.state_dict (both arms)", "training_state.py", "capture_training_state"),
    ("CheckpointManager.save", "checkpoint.py", "save"),
    ("  plain_state (weights-only check)", "safe_load.py", "plain_state"),
    ("  atomic_torch_save (file: all below)", "archive.py", "atomic_torch_save"),
    ("    torch.save (pickle, writes)", "serialization.py", "save"),
    ("      CRC-32 of every write (ISA-L)", "record_check.py", "crc32"),
    ("    store the CRC-32s in the archive", "record_crc.py", "store_crcs"),
    ("    SHA-256 of the record index", "archive.py", "archive_checksum"),
    ("  latest.json (read, write, fsyncs)", "pointer.py", "write_pointer"),
    ("  retention scan (prune)", "checkpoint.py", "prune"),
    ("fsync, all files and directories", "~", "<built-in method posix.fsync>"),
    ("  of which directories", "atomic_io.py", "fsync_directory"),
    ("rename", "~", "<built-in method posix.replace>"),
)


def profile(directory: Path, saves: int) -> None:
    """Where ``CheckpointManager.save`` spends its time: cProfile over ``saves`` saves (after
    a warm-up), each after an ``os.sync()``, printed per save as a markdown table."""
    import cProfile
    import pstats

    trainer = make_trainer()
    manager = CheckpointManager(directory / "profiled", keep_last=None)
    manager.save(0, trainer.state_dict())
    profiler = cProfile.Profile()
    for step in range(1, saves + 1):
        os.sync()
        profiler.enable()
        manager.save(step, trainer.state_dict())
        profiler.disable()
    stats: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # not in the stubs
    print(f"\nwhere a save goes ({saves} saves after a warm-up; {load_note()})\n")
    print("| phase | ms per save | calls per save |")
    print("|---|---|---|")
    for label, file_name, function in _PHASES:
        found = [
            (calls, cumulative)
            for (path, _, name), (_, calls, _, cumulative, _) in stats.items()
            if name == function and path.endswith(file_name)
        ]
        calls = sum(c for c, _ in found)
        seconds = sum(t for _, t in found)
        print(f"| {label} | {seconds / saves * 1e3:.1f} | {calls / saves:g} |")


def sharded(directory: Path, repeats: int) -> list[Row]:
    """Sharded (DCP) save and load of the state of a one-process FSDP run against raw
    ``dcp.save``/``dcp.load`` of the same tensors, interleaved, alternating the order."""
    import torch.distributed.checkpoint as dcp

    trainer = make_trainer(strategy="fsdp")
    manager = CheckpointManager(directory / "sharded", keep_last=1)
    times: dict[str, list[float]] = {}

    def record(name: str, action: Callable[[], object]) -> None:
        os.sync()
        times.setdefault(name, []).append(timed(action))

    def tensors() -> dict[str, object]:
        state = trainer.state_dict()
        return {"model": state["model"], "optimizer": state["optimizer"]}

    def load() -> None:
        loaded = manager.load_latest_checkpoint()
        assert loaded is not None
        trainer.load_state_dict(loaded.state)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process"
        for rep in range(repeats + 1):  # the first round warms up and is dropped
            raw = directory / f"raw_{rep}.dcp"
            cases: list[tuple[str, Callable[[], object]]] = [
                ("save", partial(lambda step: manager.save(step, trainer.state_dict()), rep + 1)),
                ("raw", partial(lambda path: dcp.save(tensors(), checkpoint_id=path), raw)),
                ("load", load),
                ("load_raw", partial(lambda path: dcp.load(tensors(), checkpoint_id=path), raw)),
            ]
            if rep % 2:
                cases = [cases[1], cases[0], cases[3], cases[2]]
            for name, action in cases:
                record(name, action)
            shutil.rmtree(raw)
    busy = load_note()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return [
        compare(
            "sharded save vs dcp.save",
            times["save"],
            times["raw"],
            f"raw {med['raw']:.3f} s (fsynced; no manifest checksums); {busy}",
        ),
        compare(
            "sharded load vs dcp.load",
            times["load"],
            times["load_raw"],
            f"raw {med['load_raw']:.3f} s (no verification); {busy}",
        ),
    ]


class SegmentClock(Callback):
    """Time from ``fit_start`` to the end of the last step: excludes ``fit_end``, where the
    checkpoint callback waits for the last async write (a once-per-fit cost, not a stall).
    ``steps``: each step's wall time, from the end of the one before (the first from
    ``fit_start``), so everything between two step ends counts for one of them."""

    def __init__(self) -> None:
        self.started = 0.0
        self.last_step_end = 0.0
        self.steps: list[float] = []

    def on_fit_start(self, trainer: Trainer, ctx: FitContext) -> None:
        self.started = self.last_step_end = time.perf_counter()
        self.steps = []

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        now = time.perf_counter()
        self.steps.append(now - self.last_step_end)
        self.last_step_end = now

    @property
    def seconds(self) -> float:
        return self.last_step_end - self.started


class TimedCheckpoint(CheckpointCallback):
    """The checkpoint callback, timing how long it blocks the training thread: the save
    (sync) or the snapshot (async) at ``checkpoint``, and the wait for the deferred copy at
    ``before_optimizer_step``."""

    blocked = 0.0

    def on_checkpoint(self, trainer: Trainer, ctx: CheckpointContext) -> None:
        start = time.perf_counter()
        super().on_checkpoint(trainer, ctx)
        self.blocked += time.perf_counter() - start

    def on_before_optimizer_step(self, trainer: Trainer, ctx: OptimizerStepContext) -> None:
        start = time.perf_counter()
        super().on_before_optimizer_step(trainer, ctx)
        self.blocked += time.perf_counter() - start


def stall(directory: Path, rounds: int, device: str, segment: int = 6, every: int = 3) -> list[Row]:
    """Async vs sync save on interleaved fit segments (a save every ``every`` steps):
    ``blocked`` is the time the checkpoint callback holds the training thread per save;
    ``save step + next step`` is the extra wall time of the step that saves and the step
    after it (where an async save's copy is waited for and its write competes with
    training), paired with the same steps of a run without checkpoints; ``slowdown`` is the
    extra wall time of the whole segment per save."""
    clocks: dict[str, SegmentClock] = {}
    timed_callbacks: dict[str, TimedCheckpoint] = {}
    trainers: dict[str, Trainer] = {}
    for mode in ("none", "sync", "async"):
        clocks[mode] = SegmentClock()
        callbacks: list[Callback] = [clocks[mode]]
        if mode != "none":
            timed_callbacks[mode] = TimedCheckpoint(
                directory / mode,
                every_steps=every,
                keep_last=1,
                save_final=False,
                save_on_signal=False,
                async_save=mode == "async",
            )
            callbacks.append(timed_callbacks[mode])
        trainers[mode] = make_trainer(callbacks, device)
    # make_trainer ran step 1, so a segment runs steps 2..segment+1: with segment a multiple
    # of every, no save falls on a segment's last step (its next step is in the segment).
    assert segment % every == 0 and all(t.step == 1 for t in trainers.values())
    saving = [index for index in range(segment) if (index + 2) % every == 0]
    seconds: dict[str, list[float]] = {mode: [] for mode in trainers}
    pairs: dict[str, list[list[float]]] = {mode: [] for mode in trainers}
    blocked: dict[str, list[float]] = {mode: [] for mode in timed_callbacks}
    saves = segment // every
    for rnd in range(rounds + 1):  # the first round warms up (buffers, page cache): dropped
        for mode in list(trainers) if rnd % 2 == 0 else list(trainers)[::-1]:
            os.sync()
            callback = timed_callbacks.get(mode)
            if callback is not None:
                callback.blocked = 0.0
            trainers[mode].fit(trainers[mode].step + segment)
            seconds[mode].append(clocks[mode].seconds)
            steps = clocks[mode].steps
            pairs[mode].append([steps[index] + steps[index + 1] for index in saving])
            if callback is not None:
                blocked[mode].append(callback.blocked / saves)
    busy = load_note()
    med = {mode: statistics.median(values[1:]) for mode, values in seconds.items()}
    held = {mode: statistics.median(values[1:]) for mode, values in blocked.items()}
    extra = {
        mode: [
            ours - none
            for rnd in range(1, rounds + 1)
            for ours, none in zip(pairs[mode][rnd], pairs["none"][rnd], strict=True)
        ]
        for mode in timed_callbacks
    }
    paired = statistics.median(a / s for a, s in zip(extra["async"], extra["sync"], strict=True))
    sync_extra = statistics.median(extra["sync"])
    sync_slowdown = (med["sync"] - med["none"]) / saves
    async_slowdown = max(0.0, med["async"] - med["none"]) / saves
    step = med["none"] / segment
    return [
        (
            "async vs sync: training thread blocked",
            held["async"],
            min(blocked["async"][1:]),
            held["async"] / held["sync"],
            min(blocked["async"][1:]) / held["sync"],
            f"sync save blocks {held['sync']:.3f} s (ratio = async / sync; lower is better); "
            f"{busy}",
        ),
        (
            "async vs sync: save step + next step",
            statistics.median(extra["async"]),
            min(extra["async"]),
            paired,
            min(extra["async"]) / sync_extra,
            f"sync adds {sync_extra:.3f} s to those two steps; a step takes {step:.3f} s "
            f"(ratio = async / sync, paired; lower is better); {busy}",
        ),
        (
            "async vs sync: wall-time slowdown per save",
            async_slowdown,
            async_slowdown,
            async_slowdown / sync_slowdown,
            async_slowdown / sync_slowdown,
            f"sync {sync_slowdown:.3f} s per save (whole segments, medians; ratio = async / "
            f"sync); {busy}",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where the model trains (cpu, cuda)")
    parser.add_argument("--sharded", action="store_true", help="add the sharded (DCP) rows")
    parser.add_argument("--no-async", action="store_true", help="leave out the async rows")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="profile N saves (then exit)"
    )
    parser.add_argument(
        "--paired-saves",
        action="store_true",
        help="only the save against its baseline, ABBA pairs of --repeats rounds",
    )
    parser.add_argument(
        "--torch-crc", action="store_true", help="--paired-saves: the save as without isal"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="speedtronic-ckpt-bench-", dir=args.dir))
    if args.profile:
        try:
            profile(base, args.profile)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    try:
        if args.paired_saves:
            rows = paired_saves(base, args.repeats, torch_crc=args.torch_crc)
            args.no_async = True
        else:
            rows = run(base, args.repeats, args.device)
        if not args.no_async:
            rows += stall(base, rounds=args.repeats, device=args.device)
        if args.sharded:
            rows += sharded(base, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    print("| case | median s | best s | ratio (paired median) | ratio (best) | baseline; load |")
    print("|---|---|---|---|---|---|")
    for name, seconds, best, ratio, best_ratio, note in rows:
        print(f"| {name} | {seconds:.3f} | {best:.3f} | {ratio:.2f} | {best_ratio:.2f} | {note} |")


if __name__ == "__main__":
    main()
