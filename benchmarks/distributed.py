"""Scale-out benchmark: bytes all-reduced per optimizer step (DDP versus synchronous DiLoCo)
and the steps/s of 2-rank data-parallel training versus one process, on 2 gloo ranks.

1. Bytes per optimizer step and rank. Two ranks on loopback train the tiny reference
   transformer with speedtronic's ``Trainer``:
   * DDP: a DDP communication hook counts the bytes of every gradient bucket it
     all-reduces;
   * synchronous DiLoCo (``speedtronic_callbacks.diloco.collective``, H inner steps, fp32 or bf16 on
     the wire): the callback counts the bytes it hands to its one all-reduce per round.
   The trainer's own tiny collectives (the metric reduction and the stop agreement, on
   logging steps only: here every 50 steps) are counted separately by wrapping
   ``torch.distributed.all_reduce``. With 2 ranks a ring all-reduce sends (and receives)
   the payload once per rank (2 (N - 1) / N = 1), so payload bytes are wire bytes.
   Target: DiLoCo / DDP within 5 % of 1/H (fp32) and 1/(2H) (bf16).
2. Throughput: steps/s of 2-rank DDP versus 1 process with the same per-rank batch
   (weak scaling: the 2-rank run does twice the work per step), interleaved repetitions,
   medians. 2 cores limit the speedup; the samples/s ratio is what scaling buys.

    python benchmarks/distributed.py              # ~1 minute on 2 CPU cores
    python benchmarks/distributed.py --markdown   # tables for docs/scale-out.md
    python benchmarks/distributed.py --check      # exit status 1 when a bytes target is missed

Single-threaded ranks (``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.multiprocessing.spawn import start_processes
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speedtronic import Trainer  # noqa: E402
from speedtronic.data import LearnableLanguageDataset, ResumableSampler, collate_batch  # noqa: E402
from speedtronic.engine.callback import Callback  # noqa: E402
from speedtronic.engine.contexts import FitContext  # noqa: E402
from speedtronic.models.transformer import ReferenceTransformer  # noqa: E402
from speedtronic.systems.distributed import setup_distributed, teardown_distributed  # noqa: E402
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo  # noqa: E402

MICRO = 8
K = 2
BLOCK = 32
VOCAB = 128
LOG_EVERY = 50


@dataclass(frozen=True)
class Case:
    """One benchmark run: ``diloco_h`` None is DDP."""

    name: str
    world_size: int
    steps: int
    diloco_h: int | None = None
    compression: str = "none"
    warmup: int = 0


@dataclass(frozen=True)
class Outcome:
    payload_bytes: int
    other_bytes: int
    steps: int
    seconds: float
    parameters: int


class _CountDDPBuckets(Callback):
    """Registers a DDP comm hook that counts the gradient bytes it all-reduces."""

    def __init__(self) -> None:
        self.bytes = 0

    def on_setup(self, trainer: Trainer, ctx: FitContext) -> None:
        ddp = trainer.train_module
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ctx.start_step == 0:
            ddp.register_comm_hook(self, _counting_allreduce)


def _counting_allreduce(
    state: _CountDDPBuckets, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: world


# DDP checks the hook's annotations at run time; postponed (string) annotations fail it.
_counting_allreduce.__annotations__ = {
    "state": _CountDDPBuckets,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class _CountAllReduce:
    """Wraps ``torch.distributed.all_reduce`` to count every byte handed to it."""

    def __init__(self) -> None:
        self.bytes = 0
        self._original = dist.all_reduce

    def __enter__(self) -> _CountAllReduce:
        original = self._original

        def counted(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)  # type: ignore[arg-type]  # passthrough

        dist.all_reduce = counted  # benchmark instrumentation
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def _model() -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128
    )


def _loader(rank: int, world_size: int) -> DataLoader[object]:
    data = LearnableLanguageDataset(num_samples=4096, block_size=BLOCK, vocab_size=VOCAB, seed=1)
    sampler = ResumableSampler(len(data), shuffle=True, seed=1, rank=rank, world_size=world_size)
    return DataLoader(data, batch_size=MICRO, sampler=sampler, collate_fn=collate_batch)


def _run_rank(rank: int, case: Case, port: int, out: str) -> None:
    torch.set_num_threads(1)
    if case.world_size > 1:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(case.world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    context = setup_distributed("cpu", timeout_s=120.0)
    model = _model()
    ddp_counter = _CountDDPBuckets()
    callbacks: list[Callback] = [ddp_counter]
    diloco = None
    if case.diloco_h is not None:
        diloco = CollectiveDiLoCo(inner_steps=case.diloco_h, compression=case.compression)
        callbacks.append(diloco)
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        _loader(rank, case.world_size),
        callbacks=callbacks,
        distributed=context,
        accumulation_steps=K,
        metrics_every=LOG_EVERY,
    )
    if case.warmup:
        trainer.fit(case.warmup)
    payload_before = ddp_counter.bytes + (diloco.bytes_reduced if diloco else 0)
    with _CountAllReduce() as counter:
        started = time.perf_counter()
        trainer.fit(case.warmup + case.steps)
        seconds = time.perf_counter() - started
    payload = ddp_counter.bytes + (diloco.bytes_reduced if diloco else 0) - payload_before
    # Both payloads go through dist.all_reduce too; the rest is the trainer's own traffic.
    other = counter.bytes - payload
    if rank == 0:
        outcome = {
            "payload_bytes": payload,
            "other_bytes": other,
            "steps": case.steps,
            "seconds": seconds,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        Path(out).write_text(json.dumps(outcome), encoding="utf-8")
    teardown_distributed(context)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_case(case: Case) -> Outcome:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "outcome.json")
        start_processes(  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            _run_rank,
            args=(case, _free_port(), out),
            nprocs=case.world_size,
            join=True,
            start_method="spawn",
        )
        values = json.loads(Path(out).read_text(encoding="utf-8"))
    return Outcome(**values)


# -- reports ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BytesRow:
    name: str
    per_step: float
    other_per_step: float
    ratio: float
    target: float

    @property
    def error(self) -> float:
        return abs(self.ratio / self.target - 1.0)


def bytes_rows(horizons: Sequence[int]) -> list[BytesRow]:
    steps = 2 * max(horizons)
    ddp = run_case(Case("ddp", 2, steps))
    ddp_per_step = ddp.payload_bytes / ddp.steps
    rows = [BytesRow("DDP (fp32 gradients)", ddp_per_step, ddp.other_bytes / steps, 1.0, 1.0)]
    for horizon in horizons:
        for compression, factor in (("none", 1), ("bf16", 2)):
            outcome = run_case(Case("diloco", 2, steps, diloco_h=horizon, compression=compression))
            per_step = outcome.payload_bytes / outcome.steps
            wire = "fp32" if compression == "none" else compression
            rows.append(
                BytesRow(
                    f"DiLoCo H={horizon} {wire}",
                    per_step,
                    outcome.other_bytes / steps,
                    per_step / ddp_per_step,
                    1.0 / (horizon * factor),
                )
            )
    return rows


@dataclass(frozen=True)
class SpeedRow:
    name: str
    steps_per_sec: float
    samples_per_sec: float


def speed_rows(steps: int, repeats: int) -> list[SpeedRow]:
    timings: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats):
        for world in (1, 2):  # interleaved
            outcome = run_case(Case("speed", world, steps, warmup=10))
            timings[world].append(outcome.steps / outcome.seconds)
    rows = []
    for world, values in timings.items():
        rate = statistics.median(values)
        label = "1 process" if world == 1 else f"{world}-rank DDP (gloo)"
        rows.append(SpeedRow(label, rate, rate * world * MICRO * K))
    return rows


def render(
    rows: Sequence[BytesRow], speeds: Sequence[SpeedRow], markdown: bool, parameters: int
) -> str:
    lines: list[str] = []
    fmt: Callable[[Sequence[str]], str] = (
        (lambda cells: "| " + " | ".join(cells) + " |") if markdown else (lambda c: "  ".join(c))
    )
    lines.append(f"Bytes all-reduced per optimizer step and rank ({parameters:,} parameters):")
    lines.append("")
    lines.append(fmt(["case", "bytes/step", "vs DDP", "target", "off by", "trainer's own"]))
    if markdown:
        lines.append("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        lines.append(
            fmt(
                [
                    row.name,
                    f"{row.per_step:,.0f}",
                    f"1/{1 / row.ratio:,.1f}",
                    f"1/{1 / row.target:,.0f}",
                    f"{100 * row.error:.2f} %",
                    f"{row.other_per_step:,.1f}",
                ]
            )
        )
    lines.append("")
    lines.append("Throughput (same per-rank batch; medians of interleaved runs):")
    lines.append("")
    lines.append(fmt(["case", "steps/s", "samples/s", "samples/s vs 1 process"]))
    if markdown:
        lines.append("|---|---:|---:|---:|")
    base = speeds[0].samples_per_sec
    for speed in speeds:
        lines.append(
            fmt(
                [
                    speed.name,
                    f"{speed.steps_per_sec:.1f}",
                    f"{speed.samples_per_sec:,.0f}",
                    f"{speed.samples_per_sec / base:.2f}x",
                ]
            )
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--horizons", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--speed-steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = bytes_rows(args.horizons)
    speeds = speed_rows(args.speed_steps, args.repeats)
    parameters = sum(p.numel() for p in _model().parameters())
    print(render(rows, speeds, args.markdown, parameters))
    missed = [row.name for row in rows if row.error > 0.05]
    if missed:
        print(f"\nmissed the 5 % target: {', '.join(missed)}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
