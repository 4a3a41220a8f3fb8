"""The ``ema`` callback over FSDP-sharded parameters, in one 2-rank gloo job.

Each rank's shadow is a ``DTensor`` holding its shard only; evaluating it swaps it into the
sharded parameters' own storage (so the gathered forward sees it: ``eval/ema/loss`` equals
DDP's); the sharded checkpoint stores the shards through DCP (``callback_shards``), and a run
interrupted and resumed on the same two ranks ends with the same losses and the same
average, bit for bit, as one that was not. The checkpoint also reshards: one written by one
process resumes on two, and the two ranks' checkpoint resumes in one process and exports
(``published_weights``) whole.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from forked import Forked
from test_fsdp import BlockLM, batches, free_port

from speedtronic import Trainer
from speedtronic.engine.callback import Callback
from speedtronic.state.callback_shards import CALLBACK_SHARD_PATHS
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.published_weights import published_weights
from speedtronic.state.resume import resume_from
from speedtronic_callbacks.checkpoint import CheckpointCallback
from speedtronic_callbacks.ema import EMA, EMA_EVAL_LOSS

torch.set_num_threads(1)

STEPS = 6


def held_out(rank: int) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 16, (2, 2, 9), generator=torch.Generator().manual_seed(100 + rank))
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def ema_trainer(
    strategy: str, rank: int = 0, distributed: object = None, directory: Path | None = None
) -> tuple[Trainer, EMA]:
    torch.manual_seed(rank)
    model = BlockLM()
    ema = EMA(0.7)
    callbacks: list[Callback] = [ema]
    if directory is not None:
        callbacks.append(
            CheckpointCallback(
                directory, every_steps=3, keep_last=None, save_on_signal=False, save_final=False
            )
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "parallel.strategy fsdp on a single process")
        trainer = Trainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            batches(rank),
            device="cpu",
            distributed=distributed,  # type: ignore[arg-type]  # a DistributedContext
            parallel={"strategy": strategy},
            callbacks=callbacks,
            metrics_every=1,
            eval_data=held_out(rank),
            eval_every=3,
        )
    return trainer, ema


def whole_shadow(ema: EMA) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for name, t in ema.shadow.items()
    }


def record_keys(records: list[dict[str, object]], key: str) -> list[float]:
    return [float(str(r[key])) for r in records if key in r]


def rank_main(out: str) -> int:
    """One rank of the job: FSDP and DDP with EMA, an interrupted FSDP run, a grown one."""
    from torch.distributed.tensor import DTensor

    from speedtronic.systems.distributed import setup_distributed, teardown_distributed

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    context = setup_distributed("cpu", timeout_s=60.0)
    assert context is not None
    root = Path(out)
    report: dict[str, object] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for strategy in ("fsdp", "ddp"):
            trainer, ema = ema_trainer(strategy, rank, context)
            records = trainer.fit(STEPS).metrics
            report[f"{strategy}/loss"] = record_keys(records, "loss")
            report[f"{strategy}/eval"] = record_keys(records, "eval/loss")
            report[f"{strategy}/eval_ema"] = record_keys(records, EMA_EVAL_LOSS)
            tensors[strategy] = whole_shadow(ema)
            if strategy == "fsdp":
                shadow = ema.shadow["blocks.0.0.weight"]
                report["sharded"] = isinstance(shadow, DTensor) and (
                    shadow.to_local().numel() < shadow.numel()
                )
        first, _ = ema_trainer("fsdp", rank, context, root / "two")
        first.fit(4)  # checkpoints at step 3
        second, resumed_ema = ema_trainer("fsdp", rank, context, root / "two")
        report["resumed_from"] = str(resume_from(second, CheckpointManager(root / "two")))
        report["resumed/loss"] = record_keys(second.fit(STEPS).metrics, "loss")
        tensors["resumed"] = whole_shadow(resumed_ema)
        grown, grown_ema = ema_trainer("fsdp", rank, context, root / "one")
        report["grown_from"] = str(resume_from(grown, CheckpointManager(root / "one")))
        grown.fit(3)  # nothing to train: setup takes the loaded shadow and shards it
        tensors["grown"] = whole_shadow(grown_ema)
        report["grown_sharded"] = isinstance(grown_ema.shadow["head.weight"], DTensor)
    finally:
        teardown_distributed(context)
    torch.save(tensors, root / f"rank{rank}.pt")
    (root / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_sharded_shadow_evaluates_resumes_and_reshards_exactly(
    forked: Forked, tmp_path: Path
) -> None:
    # 1 -> 2: one process writes a sharded checkpoint at step 3 (its shadow whole, state.pt).
    one, one_ema = ema_trainer("fsdp", directory=tmp_path / "one")
    one.fit(3)
    written = whole_shadow(one_ema)
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    children = [
        forked.start(
            rank_main,
            str(tmp_path),
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"},
        )
        for r in range(2)
    ]
    for child in children:
        assert child.wait(timeout=180) == 0, child.output[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    shadows = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for report, shadow in zip(reports, shadows, strict=True):
        assert report["sharded"] is True  # each rank keeps half of a block's average
        # Swapping the average in for its evaluation leaves FSDP training as DDP's (no
        # gathered copy of the average outlives the evaluation).
        assert report["fsdp/loss"] == pytest.approx(report["ddp/loss"], rel=1e-5)
        # The average is swapped into the sharded storage: the gathered forward sees it.
        assert report["fsdp/eval_ema"] != report["fsdp/eval"]
        assert torch.tensor(report["fsdp/eval_ema"]).allclose(
            torch.tensor(report["ddp/eval_ema"]), rtol=1e-5, atol=0
        )
        for name, tensor in shadow["fsdp"].items():
            assert torch.allclose(tensor, shadow["ddp"][name], rtol=1e-4, atol=1e-6), name
        # Interrupted at step 4, resumed from step 3 on the same ranks: bit for bit.
        assert report["resumed_from"].endswith("step_000000000003.dcp")
        assert report["resumed/loss"] == report["fsdp/loss"][3:]
        assert_bitwise(shadow["resumed"], shadow["fsdp"])
        # 1 -> 2: the one process's average, now sharded over two ranks.
        assert report["grown_from"].endswith("step_000000000003.dcp")
        assert report["grown_sharded"] is True
        assert_bitwise(shadow["grown"], written)
    assert_bitwise(shadows[0]["fsdp"], shadows[1]["fsdp"])
    # 2 -> 1: the two ranks' step-6 checkpoint resumes in one process, and exports whole.
    directory = tmp_path / "two"
    latest = CheckpointManager(directory, enabled=False).load_latest_checkpoint()
    assert latest is not None and latest.path.name == "step_000000000006.dcp"
    # Rank 0's state.pt holds no shard of the average: DCP holds every rank's.
    assert latest.state["callbacks"]["ema"]["weights"] == {}  # type: ignore[index]  # plain data
    assert ["ema", "weights", "head.weight"] in latest.state[CALLBACK_SHARD_PATHS]  # type: ignore[operator]  # a list
    assert_bitwise(published_weights(latest, "ema"), shadows[0]["fsdp"])
    alone, alone_ema = ema_trainer("fsdp", directory=directory)
    assert resume_from(alone, CheckpointManager(directory)) == latest.path
    alone.fit(STEPS)  # setup takes the loaded (whole) shadow
    assert_bitwise(whole_shadow(alone_ema), shadows[0]["fsdp"])
