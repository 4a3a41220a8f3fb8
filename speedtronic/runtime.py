"""The composition root: config -> model, data, optimizer, callbacks, Trainer.

``build_runtime`` follows the original construction order (seed, device, model, precision
and shape checks, data, optimizer, scheduler, callbacks, trainer, resume) and returns
``(trainer, checkpoint_manager)``; ``train_from_config`` also fits. The runtime names no
plugin: which callbacks a config turns on, and with which options, each plugin declares in
its ``PluginSpec`` (``enabled_by_default``, ``sections``, ``implied_order``); the checkpoint
manager comes from the callback that is a ``ResumeSource``.

Under ``torchrun`` the device step also joins the process group (``setup_distributed``):
the device becomes the local rank's, the data loader shards by rank, and the trainer gets
the ``DistributedContext`` (``trainer.distributed``). The group is destroyed by
``train_from_config`` when it returns, or at interpreter exit.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch.utils.data import Dataset

# The names that moved to composition.run_callbacks keep their speedtronic.runtime paths.
from speedtronic.composition.run_callbacks import ShardsData as ShardsData
from speedtronic.composition.run_callbacks import build_callbacks as build_callbacks
from speedtronic.composition.run_callbacks import callback_classes as callback_classes
from speedtronic.composition.run_callbacks import callback_specs as callback_specs
from speedtronic.composition.run_callbacks import data_shard as data_shard
from speedtronic.composition.run_callbacks import optimizer_section as optimizer_section
from speedtronic.composition.run_callbacks import resume_source
from speedtronic.composition.trainer_settings import configured_settings
from speedtronic.config import ConfigError, ConfigSource, SpeedtronicConfig
from speedtronic.config.preflight import Preflight, check
from speedtronic.data import DataSourceError, build_dataloader
from speedtronic.data.held_out import (
    build_eval_loader,
    held_out_dataset,
    known_empty,
    training_excludes_tail,
)
from speedtronic.data.held_out_sources import held_out_parts
from speedtronic.data.loader import training_dataset
from speedtronic.engine.callback import Callback
from speedtronic.engine.evaluation import EvalOutcome, HeldOutParts, evaluate_model
from speedtronic.engine.mixture_metrics import mixture_metrics
from speedtronic.engine.result import TrainResult
from speedtronic.engine.stage_streams import StageStreamCallback
from speedtronic.engine.trainer import Trainer, TrainingStateError
from speedtronic.evaluation.tasks import MultipleChoiceTask, TaskError, read_task
from speedtronic.evaluation.text import TextError, run_text
from speedtronic.models.adapters import has_lora, merge_lora
from speedtronic.models.export import (
    ExportError,
    ExportResult,
    check_export_target,
    export_model,
    export_tokens,
)
from speedtronic.models.generation import context_length
from speedtronic.models.hf import adapt_model
from speedtronic.models.registry import build_model
from speedtronic.models.summary import parameter_count
from speedtronic.optimizers import build_optimizer as build_optimizer  # 2.0's import path
from speedtronic.optimizers import build_scheduler as build_scheduler
from speedtronic.plugins import PluginContext
from speedtronic.state.checkpoint import CheckpointError, CheckpointManager, LoadedCheckpoint
from speedtronic.state.model_fit import model_mismatch, tensor_shapes
from speedtronic.state.published_weights import MODEL_WEIGHTS, apply_weights, published_weights
from speedtronic.state.resume import resume_from
from speedtronic.state.rng import seed_everything
from speedtronic.state.run_identity import new_run_id, read_run_id, write_run_id
from speedtronic.state.run_lock import (
    RunClaim,
    check_earlier_run,
    claim_run_directory,
    earlier_run_files,
    launched_as_main_process,
)
from speedtronic.state.sharded_checkpoint import (
    SHARDED_DIRECTORY,
    SHARDED_SUFFIX,
    load_sharded_weights,
)
from speedtronic.systems.distributed import (
    DistributedContext,
    setup_distributed,
    teardown_distributed,
)
from speedtronic.systems.precision import resolve_device, resolve_precision
from speedtronic.systems.shapes import validate_startup_shapes
from speedtronic.systems.stage_streams import StageStreamScheduler
from speedtronic.systems.tensor_parallel import data_parallel_share
from speedtronic.user_warnings import warn

if TYPE_CHECKING:
    from speedtronic.compat.metric_logger import build_logger as build_logger

_DEFAULT_CHECKPOINT_DIRECTORY = "checkpoints"
"""Where ``--resume`` looks (under the output directory) when no plugin of the run is a
``ResumeSource``; the manager ``build_runtime`` then returns is disabled."""


def as_config(config: ConfigSource) -> SpeedtronicConfig:
    """A validated ``SpeedtronicConfig`` from any supported source. A config object is
    checked again only when it changed since it was validated
    (``SpeedtronicConfig.ensure_valid``): it passes through several builders of a run. Its
    ``imports:`` were imported by that validation."""
    if isinstance(config, SpeedtronicConfig):
        return config.ensure_valid()
    return SpeedtronicConfig.load(config)


AUTO_THREADS_MAX_PARAMETERS = 20_000_000
"""``run.threads: auto`` trains models below this many parameters on one CPU thread."""


def choose_threads(
    setting: int | str, device: torch.device, parameters: int
) -> tuple[int | None, str]:
    """``(threads, why)`` for ``run.threads``; ``threads`` is None where torch's default is
    kept. ``auto`` on the CPU: one thread for a model under ``AUTO_THREADS_MAX_PARAMETERS``
    parameters (its per-op work is too small to split, and on a busy machine extra threads
    wait for each other), torch's default for larger models. On an accelerator the CPU only
    feeds the device, so ``auto`` keeps torch's default; an ``OMP_NUM_THREADS`` set in the
    environment is always respected."""
    if not isinstance(setting, str):
        return setting, "run.threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return None, "OMP_NUM_THREADS"
    if device.type != "cpu":
        return None, f"auto, {device.type}"
    if parameters < AUTO_THREADS_MAX_PARAMETERS:
        return 1, "auto"
    return None, "auto, large model"


def _apply_threads(setting: int | str, device: torch.device, model: torch.nn.Module) -> int:
    """Set torch's intra-op thread count as ``run.threads`` says; returns the count in use."""
    threads, _ = choose_threads(setting, device, parameter_count(model))
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _epoch_step_limit(loader: object, max_epochs: int | None, accumulation: int) -> int | None:
    """The global steps ``max_epochs`` passes over ``loader`` make (a step the last epoch
    cannot fill is not taken), or None when the loader has no length (an iterable
    dataset: the data stream then ends the fit when it runs out)."""
    if max_epochs is None:
        return None
    try:
        batches = len(loader)  # type: ignore[arg-type]  # any Sized loader; TypeError otherwise
    except TypeError:
        return None
    return max(1, max_epochs * batches // accumulation)


def build_runtime(
    config: ConfigSource,
    *,
    resume: bool = False,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    model: torch.nn.Module | None = None,
    dataloader: Iterable[object] | None = None,
    extra_callbacks: Sequence[Callback] = (),
    overwrite: bool | None = None,
    claim: RunClaim | None = None,
    resume_other_run: bool = False,
) -> tuple[Trainer, CheckpointManager]:
    """Build everything a run needs. ``max_steps`` is the absolute step to stop at (it does
    not change the LR schedule's horizon, so a stopped run resumes on the same schedule).

    ``overwrite`` checks the run directory for an earlier run's files (the plugins say which,
    ``speedtronic.state.run_lock.LeavesRunFiles``): ``False`` refuses a fresh run over them,
    ``True`` deletes them first; ``None`` (the default, as in 2.0) does not look.

    ``claim`` (what ``claim_run_directory`` yields, as the CLI and ``train_from_config``
    hold it) also locks every path the plugins write (``RunClaim.cover``) before the
    earlier-run check, and records the run's id in the run directory. The trainer's
    ``run_id`` is the run directory's on resume (``speedtronic.state.run_identity``), a new
    one on a fresh start; resuming another run's checkpoint is refused unless
    ``resume_other_run`` (which also resumes)."""
    cfg = as_config(config)
    logging.getLogger("speedtronic").setLevel(cfg.logging.level)
    seed_everything(cfg.run.seed)
    requested_device = device if device is not None else cfg.run.device
    distributed = setup_distributed(requested_device, timeout_s=cfg.distributed.timeout_s)
    resolved_device = (
        distributed.device if distributed is not None else resolve_device(requested_device)
    )
    if model is None:
        net = build_model(cfg.model)
    else:  # the config's data is next-token aligned: a raw transformers causal LM is wrapped
        net = model if dataloader is not None else adapt_model(model)
    net.to(resolved_device)
    _apply_threads(cfg.run.threads, resolved_device, net)
    precision = resolve_precision(cfg.precision, resolved_device)
    shape_report = validate_startup_shapes(cfg, net, resolved_device, precision)
    # Absolute, so plugins resolving paths at build time and at setup agree.
    output_dir = Path(cfg.run.output_dir).expanduser().resolve()
    context = PluginContext(config=cfg, output_dir=output_dir, device=resolved_device)
    callbacks = build_callbacks(cfg, context) + list(extra_callbacks)
    if claim is not None:
        claim.cover(callbacks)  # before anything looks at or writes those paths
    if cfg.ooo_backprop:
        streams = StageStreamScheduler(net, resolved_device, num_streams=cfg.ooo_streams)
        callbacks.append(StageStreamCallback(streams))
    shard_index, shard_count = data_shard(callbacks, distributed, cfg.parallel.tensor)
    try:
        loader = (
            dataloader
            if dataloader is not None
            else build_dataloader(
                cfg.data,
                pin_memory_device=resolved_device.type == "cuda",
                vocab_size=cfg.data.vocab_size,
                rank=shard_index,
                world_size=shard_count,
                held_out_fraction=training_excludes_tail(cfg.eval),
            )
        )
    except DataSourceError as exc:  # what ``preflight`` reports (exit 2 in the CLI)
        raise ConfigError(str(exc)) from None
    callbacks.extend(mixture_metrics(loader))  # data/<source>/samples, on logging steps
    target_step = max_steps if max_steps is not None else cfg.target_steps
    horizon = cfg.scheduler_steps
    epoch_steps = _epoch_step_limit(loader, cfg.run.max_epochs, cfg.accumulation_steps)
    if epoch_steps is not None:
        if epoch_steps > target_step:
            warn(
                f"run.max_epochs: {cfg.run.max_epochs} epoch(s) are {epoch_steps} steps, but the "
                f"run stops at step {target_step} first (run.max_steps); raise run.max_steps to "
                "train every epoch",
            )
        target_step = min(target_step, epoch_steps)
        if cfg.scheduler.max_steps is None:
            horizon = min(horizon, epoch_steps)
    eval_data = held_out_loader(cfg, distributed) if cfg.eval.every_steps is not None else None
    tasks = eval_tasks(cfg, net) if cfg.eval.every_steps is not None else []
    optimizer = build_optimizer(net, optimizer_section(cfg.optimizer, callbacks), resolved_device)
    scheduler = build_scheduler(optimizer, cfg.scheduler, horizon)
    source = resume_source(callbacks)
    manager = (
        source.checkpoint_manager
        if source is not None
        else CheckpointManager(output_dir / _DEFAULT_CHECKPOINT_DIRECTORY, enabled=False)
    )
    settings = configured_settings(
        cfg,
        device=resolved_device,
        precision=precision,
        output_dir=output_dir,
        distributed=distributed,
    )
    trainer = Trainer(
        net,
        optimizer,
        loader,
        scheduler=scheduler,
        callbacks=callbacks,
        max_steps=target_step,
        settings=settings,
        distributed=distributed,
        eval_data=eval_data,
        eval_every=cfg.eval.every_steps,
        eval_max_batches=cfg.eval.max_batches,
    )
    # The run's config (what checkpoints and sinks record; 2.0 code's ``trainer.logger`` is
    # built from its ``logging:`` section at the first read) and its startup shape check.
    trainer.config = cfg
    trainer.shape_report = shape_report
    trainer.evaluation.tasks = tasks
    trainer.evaluation.parts = _eval_parts(eval_data)
    if cfg.run.stop_grace_s is not None:  # else the Trainer's (class) default
        trainer.stop_grace_s = cfg.run.stop_grace_s
    resuming = resume or resume_other_run or (source is not None and source.resume_requested)
    if overwrite is not None and launched_as_main_process():
        check_earlier_run(earlier_run_files(callbacks), resume=resuming, overwrite=overwrite)
    trainer.run_id = read_run_id(output_dir) if resuming else new_run_id()
    if resuming:
        # resume_from warns (and the run starts fresh) when there is no checkpoint.
        load_callback_state = source.load_callback_state if source is not None else True
        resume_from(
            trainer,
            manager,
            load_callback_state=load_callback_state,
            allow_other_run=resume_other_run,
        )
    if trainer.run_id is None:  # resumed nothing, in a directory without an id
        trainer.run_id = new_run_id()
    if claim is not None and claim.enabled:
        write_run_id(output_dir, trainer.run_id)
    return trainer, manager


def held_out_loader(
    config: SpeedtronicConfig, distributed: DistributedContext | None
) -> Iterable[object]:
    """The run's held-out batches (``eval:`` section), this torch.distributed rank's share
    (the ranks' results are all-reduced; other shardings, such as a hub node's, evaluate the
    whole set). A held-out set that is certainly empty is a ``ConfigError`` here, before
    anything trains."""
    rank, world_size = (
        data_parallel_share(distributed.rank, distributed.world_size, config.parallel.tensor)
        if distributed is not None
        else (0, 1)
    )
    return build_eval_loader(
        config.data, config.eval, rank=rank, world_size=world_size, dataset=_held_out(config)
    )


def _eval_parts(loader: object) -> HeldOutParts | None:
    """The sources a mixture's held-out loader reads batch by batch (``eval/<source>/loss``)."""
    parts = held_out_parts(loader)
    return None if parts is None else HeldOutParts(*parts)


def eval_tasks(
    config: SpeedtronicConfig, model: torch.nn.Module | None = None
) -> list[MultipleChoiceTask]:
    """The run's multiple-choice tasks (``eval.tasks``), read and checked now; tokenized
    with the run's tokenizer, cut to ``model``'s context (default ``model.max_seq_len``).
    ``ConfigError`` for a bad task file or a run without text."""
    sources = config.eval.tasks
    if not sources:
        return []
    try:
        text = run_text(config.data.to_dict())
        default = config.model.max_seq_len
        context = default if model is None else context_length(model, default)
        return [
            MultipleChoiceTask(
                source.name or Path(source.path).stem,
                read_task(source.path),
                text.encode,
                shots=source.shots,
                seed=source.seed,
                batch_size=source.batch_size,
                context=context,
                max_rows=source.max_rows,
            )
            for source in sources
        ]
    except (TaskError, TextError) as exc:
        raise ConfigError(f"eval.tasks: {exc}") from None


def _held_out(config: SpeedtronicConfig) -> Dataset[object]:
    """The held-out dataset, or ``ConfigError`` when it cannot be built or is certainly empty."""
    try:
        dataset = held_out_dataset(config.data, config.eval, vocab_size=config.data.vocab_size)
    except DataSourceError as exc:
        raise ConfigError(f"eval: {exc}") from None
    empty = known_empty(dataset)
    if empty is not None:
        raise ConfigError(
            f"eval: the held-out set is empty ({empty}); raise eval.fraction or name a "
            "held-out source with eval.text_path or eval.dataset"
        )
    return dataset


def preflight(
    config: SpeedtronicConfig, *, device: str | None = None, max_steps: int | None = None
) -> Preflight:
    """Every check ``speedtronic fit`` makes before it trains, without training: the config's
    checks on this machine (``speedtronic.config.preflight.check``: the device, the text
    files, the warm-up; ``device`` and ``max_steps`` are the CLI's ``--device`` and
    ``--max-steps``), then the training and held-out datasets, built as the run builds them
    (a dataset is built lazily: nothing is read yet) -- an unknown dataset name, a
    ``text`` dataset without a path, an empty held-out set. ``speedtronic validate`` and
    ``speedtronic fit`` both run it, so what ``validate`` passes, ``fit`` starts."""
    outcome = check(config, device=device, max_steps=max_steps)
    if outcome.errors:
        return outcome  # the datasets may need the very files that are missing
    try:
        training_dataset(
            config.data,
            vocab_size=config.data.vocab_size,
            held_out_fraction=training_excludes_tail(config.eval),
        )
    except DataSourceError as exc:
        outcome.errors.append(str(exc))
        if not (config.eval.text_path or config.eval.dataset):
            return outcome  # the held-out set is a split of that same source
    if config.eval.every_steps is not None:
        try:
            _held_out(config)
            eval_tasks(config)
        except ConfigError as exc:
            outcome.errors.extend(exc.errors)
    return outcome


def evaluate_checkpoint(
    config: ConfigSource,
    *,
    checkpoint: str | Path | None = None,
    device: str | torch.device | None = None,
    weights: str = MODEL_WEIGHTS,
) -> tuple[LoadedCheckpoint, EvalOutcome]:
    """Evaluate a run's checkpoint on its held-out set (``eval:``) and write nothing: the
    named ``checkpoint`` file, else the newest one in the run's checkpoint directory;
    ``weights`` names which weights (``_model_with_weights``).
    ``CheckpointError`` when there is none or it cannot be read, ``TrainingStateError`` when
    it does not fit the config's model. One process (no torch.distributed)."""
    cfg = as_config(config)
    seed_everything(cfg.run.seed)
    resolved_device = resolve_device(device if device is not None else cfg.run.device)
    output_dir = Path(cfg.run.output_dir).expanduser().resolve()
    loaded = _checkpoint_to_evaluate(cfg, output_dir, resolved_device, checkpoint)
    net = _model_with_weights(cfg, loaded, weights)
    net.to(resolved_device)
    _warn_if_trained_on_the_tail(cfg)
    loader = held_out_loader(cfg, None)
    outcome = evaluate_model(
        net,
        loader,
        device=resolved_device,
        precision=resolve_precision(cfg.precision, resolved_device),
        max_batches=cfg.eval.max_batches,
        parts=_eval_parts(loader),
    )
    return loaded, outcome


def checkpoint_model(
    config: ConfigSource,
    *,
    checkpoint: str | Path | None = None,
    device: str | torch.device | None = None,
    weights: str = MODEL_WEIGHTS,
    doing: str = "evaluate",
) -> tuple[LoadedCheckpoint, torch.nn.Module]:
    """A run's checkpoint (the named one, else the newest) loaded into the config's model on
    ``device`` (``_model_with_weights``), for ``generate`` and task scoring; reads only."""
    cfg = as_config(config)
    resolved_device = resolve_device(device if device is not None else cfg.run.device)
    output_dir = Path(cfg.run.output_dir).expanduser().resolve()
    loaded = _checkpoint_to_evaluate(cfg, output_dir, resolved_device, checkpoint)
    net = _model_with_weights(cfg, loaded, weights, doing=doing)
    return loaded, net.to(resolved_device)


def _model_with_weights(
    cfg: SpeedtronicConfig,
    loaded: LoadedCheckpoint,
    weights: str = MODEL_WEIGHTS,
    *,
    doing: str = "evaluate",
) -> torch.nn.Module:
    """The config's model (on the CPU) holding the weights of ``loaded``: a sharded (FSDP)
    checkpoint's gathered whole; with ``weights`` other than ``"model"``, its parameters
    then replaced by the weights the callback of that state key published
    (``speedtronic.state.published_weights``). ``CheckpointError`` when it holds none,
    ``TrainingStateError`` when they do not fit the model (``cannot <doing> <path>: ...``)."""
    published = None if weights == MODEL_WEIGHTS else published_weights(loaded, weights)
    # Seeded as a fit seeds it: the frozen base of a LoRA run without pretrained weights
    # is its seeded initialisation, which the checkpoint's fingerprint names.
    seed_everything(cfg.run.seed)
    net = build_model(cfg.model)
    sharded = loaded.state.get(SHARDED_DIRECTORY)
    if isinstance(sharded, str):  # an FSDP run's checkpoint: its weights, gathered whole
        try:
            load_sharded_weights(Path(sharded), net)
        except ValueError as exc:
            raise TrainingStateError(f"cannot {doing} {loaded.path}: {exc}") from None
    else:
        _load_weights(net, loaded, doing=doing)
    if published is not None:
        apply_weights(net, published, weights)
    return net


def export_checkpoint(
    config: ConfigSource,
    output: str | Path,
    *,
    checkpoint: str | Path | None = None,
    overwrite: bool = False,
    weights: str = MODEL_WEIGHTS,
    allow_nonfinite: bool = False,
    adapter: bool = False,
    merge: bool = False,
) -> tuple[LoadedCheckpoint, ExportResult]:
    """Write a run's checkpoint (the named one, else the newest) as a Hugging Face
    directory ``output`` (``speedtronic.models.export``), with the run's tokenizer and its
    token ids (``speedtronic.models.export_tokens``); ``weights`` names which weights
    (``_model_with_weights``). ``ExportError`` for an output in the way, a model with no
    Hugging Face form or a tokenizer that does not fit, before anything is read, and for
    NaN or infinite weights unless ``allow_nonfinite``; one process, on the CPU. A run with
    LoRA adapters (``model.adapters.lora``) exports with ``adapter`` (a peft adapter
    directory) or ``merge`` (the adapters merged into the weights)."""
    cfg = as_config(config)
    target = Path(output).expanduser()
    check_export_target(target, overwrite=overwrite)
    tokens = export_tokens(cfg.data.to_dict())
    output_dir = Path(cfg.run.output_dir).expanduser().resolve()
    loaded = _checkpoint_to_evaluate(cfg, output_dir, torch.device("cpu"), checkpoint)
    net = _model_with_weights(cfg, loaded, weights, doing="export")
    lora = has_lora(net)
    if (adapter or merge) and not lora:
        raise ExportError("--adapter and --merge export LoRA runs: model.adapters.lora is not set")
    if adapter and merge:
        raise ExportError("--adapter and --merge: give one of them")
    if merge:
        merge_lora(net)
    return loaded, export_model(
        net,
        target,
        overwrite=overwrite,
        tokenizer=tokens,
        allow_nonfinite=allow_nonfinite,
        adapter=adapter,
    )


def _load_weights(net: torch.nn.Module, loaded: LoadedCheckpoint, *, doing: str) -> None:
    """The checkpoint's model weights into ``net``, checked first as a resume checks them
    (``speedtronic.state.model_fit``: every key and shape that differs)."""
    weights = loaded.state.get("model")
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{loaded.path} holds no model weights (no 'model' entry)")
    problem = model_mismatch(tensor_shapes(net.state_dict()), tensor_shapes(weights))
    if problem is not None:
        raise TrainingStateError(f"cannot {doing} {loaded.path}: {problem}")
    try:
        net.load_state_dict(cast("Mapping[str, torch.Tensor]", weights))
    except RuntimeError as exc:  # keys and shapes fit: what torch says is all there is
        raise TrainingStateError(f"cannot {doing} {loaded.path}: {exc}") from None


def _warn_if_trained_on_the_tail(cfg: SpeedtronicConfig) -> None:
    """A text run without evaluation trained on its whole file, the held-out tail too."""
    own_split = not cfg.eval.text_path and not cfg.eval.dataset
    text = cfg.data.text_path or (cfg.data.dataset == "text")
    if own_split and text and training_excludes_tail(cfg.eval) is None:
        warn(
            "eval.every_steps is not set, so this run trained on the whole text file: the "
            f"held-out tail it is evaluated on (the last eval.fraction={cfg.eval.fraction}) "
            "was training data too",
            UserWarning,
        )


def _checkpoint_to_evaluate(
    cfg: SpeedtronicConfig, output_dir: Path, device: torch.device, named: str | Path | None
) -> LoadedCheckpoint:
    if named is not None:
        path = Path(named).expanduser()
        if not (path.is_file() or (path.suffix == SHARDED_SUFFIX and path.is_dir())):
            raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
        manager = CheckpointManager(path.resolve().parent, enabled=False)
        state = manager.load(path.resolve())  # verified against its pointer's checksum
        counters = state.get("counters")
        step = counters.get("step") if isinstance(counters, Mapping) else None
        return LoadedCheckpoint(path, step if isinstance(step, int) else -1, state)
    context = PluginContext(config=cfg, output_dir=output_dir, device=device)
    source = resume_source(build_callbacks(cfg, context))
    directory = (
        source.checkpoint_manager.directory
        if source is not None
        else output_dir / _DEFAULT_CHECKPOINT_DIRECTORY
    )
    loaded = CheckpointManager(directory, enabled=False).load_latest_checkpoint()
    if loaded is None:
        raise CheckpointError(
            f"no checkpoint to evaluate in {directory}: train the run first, or name a "
            "checkpoint file with --checkpoint"
        )
    return loaded


def _save_run_config(config: SpeedtronicConfig, output_dir: Path) -> Path:
    """Write the resolved, redacted config to ``<output_dir>/config.yaml``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    return config.save(output_dir / "config.yaml")


@contextmanager
def prepared_fit(
    config: ConfigSource,
    *,
    resume: bool = False,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    overwrite: bool = False,
    resume_other_run: bool = False,
) -> Iterator[Trainer]:
    """The one way a fit is composed -- ``train_from_config`` and ``speedtronic fit`` both
    use it: the run directory and every path the plugins write locked, the runtime built
    (``build_runtime``), the resolved config written (by rank 0); the trainer is yielded
    to fit, and the process group torn down after."""
    cfg = as_config(config)
    with claim_run_directory(cfg.run.output_dir) as claim:
        trainer, _ = build_runtime(
            cfg,
            resume=resume,
            device=device,
            max_steps=max_steps,
            overwrite=overwrite,
            claim=claim,
            resume_other_run=resume_other_run,
        )
        try:
            if _writes_run_files(trainer.distributed):
                _save_run_config(cfg, trainer.output_dir)
            yield trainer
        finally:
            teardown_distributed(trainer.distributed)


def train_from_config(
    config: ConfigSource,
    *,
    resume: bool = False,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    overwrite: bool = False,
    resume_other_run: bool = False,
) -> TrainResult:
    """Build the runtime, write the resolved config to the run directory, and fit
    (``prepared_fit``). The run directory and every path the plugins write are locked
    meanwhile; an earlier run's files there need ``resume`` (continue) or ``overwrite``
    (replace), see ``speedtronic.state.run_lock``; another run's checkpoints need
    ``resume_other_run`` (``speedtronic.state.run_identity``)."""
    with prepared_fit(
        config,
        resume=resume,
        device=device,
        max_steps=max_steps,
        overwrite=overwrite,
        resume_other_run=resume_other_run,
    ) as trainer:
        return trainer.fit()


def _writes_run_files(distributed: DistributedContext | None) -> bool:
    """Run-level files (the resolved config) are written once, by rank 0."""
    return distributed is None or distributed.is_main


run = train_from_config
train = train_from_config


def __getattr__(name: str) -> object:
    """2.0's ``build_logger`` keeps its ``speedtronic.runtime`` path; it lives in the 2.0
    layer (``speedtronic.compat.metric_logger``), loaded when asked for."""
    if name == "build_logger":
        value: object = importlib.import_module("speedtronic.compat.metric_logger").build_logger
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
