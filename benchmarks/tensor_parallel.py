"""FSDP x TP (data 2 x tensor 2) against FSDP x 4, on 4 CPU processes (gloo).

Two models, each its own row: ``small`` (3.7M parameters, sequences of 64: per-op overhead
and collective latency dominate) and ``large`` (d_model 512, sequences of 256, a global
batch of 2,048 tokens: the matrix products dominate). Every rank builds the reference
transformer through speedtronic's ``Trainer`` twice:
``parallel: {strategy: fsdp}`` (FSDP over 4 data ranks) and ``{strategy: fsdp, tensor: 2}``
(FSDP over 2 data ranks x tensor parallelism over 2), on the same global batch per step
(4 x ``MICRO`` sequences: FSDP x 4 reads ``MICRO`` per rank, FSDP x TP ``2 MICRO`` per data
rank). The two are timed in interleaved rounds of ``STEPS`` steps after a warm-up (a barrier
before and after each round, so a round is the slowest rank's time); tokens/s is the global
tokens of a round over its time. Reported: best-of-N and median, and the ratio. Because 4
ranks on a shared 2-core machine make wall time depend on the load, each round's CPU time
(``time.process_time``, summed over the ranks: work, not waiting) is reported too; on a
machine with a core per rank and no other load, tokens/s follows the wall figures, on an
oversubscribed one it follows the CPU figures (the "CPU-bound rate": FSDP x 4's CPU
seconds per step over FSDP x TP's).

Memory: the bytes of parameters each rank holds (``DTensor.to_local()``), at rest and the
largest block a rank gathers whole for its forward (FSDP's unit: what sits in memory besides
the shards), for FSDP x 4, FSDP x TP 2 x 2, and -- for "per-rank parameter memory at tensor
2" against no tensor parallelism at the same data degree -- FSDP x 2 (on 2 of the ranks'
layout: computed from the same model, half the shards).

Targets (issue 34): FSDP x TP tokens/s >= 0.8 x FSDP x 4; per-rank parameter memory at
tensor 2 <= 0.55 x without tensor parallelism.

    python benchmarks/tensor_parallel.py [--model small|large|both] [--rounds 5] [--steps 4]

``--steps`` applies to the small model; the large one runs ``max(1, steps // 2)`` per round.

CPU-bound and sensitive to load: the script prints the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for entry in (ROOT, ROOT / "callbacks"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

MODELS: dict[str, tuple[dict[str, int], int]] = {
    "small": ({"vocab_size": 2048, "block_size": 64, "n_layer": 4, "n_head": 8, "d_model": 256}, 2),
    "large": (
        {"vocab_size": 2048, "block_size": 256, "n_layer": 4, "n_head": 8, "d_model": 512},
        2,
    ),
}
"""name -> (reference transformer options, sequences per rank under FSDP x 4)."""
MODEL, MICRO = MODELS["small"]
WORLD = 4
WARMUP = 2


def batches(rows: int, data_rank: int, steps: int) -> list[dict[str, object]]:
    import torch

    shape = (steps, WORLD * MICRO, MODEL["block_size"] + 1)
    tokens = torch.randint(
        0, MODEL["vocab_size"], shape, generator=torch.Generator().manual_seed(0)
    )
    own = tokens[:, data_rank * rows : (data_rank + 1) * rows]
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in own]


def block_bytes(model: object, tensor: int) -> int:
    """Bytes of the largest block as a rank gathers it (1/tensor of its split weights)."""
    from torch.distributed.tensor import DTensor

    largest = 0
    for block in model.transformer["h"]:  # type: ignore[attr-defined]
        total = 0
        for param in block.parameters():
            assert isinstance(param, DTensor)
            split = any(p.is_shard() for p in param.placements[1:])  # the tensor dimension
            total += param.numel() * param.element_size() // (tensor if split else 1)
        largest = max(largest, total)
    return largest


def rank_main(rank: int, port: int, rounds: int, steps: int, out: str, model_name: str) -> None:
    global MODEL, MICRO  # noqa: PLW0603  # this rank process measures one model
    MODEL, MICRO = MODELS[model_name]
    from speedtronic.systems.distributed import TORCHRUN_VARIABLES

    values = (str(rank), str(WORLD), str(rank), "127.0.0.1", str(port))
    os.environ.update(zip(TORCHRUN_VARIABLES, values, strict=True))
    import logging

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from speedtronic import Trainer
    from speedtronic.models.transformer import ReferenceTransformer
    from speedtronic.systems.distributed import setup_distributed, teardown_distributed

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    context = setup_distributed("cpu", timeout_s=600.0)
    assert context is not None
    total = WARMUP + rounds * steps
    trainers = {}
    for name, tensor in (("fsdp x 4", 1), ("fsdp 2 x tp 2", 2)):
        torch.manual_seed(0)
        model = ReferenceTransformer(**MODEL)  # type: ignore[arg-type]
        data_ranks = WORLD // tensor
        rows = WORLD * MICRO // data_ranks
        trainers[name] = Trainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            batches(rows, rank // tensor, total),
            device="cpu",
            distributed=context,
            parallel={"strategy": "fsdp", "tensor": tensor},
            metrics_every=10**6,
        )
    report: dict[str, object] = {
        "whole": sum(p.numel() * 4 for p in ReferenceTransformer(**MODEL).parameters())
    }  # type: ignore[arg-type]
    for name, trainer in trainers.items():
        params = list(trainer.model.parameters())
        report[f"{name}/params"] = sum(
            p.to_local().numel() * p.element_size() for p in params if isinstance(p, DTensor)
        )
        report[f"{name}/block"] = block_bytes(trainer.model, 2 if "tp" in name else 1)
        trainer.fit(WARMUP)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    for index in range(rounds):
        for name, trainer in trainers.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.fit(WARMUP + (index + 1) * steps)
            cpu[name].append(time.process_time() - start_cpu)  # this rank's work, no waiting
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    every_rank: list[dict[str, list[float]] | None] = [None] * WORLD
    dist.all_gather_object(every_rank, cpu)
    report["times"] = times
    report["cpu"] = {  # per round, summed over the ranks
        name: [sum(r[name][i] for r in every_rank if r) for i in range(rounds)] for name in cpu
    }
    teardown_distributed(context)
    if rank == 0:
        Path(out).write_text(json.dumps(report))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    for name in MODELS if args.model == "both" else [args.model]:
        steps = args.steps if name == "small" else max(1, args.steps // 2)
        if measure(name, args.rounds, steps):
            return 1
        print()
    return 0


def measure(model_name: str, rounds: int, steps: int) -> int:
    """Run and print one model's rows; 1 when a rank failed."""
    global MODEL, MICRO  # noqa: PLW0603  # the tables below describe this model
    MODEL, MICRO = MODELS[model_name]
    load_before = os.getloadavg()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "torch.distributed.fsdp", "speedtronic.engine.trainer"]
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "report.json")
        port = free_port()
        ranks = [
            context.Process(target=rank_main, args=(r, port, rounds, steps, out, model_name))
            for r in range(WORLD)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(p.exitcode != 0 for p in ranks):
            print("a rank failed:", [p.exitcode for p in ranks], file=sys.stderr)
            return 1
        report = json.loads(Path(out).read_text())
    load_after = os.getloadavg()
    tokens = WORLD * MICRO * MODEL["block_size"] * steps  # global tokens per round
    rows = []
    rates: dict[str, tuple[float, float]] = {}
    for name, series in report["times"].items():
        best, median = tokens / min(series), tokens / statistics.median(series)
        rates[name] = (best, median)
    cpu = {name: statistics.median(series) / steps for name, series in report["cpu"].items()}
    fsdp, tp = rates["fsdp x 4"], rates["fsdp 2 x tp 2"]
    fsdp_cpu, tp_cpu = cpu["fsdp x 4"], cpu["fsdp 2 x tp 2"]
    rows.append(
        (
            "FSDP x 4",
            f"{fsdp[0]:,.0f}",
            f"{fsdp[1]:,.0f}",
            "1.00x",
            "1.00x",
            f"{fsdp_cpu:.3f}",
            "1.00x",
        )
    )
    rows.append(
        (
            "FSDP 2 x TP 2",
            f"{tp[0]:,.0f}",
            f"{tp[1]:,.0f}",
            f"{tp[0] / fsdp[0]:.2f}x",
            f"{tp[1] / fsdp[1]:.2f}x",
            f"{tp_cpu:.3f}",
            f"{fsdp_cpu / tp_cpu:.2f}x",
        )
    )
    whole = int(report["whole"])
    fsdp4, tp22 = int(report["fsdp x 4/params"]), int(report["fsdp 2 x tp 2/params"])
    fsdp2 = 2 * fsdp4  # FSDP over 2 data ranks holds twice FSDP x 4's shards
    block4, block22 = int(report["fsdp x 4/block"]), int(report["fsdp 2 x tp 2/block"])
    print(
        f"{model_name} model: reference transformer {MODEL}, {whole // 4:,} parameters; "
        f"global batch {WORLD * MICRO} x {MODEL['block_size']} tokens; {rounds} rounds x {steps} "
        f"steps; load average before {load_before[0]:.1f}, after {load_after[0]:.1f} "
        f"({os.cpu_count()} CPUs)"
    )
    print()
    print(
        "| layout (4 ranks) | tokens/s best | tokens/s median | vs FSDP x 4 best | median "
        "| CPU s per step (4 ranks, median) | CPU-bound rate vs FSDP x 4 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print("| per-rank parameter memory | bytes | ratio |")
    print("|---|---:|---:|")
    print(f"| whole model | {whole:,} | |")
    print(f"| FSDP x 2 (data 2, no TP), at rest | {fsdp2:,} | 1.00 |")
    print(f"| FSDP 2 x TP 2, at rest | {tp22:,} | {tp22 / fsdp2:.2f} |")
    print(f"| FSDP x 4, at rest | {fsdp4:,} | {fsdp4 / fsdp2:.2f} |")
    print(f"| FSDP x 4, largest block gathered whole | {block4:,} | 1.00 |")
    name = "FSDP 2 x TP 2, largest block gathered (1/2 of its split weights)"
    print(f"| {name} | {block22:,} | {block22 / block4:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
