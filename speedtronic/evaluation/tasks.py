"""Multiple-choice in-context evaluation (HellaSwag, ARC, PIQA style).

A task is a local JSONL file of rows ``{"context": str, "choices": [str, ...], "answer":
int}``. Each row is asked with ``shots`` other rows of the same file before it (chosen with
a generator seeded by ``seed`` and the row's index, never the row itself), each written as
its context, a space and its right answer, separated by a blank line::

    <context_1> <answer_1>\\n\\n<context_2> <answer_2>\\n\\n<context> <choice>

Every choice is scored by the log-likelihood the model gives its tokens after the prompt
(the prompt and the choice are tokenized separately; a prompt too long for the model's
context loses its oldest tokens). ``acc`` counts the rows whose highest summed
log-likelihood is the answer; ``acc_norm`` divides each sum by the choice's length in UTF-8
bytes first (so longer choices are not penalised for their length, as lm-evaluation-harness
does).

Batched: all (row, choice) sequences are sorted by length and cut into batches of
``batch_size``, right-padded -- with causal attention the padding after a sequence cannot
change its logits, so no mask is needed and any causal LM returning ``{"logits"}`` works.
A 1,000-row task costs ``ceil(sequences / batch_size)`` forward passes.

In a distributed run each rank scores every ``world_size``-th row and the three counts are
all-reduced, so the metrics are those of the whole file.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from speedtronic.systems.distributed import DistributedContext
    from speedtronic.systems.precision import PrecisionPlan

__all__ = [
    "ChoiceRow",
    "MultipleChoiceTask",
    "TaskError",
    "TaskScore",
    "read_task",
    "task_metric_keys",
]

FEWSHOT_SEPARATOR = "\n\n"
CHOICE_SEPARATOR = " "
MAX_TASK_BYTES = 1 << 30
"""A task file larger than this is refused unread."""


class TaskError(ValueError):
    """A task file that cannot be read or holds a bad row (the message names file:line)."""


@dataclass(frozen=True)
class ChoiceRow:
    """One question: its ``context``, the ``choices`` and the index of the right one."""

    context: str
    choices: tuple[str, ...]
    answer: int


def _row(value: object, where: str) -> ChoiceRow:
    if not isinstance(value, dict):
        raise TaskError(f"{where}: a row must be a JSON object with context, choices, answer")
    context, choices, answer = value.get("context"), value.get("choices"), value.get("answer")
    if not isinstance(context, str):
        raise TaskError(f"{where}: context must be a string, got {context!r}")
    if not isinstance(choices, list) or not choices:
        raise TaskError(f"{where}: choices must be a non-empty list of strings")
    if not all(isinstance(choice, str) and choice for choice in choices):
        raise TaskError(f"{where}: every choice must be a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise TaskError(f"{where}: answer must be the index of the right choice, got {answer!r}")
    if not 0 <= answer < len(choices):
        raise TaskError(
            f"{where}: answer {answer} is out of range for {len(choices)} choices "
            f"(0..{len(choices) - 1})"
        )
    return ChoiceRow(context, tuple(choices), answer)


def read_task(path: str | Path) -> list[ChoiceRow]:
    """The rows of a task file; ``TaskError`` naming ``file:line`` for a bad one (blank
    lines are skipped)."""
    file = Path(path).expanduser()
    try:
        if file.stat().st_size > MAX_TASK_BYTES:
            raise TaskError(f"{file}: larger than {MAX_TASK_BYTES} bytes")
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"task file {file}: cannot read it: {exc}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: not JSON ({exc.msg})") from None
        rows.append(_row(value, where))
    if not rows:
        raise TaskError(f"{file}: the task file holds no rows")
    return rows


def task_metric_keys(name: str) -> tuple[str, str]:
    """The metric keys of task ``name``: ``eval/<name>/acc`` and ``eval/<name>/acc_norm``."""
    return f"eval/{name}/acc", f"eval/{name}/acc_norm"


@dataclass(frozen=True)
class TaskScore:
    """The counts of one evaluation (all ranks)."""

    correct: float
    correct_norm: float
    rows: float
    forward_passes: int
    """This rank's forward passes (for the cost benchmark)."""

    @property
    def acc(self) -> float:
        return self.correct / self.rows if self.rows else math.nan

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.rows if self.rows else math.nan


@dataclass(frozen=True)
class _Request:
    row: int
    choice: int
    prompt: tuple[int, ...]
    continuation: tuple[int, ...]


def _prompt(rows: Sequence[ChoiceRow], index: int, shots: int, seed: int) -> str:
    others = [i for i in range(len(rows)) if i != index]
    picked = random.Random(seed * 1_000_003 + index).sample(others, min(shots, len(others)))
    examples = [
        rows[i].context + CHOICE_SEPARATOR + rows[i].choices[rows[i].answer] for i in picked
    ]
    return FEWSHOT_SEPARATOR.join([*examples, rows[index].context])


class MultipleChoiceTask:
    """A multiple-choice task (module docstring) scored with ``encode`` (text -> ids)."""

    def __init__(
        self,
        name: str,
        rows: Sequence[ChoiceRow],
        encode: Callable[[str], list[int]],
        *,
        shots: int = 0,
        seed: int = 0,
        batch_size: int = 16,
        context: int | None = None,
        max_rows: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise TaskError(f"task {name}: batch_size must be positive, got {batch_size}")
        self.name = name
        self.rows = list(rows)
        self.encode = encode
        self.shots = shots
        self.seed = seed
        self.batch_size = batch_size
        self.context = context
        self.max_rows = max_rows

    def _requests(self, indices: Sequence[int]) -> list[_Request]:
        requests = []
        for index in indices:
            prompt = tuple(self.encode(_prompt(self.rows, index, self.shots, self.seed)))
            for choice, text in enumerate(self.rows[index].choices):
                continuation = tuple(self.encode(CHOICE_SEPARATOR + text))
                if not continuation:
                    raise TaskError(f"task {self.name}: row {index + 1} choice {choice} is empty")
                requests.append(_Request(index, choice, prompt, continuation))
        return requests

    def _fit(self, request: _Request) -> tuple[list[int], int]:
        """The ids to run (prompt cut from the left to fit) and where the choice starts."""
        ids = [*request.prompt, *request.continuation]
        limit = self.context
        if limit is not None and len(ids) > limit:
            if len(request.continuation) >= limit:
                raise TaskError(
                    f"task {self.name}: row {request.row + 1} choice {request.choice} alone "
                    f"is longer than the model's context of {limit} tokens"
                )
            ids = ids[len(ids) - limit :]
        start = len(ids) - len(request.continuation)
        if start == 0:
            raise TaskError(
                f"task {self.name}: row {request.row + 1} has an empty context (and no shots): "
                "its first choice token has nothing to be predicted from"
            )
        return ids, start

    def _batches(self, requests: list[_Request]) -> Iterator[list[_Request]]:
        ordered = sorted(requests, key=lambda r: -(len(r.prompt) + len(r.continuation)))
        for start in range(0, len(ordered), self.batch_size):
            yield ordered[start : start + self.batch_size]

    def _score_batch(
        self, model: nn.Module, batch: list[_Request], device: torch.device
    ) -> list[float]:
        fitted = [self._fit(request) for request in batch]
        width = max(len(ids) for ids, _ in fitted)
        padded = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, _) in enumerate(fitted):
            padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        output = model(padded.to(device))
        logits = output["logits"] if isinstance(output, Mapping) else output.logits
        scores = []
        for i, (ids, start) in enumerate(fitted):
            # Position t predicts token t + 1: the choice's tokens are read from start - 1.
            rows = logits[i, start - 1 : len(ids) - 1].float().log_softmax(dim=-1)
            targets = torch.tensor(ids[start:], device=rows.device)
            scores.append(rows.gather(1, targets[:, None]).sum())
        return [float(value) for value in torch.stack(scores).tolist()]

    def score(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        precision: PrecisionPlan | None = None,
        distributed: DistributedContext | None = None,
    ) -> TaskScore:
        """Score the model on the task's rows (up to ``max_rows``); the model's mode and the
        random state are left as they were."""
        from speedtronic.systems.precision import autocast_context

        rank, world = (distributed.rank, distributed.world_size) if distributed else (0, 1)
        count = len(self.rows) if self.max_rows is None else min(self.max_rows, len(self.rows))
        requests = self._requests(range(rank, count, world))
        totals: dict[int, list[float]] = {}
        passes = 0
        autocast = (
            autocast_context(precision, device)
            if precision is not None and precision.autocast_enabled
            else contextlib.nullcontext()
        )
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode(), autocast:
                for batch in self._batches(requests):
                    for request, value in zip(
                        batch, self._score_batch(model, batch, device), strict=True
                    ):
                        totals.setdefault(request.row, [0.0] * len(self.rows[request.row].choices))
                        totals[request.row][request.choice] = value
                    passes += 1
        finally:
            model.train(was_training)
        return self._reduce(totals, passes, device, distributed)

    def _reduce(
        self,
        totals: Mapping[int, list[float]],
        passes: int,
        device: torch.device,
        distributed: DistributedContext | None,
    ) -> TaskScore:
        correct = correct_norm = 0
        for index, scores in totals.items():
            row = self.rows[index]
            lengths = [len(choice.encode("utf-8")) for choice in row.choices]
            normed = [score / length for score, length in zip(scores, lengths, strict=True)]
            correct += int(max(range(len(scores)), key=scores.__getitem__) == row.answer)
            correct_norm += int(max(range(len(normed)), key=normed.__getitem__) == row.answer)
        sums = torch.tensor(
            [correct, correct_norm, len(totals)], dtype=torch.float64, device=device
        )
        if distributed is not None and distributed.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(sums)
        values = [float(value) for value in sums.tolist()]
        return TaskScore(values[0], values[1], values[2], passes)

    def metrics(self, score: TaskScore) -> dict[str, float]:
        acc, acc_norm = task_metric_keys(self.name)
        return {acc: score.acc, acc_norm: score.acc_norm}

    def evaluate(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        precision: PrecisionPlan | None,
        distributed: DistributedContext | None,
    ) -> Mapping[str, float]:
        """``eval/<name>/acc`` and ``acc_norm`` (the engine's ``EvalTask``)."""
        return self.metrics(
            self.score(model, device=device, precision=precision, distributed=distributed)
        )
