"""Tensor parallelism composed with FSDP2 (``parallel: {strategy: fsdp, tensor: 2}``).

Real gloo processes (tests/tensor_parallel_worker.py): a 2-rank job (tensor 2 x data 1) and a
4-rank job (data 2 x tensor 2) train the reference transformer and a Llama ``hf_causal_lm``
for 20 steps with clipping on; their losses and clipped grad norms match one process's on
the same global batches. The 2-rank job also resumes DCP checkpoints across layouts
(tensor 2 x data 1 -> data 2, and back). A CLI run on 2 ranks is evaluated, exported and
generated from. Bad degrees and families without a plan exit 2 naming the numbers.

Tolerance: ``rtol=1e-4, atol=1e-5`` on losses and grad norms. Tensor parallelism computes the
same fp32 math in another order (row-parallel layers sum partial products across ranks,
the grad norm is reduced per mesh dimension), so each op differs by a few ulps (~1e-7
relative); 20 AdamW steps amplify that (``1/sqrt(v)`` on small moments) -- measured: at most
~2e-6 relative. A wrong split (a head or a shard misplaced, a gradient not reduced) moves the
first loss by >1e-2. Weights and optimizer moments restored across layouts: bitwise.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli
from forked import Forked
from rank_env import free_port, rank_env
from tensor_parallel_worker import (
    ACCUMULATION_STEPS,
    GLOBAL_BATCH,
    STEPS,
    TIED_STEPS,
    cli_rank,
    fit,
    local_parameter_styles_rank,
    make_trainer,
    rank_main,
)
from text_runs import text_run_config
from torch import nn

from speedtronic.systems.tensor_parallel import (
    TensorParallelError,
    TensorParallelPlan,
    check_tensor_parallel,
    model_family,
    register_tensor_parallel_plan,
    tensor_parallel_plan,
)

torch.set_num_threads(1)

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def run_job(out: Path, world: int) -> list[dict[str, object]]:
    context = multiprocessing.get_context("forkserver")
    port = free_port()
    ranks = [
        context.Process(target=rank_main, args=(r, world, port, str(out))) for r in range(world)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(900)
    assert [p.exitcode for p in ranks] == [0] * world
    return [json.loads((out / f"w{world}-rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, list[float]]]:
    """The reference: both families, one process, the whole global batch."""
    runs = {family: fit(make_trainer(family, tensor=1), STEPS) for family in ("reference", "llama")}
    k, steps = ACCUMULATION_STEPS
    tied = make_trainer("llama_tied", tensor=1, steps=TIED_STEPS)
    runs["llama_tied"] = fit(tied, TIED_STEPS)
    runs["reference/k2"] = fit(
        make_trainer("reference", tensor=1, accumulation=k, steps=steps), steps
    )
    return runs


@pytest.fixture(scope="module")
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, list[dict[str, object]]]]:
    out = tmp_path_factory.mktemp("tp2")
    yield out, run_job(out, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return run_job(tmp_path_factory.mktemp("tp4"), 4)


def assert_matches(job: dict[str, object], one: dict[str, dict[str, list[float]]]) -> None:
    for family in ("reference", "llama"):
        got = job[family]
        assert isinstance(got, dict)
        for key in ("loss", "grad_norm", "samples"):  # samples: each batch counted once
            assert len(got[key]) == STEPS
            torch.testing.assert_close(
                torch.tensor(got[key]), torch.tensor(one[family][key]), **TOLERANCE, msg=family
            )
        assert job[f"{family}/on_2d_mesh"] is True  # every parameter a DTensor on (data, tensor)


def test_two_ranks_tensor_two_match_one_process(
    two_ranks: tuple[Path, list[dict[str, object]]], one_process: dict[str, dict[str, list[float]]]
) -> None:
    _, reports = two_ranks
    for report in reports:  # both tensor ranks log the same (global) values
        assert_matches(report, one_process)
        assert report["odd_sequence"] == (
            "parallel.tensor: 2 does not divide the sequence length (7): the reference "
            "transformer's sequence parallelism splits each sequence evenly over the tensor "
            "ranks; use sequences (data.block_size) a multiple of 2"
        )
        assert report["llama_tied/tied"] is True  # tie_word_embeddings: still one parameter
        tied = report["llama_tied"]
        assert isinstance(tied, dict)
        torch.testing.assert_close(
            torch.tensor(tied["loss"]), torch.tensor(one_process["llama_tied"]["loss"]), **TOLERANCE
        )


def test_four_ranks_data_two_by_tensor_two_match_one_process(
    four_ranks: list[dict[str, object]], one_process: dict[str, dict[str, list[float]]]
) -> None:
    for report in four_ranks:
        assert_matches(report, one_process)
        accumulated = report["reference/k2"]  # 2 microbatches a step: gradients synced once
        assert isinstance(accumulated, dict)
        for key in ("loss", "grad_norm", "samples"):
            torch.testing.assert_close(
                torch.tensor(accumulated[key]),
                torch.tensor(one_process["reference/k2"][key]),
                **TOLERANCE,
            )
    # Each rank holds about a quarter of the parameters (FSDP halves what TP halved).
    two = four_ranks[0]["reference/local_numel"]
    assert isinstance(two, int)
    whole = make_trainer("reference", tensor=1).model.num_parameters()  # type: ignore[attr-defined]
    assert two <= 0.3 * whole


@pytest.mark.parametrize("key", ["reference/t2->t1", "reference/t1->t2", "llama/t2->t1"])
def test_checkpoints_resume_across_layouts(
    two_ranks: tuple[Path, list[dict[str, object]]],
    one_process: dict[str, dict[str, list[float]]],
    key: str,
) -> None:
    """tensor 2 x data 1 <-> data 2: weights and AdamW moments restored bit for bit, and --
    the global batch being the same in both layouts -- the next losses are the one-process
    run's. The sample and token counters continue as the one-process run's: logged and in
    the fit's totals, each batch counted once, not once per tensor rank."""
    out, reports = two_ranks
    states = torch.load(out / "w2.pt")[key]
    assert sorted(states["saved"]) == sorted(states["loaded"])
    for name, saved in states["saved"].items():
        torch.testing.assert_close(states["loaded"][name], saved, rtol=0, atol=0, msg=name)
    family = key.split("/")[0]
    for report in reports:
        resumed = report[key]
        assert isinstance(resumed, dict)
        assert resumed["step"] == 5 and str(resumed["from"]).endswith("step_000000000005.dcp")
        torch.testing.assert_close(
            torch.tensor(resumed["after"]),
            torch.tensor(one_process[family]["loss"][5:7]),
            **TOLERANCE,
        )
        counted = resumed["counted"]
        assert isinstance(counted, dict)
        one = one_process[family]
        assert counted["samples"] == one["samples"][5:7] == [6 * GLOBAL_BATCH, 7 * GLOBAL_BATCH]
        assert counted["tokens"] == one["tokens"][5:7]
        assert counted["totals"] == [one["samples"][6], one["tokens"][6]]


def test_a_cli_run_under_tensor_parallelism_evaluates_exports_and_generates(
    forked: Forked, tmp_path: Path
) -> None:
    model = {"vocab_size": 258, "max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 16}
    config = text_run_config(
        tmp_path, extra={"model": model, "parallel": {"strategy": "fsdp", "tensor": 2}}
    )
    port = free_port()
    argv = ["fit", "--config", str(config)]
    children = [forked.start(cli_rank, argv, env=rank_env(r, 2, port)) for r in range(2)]
    assert [child.wait(timeout=600) for child in children] == [0, 0], children[0].output
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000000000004.dcp"
    assert checkpoint.is_dir()
    evaluated = run_cli("evaluate", "--config", str(config), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    assert "loss" in evaluated.stdout
    exported = run_cli(
        "export", "--config", str(config), "--output", str(tmp_path / "hf"), cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # whole tensors, gathered
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (16, 16)
    generated = run_cli(
        "generate",
        "--config",
        str(config),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
        cwd=tmp_path,
    )
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("the cat")


# -- bad input: exit 2 naming the numbers ------------------------------------------------


def write(tmp_path: Path, model: dict[str, object], **sections: object) -> Path:
    config = {
        "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path / "run")},
        "model": {"vocab_size": 32, "max_seq_len": 16, **model},
        "data": {"synthetic_kind": "learnable", "num_tokens": 256, "micro_batch_size": 2},
        "scheduler": {"warmup_steps": 0},
        "parallel": {"strategy": "fsdp", "tensor": 2},
        **sections,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


REFERENCE = {"n_layer": 1, "n_head": 4, "n_kv_head": 2, "d_model": 32}


@pytest.mark.parametrize(
    ("model", "parallel", "message"),
    [
        (
            {**REFERENCE, "n_head": 6, "n_kv_head": 6, "d_model": 48},
            {"strategy": "fsdp", "tensor": 4},
            "parallel.tensor: 4 does not divide model.n_head, the attention heads (6)",
        ),
        (
            {**REFERENCE, "n_kv_head": 1},
            {"strategy": "fsdp", "tensor": 2},
            "parallel.tensor: 2 does not divide model.n_kv_head, the key/value heads (1)",
        ),
        (
            {**REFERENCE, "vocab_size": 33},
            {"strategy": "fsdp", "tensor": 2},
            "parallel.tensor: 2 does not divide model.vocab_size (33)",
        ),
        (
            {
                "name": "hf_causal_lm",
                "options": {
                    "config": {
                        "model_type": "llama",
                        "hidden_size": 32,
                        "intermediate_size": 51,
                        "num_hidden_layers": 1,
                        "num_attention_heads": 4,
                        "num_key_value_heads": 2,
                    }
                },
            },
            {"strategy": "fsdp", "tensor": 2},
            "parallel.tensor: 2 does not divide intermediate_size, the MLP hidden size (51)",
        ),
        (
            {
                "name": "hf_causal_lm",
                "options": {
                    "config": {
                        "model_type": "llama",
                        "hidden_size": 32,
                        "intermediate_size": 48,
                        "num_hidden_layers": 1,
                        "num_attention_heads": 4,
                        "num_key_value_heads": 2,
                    }
                },
            },
            {"strategy": "fsdp", "tensor": 4},
            "parallel.tensor: 4 does not divide num_key_value_heads, the key/value heads (2)",
        ),
        (
            {
                "name": "hf_causal_lm",
                "options": {
                    "config": {
                        "model_type": "gpt2",
                        "n_embd": 32,
                        "n_layer": 1,
                        "n_head": 2,
                        "n_positions": 16,
                    }
                },
            },
            {"strategy": "fsdp", "tensor": 2},
            "parallel.tensor: model family 'gpt2' has no tensor-parallel plan",
        ),
        (
            REFERENCE,
            {"strategy": "ddp", "tensor": 2},
            "parallel.tensor: 2 needs parallel.strategy 'fsdp'",
        ),
        (
            {**REFERENCE, "max_seq_len": 15},
            {"strategy": "fsdp", "tensor": 2},
            "parallel.tensor: 2 does not divide the sequence length (data.block_size, by "
            "default model.max_seq_len) (15): the reference transformer's sequence "
            "parallelism splits each sequence evenly over the tensor ranks",
        ),
    ],
)
def test_validate_refuses_what_does_not_split(
    tmp_path: Path, model: dict[str, object], parallel: dict[str, object], message: str
) -> None:
    result = run_cli(
        "validate", "--config", str(write(tmp_path, model, parallel=parallel)), cwd=tmp_path
    )
    assert result.returncode == 2, result.stdout
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_degree_that_does_not_divide_the_world_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path, REFERENCE)
    monkeypatch.setenv("WORLD_SIZE", "3")  # validate under torchrun with 3 ranks
    result = run_cli("validate", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert (
        "parallel.tensor: 2 does not divide the world size (number of ranks) (3)" in result.stderr
    )
    monkeypatch.delenv("WORLD_SIZE")
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)  # one process
    assert result.returncode == 2
    assert "parallel.tensor: 2 does not divide the world size (1 rank(s))" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_sequence_length_the_degree_does_not_divide_exits_2_before_anything_runs(
    tmp_path: Path,
) -> None:
    """Sequence parallelism splits each sequence over the tensor ranks: ``validate`` and
    ``fit`` (on any number of processes) refuse a block size it cannot split, naming both."""
    config = write(
        tmp_path,
        REFERENCE,
        data={
            "synthetic_kind": "learnable",
            "num_tokens": 256,
            "micro_batch_size": 2,
            "block_size": 6,
        },
        parallel={"strategy": "fsdp", "tensor": 4},
    )
    message = (
        "parallel.tensor: 4 does not divide data.block_size (6): the reference transformer's "
        "sequence parallelism splits each sequence evenly over the tensor ranks; use a "
        "sequence length that is a multiple of 4"
    )
    for command in ("validate", "fit"):
        result = run_cli(command, "--config", str(config), cwd=tmp_path)
        assert result.returncode == 2, result.stdout
        assert message in result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
    fits = write(tmp_path, REFERENCE, parallel={"strategy": "fsdp", "tensor": 2})  # 16 tokens
    assert run_cli("validate", "--config", str(fits), cwd=tmp_path).returncode == 0


def test_muon_is_refused_under_tensor_parallelism(tmp_path: Path) -> None:
    config = write(tmp_path, REFERENCE, optimizer={"name": "muon"})
    result = run_cli("validate", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "Muon's Newton-Schulz step needs each whole weight matrix" in result.stderr


# -- the plan registry ------------------------------------------------------------------


class Mixer(nn.Module):
    tensor_parallel_family = "mixer"

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))


def test_a_family_without_a_plan_is_named_and_a_registered_one_is_found() -> None:
    with pytest.raises(TensorParallelError, match="model family 'mixer' has no tensor-parallel"):
        check_tensor_parallel(Mixer(), 2)

    def check(model: nn.Module, degree: int) -> None:
        if 6 % degree:
            raise TensorParallelError(f"parallel.tensor: {degree} does not divide 6")

    plan = TensorParallelPlan(apply=lambda model, mesh: None, check=check)
    register_tensor_parallel_plan("mixer", plan)
    assert model_family(Mixer()) == "mixer" and tensor_parallel_plan(Mixer()) is plan
    check_tensor_parallel(Mixer(), 2, world_size=4)
    with pytest.raises(TensorParallelError, match="4 does not divide 6"):
        check_tensor_parallel(Mixer(), 4, world_size=4)
    with pytest.raises(TensorParallelError, match=r"does not divide the world size .*\(6\)"):
        check_tensor_parallel(Mixer(), 4, world_size=6)


def test_the_data_share_of_a_world_the_degree_does_not_divide_is_refused() -> None:
    """The runtime splits the data by the tensor degree before anything else (a fit of
    tensor 2 on 3 ranks crashed there with a sampler's ``ValueError``, exit 1)."""
    from speedtronic.systems.tensor_parallel import data_parallel_share

    shares = [data_parallel_share(rank, 4, 2) for rank in range(4)]
    assert shares == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert data_parallel_share(0, 1, 2) == (0, 1)  # one process: the fit's own refusal
    with pytest.raises(TensorParallelError, match=r"does not divide the world size .*\(3\)"):
        data_parallel_share(2, 3, 2)


def test_muon_built_in_python_is_refused_before_anything_is_split() -> None:
    from speedtronic.optimizers import Muon
    from speedtronic.systems.tensor_parallel import apply_tensor_parallel

    model = make_trainer("reference", tensor=1).model  # type: ignore[attr-defined]
    matrices = [p for p in model.parameters() if p.dim() == 2]
    before = [p.detach().clone() for p in matrices]
    with pytest.raises(TensorParallelError, match="Muon's Newton-Schulz step needs each whole"):
        apply_tensor_parallel(model, Muon(matrices, lr=0.02), torch.device("cpu"), 2)
    assert all(torch.equal(p, q) for p, q in zip(matrices, before, strict=True))


def test_norm_styles_run_on_plain_tensors_and_put_their_dtensor_parameters_back(
    forked: Forked,
) -> None:
    child = forked.start(local_parameter_styles_rank, env=rank_env(0, 1, free_port()))
    assert child.wait(timeout=300) == 0, child.output
