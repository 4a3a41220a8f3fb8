"""FSDP2 sharding (``parallel.strategy: fsdp``) and sharded (DCP) checkpoints that reshard.

One 2-rank gloo job (``test_two_ranks_*``) covers what needs real processes: FSDP gives DDP's
losses and clipped global grad norm, with and without accumulation; a sharded checkpoint
resumes exactly on the same ranks; a checkpoint written by one process resumes on two
(1 -> 2) and one written by two resumes on one process (2 -> 1, checked here, in the test
process); a checkpoint missing a rank's shard makes both ranks fall back together. Ranks are
forked from a ``forkserver`` that has already imported torch and speedtronic, so they cost
no ``import torch`` each. Everything else runs in this process.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import socket
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli as speedtronic
from planted_payloads import payload, plant_in_record
from torch import nn

from speedtronic import Trainer
from speedtronic.config import ConfigError, load_config
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.engine.trainer import TrainingStateError
from speedtronic.engine.view import TrainerView
from speedtronic.state.checkpoint import (
    POINTER_NAME,
    CheckpointError,
    CheckpointManager,
    UnsafeCheckpointError,
)
from speedtronic.state.resume import resume_from
from speedtronic.state.run_lock import check_earlier_run
from speedtronic.state.sharded_checkpoint import MANIFEST_NAME, STATE_NAME
from speedtronic.systems.sharding import ShardingError, find_shard_blocks
from speedtronic_callbacks.checkpoint import CheckpointCallback

torch.set_num_threads(1)

STEPS = 10


class BlockLM(nn.Module):
    """A tiny language model whose repeated layers sit in an ``nn.ModuleList``."""

    def __init__(self, vocab_out: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, vocab_out)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.emb(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return {"logits": self.head(hidden)}


class StepCounter(Callback):
    """A stateful callback: its state must survive a resume, resharded or not."""

    state_key = "counter"

    def __init__(self) -> None:
        self.count = 0

    def on_step_start(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.count += 1  # before the step's checkpoint event: saved with the step

    def state_dict(self) -> dict[str, object]:
        return {"count": self.count}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        count = state["count"]
        assert isinstance(count, int)
        self.count = count


class OwnReplicas(Callback):
    """Says every rank is its own model replica (as synchronous DiLoCo does)."""

    ranks_per_replica = 1


def batches(rank: int) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 16, (24, 2, 9), generator=torch.Generator().manual_seed(rank))
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def make_trainer(
    strategy: str,
    *,
    rank: int = 0,
    distributed: object = None,
    directory: Path | None = None,
    accumulation: int = 1,
    keep_last: int | None = None,
    vocab_out: int = 16,
    async_save: bool = False,
    reshard_after_forward: bool = True,
) -> Trainer:
    torch.manual_seed(rank)  # every rank its own init: DDP and FSDP start from rank 0's
    model = BlockLM(vocab_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    callbacks: list[Callback] = (
        [
            StepCounter(),
            CheckpointCallback(
                directory,
                every_steps=5,
                keep_last=keep_last,
                save_on_signal=False,
                async_save=async_save,
            ),
        ]
        if directory is not None
        else []
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "parallel.strategy fsdp on a single process")
        return Trainer(
            model,
            optimizer,
            batches(rank),
            device="cpu",
            distributed=distributed,  # type: ignore[arg-type]  # a DistributedContext
            parallel={"strategy": strategy, "reshard_after_forward": reshard_after_forward},
            callbacks=callbacks,
            accumulation_steps=accumulation,
            grad_clip=0.05,  # small: clipping is active on every step
            metrics_every=1,
        )


def losses(trainer: Trainer, steps: int) -> list[float]:
    return [float(record["loss"]) for record in trainer.fit(steps).metrics]


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Model weights and AdamW moments as whole tensors (gathered when sharded)."""
    from torch.distributed.tensor import DTensor

    def whole(value: torch.Tensor) -> torch.Tensor:
        return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()

    out = {f"w/{k}": whole(v) for k, v in trainer.model.state_dict().items()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for param, state in trainer.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{names[id(param)]}"] = whole(state[key])
    return out


def carried(trainer: Trainer) -> dict[str, object]:
    """What a resume carries besides the tensors: counters, data position, RNG, callbacks."""
    return {
        "step": trainer.step,
        "samples": trainer.samples,
        "data": dict(trainer.data_position()),
        "rng": torch.get_rng_state().tolist(),
        "callbacks": trainer.callback_states(),
    }


def resume(trainer: Trainer) -> Path | None:
    callback = trainer.callbacks[1]
    assert isinstance(callback, CheckpointCallback)
    return resume_from(trainer, callback.manager)


def assert_same(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


# -- the 2-rank job -----------------------------------------------------------------------


def rank_main(rank: int, port: int, out: str) -> None:
    """One rank: every multi-process scenario, results written to ``out``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from torch.distributed.tensor import DTensor

    from speedtronic.engine.contexts import FitContext
    from speedtronic.systems.distributed import setup_distributed, teardown_distributed
    from speedtronic_callbacks.console import describe_fit_start

    context = setup_distributed("cpu", timeout_s=60.0)
    assert context is not None
    root = Path(out)
    report: dict[str, object] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    try:
        # 1. FSDP vs DDP, same data, with and without accumulation (clipping on).
        reduce_scatter = torch.distributed.reduce_scatter_single
        calls = [0]

        def counted(*args: object, **kwargs: object) -> object:
            calls[0] += 1
            return reduce_scatter(*args, **kwargs)

        torch.distributed.reduce_scatter_single = counted
        for k in (1, 2):
            for strategy in ("ddp", "fsdp"):
                trainer = make_trainer(strategy, rank=rank, distributed=context, accumulation=k)
                calls[0] = 0
                result = trainer.fit(STEPS)
                report[f"{strategy}/k{k}/reduce_scatters"] = calls[0]
                report[f"{strategy}/k{k}/loss"] = [float(r["loss"]) for r in result.metrics]
                report[f"{strategy}/k{k}/grad_norm"] = [
                    float(r["grad_norm"]) for r in result.metrics
                ]
                if strategy == "fsdp":
                    report["start_line"] = describe_fit_start(trainer, FitContext(0, STEPS))
                    weight = trainer.model.get_parameter("blocks.0.0.weight")
                    report["sharded"] = isinstance(weight, DTensor) and (
                        weight.to_local().numel() < weight.numel()
                    )
        torch.distributed.reduce_scatter_single = reduce_scatter
        kept = make_trainer("fsdp", rank=rank, distributed=context, reshard_after_forward=False)
        report["fsdp/kept/loss"] = losses(kept, STEPS)
        # 2. Exact resume on the same ranks: 10 steps vs 5 + resume to 10.
        report["full"] = losses(make_trainer("fsdp", rank=rank, distributed=context), STEPS)
        part = root / "two_ranks"
        first = make_trainer("fsdp", rank=rank, distributed=context, directory=part)
        first.fit(5)
        tensors["at5"] = full_state(first)
        report["carried5"] = carried(first)
        second = make_trainer("fsdp", rank=rank, distributed=context, directory=part)
        report["resumed_from"] = str(resume(second))
        report["resumed"] = losses(second, STEPS)
        # 3. 1 -> 2: the test process wrote root/one_rank at step 5 on its own.
        grown = make_trainer("fsdp", rank=rank, distributed=context, directory=root / "one_rank")
        report["grown_from"] = str(resume(grown))
        report["grown_carried"] = carried(grown)
        tensors["grown"] = full_state(grown)
        report["grown_loss"] = losses(grown, 7)
        # 4. FSDP inside replicas of a ReplicaSync callback (synchronous DiLoCo) is refused.
        try:
            Trainer(
                BlockLM(),
                torch.optim.SGD(BlockLM().parameters()),
                [],
                device="cpu",
                distributed=context,
                parallel={"strategy": "fsdp"},
                callbacks=[OwnReplicas()],
            )
        except ShardingError as exc:
            report["replicas_refused"] = str(exc)
        # 5. A rank's shard missing from the newest checkpoint: both ranks fall back.
        if rank == 0:
            (part / "step_000000000010.dcp" / "__1_0.distcp").unlink()
        context.barrier()
        fallback = make_trainer("fsdp", rank=rank, distributed=context, directory=part)
        report["fallback_from"] = str(resume(fallback))
        report["fallback_step"] = fallback.step
        # 6. A pickle planted in a bytes record (refused by every rank's verification) or in
        #    a tensor record that only one rank reads (refused inside DCP's collective load),
        #    hashes rewritten: both ranks refuse the resume, the payload runs on neither.
        for record in ("optimizer.param_groups.0.lr", "model.head.weight"):
            planted = root / f"planted-{record}"
            if rank == 0:
                shutil.copytree(part, planted)  # its step 10 lost a shard: step 5 is next
                plant_in_record(planted / "step_000000000005.dcp", record, payload(root / "pwned"))
            context.barrier()
            trainer = make_trainer("fsdp", rank=rank, distributed=context, directory=planted)
            try:
                resume(trainer)
            except UnsafeCheckpointError as exc:
                report[f"refused/{record}"] = str(exc)
            report[f"ran/{record}"] = (root / "pwned").exists()
    finally:
        teardown_distributed(context)
    torch.save(tensors, root / f"rank{rank}.pt")
    (root / f"rank{rank}.json").write_text(json.dumps(report))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Run the 2-rank job once for the module's tests; yields its output directory."""
    out = tmp_path_factory.mktemp("fsdp")
    # 1 -> 2: a one-process FSDP run writes a sharded checkpoint at step 5 first.
    one = make_trainer("fsdp", directory=out / "one_rank")
    one.fit(5)
    torch.save(full_state(one), out / "one_rank_state.pt")
    (out / "one_rank_carried.json").write_text(json.dumps(carried(one)))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        [
            "torch",
            "torch._dynamo",
            "torch.distributed.fsdp",
            "speedtronic.engine.trainer",
            "speedtronic.state.dcp_io",
            "test_fsdp",
        ]
    )
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, port, str(out))) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in ranks] == [0, 0], "a rank failed (see its output above)"
    yield out


def reports(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def as_floats(value: object) -> list[float]:
    assert isinstance(value, list)
    return [float(v) for v in value]


def test_two_ranks_fsdp_trains_like_ddp_with_and_without_accumulation(two_ranks: Path) -> None:
    for report in reports(two_ranks):
        assert report["sharded"] is True  # each rank holds half of a block's weight
        assert "| world 2 (fsdp, gloo) |" in str(report["start_line"])
        for k in (1, 2):
            ddp, fsdp = as_floats(report[f"ddp/k{k}/loss"]), as_floats(report[f"fsdp/k{k}/loss"])
            assert len(ddp) == len(fsdp) == STEPS
            assert fsdp == pytest.approx(ddp, rel=1e-5)
            # Clipping sees the global norm of the sharded gradients, the same on every
            # rank and the same as DDP's (not this rank's shard alone).
            norms = as_floats(report[f"fsdp/k{k}/grad_norm"])
            assert norms == pytest.approx(as_floats(report[f"ddp/k{k}/grad_norm"]), rel=1e-5)
            assert all(n > 0.05 for n in norms)  # clipping was active
        # One reduce-scatter per FSDP unit (2 blocks and the root) per step, whatever K:
        # none on the non-final microbatches.
        assert report["fsdp/k1/reduce_scatters"] == report["fsdp/k2/reduce_scatters"] == 3 * STEPS
        # Keeping the gathered blocks after forward changes memory, not results.
        assert as_floats(report["fsdp/kept/loss"]) == pytest.approx(
            as_floats(report["ddp/k1/loss"]), rel=1e-5
        )
    first, second = reports(two_ranks)
    assert first["fsdp/k2/grad_norm"] == second["fsdp/k2/grad_norm"]


def test_two_ranks_sharded_checkpoint_resumes_exactly(two_ranks: Path) -> None:
    for report in reports(two_ranks):
        assert str(report["resumed_from"]).endswith("step_000000000005.dcp")
        assert as_floats(report["resumed"]) == as_floats(report["full"])[5:]  # bit for bit
    directory = two_ranks / "two_ranks"
    pointer = json.loads((directory / POINTER_NAME).read_text())
    assert pointer["file"] == "step_000000000010.dcp"
    assert sorted(pointer["checkpoints"]) == ["step_000000000005.dcp", "step_000000000010.dcp"]
    manifest = json.loads((directory / "step_000000000005.dcp" / MANIFEST_NAME).read_text())
    assert manifest["world_size"] == 2
    assert {"__0_0.distcp", ".metadata", STATE_NAME} <= set(manifest["files"])
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]


def test_one_process_checkpoint_resumes_on_two_ranks(two_ranks: Path) -> None:
    written = torch.load(two_ranks / "one_rank_state.pt", weights_only=True)
    grown = torch.load(two_ranks / "rank0.pt", weights_only=True)["grown"]
    assert_same(grown, written)  # 1 -> 2: the same weights and moments, now sharded
    written_carried = json.loads((two_ranks / "one_rank_carried.json").read_text())
    written_samples = written_carried.pop("samples")
    shares = []
    for report in reports(two_ranks):
        assert str(report["grown_from"]).endswith("step_000000000005.dcp")
        grown_carried = dict(report["grown_carried"])  # type: ignore[call-overload]  # JSON
        shares.append(grown_carried.pop("samples"))
        assert grown_carried == written_carried  # step, data, RNG, callbacks
        assert len(as_floats(report["grown_loss"])) == 2  # steps 6 and 7 on two ranks
    # The one process's samples are the run's total: the two ranks split it between them,
    # so the grown run's totals (the sum over ranks) continue from it.
    assert shares == [written_samples // 2, written_samples // 2]


def test_two_rank_checkpoint_resumes_on_one_process(two_ranks: Path) -> None:
    directory = two_ranks / "two_ranks_copy"
    shutil.copytree(two_ranks / "two_ranks", directory)
    trainer = make_trainer("fsdp", directory=directory)
    with pytest.warns(UserWarning) as caught:  # step 10 lost a rank's shard
        assert resume(trainer) == directory / "step_000000000005.dcp"
    assert "__1_0.distcp is missing" in str(caught[0].message)
    assert trainer.step == 5
    assert_same(full_state(trainer), torch.load(two_ranks / "rank0.pt")["at5"])
    saved = dict(reports(two_ranks)[0]["carried5"])  # type: ignore[call-overload]  # JSON
    now = carried(trainer)
    # One process now holds the whole run: both ranks' samples (rank 0's, as saved, twice).
    assert now.pop("samples") == 2 * saved.pop("samples")
    assert now == saved  # step, data position, RNG, callbacks as saved by rank 0
    with pytest.warns(UserWarning, match="already holds a checkpoint of step 10"):
        assert len(losses(trainer, 7)) == 2  # and it trains on


def test_two_ranks_fall_back_together_past_a_missing_shard(two_ranks: Path) -> None:
    for report in reports(two_ranks):
        assert str(report["fallback_from"]).endswith("step_000000000005.dcp")
        assert report["fallback_step"] == 5


def test_two_ranks_refuse_a_pickle_planted_in_a_shard_and_run_nothing(two_ranks: Path) -> None:
    for report in reports(two_ranks):
        for record in ("optimizer.param_groups.0.lr", "model.head.weight"):
            refused = str(report.get(f"refused/{record}"))
            assert f"(record '{record}'): it contains a pickled Python object (posix.system)" in (
                refused
            )
            assert f"planted-{record}/step_000000000005.dcp/__" in refused
            assert report[f"ran/{record}"] is False


def test_two_ranks_refuse_fsdp_inside_replicas(two_ranks: Path) -> None:
    for report in reports(two_ranks):
        assert "ranks_per_replica=1 of 2) is not supported" in str(report["replicas_refused"])


# -- one process --------------------------------------------------------------------------


def test_single_process_fsdp_runs_whole_with_a_note_and_resumes_exactly(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="one whole shard"):
        Trainer(
            BlockLM(),
            torch.optim.AdamW(BlockLM().parameters()),
            batches(0),
            device="cpu",
            parallel={"strategy": "fsdp"},
        )
    full = losses(make_trainer("fsdp"), STEPS)
    assert full == losses(make_trainer("ddp"), STEPS)  # one process: nothing is sharded
    make_trainer("fsdp", directory=tmp_path).fit(5)
    assert (tmp_path / "step_000000000005.dcp" / MANIFEST_NAME).is_file()
    again = make_trainer("fsdp", directory=tmp_path)
    assert resume(again) == tmp_path / "step_000000000005.dcp"
    assert losses(again, STEPS) == full[5:]


def test_sharded_checkpoints_follow_keep_last_and_fall_back_past_damage(tmp_path: Path) -> None:
    trainer = make_trainer("fsdp", directory=tmp_path, keep_last=2)
    trainer.fit(15)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [POINTER_NAME, "step_000000000010.dcp", "step_000000000015.dcp"]
    newest = tmp_path / "step_000000000015.dcp"
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    manager = CheckpointManager(tmp_path)
    with pytest.warns(UserWarning) as caught:
        loaded = manager.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 10
    assert "__0_0.distcp was truncated or changed" in str(caught[0].message)
    (tmp_path / "step_000000000010.dcp" / STATE_NAME).unlink()
    with pytest.warns(UserWarning) as caught:
        with pytest.raises(CheckpointError, match="all truncated or corrupt"):
            manager.load_latest_checkpoint()
    assert "state.pt is missing" in str(caught[-1].message)
    # A fresh run over them: --overwrite deletes the sharded directories too.
    earlier = CheckpointCallback(tmp_path).earlier_run_files()
    assert tmp_path / "step_000000000010.dcp" in earlier
    with pytest.warns(UserWarning, match="--overwrite: deleted"):
        check_earlier_run(earlier, resume=False, overwrite=True)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_sharded_save_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Something at the temp directory's name no longer fails a save (it takes another
    # name: test_checkpoint_security.py); a failing write does.
    in_the_way = tmp_path / f".step_000000000005.dcp.tmp-{os.getpid()}"
    in_the_way.write_text("in the way")
    trainer = make_trainer("fsdp", directory=tmp_path)

    def failing_save(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "the disk failed")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(
        CheckpointError,
        match=r"could not write sharded checkpoint .*step_0+5\.dcp: .*the disk failed",
    ):
        trainer.fit(5)
    assert not (tmp_path / POINTER_NAME).exists()
    assert sorted(tmp_path.iterdir()) == [in_the_way]  # no temp directory left either
    assert in_the_way.read_text() == "in the way"


def test_a_sharded_checkpoint_holds_no_pickled_objects(tmp_path: Path) -> None:
    make_trainer("fsdp", directory=tmp_path).fit(5)
    directory = tmp_path / "step_000000000005.dcp"
    metadata = directory / ".metadata"
    with open(metadata, "rb") as handle:  # a torch.save archive, not a bare pickle
        assert handle.read(2) == b"PK"
    # A tampered .metadata that pickles a callable is refused, never run -- also when the
    # attacker rewrote the manifest and the pointer to match.
    with open(metadata, "wb") as handle:
        torch.save({"run": os.system}, handle)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    import hashlib

    manifest["files"][".metadata"] = {
        "size": metadata.stat().st_size,
        "sha256": hashlib.sha256(metadata.read_bytes()).hexdigest(),
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    pointer = json.loads((tmp_path / POINTER_NAME).read_text())
    digest = hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest()
    pointer["checkpoints"][directory.name]["sha256"] = digest
    (tmp_path / POINTER_NAME).write_text(json.dumps(pointer))
    with pytest.raises(UnsafeCheckpointError, match="could run arbitrary code"):
        CheckpointManager(tmp_path).load_latest_checkpoint()


def test_resume_mismatches_are_clear_errors(tmp_path: Path) -> None:
    make_trainer("ddp", directory=tmp_path / "file").fit(5)
    with pytest.raises(TrainingStateError, match="resume it with parallel.strategy ddp"):
        resume(make_trainer("fsdp", directory=tmp_path / "file"))
    make_trainer("fsdp", directory=tmp_path / "dcp").fit(5)
    wider = make_trainer("fsdp", directory=tmp_path / "dcp", vocab_out=32)
    with pytest.raises(TrainingStateError, match=r"shape mismatch: head.weight: checkpoint"):
        resume(wider)
    # A run that does not shard resumes a sharded checkpoint too (its tensors are whole).
    plain = make_trainer("ddp", directory=tmp_path / "dcp")
    assert resume(plain) == tmp_path / "dcp" / "step_000000000005.dcp"


def test_async_save_is_refused_with_fsdp(tmp_path: Path) -> None:
    trainer = make_trainer("fsdp", directory=tmp_path, async_save=True)
    with pytest.raises(ValueError, match="async_save is not supported with parallel.strategy"):
        trainer.fit(1)


# -- the wrap policy and the config ---------------------------------------------------------


class Declared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def shard_blocks(self) -> list[nn.Module]:
        return [self.a]


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleDict({"h": nn.ModuleList([nn.ModuleList([nn.Linear(2, 2)])])})


def test_wrap_policy_uses_declared_blocks_else_the_outermost_module_lists() -> None:
    model = BlockLM()
    assert find_shard_blocks(model) == list(model.blocks)
    declared = Declared()
    assert find_shard_blocks(declared) == [declared.a]
    nested = Nested()
    assert find_shard_blocks(nested) == [nested.stack["h"][0]]  # type: ignore[index]
    with pytest.raises(ShardingError, match="has no shardable blocks"):
        find_shard_blocks(nn.Sequential(nn.Linear(2, 2)))
    stray = Declared()
    stray.shard_blocks = lambda: [nn.Linear(2, 2)]  # type: ignore[method-assign]
    with pytest.raises(ShardingError, match=r"item 0 is not a submodule"):
        find_shard_blocks(stray)
    with pytest.raises(ShardingError, match="has no shardable blocks"):
        Trainer(
            nn.Linear(2, 2),
            torch.optim.SGD(nn.Linear(2, 2).parameters()),
            [],
            device="cpu",
            parallel={"strategy": "fsdp"},
        )


def test_parallel_section_validates() -> None:
    assert load_config({}).parallel.strategy == "ddp"
    config = load_config({"parallel": {"strategy": "FSDP", "reshard_after_forward": False}})
    assert (config.parallel.strategy, config.parallel.reshard_after_forward) == ("fsdp", False)
    with pytest.raises(ConfigError) as bad:
        load_config({"parallel": {"strategy": "zero3", "wrap": 1}})
    assert bad.value.errors == [
        "parallel.strategy: 'zero3' is not one of ['ddp', 'fsdp']",
        "parallel.wrap: unknown key",
    ]
    with pytest.raises(ConfigError, match="'fsdp' cannot be combined with optimizer.name 'muon'"):
        load_config({"parallel": {"strategy": "fsdp"}, "optimizer": {"name": "muon"}})


FLAT_MODEL = (
    "from torch import nn\n"
    "from speedtronic import register_model\n"
    "@register_model('flat_for_fsdp')\n"
    "def flat(**kwargs):\n"
    "    return nn.Sequential(nn.Embedding(kwargs['vocab_size'], 8), nn.Linear(8, 8))\n"
)


def test_validate_reports_bad_parallel_settings_with_exit_2(tmp_path: Path) -> None:
    config = {
        "run": {"max_steps": 2, "output_dir": str(tmp_path / "o"), "device": "cpu"},
        "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "vocab_size": 32, "max_seq_len": 8},
        "parallel": {"strategy": "fsdp"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    good = speedtronic("validate", "--config", str(path), cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    assert "strategy: fsdp" in good.stdout
    path.write_text(yaml.safe_dump(dict(config, parallel={"strategy": "FSDP2"})))
    unknown = speedtronic("validate", "--config", str(path), cwd=tmp_path)
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "parallel.strategy: 'fsdp2' is not one of ['ddp', 'fsdp']" in unknown.stderr
    (tmp_path / "flat_models.py").write_text(FLAT_MODEL)
    flat = dict(config, imports=["flat_models"], model={"name": "flat_for_fsdp"})
    path.write_text(yaml.safe_dump(flat))
    for command in ("validate", "fit"):
        done = speedtronic(command, "--config", str(path), cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert "model Sequential has no shardable blocks" in done.stderr
