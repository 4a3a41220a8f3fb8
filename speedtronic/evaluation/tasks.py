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

Batched (``speedtronic.evaluation.likelihood``): all (row, choice) sequences are sorted by
length and cut into batches of ``batch_size``, right-padded, so a 1,000-row task costs
``ceil(sequences / batch_size)`` forward passes; any causal LM returning ``{"logits"}``
works.

In a distributed run each rank scores every ``world_size``-th row and the three counts are
all-reduced, so the metrics are those of the whole file. That holds under FSDP too: the
ranks of a sharded model run their forward passes in lockstep (a rank with fewer batches
makes one-token passes to match, ``score_continuations``).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic.evaluation.likelihood import Continuation, LikelihoodError, score_continuations

if TYPE_CHECKING:
    from speedtronic.systems.distributed import DistributedContext
    from speedtronic.systems.precision import PrecisionPlan

__all__ = ["ChoiceRow", "MultipleChoiceTask", "TaskError", "read_task"]

_FEWSHOT_SEPARATOR = "\n\n"
_CHOICE_SEPARATOR = " "
_MAX_TASK_BYTES = 1 << 30
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
        if file.stat().st_size > _MAX_TASK_BYTES:
            raise TaskError(f"{file}: larger than {_MAX_TASK_BYTES} bytes")
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


def _task_metric_keys(name: str) -> tuple[str, str]:
    """The metric keys of task ``name``: ``eval/<name>/acc`` and ``eval/<name>/acc_norm``."""
    return f"eval/{name}/acc", f"eval/{name}/acc_norm"


@dataclass(frozen=True)
class _TaskScore:
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


def _prompt(rows: Sequence[ChoiceRow], index: int, shots: int, seed: int) -> str:
    others = [i for i in range(len(rows)) if i != index]
    picked = random.Random(seed * 1_000_003 + index).sample(others, min(shots, len(others)))
    examples = [
        rows[i].context + _CHOICE_SEPARATOR + rows[i].choices[rows[i].answer] for i in picked
    ]
    return _FEWSHOT_SEPARATOR.join([*examples, rows[index].context])


def _is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP-sharded (its forwards gather shards with the other ranks)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


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

    def _requests(self, indices: Sequence[int]) -> list[tuple[int, int, Continuation]]:
        """``(row, choice, continuation)`` of every choice of the rows ``indices``."""
        requests = []
        for index in indices:
            prompt = tuple(self.encode(_prompt(self.rows, index, self.shots, self.seed)))
            for choice, text in enumerate(self.rows[index].choices):
                tokens = tuple(self.encode(_CHOICE_SEPARATOR + text))
                label = f"task {self.name}: row {index + 1} choice {choice}"
                requests.append((index, choice, Continuation(prompt, tokens, label)))
        return requests

    def score(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        precision: PrecisionPlan | None = None,
        distributed: DistributedContext | None = None,
    ) -> _TaskScore:
        """Score the model on the task's rows (up to ``max_rows``); the model's mode and the
        random state are left as they were."""
        rank, world = (distributed.rank, distributed.world_size) if distributed else (0, 1)
        count = len(self.rows) if self.max_rows is None else min(self.max_rows, len(self.rows))
        requests = self._requests(range(rank, count, world))
        try:
            scored, passes = score_continuations(
                model,
                [continuation for _, _, continuation in requests],
                device=device,
                batch_size=self.batch_size,
                context=self.context,
                precision=precision,
                lockstep=distributed if _is_sharded(model) else None,
            )
        except LikelihoodError as exc:
            raise TaskError(str(exc)) from None
        totals: dict[int, list[float]] = {}
        for (row, choice, _), result in zip(requests, scored, strict=True):
            totals.setdefault(row, [0.0] * len(self.rows[row].choices))[choice] = result.logprob
        return self._reduce(totals, passes, device, distributed)

    def _reduce(
        self,
        totals: Mapping[int, list[float]],
        passes: int,
        device: torch.device,
        distributed: DistributedContext | None,
    ) -> _TaskScore:
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
        return _TaskScore(values[0], values[1], values[2], passes)

    def metrics(self, score: _TaskScore) -> dict[str, float]:
        acc, acc_norm = _task_metric_keys(self.name)
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
