"""Multiple-choice tasks: accuracy on a hand-checked file, batching that changes nothing and
costs ceil(sequences / batch) forwards, bad rows named by file:line, and the task metrics in
the records of a fit and from ``speedtronic evaluate --task``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from forked import Forked
from torch import nn

from speedtronic.evaluation.tasks import MultipleChoiceTask, TaskError, read_task
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.runtime import train_from_config
from tests.cli_runner import run_cli
from tests.task_rank_worker import score_rank, task_model
from tests.test_distributed import free_port, rank_env
from tests.text_runs import text_run_config, write_rows


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class FavoursX(nn.Module):
    """Every position gives byte ``x`` logit 5 and the other 256 ids logit 0:
    log p(x) = 5 - log(256 + e^5) (about -1.0), log p(other) = -log(256 + e^5) (about -6.0)."""

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = torch.zeros((*input_ids.shape, 257))
        logits[..., ord("x")] = 5.0
        return {"logits": logits}


# Hand-checked with lx = -1.0, lo = -6.0 (continuations are " " + choice):
#   " x" = lo + lx = -7, " xx" = lo + 2 lx = -8, " yyy" = 4 lo = -24; per byte: -7, -4, -8.
#   row 1: answer 2 (" x"):  acc right (max sum), acc_norm wrong (" xx" has max per byte).
#   row 2: answer 0 (" xx"): acc wrong, acc_norm right.
#   row 3: " x" = -7 vs " yy" = -18, per byte -7 vs -9: both right.
HAND_ROWS = [
    {"context": "a", "choices": ["xx", "yyy", "x"], "answer": 2},
    {"context": "b", "choices": ["xx", "yyy", "x"], "answer": 0},
    {"context": "c", "choices": ["x", "yy"], "answer": 0},
]


def test_accuracy_on_a_hand_checked_file(tmp_path: Path) -> None:
    rows = read_task(write_rows(tmp_path / "hand.jsonl", HAND_ROWS))
    task = MultipleChoiceTask("hand", rows, encode, shots=1, batch_size=3)
    score = task.score(FavoursX(), device=torch.device("cpu"))
    assert (score.correct, score.correct_norm, score.rows) == (2.0, 2.0, 3.0)
    assert task.metrics(score) == {"eval/hand/acc": 2 / 3, "eval/hand/acc_norm": 2 / 3}
    assert score.forward_passes == math.ceil(8 / 3)  # 8 (row, choice) sequences


def test_shots_come_from_other_rows_and_are_seeded(tmp_path: Path) -> None:
    rows = read_task(write_rows(tmp_path / "hand.jsonl", HAND_ROWS))
    seen: list[str] = []

    def recording(text: str) -> list[int]:
        seen.append(text)
        return encode(text)

    task = MultipleChoiceTask("hand", rows, recording, shots=2, seed=7)
    task.score(FavoursX(), device=torch.device("cpu"))
    prompts = [text for text in seen if not text.startswith(" ")]
    assert prompts[0] in ("b xx\n\nc x\n\na", "c x\n\nb xx\n\na")  # never row 1 itself
    first = list(seen)
    seen.clear()
    task.score(FavoursX(), device=torch.device("cpu"))
    assert seen == first


def test_batching_and_padding_change_no_score(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ReferenceTransformer(vocab_size=257, block_size=64, n_layer=1, n_head=2, d_model=16)
    rows = [
        {"context": "the " * (i % 5 + 1), "choices": ["cat", "a dog", "mat."], "answer": i % 3}
        for i in range(10)
    ]
    parsed = read_task(write_rows(tmp_path / "t.jsonl", rows))
    one = MultipleChoiceTask("t", parsed, encode, batch_size=1, context=64)
    many = MultipleChoiceTask("t", parsed, encode, batch_size=8, context=64)
    cpu = torch.device("cpu")
    single, batched = one.score(model, device=cpu), many.score(model, device=cpu)
    assert (single.correct, single.correct_norm) == (batched.correct, batched.correct_norm)
    assert (single.forward_passes, batched.forward_passes) == (30, 4)
    assert model.training  # the mode is restored


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_reduce_to_the_one_process_score(
    tmp_path: Path, forked: Forked, sharded: bool
) -> None:
    rows = [
        {
            "context": f"row {i}: the",
            "choices": ["cat", "dog", "mat."][: 2 + i % 2],
            "answer": i % 2,
        }
        for i in range(9)  # an odd count: the ranks score 5 and 4 rows
    ]
    task_file = write_rows(tmp_path / "t.jsonl", rows)
    port = free_port()
    # Sharded: batches of 5 give rank 0 (10 choices) 2 batches and rank 1 (12) 3, so rank 0
    # makes a padding pass to keep the forwards (and their all-gathers) in lockstep.
    size = 5 if sharded else 4
    children = [
        forked.start(
            score_rank, str(tmp_path), str(task_file), sharded, size, env=rank_env(rank, 2, port)
        )
        for rank in (0, 1)
    ]
    assert [child.wait(timeout=120) for child in children] == [0, 0], children[0].output
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text("utf-8")) for r in (0, 1)]
    if sharded:
        assert [report.pop("passes") for report in reports] == [3, 3]
    task = MultipleChoiceTask("t", read_task(task_file), encode, batch_size=4, context=64)
    alone = task.score(task_model(), device=torch.device("cpu"))
    expected = {"correct": alone.correct, "correct_norm": alone.correct_norm, "rows": 9.0}
    assert reports == [expected, expected]
    assert 0 < alone.correct < 9  # a score the split could get wrong


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"context": "a", "choices": ["x", "y"], "answer": 2}, "answer 2 is out of range"),
        ({"context": "a", "choices": [], "answer": 0}, "choices must be a non-empty list"),
        ({"context": "a", "choices": ["x"], "answer": True}, "answer must be the index"),
        ({"choices": ["x"], "answer": 0}, "context must be a string"),
    ],
)
def test_a_bad_row_is_named_by_file_and_line(
    tmp_path: Path, line: dict[str, object], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(HAND_ROWS[0]) + "\n\n" + json.dumps(line) + "\n", "utf-8")
    with pytest.raises(TaskError, match=f"{path}:3: {message}"):
        read_task(path)


@pytest.fixture(scope="module")
def task_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    tmp_path = tmp_path_factory.mktemp("tasks")
    rows = [
        {"context": "the cat sat on the", "choices": ["mat.", "park."], "answer": 0},
        {"context": "the dog ran in the", "choices": ["mat.", "park."], "answer": 1},
        {"context": "the cat", "choices": ["sat", "ran", "on"], "answer": 0},
    ]
    write_rows(tmp_path / "animals.jsonl", rows)
    task = {"path": str(tmp_path / "animals.jsonl"), "shots": 1}
    monitored = {
        "checkpoint": {"every_steps": 2, "monitor": "eval/animals/acc", "mode": "max"},
        "callbacks": [
            {"name": "early_stopping", "monitor": "eval/animals/acc_norm", "mode": "max"}
        ],
    }
    config = text_run_config(tmp_path, extra=monitored, tasks=[task], every_steps=2)
    result = train_from_config(config)
    return config, result.metrics[-1]


def test_task_metrics_join_the_evaluation_record(
    task_run: tuple[Path, dict[str, object]],
) -> None:
    _, record = task_run
    assert "eval/loss" in record
    for key in ("eval/animals/acc", "eval/animals/acc_norm"):
        value = record[key]
        assert isinstance(value, float) and value in (0.0, 1 / 3, 2 / 3, 1.0)


def test_the_best_checkpoint_monitors_a_task_metric(
    task_run: tuple[Path, dict[str, object]],
) -> None:
    config, record = task_run
    best = json.loads((config.parent / "run" / "checkpoints" / "best.json").read_text("utf-8"))
    assert best["monitor"] == "eval/animals/acc"
    assert best["value"] >= record["eval/animals/acc"]


def test_tasks_on_synthetic_tokens_are_a_config_error(tmp_path: Path) -> None:
    from tests.hf_helpers import run_config

    write_rows(tmp_path / "t.jsonl", HAND_ROWS)
    eval_section = {"every_steps": 2, "tasks": [{"path": str(tmp_path / "t.jsonl")}]}
    config = run_config(tmp_path, {"name": "reference_transformer"}, eval=eval_section)
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "eval.tasks: the run trains on synthetic tokens" in result.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_evaluate_task_scores_a_checkpoint_as_the_fit_did(
    task_run: tuple[Path, dict[str, object]],
) -> None:
    config, record = task_run
    task = config.parent / "animals.jsonl"
    result = run_cli(
        "evaluate",
        "--config",
        str(config),
        "--task",
        str(task),
        "--shots",
        "1",
        cwd=config.parent,
    )
    assert result.returncode == 0, result.stderr
    fields = dict(part.split("=", 1) for part in result.stdout.split())
    assert float(fields["eval/animals/acc"]) == record["eval/animals/acc"]
    assert float(fields["eval/animals/acc_norm"]) == record["eval/animals/acc_norm"]
    assert fields["rows"] == "3" and fields["step"] == "4"


def test_evaluate_a_bad_task_file_exits_2_naming_the_line(
    task_run: tuple[Path, dict[str, object]],
) -> None:
    config, _ = task_run
    bad = write_rows(config.parent / "bad.jsonl", [{"context": "a", "choices": [], "answer": 0}])
    result = run_cli("evaluate", "--config", str(config), "--task", str(bad), cwd=config.parent)
    assert result.returncode == 2
    assert f"{bad}:1: choices must be a non-empty list" in result.stderr
    assert "Traceback" not in result.stderr
