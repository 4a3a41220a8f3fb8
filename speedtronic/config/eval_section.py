"""The ``eval:`` section and its tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from speedtronic.config.declare import Opt
from speedtronic.config.section_base import STEPS_MAX, JSONValue, Section, redacted_repr


@dataclass(repr=False)
class EvalConfig(Section):
    """``eval:`` -- evaluation on a held-out set: how often, how much, and from where (no
    data option: the training source's held-out split, see ``docs/evaluation.md``)."""

    section_name: ClassVar[str] = "eval"
    section_doc: ClassVar[str] = (
        "Evaluation on a held-out set during training (and for `speedtronic evaluate`)."
    )

    every_steps: Annotated[
        int | None,
        Opt(
            "evaluate every N global steps and on the final step; `null`: no evaluation "
            "during training. A `monitor: eval/...` (checkpoint, early stopping) needs it",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None
    max_batches: Annotated[
        int | None,
        Opt(
            "batches per evaluation, all ranks together (`data.micro_batch_size` samples each; "
            "each rank reads its share); `null`: the whole "
            "held-out set",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None
    fraction: Annotated[
        float,
        Opt(
            "the tail of a training text file kept out of training as the held-out set (only "
            "while `every_steps` is set and no other held-out source is named); token shards "
            "fix their split at `speedtronic prepare --eval-fraction` instead",
            exclusive_minimum=0,
            maximum=0.5,
        ),
    ] = 0.05
    text_path: Annotated[
        str | None,
        Opt("a UTF-8 file to evaluate on instead (through `data.tokenizer`)", min_length=1),
    ] = None
    dataset: Annotated[
        str | None,
        Opt("a registered dataset to evaluate on instead (not with `text_path`)", min_length=1),
    ] = None
    dataset_options: Annotated[
        dict[str, JSONValue],
        Opt("options of the `eval.dataset` factory (`DatasetRequest.options`)"),
    ] = field(default_factory=dict)
    tasks: Annotated[
        list[EvalTaskSource],
        Opt(
            "multiple-choice tasks scored with the held-out set on every evaluation "
            "(`eval/<name>/acc`, `eval/<name>/acc_norm`); needs a run on text",
            extra={"maxItems": 64},
            type_text="list of `{path, name, shots, seed, max_rows, batch_size}`",
        ),
    ] = field(default_factory=list)

    def __repr__(self) -> str:
        return redacted_repr(self)


@dataclass(frozen=True)
class EvalTaskSource:
    """One multiple-choice task scored on evaluation steps (docs/evaluation.md)."""

    path: Annotated[
        str,
        Opt("a local JSONL file of `{context, choices, answer}` rows", min_length=1),
    ]
    name: Annotated[
        str | None,
        Opt(
            "the metric name, `eval/<name>/acc` and `acc_norm`; default: the file's stem",
            min_length=1,
            pattern=r"^[A-Za-z0-9_.-]+$",
        ),
    ] = None
    shots: Annotated[
        int, Opt("examples from the same file asked before each row", minimum=0, maximum=64)
    ] = 0
    seed: Annotated[int, Opt("seeds the choice of the examples", minimum=0, maximum=2**32 - 1)] = 0
    max_rows: Annotated[
        int | None, Opt("score the first N rows; `null`: all", minimum=1, maximum=STEPS_MAX)
    ] = None
    batch_size: Annotated[
        int, Opt("sequences (one per choice) per forward pass", minimum=1, maximum=4096)
    ] = 16

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "path": self.path,
            "name": self.name,
            "shots": self.shots,
            "seed": self.seed,
            "max_rows": self.max_rows,
            "batch_size": self.batch_size,
        }
