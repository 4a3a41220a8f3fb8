"""DiLoCo benchmark: bytes on the wire per optimizer step versus data-parallel training, and
the loss reached at an equal number of inner steps.

1. Bytes per optimizer step and worker.
   * Data parallel: two ``gloo`` processes on loopback train the reference transformer with
     ``DistributedDataParallel``; a communication hook counts the bytes handed to the
     gradient all-reduce each step. With two workers a ring all-reduce sends (and receives)
     exactly that payload per worker, 2 (N - 1) / N = 1 times.
   * DiLoCo: one master and two workers on a shared-directory hub, in one process
     (alternating ``Trainer.fit`` segments of ``H`` steps, the real ``diloco`` callback).
     What a worker sends is the size of the delta files it writes -- safetensors headers
     and metadata included -- over its optimizer steps; what it receives (global models) is
     reported too.
   Target: DiLoCo / data-parallel within 5 % of 1/H (fp32 deltas) and 1/(2H) (bf16).
2. Loss: the held-out loss of one node trained alone for S steps versus the global model
   of one master and two workers that each ran S steps on their own shard of the learnable
   synthetic language (``LearnableLanguageDataset``; its entropy floor is printed).
   Target: the three-node global model at least matches the single node.

    python benchmarks/diloco.py              # ~1-2 minutes on 2 CPU cores
    python benchmarks/diloco.py --quick      # a smoke run
    python benchmarks/diloco.py --check      # exit status 1 when a target is missed

Single-threaded (``torch.set_num_threads(1)``) so results are comparable across machines.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.queues
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset

from speedtronic import Trainer
from speedtronic.data import LearnableLanguageDataset
from speedtronic.model import ReferenceTransformer
from speedtronic_callbacks.diloco import DiLoCoCallback
from speedtronic_callbacks.diloco.model_layout import build_layout

VOCAB, BLOCK, BATCH = 64, 32, 16
TRAIN_SAMPLES, EVAL_START, EVAL_SAMPLES = 6000, 50_000, 256
DATA_SEED = 7


def make_model() -> ReferenceTransformer:
    torch.manual_seed(0)  # every node, and every run, starts from the same weights
    return ReferenceTransformer(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, d_model=64)


def language(num_samples: int) -> LearnableLanguageDataset:
    return LearnableLanguageDataset(
        num_samples=num_samples, block_size=BLOCK, vocab_size=VOCAB, seed=DATA_SEED
    )


def shard_loader(shard: int, shards: int) -> DataLoader[object]:
    """Node ``shard`` of ``shards`` sees every ``shards``-th training sample."""
    dataset = language(TRAIN_SAMPLES)
    return DataLoader(
        Subset(dataset, range(shard, TRAIN_SAMPLES, shards)),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(1000 + shard),
    )


def held_out_loss(model: torch.nn.Module) -> float:
    dataset = language(EVAL_START + EVAL_SAMPLES)
    loader = DataLoader(Subset(dataset, range(EVAL_START, EVAL_START + EVAL_SAMPLES)), 64)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for batch in loader:
            logits = model(input_ids=batch["input_ids"])["logits"]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += batch["labels"].numel()
    model.train()
    return total / count


def make_trainer(shard: int, shards: int, callbacks: list[DiLoCoCallback], out: Path) -> Trainer:
    model = make_model()
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0),
        shard_loader(shard, shards),
        callbacks=callbacks,
        output_dir=out,
        metrics_every=10_000,
    )


# -- data parallel: bytes handed to the gradient all-reduce ---------------------------------


def _ddp_worker(
    rank: int, port: int, steps: int, results: multiprocessing.queues.Queue[float]
) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = DistributedDataParallel(make_model())
    counted = [0]
    world = dist.group.WORLD
    assert world is not None  # set by init_process_group

    def counting_hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        counted[0] += buffer.numel() * buffer.element_size()
        return allreduce_hook(world, bucket)

    # DDP checks the hook's annotations by identity; postponed (string) annotations fail it.
    counting_hook.__annotations__.update(
        bucket=GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
    )
    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = iter(shard_loader(rank, 2))
    for _ in range(steps):
        batch = next(batches)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"])["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if rank == 0:
        results.put(counted[0] / steps)
    dist.destroy_process_group()


def ddp_bytes_per_step(steps: int = 4) -> float:
    """Bytes per optimizer step each of two DDP workers all-reduces (measured)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.queues.Queue[float] = context.Queue()
    workers = [
        context.Process(target=_ddp_worker, args=(rank, port, steps, results)) for rank in (0, 1)
    ]
    for worker in workers:
        worker.start()
    measured = results.get(timeout=120)
    for worker in workers:
        worker.join(timeout=60)
        if worker.exitcode != 0:
            raise RuntimeError(f"data-parallel worker exited with status {worker.exitcode}")
    return measured


# -- DiLoCo ----------------------------------------------------------------------------------


@dataclass
class DiLoCoRun:
    global_loss: float
    sent_per_step: float
    received_per_step: float
    outer_steps: int
    uploads: int
    seconds: float


def run_diloco(steps: int, inner_steps: int, compression: str, root: Path) -> DiLoCoRun:
    """One master and two workers, ``steps`` optimizer steps each, in H-step segments."""
    hub = root / f"hub-{compression}"
    names = ("master", "worker-1", "worker-2")
    callbacks = [
        DiLoCoCallback(
            role="master" if index == 0 else "worker",
            node_id=name,
            hub_dir=str(hub),
            inner_steps=inner_steps,
            compression=compression,
            poll_interval=0.001,
            retry_initial=0.01,
            retry_max=0.1,
            audit_log=False,
        )
        for index, name in enumerate(names)
    ]
    trainers = [
        make_trainer(index, 3, [callback], root / f"{name}-{compression}")
        for index, (name, callback) in enumerate(zip(names, callbacks, strict=True))
    ]
    started = time.perf_counter()
    for segment in range(1, steps // inner_steps + 1):
        for trainer in trainers:
            trainer.fit(segment * inner_steps)
    trainers[0].fit(steps + 1)  # one more master step: a last round for the final deltas
    seconds = time.perf_counter() - started
    master = callbacks[0].node
    assert master is not None and master.master is not None
    snapshot = master.master.snapshot()
    assert snapshot is not None
    model = make_model()
    layout = build_layout(model.state_dict())
    full = dict(snapshot.global_state)
    full.update({alias: full[source] for alias, source in layout.aliases.items()})
    model.load_state_dict(full)
    workers = [callback.node for callback in callbacks[1:]]
    sent = [node.transport.bytes_up / steps for node in workers if node is not None]
    received = [node.transport.bytes_down / steps for node in workers if node is not None]
    uploads = sum(node.stats.uploads for node in workers if node is not None)
    return DiLoCoRun(
        global_loss=held_out_loss(model),
        sent_per_step=sum(sent) / len(sent),
        received_per_step=sum(received) / len(received),
        outer_steps=master.master.outer_step,
        uploads=uploads,
        seconds=seconds,
    )


def run_single(steps: int, root: Path) -> tuple[float, float]:
    trainer = make_trainer(0, 1, [], root / "single")
    started = time.perf_counter()
    trainer.fit(steps)
    return held_out_loss(trainer.model), time.perf_counter() - started


# -- report ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240, help="inner steps per node")
    parser.add_argument("--inner-steps", type=int, default=20, help="H")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    steps, inner = (40, 10) if args.quick else (args.steps, args.inner_steps)
    if steps % inner:
        parser.error("--steps must be a multiple of --inner-steps")
    torch.set_num_threads(1)
    logging.getLogger("speedtronic.diloco").setLevel(logging.WARNING)

    layout = build_layout(make_model().state_dict())
    print(
        f"model: {layout.sync_numel:,} synchronised parameters "
        f"({len(layout.aliases)} tied weight sent once); H = {inner}; {steps} steps per node; "
        f"language entropy floor {language(TRAIN_SAMPLES).entropy_floor:.3f} nats\n"
    )
    ddp = ddp_bytes_per_step()
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as scratch:
        root = Path(scratch)
        single_loss, single_seconds = run_single(steps, root)
        runs = {name: run_diloco(steps, inner, name, root) for name in ("none", "bf16")}

    failures: list[str] = []
    print("| sync | bytes sent / step / worker | vs data parallel | target | received / step |")
    print("|---|---:|---:|---:|---:|")
    print(f"| data parallel (all-reduce, N=2) | {ddp:,.0f} | 1 | 1 | {ddp:,.0f} |")
    for name, factor in (("none", 1), ("bf16", 2)):
        run = runs[name]
        ratio = run.sent_per_step / ddp
        target = 1 / (factor * inner)
        label = "fp32" if name == "none" else name
        print(
            f"| DiLoCo {label} deltas, H={inner} | {run.sent_per_step:,.0f} | 1/{1 / ratio:.1f} "
            f"| 1/{factor * inner} | {run.received_per_step:,.0f} |"
        )
        if abs(ratio - target) > 0.05 * target:
            failures.append(f"{label} byte ratio {ratio:.5f} is not within 5% of {target:.5f}")

    print("\n| run | held-out loss | outer steps | deltas sent | wall s |")
    print("|---|---:|---:|---:|---:|")
    print(f"| 1 node, {steps} steps | {single_loss:.4f} | - | - | {single_seconds:.1f} |")
    for name, run in runs.items():
        label = "fp32" if name == "none" else name
        print(
            f"| 1 master + 2 workers, {steps} steps each, {label} | {run.global_loss:.4f} "
            f"| {run.outer_steps} | {run.uploads} | {run.seconds:.1f} |"
        )
    if runs["none"].global_loss > single_loss:
        failures.append(
            f"three-node loss {runs['none'].global_loss:.4f} is above the single node's "
            f"{single_loss:.4f}"
        )
    print()
    for failure in failures:
        print(f"MISSED: {failure}")
    if not failures:
        print("all targets met")
    return 1 if failures and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
