"""The ``speedtronic`` command: fit (alias train), evaluate, generate, export, validate, schema,
plugins, plot, prepare, tokenizer.

User mistakes (bad config, unknown plugin, missing file, unreadable checkpoint) print
``speedtronic: error: ...`` and exit 2 -- never a traceback. A run that fails while
training prints the error and exits 1 (``--traceback`` shows the full stack).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from speedtronic.commands import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UserError,
    checkpoints,
    corpus,
)
from speedtronic.commands.config_args import add_config_args, add_max_time, load
from speedtronic.user_imports import search_dirs

if TYPE_CHECKING:
    import torch


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speedtronic",
        description="Event-driven PyTorch training with typed callbacks and DiLoCo.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name, help_text in (("fit", "train a model from a config file"), ("train", "alias of fit")):
        fit = sub.add_parser(name, help=help_text)
        add_config_args(fit)
        _add_max_steps(fit)
        add_max_time(fit)
        fit.add_argument(
            "--resume", action="store_true", help="continue from the latest checkpoint"
        )
        fit.add_argument(
            "--resume-from-other-run",
            action="store_true",
            help="resume even from a checkpoint another run wrote (a shared checkpoint "
            "directory); implies --resume",
        )
        fit.add_argument(
            "--overwrite",
            action="store_true",
            help="replace an earlier run in the run directory (deletes its checkpoints and "
            "metrics)",
        )
        _add_launch_args(fit)

    checkpoints.add_parsers(sub)

    validate = sub.add_parser("validate", help="check a config; print it and the callback plan")
    add_config_args(validate)
    _add_max_steps(validate)
    add_max_time(validate)
    validate.add_argument("--format", choices=("yaml", "json"), default="yaml")

    schema = sub.add_parser("schema", help="print the composed JSON Schema of run.yaml")
    schema.add_argument("--write", metavar="DIR", help="write the published schema files to DIR")
    schema.add_argument(
        "--docs",
        metavar="DIR",
        help="regenerate the option tables of the pages in DIR from the declarations",
    )
    schema.add_argument(
        "--package",
        action="store_true",
        help="also rewrite the packaged core schema (speedtronic/schemas/run.schema.json)",
    )
    schema.add_argument(
        "--config", help="also import the config's imports: and include their plugins"
    )

    plugins = sub.add_parser(
        "plugins", help="list models, datasets and callbacks, and where each comes from"
    )
    plugins.add_argument(
        "--config", help="also import the config's imports: and list their plugins"
    )

    plot = sub.add_parser("plot", help="draw a PNG of a run from its metrics.jsonl")
    plot.add_argument("output_dir", help="the run directory")
    plot.add_argument("--out", help="PNG path (default <output_dir>/metrics.png)")
    plot.add_argument(
        "--keys",
        nargs="+",
        metavar="KEY[,KEY...]",
        help="draw these keys instead of the default panels: one panel per argument, "
        "comma-joined keys share it; a key includes the keys under it (lr: lr/group1, ...)",
    )
    corpus.add_parsers(sub)
    _add_common_args(sub.choices.values())
    return parser


def _add_common_args(parsers: Iterable[argparse.ArgumentParser]) -> None:
    """What every subcommand takes (one that declares it itself keeps its own)."""
    for parser in parsers:
        with suppress(argparse.ArgumentError):
            parser.add_argument(
                "--traceback",
                action="store_true",
                help="show the full traceback of an error (user mistakes included)",
            )


def _add_launch_args(parser: argparse.ArgumentParser) -> None:
    """``fit``'s launcher flags (``speedtronic.systems.launch``): start the ranks, like torchrun."""
    launch = parser.add_argument_group("launching ranks (instead of torchrun)")
    launch.add_argument(
        "--nproc-per-node", type=int, help="start N ranks on this node and exit as the run did"
    )
    launch.add_argument("--nnodes", default="1", help="nodes of the job: N or MIN:MAX")
    launch.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node (multi-node)")


def _add_max_steps(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, help="absolute step to stop at")


def _version() -> str:
    from speedtronic._version import __version__

    return f"speedtronic {__version__}"


def _preflight(config: object, *, device: str | None = None, max_steps: int | None = None) -> None:
    """Stop on what cannot work on this machine (exit 2); print one line per warning. The
    same checks for ``validate`` and ``fit`` (``speedtronic.runtime.preflight``)."""
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.runtime import preflight

    assert isinstance(config, SpeedtronicConfig)
    outcome = preflight(config, device=device, max_steps=max_steps)
    for message in outcome.warnings:
        _print_warning(message)
    if outcome.errors:
        raise UserError("; ".join(outcome.errors))


def _checked_max_steps(args: argparse.Namespace) -> int | None:
    """``--max-steps``, within the bounds of ``run.max_steps`` (exit 2 otherwise)."""
    from speedtronic.config.schema import core_maximum

    if args.max_steps is not None and args.max_steps <= 0:
        raise UserError(f"--max-steps must be positive, got {args.max_steps}")
    if args.max_steps is not None and args.max_steps > core_maximum("run", "max_steps"):
        raise UserError(
            f"--max-steps {args.max_steps} is greater than the maximum of "
            f"{core_maximum('run', 'max_steps')} (the bound of run.max_steps)"
        )
    max_steps: int | None = args.max_steps
    return max_steps


def _print_warning(message: str) -> None:
    print(f"speedtronic: warning: {message}", file=sys.stderr)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    """Warnings in the CLI are one clean line each (no source line, no file:line)."""
    del category, filename, lineno, file, line
    _print_warning(str(message))


def _fit(args: argparse.Namespace) -> int:
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.runtime import prepared_fit

    config = load(args)
    if args.nproc_per_node is not None:
        from speedtronic.systems.launch import LaunchError, LaunchOptions, launch_fit

        options = LaunchOptions(args.nproc_per_node, args.nnodes, args.rdzv_endpoint)
        try:
            return launch_fit(options, args.argv)  # the ranks run the rest of this function
        except LaunchError as exc:
            raise UserError(str(exc)) from None
    assert isinstance(config, SpeedtronicConfig)
    _preflight(config, device=args.device, max_steps=_checked_max_steps(args))
    with prepared_fit(
        config,
        resume=args.resume,
        device=args.device,
        max_steps=args.max_steps,
        overwrite=args.overwrite,
        resume_other_run=args.resume_from_other_run,
    ) as trainer:
        main_rank = trainer.distributed is None or trainer.distributed.is_main
        if main_rank and trainer.resumed_from is not None:
            print(trainer.resumed_from.describe(Path.cwd()), flush=True)
        start_step = trainer.step
        with _callback_failures() as failed:
            result = trainer.fit()
    if main_rank:
        loss = "None" if result.final_loss is None else f"{result.final_loss!r}"
        this_run = f" (this run: {result.steps - start_step} steps)" if start_step else ""
        print(
            f"completed steps={result.steps} samples={result.samples} tokens={result.tokens} "
            f"loss={loss}{this_run}"
        )
        if result.stop_reason:
            print(f"stopped early: {result.stop_reason}")
    from speedtronic.state.signals import stop_exit_code

    # A signal stop (after the final checkpoint) exits 128+signal so a scheduler requeues it;
    # a spent time budget exits 75 (EX_TEMPFAIL), for the same purpose; a plugin's stop for
    # bad input (after the final checkpoint too) exits 2, as any other user mistake.
    requeue = stop_exit_code(result.stop_reason)
    if requeue is None and failed:
        # Observers never stop training, but what they failed to write is lost: say so.
        more = f" (and {len(failed) - 1} more callback failure(s) above)" if failed[1:] else ""
        print(f"speedtronic: error: the run finished, but {failed[0]}{more}", file=sys.stderr)
        return EXIT_FAILED
    return requeue or EXIT_OK


@contextmanager
def _callback_failures() -> Iterator[list[str]]:
    """Collect the observer failures (``CallbackWarning``) shown while the block runs."""
    from speedtronic.engine.dispatch import CallbackWarning

    failed: list[str] = []
    show = warnings.showwarning

    def record(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, CallbackWarning):
            failed.append(str(message).split(" (training continues;")[0])
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    try:
        yield failed
    finally:
        warnings.showwarning = show


def _validate(args: argparse.Namespace) -> int:
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.engine.dispatch import describe_classes, format_plan
    from speedtronic.runtime import callback_classes

    config = load(args)
    assert isinstance(config, SpeedtronicConfig)
    _preflight(config, device=args.device, max_steps=_checked_max_steps(args))
    # Everything that can still refuse the run comes before the first line is printed.
    classes = callback_classes(config)
    _check_callbacks(config)
    plan = format_plan(describe_classes(classes))
    model = _meta_model(config)
    _check_shardable(config, model)
    summary, routing = _model_summary(model), _routing_table(config, model)
    if args.format == "json":
        print(json.dumps(config.to_dict(redact_secrets=True), indent=2))
    else:
        print(config.to_yaml(redact_secrets=True), end="")
    print("\n# callbacks: " + (", ".join(name for name, _ in classes) or "none"))
    print("# per-event plan (callbacks run in this order):")
    print("\n".join("# " + line for line in plan.splitlines()))
    print("# model summary (parameters per top-level module):")
    print("\n".join("# " + line for line in summary.splitlines()))
    print("# optimizer routing (which parameter goes where, and why):")
    print("\n".join("# " + line for line in routing.splitlines()))
    print(
        f"# OK: {args.config} is valid ({len(classes)} callbacks, "
        f"{config.target_steps} steps, model {config.model.name!r})"
    )
    return EXIT_OK


def _check_callbacks(config: object) -> None:
    """The run's callbacks built as ``fit`` builds them (no hook runs), and ``fit``'s check
    of their state keys: two that share one (two ``nan_guard`` entries) are refused here too."""
    import torch

    from speedtronic.config import SpeedtronicConfig
    from speedtronic.engine.dispatch import DuplicateStateKeyError, check_state_keys
    from speedtronic.plugins import PluginContext
    from speedtronic.runtime import build_callbacks

    assert isinstance(config, SpeedtronicConfig)
    context = PluginContext(config, Path(config.run.output_dir), torch.device("cpu"))
    try:
        check_state_keys(build_callbacks(config, context))
    except DuplicateStateKeyError as exc:
        raise UserError(str(exc)) from None


def _check_shardable(config: object, model: torch.nn.Module) -> None:
    """``parallel.strategy: fsdp`` needs a model with blocks to shard, and ``parallel.tensor``
    a plan for its family whose shapes the degree divides (exit 2 otherwise)."""
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.systems.sharding import ShardingError, find_shard_blocks

    assert isinstance(config, SpeedtronicConfig)
    if config.parallel.strategy != "fsdp":
        return
    import os

    from speedtronic.systems.tensor_parallel import check_tensor_parallel

    try:
        find_shard_blocks(model)
        if config.parallel.tensor > 1:  # the plan, the shapes and (under torchrun) the world
            world = os.environ.get("WORLD_SIZE", "")
            world_size = int(world) if world.isdigit() else None
            check_tensor_parallel(model, config.parallel.tensor, world_size)
    except ShardingError as exc:
        raise UserError(str(exc)) from None


def _meta_model(config: object) -> torch.nn.Module:
    """The config's model built on the meta device (no memory, no init cost)."""
    import torch

    from speedtronic.config import SpeedtronicConfig
    from speedtronic.models.registry import build_model

    assert isinstance(config, SpeedtronicConfig)  # validated: its imports: are imported
    with torch.device("meta"):
        return build_model(config.model)


def _model_summary(model: torch.nn.Module) -> str:
    from speedtronic.models.summary import format_model_summary, summarize_model

    return format_model_summary(summarize_model(model))


def _routing_table(config: object, model: torch.nn.Module) -> str:
    """Route the (meta) model's parameters as the optimizer will."""
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.optimizers import describe_routing, format_routing_table

    assert isinstance(config, SpeedtronicConfig)
    return format_routing_table(describe_routing(model, config.optimizer))


def _import_config_modules(args: argparse.Namespace) -> None:
    """``--config``: import the modules its ``imports:`` lists (their registrations run).
    Only ``imports:`` is read, so a config that is otherwise invalid still lists them."""
    if not getattr(args, "config", None):
        return
    from speedtronic.config.loading import read_file
    from speedtronic.plugins import import_modules

    path = Path(args.config)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    imports = read_file(path).get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(name, str) for name in imports):
        raise UserError(f"{path}: imports must be a list of module names")
    import_modules(imports)


def _schema(args: argparse.Namespace) -> int:
    from speedtronic.config import composed_schema, write_schemas
    from speedtronic.config.docs_tables import write_docs
    from speedtronic.config.schema import write_packaged_core_schema

    _import_config_modules(args)
    if args.write:
        names = None
        if args.config:
            from speedtronic.plugins import callback_registry

            names = callback_registry.names()
        for path in write_schemas(Path(args.write), names):
            print(f"wrote {path}")
    if args.package:
        print(f"wrote {write_packaged_core_schema()}")
    if args.docs:
        for page in write_docs(Path(args.docs)):
            print(f"wrote {page}")
    if not (args.write or args.package or args.docs):
        print(json.dumps(composed_schema(model_options=True), indent=2))
    return EXIT_OK


def _plugins(args: argparse.Namespace) -> int:
    from speedtronic.data import collate_registry, dataset_registry
    from speedtronic.models.registry import registry
    from speedtronic.plugins import PluginRegistry, callback_registry

    _import_config_modules(args)
    registries: list[tuple[str, PluginRegistry[object]]] = [
        ("models", registry),  # type: ignore[list-item]  # invariance: read-only use
        ("datasets", dataset_registry),  # type: ignore[list-item]  # invariance: read-only use
        ("collates", collate_registry),  # type: ignore[list-item]  # invariance: read-only use
        ("callbacks", callback_registry),  # type: ignore[list-item]  # invariance: read-only use
    ]
    for title, reg in registries:
        print(f"{title}:")
        for name in reg.names():
            print(f"  {name:<24} {reg.origin(name)}")
            schema = _options_schema(title, name)
            if schema:
                print(f"    options: {_schema_keys(schema)}")
    return EXIT_OK


def _options_schema(kind: str, name: str) -> dict[str, object] | None:
    """The options schema a model or callback plugin declares (None for the others)."""
    from speedtronic.models.registry import registry
    from speedtronic.plugins import PluginError, callback_options_schema

    try:
        if kind == "models":
            declared = registry.options_schema(name)
        elif kind == "callbacks":
            declared = callback_options_schema(name)
        else:
            return None
    except PluginError:
        return None
    return dict(declared) if declared else None


def _schema_keys(schema: dict[str, object]) -> str:
    """The option names an object schema declares (``speedtronic schema`` has the rest)."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return "none"
    return ", ".join(str(key) for key in properties)


def _plot(args: argparse.Namespace) -> int:
    from speedtronic.plotting import plot_run

    out = plot_run(Path(args.output_dir), Path(args.out) if args.out else None, keys=args.keys)
    print(f"wrote {out}")
    return EXIT_OK


_COMMANDS = {
    "fit": _fit,
    "train": _fit,
    "evaluate": checkpoints.evaluate_command,
    "generate": checkpoints.generate_command,
    "export": checkpoints.export_command,
    "validate": _validate,
    "schema": _schema,
    "plugins": _plugins,
    "plot": _plot,
    "prepare": corpus.prepare_command,
    "tokenizer": corpus.tokenizer_command,
}


def _user_error_types() -> tuple[type[BaseException], ...]:
    import yaml

    from speedtronic.config import ConfigError
    from speedtronic.data import DataSourceError
    from speedtronic.engine.dispatch import DuplicateStateKeyError, FilterError, UnknownHookError
    from speedtronic.engine.oom_retry import MicroBatchError
    from speedtronic.engine.trainer import TrainingStateError
    from speedtronic.plotting import PlotError
    from speedtronic.plugins import PluginError
    from speedtronic.state.checkpoint import CheckpointError
    from speedtronic.state.run_lock import RunDirectoryError
    from speedtronic.systems.distributed import DistributedSetupError
    from speedtronic.systems.sharding import ShardingError

    return (
        UserError,
        ConfigError,
        DistributedSetupError,
        PluginError,
        PlotError,
        CheckpointError,
        RunDirectoryError,
        TrainingStateError,
        MicroBatchError,
        ShardingError,
        UnknownHookError,  # a user's callback: a typo'd hook, a shared state_key, a bad filter
        DuplicateStateKeyError,
        FilterError,
        DataSourceError,
        FileNotFoundError,
        yaml.YAMLError,
    )


def _user_module_dirs(args: argparse.Namespace) -> list[Path]:
    """Where the config's ``imports:`` are looked for (after installed packages): the working
    directory, then the config file's directory. Nothing else there is importable."""
    dirs = [Path.cwd()]
    if getattr(args, "config", None):
        dirs.append(Path(args.config).parent)
    return dirs


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the launcher passes on
    with warnings.catch_warnings(), search_dirs(*_user_module_dirs(args)):
        warnings.simplefilter("default")
        warnings.showwarning = _show_warning
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.command](args)
    except BrokenPipeError:
        # ``speedtronic validate | head``: the reader left; say nothing more.
        _silence_stdout()
        return EXIT_FAILED if args.command in ("fit", "train") else EXIT_OK
    except KeyboardInterrupt:
        print("speedtronic: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        user_error = isinstance(exc, _user_error_types())
        if _reported_by_rank_zero(exc):
            return EXIT_USAGE if user_error else EXIT_FAILED
        if user_error:
            if args.traceback:  # asked for: where the mistake was found, then the message
                traceback.print_exception(exc, file=sys.stderr)
            print(f"speedtronic: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if args.traceback:
            raise
        print(f"speedtronic: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("(run again with --traceback for the full stack)", file=sys.stderr)
        return EXIT_FAILED


_RANK_ZERO_REPORTS_WITHIN_S = 5.0


def _reported_by_rank_zero(exc: BaseException) -> bool:
    """An error every rank raises alike is printed by rank 0 only (once per job). Another
    rank exits with the same code without a word -- a few seconds later: rank 0 raises the
    error too, prints it and exits, and the launcher stops the other ranks meanwhile.
    Exiting at once would let the launcher stop rank 0 before it printed, and report this
    rank's code for a message nobody saw."""
    import os
    import time

    from speedtronic.systems.distributed import SameOnEveryRankError

    if not isinstance(exc, SameOnEveryRankError) or os.environ.get("RANK", "0") == "0":
        return False
    time.sleep(_RANK_ZERO_REPORTS_WITHIN_S)
    return True
