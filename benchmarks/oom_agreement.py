"""What ``data.micro_batch_size: auto`` costs a step of 2 DDP ranks when nothing runs out of
memory: the ranks' agreement after the last microbatch's forward (one MIN all-reduce of a
one-element int64 tensor, read on the host; ``speedtronic.engine.oom_agreement``).

1. The agreement alone: ``StepAgreement.agree`` called ``--calls`` times on both ranks
   (wall and CPU time per call, rank 0).
2. A training step: the reference transformer (2 layers, d_model 64, 8 samples x 32 tokens
   a rank, no accumulation) on 2 gloo ranks with ``Trainer``, an integer micro-batch versus
   ``auto``; each step's wall time from ``step_end`` to ``step_end`` (both cases carry the
   same timing callback), medians over the steps after the first 10, cases interleaved.

    python benchmarks/oom_agreement.py               # ~1 minute on 2 CPU cores
    python benchmarks/oom_agreement.py --steps 300 --repeats 3

Single-threaded ranks (``torch.set_num_threads(1)``). Report the load average with the
figures: the machine these run on is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.multiprocessing.spawn import start_processes
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from distributed import _free_port as free_port  # noqa: E402  # the scale-out benchmark's

from speedtronic import Trainer  # noqa: E402
from speedtronic.data import LearnableLanguageDataset, ResumableSampler, collate_batch  # noqa: E402
from speedtronic.engine.callback import Callback  # noqa: E402
from speedtronic.engine.contexts import StepContext  # noqa: E402
from speedtronic.engine.oom_agreement import step_agreement  # noqa: E402
from speedtronic.engine.view import TrainerView  # noqa: E402
from speedtronic.models.transformer import ReferenceTransformer  # noqa: E402
from speedtronic.systems.distributed import (  # noqa: E402
    DistributedContext,
    setup_distributed,
    teardown_distributed,
)

MICRO = 8
BLOCK = 32
VOCAB = 128
SKIP = 10


class _StepClock(Callback):
    """The wall time between consecutive ``step_end`` events."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.ends.append(time.perf_counter())


def _trainer(
    rank: int, auto: bool, clock: _StepClock, context: DistributedContext, out: Path
) -> Trainer:
    torch.manual_seed(0)
    model = ReferenceTransformer(
        vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128
    )
    data = LearnableLanguageDataset(num_samples=1 << 16, block_size=BLOCK, vocab_size=VOCAB, seed=1)
    sampler = ResumableSampler(len(data), shuffle=True, seed=1, rank=rank, world_size=2)
    loader = DataLoader(data, batch_size=MICRO, sampler=sampler, collate_fn=collate_batch)
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        loader,
        callbacks=[clock],
        distributed=context,
        metrics_every=1000,
        output_dir=out,
    )
    trainer.settings = dataclasses.replace(trainer.settings, auto_micro_batch=auto)
    return trainer


def _run_rank(rank: int, port: int, steps: int, repeats: int, calls: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    context = setup_distributed("cpu", timeout_s=120.0)
    assert context is not None  # RANK and WORLD_SIZE are set
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    agreement = step_agreement(ddp, torch.device("cpu"))
    agreement.agree(1)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        agreement.agree(8)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    step_s: dict[str, list[float]] = {"integer": [], "auto": []}
    for _ in range(repeats):
        for name in ("integer", "auto"):
            clock = _StepClock()
            with tempfile.TemporaryDirectory() as tmp:
                _trainer(rank, name == "auto", clock, context, Path(tmp)).fit(steps)
            ends = clock.ends[SKIP:]
            step_s[name].extend(b - a for a, b in zip(ends, ends[1:], strict=False))
    if rank == 0:
        result = {
            "agree_wall_us": wall / calls * 1e6,
            "agree_cpu_us": cpu / calls * 1e6,
            "step_ms": {name: statistics.median(v) * 1e3 for name, v in step_s.items()},
        }
        Path(out).write_text(json.dumps(result), encoding="utf-8")
    teardown_distributed(context)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        start_processes(  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            _run_rank,
            args=(free_port(), args.steps, args.repeats, args.calls, out),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        result = json.loads(Path(out).read_text(encoding="utf-8"))
    step = result["step_ms"]
    extra = step["auto"] - step["integer"]
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(
        f"agreement alone: {result['agree_wall_us']:.1f} us wall, "
        f"{result['agree_cpu_us']:.1f} us CPU per call"
    )
    print(
        f"2-rank step (median): integer {step['integer']:.3f} ms, auto {step['auto']:.3f} ms "
        f"({extra:+.3f} ms, {extra / step['integer']:+.1%})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
