"""``data.micro_batch_size: auto``: on out-of-memory the micro-batch halves and the
accumulation doubles, over the same samples, so the weights after training equal those of a
run configured with the final layout from the start.

The OOM comes from a forward pre-hook (``tests/oom_worker.py``). The comparison is bitwise:
the recovered step runs the same microbatches, in the same order, with the same loss divisors
as the directly configured run (the failed attempt is dropped before it changes anything but
the gradients, which are set to None), and the model has no dropout whose masks the failed
attempt would have drawn. Ranks are real gloo processes forked from the fork server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from elastic_worker import elastic_config
from forked import Child, Forked, cli_main
from oom_worker import oom_rank
from rank_env import free_port, rank_env
from sequential_shards import write_sequential_shards

from speedtronic.engine.batch_layout import LAYOUT_KEY

NO_RANK = {key: None for key in rank_env(0, 1, 0)}


def config(root: Path, tag: str, micro: int | str, target: int, steps: int) -> dict[str, object]:
    data = {"tokens": str(write_sequential_shards(root / "shards", [(0, 129), (1000, 129)]))}
    out = root / tag
    cfg = elastic_config(out, data, micro=2, target=target, steps=steps)
    cfg["data"]["micro_batch_size"] = micro  # type: ignore[index]  # a dict
    return cfg


def start(
    forked: Forked,
    root: Path,
    tag: str,
    cfg: dict[str, object],
    world: int,
    *,
    limit: int = 1 << 20,
    failing: int = -1,
    after: int = 0,
    resume: bool = False,
    backward: bool = False,
    middle: bool = False,
) -> list[Child]:
    """``world`` ranks of ``oom_worker.oom_rank`` started (one process without a rank)."""
    port = free_port()
    envs = [rank_env(rank, world, port) for rank in range(world)] if world > 1 else [NO_RANK]
    return [
        forked.start(
            oom_rank,
            str(root),
            tag,
            json.dumps(cfg),
            resume,
            limit,
            failing,
            after,
            backward,
            middle,
            env=env,
        )
        for env in envs
    ]


def start_cli(forked: Forked, root: Path, path: Path) -> list[Child]:
    """``speedtronic fit --config path`` on 2 ranks."""
    port = free_port()
    return [
        forked.start(
            cli_main, "fit", "--config", str(path), env=rank_env(rank, 2, port), cwd=str(root)
        )
        for rank in range(2)
    ]


def run(
    forked: Forked,
    root: Path,
    tag: str,
    cfg: dict[str, object],
    world: int,
    *,
    limit: int = 1 << 20,
    failing: int = -1,
    after: int = 0,
    resume: bool = False,
    middle: bool = False,
) -> list[dict[str, object]]:
    """Each rank's report (``oom_worker.oom_rank``), with its console output as ``output``."""
    children = start(
        forked,
        root,
        tag,
        cfg,
        world,
        limit=limit,
        failing=failing,
        after=after,
        resume=resume,
        middle=middle,
    )
    reports = []
    for rank, child in enumerate(children):
        assert child.wait(timeout=120) == 0, f"rank {rank}:\n{child.output[-3000:]}"
        reports.append({**torch.load(root / f"{tag}-rank{rank}.pt"), "output": child.output})
    return reports


def last_training_state(output_dir: Path) -> Path:
    """The latest step's checkpoint file under a run's output directory."""
    return max(output_dir.rglob("step_*.pt"))


def assert_same_weights(a: dict[str, object], b: dict[str, object]) -> None:
    wa, wb = a["weights"], b["weights"]
    assert isinstance(wa, dict) and isinstance(wb, dict) and wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_an_oom_halves_the_micro_batch_and_keeps_the_weights_bitwise(
    forked: Forked, tmp_path: Path
) -> None:
    direct = run(forked, tmp_path, "direct", config(tmp_path, "direct", 2, 8, 4), 1)
    auto = run(forked, tmp_path, "auto", config(tmp_path, "auto", "auto", 8, 4), 1, limit=2)
    assert auto[0]["raised"] == [8, 4]  # 8 -> 4 -> 2, at the first step only
    assert auto[0]["layout"] == [2, 4] == direct[0]["layout"]
    assert_same_weights(auto[0], direct[0])


def test_an_oom_mid_run_repeats_the_step_over_the_same_samples(
    forked: Forked, tmp_path: Path
) -> None:
    """Steps 1-2 fit at 8, step 3 runs out of memory: from then on 4 x 2, through the end of
    the epoch (8 steps) and into the next. Against a run at 4 x 2 throughout the weights agree
    to float tolerance, not bitwise: steps 1-2 summed one microbatch of 8 there and two of 4
    here (the same samples, the additions in another order)."""
    direct = run(forked, tmp_path, "direct", config(tmp_path, "direct", 4, 8, 10), 1)
    auto = run(
        forked, tmp_path, "auto", config(tmp_path, "auto", "auto", 8, 10), 1, limit=4, after=2
    )
    assert auto[0]["raised"] == [8] and auto[0]["layout"] == [4, 2] == direct[0]["layout"]
    wa, wd = auto[0]["weights"], direct[0]["weights"]
    assert isinstance(wa, dict) and isinstance(wd, dict)
    for key in wa:
        torch.testing.assert_close(wa[key], wd[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_without_an_oom_auto_trains_bitwise_as_the_integer_size(
    forked: Forked, tmp_path: Path, world: int
) -> None:
    """On 2 ranks every forward of ``auto`` runs under ``no_sync`` and the agreement arms
    DDP's reducer for the last backward: the same all-reduce, the same weights."""
    direct = run(forked, tmp_path, "direct", config(tmp_path, "direct", 8, 8, 3), world)
    auto = run(forked, tmp_path, "auto", config(tmp_path, "auto", "auto", 8, 3), world)
    for rank in range(world):
        assert auto[rank]["raised"] == [] and auto[rank]["layout"] == [8, 1]
        assert_same_weights(auto[rank], direct[rank])


def test_one_rank_out_of_memory_all_ranks_agree_and_keep_the_weights_bitwise(
    forked: Forked, tmp_path: Path
) -> None:
    direct = run(forked, tmp_path, "direct", config(tmp_path, "direct", 2, 4, 3), 2)
    auto = run(
        forked, tmp_path, "auto", config(tmp_path, "auto", "auto", 4, 3), 2, limit=2, failing=0
    )
    assert auto[0]["raised"] == [4] and auto[1]["raised"] == []
    for rank in (0, 1):
        assert auto[rank]["layout"] == [2, 2] == direct[rank]["layout"]
        assert_same_weights(auto[rank], direct[rank])


def test_one_rank_out_of_memory_mid_run_every_rank_shrinks_and_the_weights_agree(
    forked: Forked, tmp_path: Path
) -> None:
    """2 gloo ranks, 4 samples each a step. Rank 0 runs out of memory at step 3 (its forward
    calls: the first step's probe, steps 1-2, then step 3's); rank 1 is already past its
    last forward, waiting in the agreement. Both drop the step and run it again at 2 x 2
    through the end. Against a run at 2 x 2 from the start the weights agree to float
    tolerance (steps 1-2 summed one microbatch of 4 here, two of 2 there); the two ranks'
    weights are bitwise the same (DDP's all-reduce ran once per step, on both)."""
    direct = run(forked, tmp_path, "direct", config(tmp_path, "direct", 2, 4, 8), 2)
    auto = run(
        forked,
        tmp_path,
        "auto",
        config(tmp_path, "auto", "auto", 4, 8),
        2,
        limit=2,
        failing=0,
        after=3,
    )
    assert auto[0]["raised"] == [4] and auto[1]["raised"] == []
    for rank in (0, 1):
        assert auto[rank]["layout"] == [2, 2] == direct[rank]["layout"]
        wa, wd = auto[rank]["weights"], direct[rank]["weights"]
        assert isinstance(wa, dict) and isinstance(wd, dict)
        for key in wa:
            torch.testing.assert_close(wa[key], wd[key], rtol=1e-5, atol=1e-6)
    assert_same_weights(auto[0], auto[1])
    assert "micro-batch 4 -> 2, accumulation 1 -> 2" in str(auto[0]["output"])
    assert "another rank ran out of memory" in str(auto[1]["output"])
    # Every checkpoint from step 3 on records the agreed layout; a resume starts with it.
    state = torch.load(last_training_state(tmp_path / "auto"), weights_only=True)
    assert state[LAYOUT_KEY] == {"micro": 2, "accumulation": 2, "ranks": 2}
    resumed = run(forked, tmp_path, "auto", config(tmp_path, "auto", "auto", 4, 10), 2, resume=True)
    assert [report["layout"] for report in resumed] == [[2, 2], [2, 2]]


def test_an_oom_in_an_earlier_microbatch_waits_for_the_other_rank_in_the_agreement(
    forked: Forked, tmp_path: Path
) -> None:
    """Rank 0 runs out of memory at step 5 with 8 samples, then again in the first of the
    repeated step's two microbatches of 4 (under ``no_sync``, while rank 1 runs on to its last
    forward); both end at 2 x 4 with the weights of a run at 2 x 4 (float tolerance, as
    above) and bitwise equal to each other."""
    direct = run(forked, tmp_path, "direct", config(tmp_path, "direct", 2, 8, 7), 2)
    auto = run(
        forked,
        tmp_path,
        "auto",
        config(tmp_path, "auto", "auto", 8, 7),
        2,
        limit=2,
        failing=0,
        after=5,
    )
    assert auto[0]["raised"] == [8, 4] and auto[1]["raised"] == []
    for rank in (0, 1):
        assert auto[rank]["layout"] == [2, 4] == direct[rank]["layout"]
        wa, wd = auto[rank]["weights"], direct[rank]["weights"]
        assert isinstance(wa, dict) and isinstance(wd, dict)
        for key in wa:
            torch.testing.assert_close(wa[key], wd[key], rtol=1e-5, atol=1e-6)
    assert_same_weights(auto[0], auto[1])


def test_an_oom_in_the_synchronising_backward_ends_the_run_naming_it(
    forked: Forked, tmp_path: Path
) -> None:
    """Past the agreement the last backward's all-reduce is in flight on the other rank:
    rank 0 stops with the reason and what to do, rank 1 with the collective's failure."""
    cfg = config(tmp_path, "bw", "auto", 4, 4)
    children = start(
        forked, tmp_path, "bw", cfg, 2, limit=1 << 20, failing=0, after=2, backward=True
    )
    codes = [child.wait(timeout=120) for child in children]
    assert codes[0] != 0 and codes[1] != 0
    assert "a collective operation failed" in children[1].output
    first = children[0].output
    assert "out of memory in the backward pass of the step's last microbatch" in first
    assert "data.micro_batch_size (2 or less)" in first


def test_a_resume_reuses_the_chosen_micro_batch(forked: Forked, tmp_path: Path) -> None:
    first = run(forked, tmp_path, "run", config(tmp_path, "run", "auto", 8, 2), 1, limit=2)
    assert first[0]["layout"] == [2, 4]
    resumed = run(
        forked, tmp_path, "run", config(tmp_path, "run", "auto", 8, 4), 1, limit=2, resume=True
    )
    assert resumed[0]["raised"] == []  # started at the checkpoint's micro-batch of 2
    assert resumed[0]["layout"] == [2, 4]
    direct = run(forked, tmp_path, "direct", config(tmp_path, "direct", 2, 8, 4), 1)
    assert_same_weights(resumed[0], direct[0])


def test_an_integer_micro_batch_is_unchanged(forked: Forked, tmp_path: Path) -> None:
    """No recovery without ``auto``: the same OOM ends the run."""
    cfg = config(tmp_path, "int", 4, 8, 1)
    child = forked.start(
        oom_rank, str(tmp_path), "int", json.dumps(cfg), False, 2, -1, 0, env=NO_RANK
    )
    assert child.wait(timeout=120) != 0
    assert "OutOfMemoryError" in child.output


OOM_PLUGIN = (
    "import os, torch\n"
    "from speedtronic import Callback, register_callback\n"
    "def refuse(module, args):\n"
    "    raise torch.OutOfMemoryError('CUDA out of memory (injected)')\n"
    "@register_callback('always_oom')\n"
    "class AlwaysOom(Callback):\n"
    "    def on_setup(self, trainer, ctx):\n"
    "        if os.environ.get('RANK', '0') == '0':\n"
    "            trainer.model.register_forward_pre_hook(refuse)\n"
)


@pytest.mark.parametrize("world", [1, 2])
def test_a_micro_batch_of_one_that_does_not_fit_exits_2_naming_the_memory(
    forked: Forked, tmp_path: Path, world: int
) -> None:
    """Rank 0 cannot fit one sample: every rank stops with exit 2 and one message, rank 0's
    naming its device's memory and the OOM, the other's pointing at it."""
    (tmp_path / "oom_plugin.py").write_text(OOM_PLUGIN)
    cfg = config(tmp_path, "cli", "auto", 4, 2)
    cfg["imports"] = ["oom_plugin"]
    cfg["callbacks"] = [{"name": "always_oom"}]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    envs = [rank_env(rank, world, port) for rank in range(world)] if world > 1 else [NO_RANK]
    children = [
        forked.start(cli_main, "fit", "--config", str(path), env=env, cwd=str(tmp_path))
        for env in envs
    ]
    codes = [child.wait(timeout=120) for child in children]
    assert codes == [2] * world, children[0].output
    assert all("Traceback" not in child.output for child in children)
    first = children[0].output
    assert "a micro-batch of 1 sample does not fit in the memory of cpu" in first
    assert "CUDA out of memory (injected)" in first
    if world == 2:
        assert "does not fit in the memory of another rank" in children[1].output


def fsdp_config(
    root: Path, tag: str, micro: int | str, target: int, steps: int
) -> dict[str, object]:
    """Under FSDP2 with three layers: three units below the root, one in the middle."""
    cfg = config(root, tag, micro, target, steps)
    cfg["parallel"] = {"strategy": "fsdp"}
    cfg["model"]["n_layer"] = 3  # type: ignore[index]  # a dict
    return cfg


def test_fsdp_one_rank_out_of_memory_in_a_middle_unit_at_the_first_step(
    forked: Forked, tmp_path: Path
) -> None:
    """2 gloo ranks under FSDP2, 4 samples each a step; rank 0 runs out of memory in the
    forward of its middle FSDP unit above 2 samples, in the first step's search (the
    parameters gathered, no collective during a try). Both settle on 2 x 2, log it, train
    bitwise as a run at 2 x 2 from the start (each rank's shards), write the layout into
    the sharded checkpoint, and a resume starts with it."""
    direct = run(forked, tmp_path, "direct", fsdp_config(tmp_path, "direct", 2, 4, 3), 2)
    auto = run(
        forked,
        tmp_path,
        "auto",
        fsdp_config(tmp_path, "auto", "auto", 4, 3),
        2,
        limit=2,
        failing=0,
        middle=True,
    )
    assert auto[0]["raised"] == [4] and auto[1]["raised"] == []
    # Every rank issued the same collectives, as many of each (none was left unmatched).
    assert auto[0]["collectives"] == auto[1]["collectives"]
    assert auto[0]["collectives"]["all_gather_single"] > 0  # type: ignore[index]  # a dict
    for rank in (0, 1):
        assert auto[rank]["layout"] == [2, 2] == direct[rank]["layout"]
        assert_same_weights(auto[rank], direct[rank])
        assert "micro-batch 4 -> 2, accumulation 1 -> 2" in str(auto[rank]["output"])
        assert "the ranks agreed on the largest size they all fit" in str(auto[rank]["output"])
    state = torch.load(max((tmp_path / "auto").rglob("state.pt")), weights_only=True)
    assert state[LAYOUT_KEY] == {"micro": 2, "accumulation": 2, "ranks": 2}
    resumed = run(
        forked,
        tmp_path,
        "auto",
        fsdp_config(tmp_path, "auto", "auto", 4, 5),
        2,
        limit=2,
        failing=0,
        middle=True,
        resume=True,
    )
    assert [report["layout"] for report in resumed] == [[2, 2], [2, 2]]
    assert resumed[0]["raised"] == []  # started at the checkpoint's 2, no search at 4


def test_fsdp_one_rank_out_of_memory_in_the_search_backward_every_rank_shrinks(
    forked: Forked, tmp_path: Path
) -> None:
    """Rank 0 runs out of memory at the start of the first try's backward (the gradient of
    the model's output, before any unit's pre-backward): no unit reshards after the try's
    forward and no gradient is reduced, so rank 1's backward issues no all-gather rank 0
    would miss. Both issue the same collectives, settle on 2 x 2 and train bitwise as a run
    at 2 x 2 from the start."""
    direct = run(forked, tmp_path, "direct", fsdp_config(tmp_path, "direct", 2, 4, 2), 2)
    cfg = fsdp_config(tmp_path, "bw", "auto", 4, 2)
    children = start(
        forked,
        tmp_path,
        "bw",
        cfg,
        2,
        limit=1 << 20,
        failing=0,
        after=0,
        backward=True,
        middle=True,
    )
    assert [child.wait(timeout=120) for child in children] == [0, 0], children[0].output
    # Every rank issued the same collectives, as many of each (none was left unmatched).
    counts = [torch.load(tmp_path / f"bw-rank{rank}.pt")["collectives"] for rank in (0, 1)]
    assert counts[0] == counts[1] and counts[0]["all_gather_single"] > 0
    for rank in (0, 1):
        auto = torch.load(tmp_path / f"bw-rank{rank}.pt")
        assert auto["raised"] == ([1] if rank == 0 else [])
        assert auto["layout"] == [2, 2]
        assert_same_weights(auto, direct[rank])


def test_fsdp_without_an_oom_auto_trains_bitwise_as_the_integer_size(
    forked: Forked, tmp_path: Path
) -> None:
    """The search's gathered parameters and unreduced gradients are dropped: the first
    step's reduce-scatter sums only its own gradients."""
    direct = run(forked, tmp_path, "direct", fsdp_config(tmp_path, "direct", 4, 4, 3), 2)
    auto = run(forked, tmp_path, "auto", fsdp_config(tmp_path, "auto", "auto", 4, 3), 2)
    for rank in (0, 1):
        assert auto[rank]["raised"] == [] and auto[rank]["layout"] == [4, 1]
        assert_same_weights(auto[rank], direct[rank])


def test_fsdp_an_oom_after_the_first_step_ends_the_run_naming_the_size_to_resume_with(
    forked: Forked, tmp_path: Path
) -> None:
    """Rank 0 runs out of memory in its middle unit at step 3 (its calls: the search's try,
    steps 1-2, then step 3's): rank 1 is inside FSDP's next all-gather, so the step cannot be
    run again; rank 0 stops naming the integer size to resume with, rank 1 on the failed
    collective."""
    cfg = fsdp_config(tmp_path, "mid", "auto", 4, 6)
    children = start(forked, tmp_path, "mid", cfg, 2, limit=2, failing=0, after=3, middle=True)
    codes = [child.wait(timeout=120) for child in children]
    assert codes[0] != 0 and codes[1] != 0
    first = children[0].output
    assert "out of memory after the first step under parallel.strategy fsdp" in first
    assert "an integer data.micro_batch_size of 2 or less" in first
    assert "injected: 4 samples > 2" in first


def test_auto_with_tensor_parallelism_on_two_ranks_exits_2_saying_why(
    forked: Forked, tmp_path: Path
) -> None:
    """Tensor-parallel layers run collectives inside forward and backward: no rank can
    drop a try alone."""
    cfg = config(tmp_path, "tp", "auto", 4, 2)
    cfg["parallel"] = {"strategy": "fsdp", "tensor": 2}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    children = start_cli(forked, tmp_path, path)
    assert [child.wait(timeout=120) for child in children] == [2, 2], children[0].output
    for child in children:
        assert "Traceback" not in child.output
        assert "auto cannot run with parallel.strategy fsdp on 2 ranks" in child.output
        assert "tensor parallelism (parallel.tensor 2)" in child.output
        assert "set an integer data.micro_batch_size" in child.output


NO_ROOM_PLUGIN = (
    "import os\n"
    "from speedtronic import Callback, register_callback\n"
    "from speedtronic.engine import oom_probe\n"
    "@register_callback('no_gather_room')\n"
    "class NoGatherRoom(Callback):\n"
    "    def on_setup(self, trainer, ctx):\n"
    "        if os.environ.get('RANK', '0') == '0':\n"
    "            oom_probe.gather_room = lambda model, device: 'cuda:0 (injected: no room)'\n"
)


def test_fsdp_parameters_that_cannot_be_gathered_on_one_rank_exit_2_on_every_rank(
    forked: Forked, tmp_path: Path
) -> None:
    """Rank 0 reports no room for the gathered parameters (CPU reports no free memory, so
    the check is replaced there): no rank gathers, both stop with exit 2, rank 0 naming its
    device, rank 1 pointing at the other rank."""
    (tmp_path / "room_plugin.py").write_text(NO_ROOM_PLUGIN)
    cfg = fsdp_config(tmp_path, "room", "auto", 4, 2)
    cfg["imports"] = ["room_plugin"]
    cfg["callbacks"] = [{"name": "no_gather_room"}]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    children = start_cli(forked, tmp_path, path)
    assert [child.wait(timeout=120) for child in children] == [2, 2], children[0].output
    assert all("Traceback" not in child.output for child in children)
    assert "gathers every parameter for its first-step search" in children[0].output
    assert "do not fit in the memory of cuda:0 (injected: no room)" in children[0].output
    assert "do not fit in the memory of another rank" in children[1].output
