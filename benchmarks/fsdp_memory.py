"""Memory benchmark: per-rank parameter + optimizer-state bytes, DDP versus FSDP, at 1, 2
and 4 ranks on CPU (gloo), and each rank's peak RSS.

Every rank builds the reference transformer through speedtronic's ``Trainer`` with
``parallel.strategy`` ddp or fsdp, trains 2 steps with AdamW (so the optimizer state
exists), then reports:

* ``params``: the bytes of the parameters this rank holds (under FSDP its shards:
  ``DTensor.to_local()``);
* ``optim``: the bytes of this rank's optimizer state (AdamW's two moments and step counts);
* ``state``: their sum, the number the target is about;
* ``peak RSS``: ``ru_maxrss`` of the rank's process (includes the ~0.4 GB every process pays
  for ``import torch``), and its growth from just before the model is built to the end of
  the fit: parameters, gradients, optimizer state, activations, DDP's gradient buckets,
  FSDP's gathered blocks.

Target (issue 13): FSDP state per rank <= 1.1 x (DDP state / N) + the largest unsharded
block (the largest FSDP unit's parameters, which a rank gathers whole for its forward).
At one rank FSDP is DDP (one shard, nothing to split).

    python benchmarks/fsdp_memory.py              # ~1-2 minutes on 2 CPU cores
    python benchmarks/fsdp_memory.py --markdown   # the table for docs/performance.md
    python benchmarks/fsdp_memory.py --check      # exit status 1 when the target is missed

Ranks are started from a forkserver that has imported torch and speedtronic already.
Single-threaded ranks (``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import socket
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for entry in (ROOT, ROOT / "callbacks"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

MODEL = {"vocab_size": 4096, "max_seq_len": 64, "n_layer": 8, "n_head": 4, "d_model": 256}
RANKS = (1, 2, 4)
STEPS = 2


def rank_main(rank: int, world: int, port: int, strategy: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from torch.distributed.tensor import DTensor

    from speedtronic import Trainer
    from speedtronic.config import ModelConfig
    from speedtronic.models.registry import build_model
    from speedtronic.systems.distributed import setup_distributed, teardown_distributed
    from speedtronic.systems.sharding import find_shard_blocks

    context = setup_distributed("cpu", timeout_s=120.0) if world > 1 else None
    # What every run pays once, not for its model: the lazy imports of the first optimizer
    # step (torch._dynamo) and of a first forward/backward.
    warm = torch.nn.Linear(2, 2)
    warm(torch.zeros(1, 2)).sum().backward()
    torch.optim.AdamW(warm.parameters()).step()
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(MODEL))
    largest_block = max(
        sum(p.numel() * p.element_size() for p in block.parameters())
        for block in find_shard_blocks(model)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, MODEL["vocab_size"], (STEPS, 4, MODEL["max_seq_len"] + 1))
    batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    trainer = Trainer(
        model,
        optimizer,
        batches,
        device="cpu",
        distributed=context,
        parallel={"strategy": strategy},
        metrics_every=STEPS,
    )
    trainer.fit(STEPS)

    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    params = sum(local_bytes(p) for p in trainer.model.parameters())
    optim = sum(local_bytes(t) for t in trainer.optimizer_state_tensors())
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    teardown_distributed(context)
    record = {
        "strategy": strategy,
        "world": world,
        "rank": rank,
        "params": params,
        "optim": optim,
        "largest_block": largest_block,
        "peak_rss": peak_kib * 1024,
        "rss_growth": (peak_kib - before_kib) * 1024,
    }
    Path(out, f"{strategy}-{world}-{rank}.json").write_text(json.dumps(record))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def measure() -> list[dict[str, int | str]]:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "torch.distributed.fsdp", "speedtronic.engine.trainer"]
    )
    records: list[dict[str, int | str]] = []
    with tempfile.TemporaryDirectory() as out:
        for world in RANKS:
            for strategy in ("ddp", "fsdp"):
                port = free_port()
                ranks = [
                    context.Process(target=rank_main, args=(r, world, port, strategy, out))
                    for r in range(world)
                ]
                for process in ranks:
                    process.start()
                for process in ranks:
                    process.join(timeout=600)
                if any(p.exitcode != 0 for p in ranks):
                    raise SystemExit(f"{strategy} at {world} ranks failed")
                for r in range(world):
                    records.append(
                        json.loads(Path(out, f"{strategy}-{world}-{r}.json").read_text())
                    )
    return records


def mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def table(records: list[dict[str, int | str]]) -> tuple[list[str], bool]:
    """Markdown rows (the per-rank maximum of each quantity) and whether the target holds."""
    rows = [
        "| ranks | strategy | params / rank | optimizer state / rank | state / rank "
        "| target | peak RSS / rank | its growth in the fit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    ddp_state: dict[int, int] = {}
    for world in RANKS:
        for strategy in ("ddp", "fsdp"):
            mine = [r for r in records if r["strategy"] == strategy and r["world"] == world]
            params = max(int(r["params"]) for r in mine)
            optim = max(int(r["optim"]) for r in mine)
            state = max(int(r["params"]) + int(r["optim"]) for r in mine)
            peak = max(int(r["peak_rss"]) for r in mine)
            growth = max(int(r["rss_growth"]) for r in mine)
            target = "-"
            if strategy == "ddp":
                ddp_state[world] = state
            else:
                bound = 1.1 * ddp_state[world] / world + int(mine[0]["largest_block"])
                met = state <= bound
                ok = ok and met
                target = f"≤ {mib(bound)} {'met' if met else 'MISSED'}"
            rows.append(
                f"| {world} | {strategy} | {mib(params)} | {mib(optim)} | {mib(state)} "
                f"| {target} | {mib(peak)} | {mib(growth)} |"
            )
    return rows, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the markdown table only")
    parser.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    args = parser.parse_args()
    records = measure()
    rows, ok = table(records)
    if not args.markdown:
        print(f"reference transformer {MODEL}, AdamW, {STEPS} steps, CPU/gloo")
    print("\n".join(rows))
    if not args.markdown:
        print("target met" if ok else "target MISSED")
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
