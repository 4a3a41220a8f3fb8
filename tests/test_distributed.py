"""Scale-out on torch.distributed, with real processes on gloo (CPU).

Multi-process tests start one process per rank running ``tests/distributed_worker.py`` with
the torchrun variables set (exactly what torchrun does) on a free localhost port; each rank
writes a JSON report (and tensors) that the test compares. The ranks are forked from a fork
server that already imported torch (``tests/forked.py``), so they start in milliseconds;
``test_torchrun_runs_the_cli_data_parallel`` starts the real ``torchrun`` and console entry
point once. The rest are in-process unit tests of the launch environment, the rank policy,
rank-sharded data and the config rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from distributed_worker import DDP_EVAL, base_config, run_rank
from forked import Forked
from rank_env import free_port as free_port  # re-exported: other tests import them here
from rank_env import rank_env as rank_env
from torch.utils.data import DataLoader, Dataset

from speedtronic.config import ConfigError, load_config
from speedtronic.config.validation import cross_field_errors
from speedtronic.data import BatchStream, ResumableSampler, TextFileTokenDataset
from speedtronic.data.stream import RankShardedIterable
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import FitContext
from speedtronic.engine.dispatch import CallbackPlan
from speedtronic.engine.events import Event
from speedtronic.engine.trainer import Trainer
from speedtronic.runtime import build_runtime
from speedtronic.systems.distributed import (
    DistributedSetupError,
    read_launch_environment,
    setup_distributed,
)
from speedtronic_callbacks.checkpoint import CheckpointCallback
from speedtronic_callbacks.console import ConsoleCallback
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo
from speedtronic_callbacks.diloco.encoding import Encoding, packed_bytes
from speedtronic_callbacks.jsonl import JsonlCallback
from speedtronic_callbacks.progress import ProgressBarCallback

ROOT = Path(__file__).resolve().parents[1]


# -- launching ranks ------------------------------------------------------------------------


@dataclass
class RankOutcome:
    returncode: int
    output: str
    report: dict[str, object]


def launch(
    forked: Forked,
    scenario: str,
    out: Path,
    params: Mapping[str, object] | None = None,
    *,
    world: int = 2,
    timeout: float = 90.0,
    wait_for: Sequence[int] | None = None,
) -> list[RankOutcome]:
    """Run ``scenario`` on ``world`` ranks, each a process of its own (forked from the
    preloaded fork server, so none pays ``import torch``). With ``wait_for``, only those
    ranks are awaited and the others are killed afterwards (a rank that hangs on purpose)."""
    port = free_port()
    children = [
        forked.start(
            run_rank, scenario, str(out), json.dumps(params or {}), env=rank_env(rank, world, port)
        )
        for rank in range(world)
    ]
    awaited = set(range(world) if wait_for is None else wait_for)
    try:
        for rank in sorted(awaited):
            children[rank].wait(timeout=timeout)
    finally:
        for child in children:
            child.kill()  # only those still running
    outcomes = []
    for rank, child in enumerate(children):
        path = out / f"rank{rank}.json"
        report = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        assert child.returncode is not None
        outcomes.append(RankOutcome(child.returncode, child.output, report))
    return outcomes


def succeeded(outcomes: Sequence[RankOutcome]) -> list[dict[str, object]]:
    for rank, outcome in enumerate(outcomes):
        assert outcome.returncode == 0, f"rank {rank} failed:\n{outcome.output[-4000:]}"
    return [outcome.report for outcome in outcomes]


def tensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    loaded: dict[str, dict[str, torch.Tensor]] = torch.load(path, weights_only=True)
    return loaded


def assert_same_weights(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def curve(report: Mapping[str, object], key: str) -> dict[int, float]:
    values = report[key]
    assert isinstance(values, dict)
    return {int(step): float(loss) for step, loss in values.items()}


# -- the launch environment ---------------------------------------------------------------


def test_launch_environment_absent_complete_and_half_set() -> None:
    assert read_launch_environment({}) is None
    full = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    launch_env = read_launch_environment(full)
    assert launch_env is not None
    assert (launch_env.rank, launch_env.world_size, launch_env.local_rank) == (1, 4, 1)
    assert (launch_env.local_world_size, launch_env.master_port) == (2, 29500)

    with pytest.raises(DistributedSetupError) as half_set:
        read_launch_environment({"RANK": "0", "WORLD_SIZE": "2"})
    message = str(half_set.value)
    assert "RANK, WORLD_SIZE set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing" in message
    assert "torchrun" in message
    with pytest.raises(DistributedSetupError, match=r"\$RANK=4 is not below \$WORLD_SIZE=4"):
        read_launch_environment({**full, "RANK": "4"})
    with pytest.raises(DistributedSetupError, match=r"\$MASTER_PORT='http' is not an integer"):
        read_launch_environment({**full, "MASTER_PORT": "http"})
    # setup_distributed reports the same problem before touching torch.distributed
    with pytest.raises(DistributedSetupError, match="MASTER_PORT missing"):
        setup_distributed(
            "cpu", timeout_s=5, environ={key: full[key] for key in full if key != "MASTER_PORT"}
        )
    assert setup_distributed("cpu", timeout_s=5, environ={}) is None


# -- rank policy ----------------------------------------------------------------------------


class _Everywhere(Callback):
    def on_setup(self, trainer: Trainer, ctx: FitContext) -> None:
        pass


class _OncePerNode(_Everywhere):
    rank_policy = "local_main"


def _setup_names(plan: CallbackPlan) -> list[str]:
    return [cb.display_name for cb in plan._order[Event.SETUP]]


def test_rank_policy_places_sinks_on_rank_zero(tmp_path: Path) -> None:
    callbacks: list[Callback] = [
        ConsoleCallback(),
        JsonlCallback(tmp_path / "m.jsonl"),
        ProgressBarCallback(),
        CheckpointCallback(tmp_path / "ckpt"),
        _Everywhere(),
        _OncePerNode(),
    ]
    assert [cb.rank_policy for cb in callbacks[:4]] == ["main", "main", "main", "all"]
    everything = _setup_names(CallbackPlan(callbacks))
    assert everything == _setup_names(CallbackPlan(callbacks, rank=0, local_rank=0))
    node_main = _setup_names(CallbackPlan(callbacks, rank=2, local_rank=0))
    other = _setup_names(CallbackPlan(callbacks, rank=3, local_rank=1))
    assert "console" in everything and "jsonl" in everything
    assert node_main == ["checkpoint", "_Everywhere", "_OncePerNode"]
    assert other == ["checkpoint", "_Everywhere"]
    assert not CallbackPlan(callbacks, rank=1, local_rank=1).listens(Event.METRICS)


# -- rank-sharded data ----------------------------------------------------------------------


def test_sharded_sampler_covers_the_epoch_once_in_step_and_matches_one_big_batch() -> None:
    shards = [ResumableSampler(10, shuffle=True, seed=3, rank=r, world_size=2) for r in (0, 1)]
    orders = [list(sampler) for sampler in shards]
    assert len(orders[0]) == len(orders[1]) == 5
    assert sorted(orders[0] + orders[1]) == list(range(10))
    whole = ResumableSampler(10, shuffle=True, seed=3).global_order()
    # micro-batch j of every rank together = micro-batch j of one process, twice as large
    for j in range(2):
        together = orders[0][2 * j : 2 * j + 2] + orders[1][2 * j : 2 * j + 2]
        assert sorted(together) == sorted(whole[4 * j : 4 * j + 4])
    uneven = [ResumableSampler(7, shuffle=False, seed=0, rank=r, world_size=3) for r in range(3)]
    assert [list(s) for s in uneven] == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]  # wrapped padding
    shards[1].set_epoch(1)
    epoch1 = list(shards[1])
    assert epoch1 != orders[1] and list(shards[1]) == epoch1  # deterministic per epoch
    saved = ResumableSampler(10, shuffle=True, seed=3, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="world_size=2 but this sampler has 1"):
        ResumableSampler(5, shuffle=True, seed=3).load_state_dict(saved)


class _Numbers(Dataset[int]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index


def test_sharded_loader_resumes_at_the_exact_sample_of_its_shard() -> None:
    def stream(rank: int) -> BatchStream[torch.Tensor]:
        sampler = ResumableSampler(12, shuffle=True, seed=5, rank=rank, world_size=2)
        return BatchStream(DataLoader(_Numbers(), batch_size=2, sampler=sampler))

    uninterrupted = stream(1)
    batches = [next(uninterrupted).tolist() for _ in range(5)]
    first = stream(1)
    for _ in range(2):
        next(first)
    state = first.state_dict()
    assert state == {"epoch": 0, "batches_in_epoch": 2, "shards": 2, "samples": 8}
    resumed = stream(1)
    resumed.load_state_dict(state)
    assert [next(resumed).tolist() for _ in range(3)] == batches[2:]
    with pytest.warns(UserWarning, match="saved with the data split into 2 rank shard"):
        BatchStream(DataLoader(_Numbers(), batch_size=2)).load_state_dict(state)


def test_iterable_data_is_sharded_by_rank_and_worker(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(str(i) for i in range(200)), encoding="utf-8")  # unique blocks
    dataset = TextFileTokenDataset(text, block_size=7)
    blocks = [tuple(item["input_ids"].tolist()) for item in dataset]
    assert len(blocks) > 20 and len(set(blocks)) == len(blocks)
    per_rank = []
    for rank in (0, 1):
        shard = RankShardedIterable(dataset, rank=rank, world_size=2)
        loader = DataLoader(shard, batch_size=None, num_workers=2)
        per_rank.append([tuple(item["input_ids"].tolist()) for item in loader])
    assert len(per_rank[0]) == len(per_rank[1])  # ranks stay in step
    seen = per_rank[0] + per_rank[1]
    assert len(set(seen)) == len(seen)  # nothing twice
    assert len(blocks) - len(seen) <= 2 * (2 - 1)  # at most one short round per worker


# -- data-parallel training ---------------------------------------------------------------


def test_two_rank_ddp_matches_one_process_and_resumes_exactly(
    tmp_path: Path, forked: Forked
) -> None:
    reports = succeeded(launch(forked, "ddp", tmp_path / "ddp"))
    weights = [tensors(tmp_path / "ddp" / f"rank{r}.pt") for r in (0, 1)]
    assert_same_weights(weights[0]["full"], weights[1]["full"])
    assert reports[0]["full"] == reports[1]["full"]
    full = curve(reports[0], "full")
    assert sorted(full) == list(range(1, 9))
    # exact resume: steps 5..8 after a restart from the step-4 checkpoint, bit for bit
    assert curve(reports[0], "resumed") == {step: full[step] for step in range(5, 9)}
    assert_same_weights(weights[0]["full"], weights[0]["resumed"])
    # one writer: a single metrics file line per step, checkpoints from rank 0
    lines = (tmp_path / "ddp" / "full" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 9))
    assert (tmp_path / "ddp" / "full" / "checkpoints" / "latest.json").is_file()

    # the same global batch (2 ranks x 2 x K=2) in one process: 4 x K=2
    single = base_config(
        tmp_path / "single",
        data={"micro_batch_size": 4, "target_batch_size": 8},
        checkpoint={"enabled": False},
        eval=DDP_EVAL,
    )
    trainer, _ = build_runtime(single)
    result = trainer.fit()
    single_curve = {int(r["step"]): float(r["loss"]) for r in result.metrics}
    assert single_curve == pytest.approx(full, rel=1e-5)
    # Evaluation: each rank evaluated half the held-out set (in batches of 2, the single
    # process in batches of 4); the token-weighted all-reduce gives the one-process value.
    # Resumed, the eval/loss values are those of the uninterrupted run, bit for bit.
    single_eval = {
        str(r["step"]): float(r["eval/loss"]) for r in result.metrics if "eval/loss" in r
    }
    assert sorted(single_eval, key=int) == ["3", "6", "8"]
    assert reports[0]["full_eval"] == reports[1]["full_eval"]
    assert reports[0]["full_eval"] == pytest.approx(single_eval, rel=1e-5)
    assert reports[0]["resumed_eval"] == {
        step: reports[0]["full_eval"][step] for step in ("6", "8")
    }
    assert reports[0]["final_loss"] == pytest.approx(result.final_loss, rel=1e-5)
    assert (reports[0]["samples"], reports[0]["tokens"]) == (result.samples, result.tokens)
    for key, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, weights[0]["full"][key], rtol=1e-4, atol=1e-5)


# -- synchronous DiLoCo -------------------------------------------------------------------


def test_synchronous_diloco_h1_equals_data_parallel_sgd(tmp_path: Path, forked: Forked) -> None:
    reports = succeeded(launch(forked, "diloco_equivalence", tmp_path, {"steps": 5}))
    report = reports[0]
    assert report["ddp_wrapped"] is True and report["diloco_wrapped"] is False
    assert report["outer_steps"] == 5
    assert curve(report, "diloco") == pytest.approx(curve(report, "ddp"), rel=1e-6)
    weights = [tensors(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert_same_weights(weights[0]["diloco"], weights[1]["diloco"])
    for key, value in weights[0]["ddp"].items():
        torch.testing.assert_close(weights[0]["diloco"][key], value, rtol=1e-5, atol=1e-6)
    # bf16 wire: 2 rounds (H=2, 4 steps) x every parameter x 2 bytes
    synced = report["synced_numel"]
    assert isinstance(synced, int)
    assert report["bf16_bytes"] == 2 * synced * 2
    # fp4 wire: 2 rounds x (codes: 2 values a byte + a float32 scale per 64 values); every
    # rank decodes the same gathered codes, so the replicas hold the same global model.
    assert report["fp4_outer_steps"] == 2
    assert report["fp4_bytes"] == 2 * packed_bytes(Encoding.FP4, synced)
    assert_same_weights(weights[0]["fp4"], weights[1]["fp4"])


def test_replicas_of_two_ranks_run_ddp_inside_and_diloco_across(
    tmp_path: Path, forked: Forked
) -> None:
    """4 ranks = 2 replicas x 2 ranks: DDP within a replica, one all-reduce across the
    replicas per round; with H=1, lr 1, momentum 0 this is 4-rank data-parallel SGD."""
    params = {"steps": 3, "ranks_per_replica": 2}
    reports = succeeded(launch(forked, "diloco_equivalence", tmp_path, params, world=4))
    report = reports[0]
    assert report["ddp_wrapped"] is True and report["diloco_wrapped"] is True
    assert curve(report, "diloco") == pytest.approx(curve(report, "ddp"), rel=1e-6)
    weights = [tensors(tmp_path / f"rank{r}.pt") for r in range(4)]
    for other in weights[1:]:
        assert_same_weights(weights[0]["diloco"], other["diloco"])
    for key, value in weights[0]["ddp"].items():
        torch.testing.assert_close(weights[0]["diloco"][key], value, rtol=1e-5, atol=1e-6)
    synced = report["synced_numel"]
    assert isinstance(synced, int)
    assert report["bf16_bytes"] == 2 * synced * 2  # the whole model, with its peer replica


def test_synchronous_diloco_h4_trains_and_resumes_exactly(tmp_path: Path, forked: Forked) -> None:
    steps = 24
    reports = succeeded(launch(forked, "diloco_resume", tmp_path, {"steps": steps}))
    full = curve(reports[0], "full")
    assert reports[0]["outer_steps"] == steps // 4
    assert curve(reports[1], "full") == full  # the loss is reduced over ranks
    first, last = [full[s] for s in range(1, 5)], [full[s] for s in range(steps - 3, steps + 1)]
    assert sum(last) / 4 < sum(first) / 4 - 0.2
    assert curve(reports[0], "resumed") == {s: full[s] for s in range(steps - 3, steps + 1)}
    weights = [tensors(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert_same_weights(weights[0]["full"], weights[1]["full"])  # in step after a round
    assert_same_weights(weights[0]["full"], weights[0]["resumed"])
    mid_round = reports[0]["warnings"]
    assert isinstance(mid_round, list) and len(mid_round) == 1
    assert "not the end of an outer round" in mid_round[0]
    # Evaluations right after an outer round measure the global model: each rank its share,
    # reduced over the ranks into diloco/eval_global/loss -- the same on both ranks, a
    # weighted mean of the two shares' losses, and resumed bit for bit.
    global_eval = reports[0]["global_eval"]
    assert isinstance(global_eval, dict)
    assert sorted(global_eval, key=int) == [str(s) for s in range(4, steps + 1, 4)]
    assert reports[1]["global_eval"] == global_eval
    local = [reports[r]["local_eval"] for r in (0, 1)]
    for step, value in global_eval.items():
        shares = [float(losses[step]) for losses in local]  # type: ignore[index]  # JSON
        assert min(shares) - 1e-9 <= value <= max(shares) + 1e-9
    assert reports[0]["resumed_global_eval"] == {
        str(s): global_eval[str(s)] for s in range(steps - 3, steps + 1) if s % 4 == 0
    }


# -- failures ---------------------------------------------------------------------------------


def test_a_killed_rank_ends_the_run_with_an_error(tmp_path: Path, forked: Forked) -> None:
    started = time.monotonic()
    outcomes = launch(forked, "failure", tmp_path, {"how": "die", "timeout_s": 20}, timeout=60)
    assert outcomes[1].returncode == 17
    assert outcomes[0].returncode == 1, outcomes[0].output[-3000:]
    error = outcomes[0].report["error"]
    assert isinstance(error, str) and error.startswith("CollectiveError: rank 0/2")
    assert "a peer rank crashed, was killed, or did not answer" in error
    assert time.monotonic() - started < 45


def test_a_hung_rank_times_out_instead_of_hanging(tmp_path: Path, forked: Forked) -> None:
    outcomes = launch(
        forked, "failure", tmp_path, {"how": "hang", "timeout_s": 3}, timeout=60, wait_for=[0]
    )
    assert outcomes[0].returncode == 1, outcomes[0].output[-3000:]
    error = outcomes[0].report["error"]
    assert isinstance(error, str) and "distributed.timeout_s=3 s" in error
    seconds = outcomes[0].report["seconds"]
    assert isinstance(seconds, float) and seconds < 25


# -- torchrun ---------------------------------------------------------------------------------


def test_torchrun_runs_the_cli_data_parallel(tmp_path: Path) -> None:
    config = base_config(tmp_path / "run", run={"max_steps": 4}, checkpoint={"every_steps": 2})
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    # The checkout's own code, both packages (not whatever an editable install points at).
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "callbacks")])
    )
    completed = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "speedtronic",
            "fit",
            "--config",
            str(config_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    pointer = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == 4


# -- config ---------------------------------------------------------------------------------


def test_config_checks_that_the_distributed_timeouts_fit_together() -> None:
    entry = {"name": "diloco", "mode": "collective", "sync_timeout_s": 10}
    short = cross_field_errors({"distributed": {"timeout_s": 60}, "callbacks": [entry]})
    assert short == [
        "callbacks[0].sync_timeout_s: 10 s is shorter than distributed.timeout_s (60 s); an "
        "outer round all-reduces the whole model and waits for the slowest replica, so give "
        "it at least the per-step collective timeout"
    ]
    # the default collective timeout (1800 s) counts too
    assert cross_field_errors({"callbacks": [entry]})[0].startswith(
        "callbacks[0].sync_timeout_s: 10 s is shorter than distributed.timeout_s (1800 s)"
    )
    assert (
        cross_field_errors(
            {"distributed": {"timeout_s": 60}, "callbacks": [{**entry, "sync_timeout_s": 600}]}
        )
        == []
    )
    assert cross_field_errors({"callbacks": [{**entry, "sync_timeout_s": None}]}) == []
    with pytest.raises(ConfigError, match="distributed.timeout_s: 0 is less than or equal"):
        load_config({"distributed": {"timeout_s": 0}})


def test_collective_diloco_options_are_validated() -> None:
    # The options are checked by their JSON Schema (the one config validation uses).
    with pytest.raises(ValueError, match="inner_steps: 0 is less than the minimum of 1"):
        CollectiveDiLoCo(inner_steps=0)
    with pytest.raises(ValueError, match="unknown option"):
        CollectiveDiLoCo(hub_dir="/tmp/x")
    with pytest.raises(ValueError, match="ranks_per_replica=2 needs a distributed run"):
        callback = CollectiveDiLoCo(ranks_per_replica=2)
        callback._replica_groups(None)
