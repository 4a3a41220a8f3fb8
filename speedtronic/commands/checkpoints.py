"""``speedtronic evaluate``, ``generate`` and ``export``: the commands that read a run's
checkpoint (its latest, or ``--checkpoint``; the model's weights or a callback's,
``--weights``) and write nothing into the run."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from speedtronic.commands import EXIT_OK, UserError
from speedtronic.commands.config_args import add_config_args, load, loaded_config

if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig

__all__ = ["add_parsers", "evaluate_command", "export_command", "generate_command"]

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_parsers(sub: Subcommands) -> None:
    """The ``evaluate``, ``generate`` and ``export`` subcommands."""
    evaluate = _checkpoint_parser(sub, "evaluate")
    _add_weights_arg(evaluate)
    evaluate.add_argument(
        "--task",
        dest="tasks",
        action="append",
        metavar="FILE.jsonl",
        help="score a multiple-choice task file instead of the held-out set (repeatable; "
        "docs/evaluation.md)",
    )
    evaluate.add_argument(
        "--shots", type=int, default=0, help="examples asked before each --task row"
    )
    _add_generate_parser(sub)

    export = _checkpoint_parser(sub, "export")
    export.add_argument("--output", required=True, help="the directory to write")
    _add_flags(
        export,
        {
            "--overwrite": "replace an earlier export in --output",
            "--allow-nonfinite": "write weights that hold NaN or infinite values (refused by "
            "default)",
        },
    )
    _add_weights_arg(export)
    _add_flags(  # one or the other
        export.add_mutually_exclusive_group(),
        {
            "--adapter": "a LoRA run: write its adapters for peft",
            "--merge": "a LoRA run: write the weights with the adapters merged",
        },
    )


def _add_generate_parser(sub: Subcommands) -> None:
    generate = _checkpoint_parser(sub, "generate")
    _add_weights_arg(generate)
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=100, help="default 100")
    generate.add_argument(
        "--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)"
    )
    generate.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


_READERS: dict[str, tuple[str, str]] = {
    "evaluate": (
        "evaluate a run's checkpoint on its held-out set (writes nothing)",
        "checkpoint file to evaluate",
    ),
    "generate": ("print what a run's checkpoint writes after a prompt", "checkpoint file to load"),
    "export": (
        "write a run's checkpoint as a Hugging Face model directory",
        "checkpoint file or .dcp directory",
    ),
}
"""The subcommands that read a run's checkpoint: their help, and what ``--checkpoint`` names."""


def _checkpoint_parser(sub: Subcommands, name: str) -> argparse.ArgumentParser:
    """The subcommand ``name`` (one of ``_READERS``), with the config arguments and
    ``--checkpoint`` (default: the run's latest)."""
    description, checkpoint = _READERS[name]
    parser = sub.add_parser(name, help=description)
    add_config_args(parser)
    parser.add_argument("--checkpoint", help=f"{checkpoint} (default: the run's latest)")
    return parser


def _add_flags(parser: argparse._ActionsContainer, flags: Mapping[str, str]) -> None:
    """On/off options (``store_true``), each with its help."""
    for flag, description in flags.items():
        parser.add_argument(flag, action="store_true", help=description)


def _add_weights_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        default="model",
        metavar="{model,ema,...}",
        help="which weights: the model's own (default), or those a callback kept in the "
        "checkpoint under its state key, e.g. ema (docs/ema-and-profiling.md)",
    )


def _weights_note(weights: str) -> str:
    return "" if weights == "model" else f" weights={weights}"


def evaluate_command(args: argparse.Namespace) -> int:
    """``speedtronic evaluate``: one line with the held-out metrics of a checkpoint (or its
    ``--task`` scores). Reads the config, the checkpoint and the held-out data; writes
    nothing (no lock, no metrics)."""
    from speedtronic.data import DataSourceError
    from speedtronic.engine.evaluation import EVAL_LOSS, EVAL_PPL, EvaluationError
    from speedtronic.runtime import evaluate_checkpoint

    config = loaded_config(args)
    if args.tasks:
        return _evaluate_tasks(args, config)
    try:
        loaded, outcome = evaluate_checkpoint(
            config, checkpoint=args.checkpoint, device=args.device, weights=args.weights
        )
    except (EvaluationError, DataSourceError) as exc:
        raise UserError(str(exc)) from None
    metrics = outcome.metrics
    parts = "".join(  # a mixture's eval/<source>/loss
        f"{key}={value!r} " for key, value in metrics.items() if key not in (EVAL_LOSS, EVAL_PPL)
    )
    print(
        f"{EVAL_LOSS}={metrics[EVAL_LOSS]!r} {EVAL_PPL}={metrics[EVAL_PPL]!r} {parts}"
        f"step={loaded.step} batches={outcome.batches} checkpoint={loaded.path}"
        f"{_weights_note(args.weights)}"
    )
    return EXIT_OK


def _evaluate_tasks(args: argparse.Namespace, config: SpeedtronicConfig) -> int:
    """``speedtronic evaluate --task``: one line per task file."""
    from speedtronic.config.sections import EvalTaskSource
    from speedtronic.runtime import checkpoint_model, eval_tasks
    from speedtronic.systems.precision import resolve_precision

    if args.shots < 0:
        raise UserError(f"--shots must be >= 0, got {args.shots}")
    loaded, net = checkpoint_model(
        config, checkpoint=args.checkpoint, device=args.device, weights=args.weights
    )
    device = next(net.parameters()).device
    config.eval.tasks = [EvalTaskSource(path=path, shots=args.shots) for path in args.tasks]
    for task in eval_tasks(config, net):
        score = task.score(
            net, device=device, precision=resolve_precision(config.precision, device)
        )
        values = " ".join(f"{key}={value!r}" for key, value in task.metrics(score).items())
        print(
            f"{values} rows={int(score.rows)} step={loaded.step} checkpoint={loaded.path}"
            f"{_weights_note(args.weights)}"
        )
    return EXIT_OK


def generate_command(args: argparse.Namespace) -> int:
    """``speedtronic generate``: the prompt's continuation, decoded with the run's tokenizer."""
    from speedtronic.evaluation.text import TextError, run_text
    from speedtronic.models.generation import GenerationError, Sampling, generate_ids
    from speedtronic.runtime import checkpoint_model

    config = loaded_config(args)
    try:
        text = run_text(config.data.to_dict())
        sampling = Sampling(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            stop_ids=text.stop_ids,
        )
    except (TextError, GenerationError) as exc:
        raise UserError(_option_named(str(exc))) from None
    _, net = checkpoint_model(
        config,
        checkpoint=args.checkpoint,
        device=args.device,
        weights=args.weights,
        doing="generate from",
    )
    try:
        ids = generate_ids(
            net, text.encode(args.prompt), sampling, context=config.model.max_seq_len
        )
    except GenerationError as exc:
        raise UserError(_option_named(str(exc))) from None
    print(args.prompt + text.decode(ids))
    return EXIT_OK


def _option_named(message: str) -> str:
    """A generation error prefixed by the option the user can change."""
    for words, option in (
        ("the prompt (", "--max-new-tokens"),
        ("prompt", "--prompt"),
        ("max_new_tokens", "--max-new-tokens"),
        ("temperature", "--temperature"),
        ("top_k", "--top-k"),
    ):
        if words in message:
            return f"{option}: {message}"
    return message


def export_command(args: argparse.Namespace) -> int:
    """``speedtronic export``: one line naming what was written, and from which checkpoint."""
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.models.export import ExportError
    from speedtronic.runtime import export_checkpoint

    config = load(args)
    assert isinstance(config, SpeedtronicConfig)
    try:
        loaded, result = export_checkpoint(
            config,
            Path(args.output),
            checkpoint=args.checkpoint,
            overwrite=args.overwrite,
            weights=args.weights,
            allow_nonfinite=args.allow_nonfinite,
            adapter=args.adapter,
            merge=args.merge,
        )
    except ExportError as exc:
        raise UserError(str(exc)) from None
    print(
        f"wrote {result.output} ({result.architecture}: {', '.join(result.files)}) "
        f"step={loaded.step} checkpoint={loaded.path}{_weights_note(args.weights)}"
    )
    return EXIT_OK
