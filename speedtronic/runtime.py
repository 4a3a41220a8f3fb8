"""The composition root: config -> model, data, optimizer, callbacks, Trainer.

``build_runtime`` follows the original construction order (seed, device, model, precision
and shape checks, data, optimizer, scheduler, callbacks, trainer, resume) and returns
``(trainer, checkpoint_manager)``; ``train_from_config`` also fits. The runtime names no
plugin: which callbacks a config turns on, and with which options, each plugin declares
(``Callback.enabled_by_default``, ``legacy_sections``, ``options_from_legacy``); the
checkpoint manager comes from the callback that is a ``ResumeSource``.

Under ``torchrun`` the device step also joins the process group (``setup_distributed``):
the device becomes the local rank's, the data loader shards by rank, and the trainer gets
the ``DistributedContext`` (``trainer.distributed``). The group is destroyed by
``train_from_config`` when it returns, or at interpreter exit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, cast, runtime_checkable

import torch

from speedtronic.callback import Callback
from speedtronic.checkpoint import CheckpointManager
from speedtronic.compat.metric_logger import MetricLogger
from speedtronic.config import CallbackSpec, JSONValue, SpeedtronicConfig
from speedtronic.data import build_dataloader
from speedtronic.distributed import DistributedContext, setup_distributed, teardown_distributed
from speedtronic.model_registry import build_model
from speedtronic.optimizers import build_optimizer as build_optimizer  # 2.0's import path
from speedtronic.optimizers import build_scheduler as build_scheduler
from speedtronic.plugins import (
    PluginContext,
    build_callback,
    callback_registry,
    configurable_plugins,
    import_modules,
    legacy_sections_of,
)
from speedtronic.precision import resolve_device, resolve_precision
from speedtronic.result import TrainResult
from speedtronic.resume import ResumeSource, resume_from
from speedtronic.rng import seed_everything
from speedtronic.run_lock import (
    check_earlier_run,
    claim_run_directory,
    earlier_run_files,
    launched_as_main_process,
)
from speedtronic.shapes import validate_startup_shapes
from speedtronic.stage_streams import StageStreamCallback, StageStreamScheduler
from speedtronic.trainer import Trainer

ConfigSource = SpeedtronicConfig | Mapping[str, object] | str | Path

DEFAULT_CHECKPOINT_DIRECTORY = "checkpoints"
"""Where ``--resume`` looks (under the output directory) when no plugin of the run is a
``ResumeSource``; the manager ``build_runtime`` then returns is disabled."""


def as_config(config: ConfigSource) -> SpeedtronicConfig:
    """A validated ``SpeedtronicConfig`` from any supported source."""
    if isinstance(config, SpeedtronicConfig):
        return config.validate()
    return SpeedtronicConfig.load(config)


def callback_specs(config: SpeedtronicConfig) -> list[CallbackSpec]:
    """The callbacks a run uses, in order: the plugins the config turns on without naming
    them (on by default, or through a 2.0 section) with a negative ``implied_order``, the
    configured list, then the other implied plugins. Each plugin rewrites its own 2.0
    sections into its options (``Callback.options_from_legacy``); the runtime knows no
    plugin by name."""
    data = config.to_dict()
    configured = [_with_legacy_sections(spec, data) for spec in config.callbacks]
    named = {spec.name for spec in config.callbacks}
    implied: list[tuple[int, str, CallbackSpec]] = []
    for name, plugin in configurable_plugins():
        if name in named or named.intersection(plugin.default_replaced_by):
            continue
        options = plugin.options_from_legacy(legacy_sections_of(plugin, data), None)
        if options is not None:
            implied.append((plugin.implied_order, name, _spec(name, options)))
    implied.sort(key=lambda item: (item[0], item[1]))
    before = [spec for order, _, spec in implied if order < 0]
    after = [spec for order, _, spec in implied if order >= 0]
    return before + configured + after


def _with_legacy_sections(spec: CallbackSpec, data: Mapping[str, object]) -> CallbackSpec:
    """A configured entry with what its plugin takes from the 2.0 sections."""
    plugin = callback_registry.get(spec.name)
    if not plugin.legacy_sections:
        return spec
    options = plugin.options_from_legacy(legacy_sections_of(plugin, data), spec.options)
    return spec if options is None else _spec(spec.name, options)


def _spec(name: str, options: Mapping[str, object]) -> CallbackSpec:
    return CallbackSpec(name=name, options=cast("dict[str, JSONValue]", dict(options)))


def build_callbacks(config: SpeedtronicConfig, context: PluginContext) -> list[Callback]:
    """Instantiate every callback of ``callback_specs`` (options already validated)."""
    return [build_callback(spec.name, spec.options, context) for spec in callback_specs(config)]


def callback_classes(config: SpeedtronicConfig) -> list[tuple[str, type[Callback]]]:
    """The callback classes of a run, without building them (for ``validate``)."""
    return [(spec.name, callback_registry.get(spec.name)) for spec in callback_specs(config)]


@runtime_checkable
class ShardsData(Protocol):
    """A callback that trains on one shard of the data (a node of a hub-synchronised run, say)."""

    @property
    def data_shard(self) -> tuple[int, int] | None: ...


def data_shard(
    callbacks: Sequence[Callback], distributed: DistributedContext | None
) -> tuple[int, int]:
    """``(index, count)`` of the data this process reads: its torch.distributed rank, or the
    shard a callback (a node of a hub-synchronised run) asks for, or all of it."""
    if distributed is not None and distributed.world_size > 1:
        return distributed.rank, distributed.world_size
    for callback in callbacks:
        if isinstance(callback, ShardsData) and callback.data_shard is not None:
            return callback.data_shard
    return 0, 1


def _resume_source(callbacks: Sequence[Callback]) -> ResumeSource | None:
    """The first callback that knows the run's checkpoints (the checkpoint plugin)."""
    for callback in callbacks:
        if isinstance(callback, ResumeSource):
            return callback
    return None


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
) -> tuple[Trainer, CheckpointManager]:
    """Build everything a run needs. ``max_steps`` is the absolute step to stop at (it does
    not change the LR schedule's horizon, so a stopped run resumes on the same schedule).

    ``overwrite`` checks the run directory for an earlier run's files (the plugins say which,
    ``speedtronic.run_lock.LeavesRunFiles``): ``False`` refuses a fresh run over them,
    ``True`` deletes them first; ``None`` (the default, as in 2.0) does not look."""
    cfg = as_config(config)
    import_modules(cfg.imports)
    logging.getLogger("speedtronic").setLevel(cfg.logging.level)
    seed_everything(cfg.run.seed)
    requested_device = device if device is not None else cfg.run.device
    distributed = setup_distributed(requested_device, timeout_s=cfg.distributed.timeout_s)
    resolved_device = (
        distributed.device if distributed is not None else resolve_device(requested_device)
    )
    net = model if model is not None else build_model(cfg.model)
    net.to(resolved_device)
    precision = resolve_precision(cfg.precision, resolved_device)
    shape_report = validate_startup_shapes(cfg, net, resolved_device, precision)
    # Absolute, so plugins resolving paths at build time and at setup agree.
    output_dir = Path(cfg.run.output_dir).expanduser().resolve()
    context = PluginContext(config=cfg, output_dir=output_dir, device=resolved_device)
    callbacks = build_callbacks(cfg, context) + list(extra_callbacks)
    if cfg.ooo_backprop:
        streams = StageStreamScheduler(net, resolved_device, num_streams=cfg.ooo_streams)
        callbacks.append(StageStreamCallback(streams))
    shard_index, shard_count = data_shard(callbacks, distributed)
    loader = (
        dataloader
        if dataloader is not None
        else build_dataloader(
            cfg.data,
            pin_memory_device=resolved_device.type == "cuda",
            vocab_size=cfg.data.vocab_size,
            rank=shard_index,
            world_size=shard_count,
        )
    )
    optimizer = build_optimizer(net, cfg.optimizer, resolved_device)
    scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.scheduler_steps)
    source = _resume_source(callbacks)
    manager = (
        source.checkpoint_manager
        if source is not None
        else CheckpointManager(output_dir / DEFAULT_CHECKPOINT_DIRECTORY, enabled=False)
    )
    trainer = Trainer(
        net,
        optimizer,
        loader,
        device=resolved_device,
        config=cfg,
        scheduler=scheduler,
        precision=precision,
        callbacks=callbacks,
        max_steps=max_steps if max_steps is not None else cfg.target_steps,
        output_dir=output_dir,
        shape_report=shape_report,
        distributed=distributed,
        logger=build_logger(cfg, outputs=False),
    )
    resuming = resume or (source is not None and source.resume_requested)
    if overwrite is not None and launched_as_main_process():
        check_earlier_run(earlier_run_files(callbacks), resume=resuming, overwrite=overwrite)
    if resuming:
        # resume_from warns (and the run starts fresh) when there is no checkpoint.
        load_callback_state = source.load_callback_state if source is not None else True
        resume_from(trainer, manager, load_callback_state=load_callback_state)
    return trainer, manager


def build_logger(config: ConfigSource, *, outputs: bool = True) -> MetricLogger:
    """2.0's ``build_logger``: a ``MetricLogger`` with ``logging.level``, ``logging.file``,
    ``logging.json_file`` and ``logging.every_steps`` (paths relative to the working
    directory, as in 2.0), and no hooks.

    ``build_runtime`` attaches one as ``trainer.logger`` so that 2.0 code can append hooks
    (``trainer.logger.hooks.append(hook)``). That one is built with ``outputs=False``: the
    console and ``jsonl`` sinks already print the metrics and write ``logging.file`` and
    ``logging.json_file``, so it only feeds its hooks.
    """
    section = as_config(config).logging
    json_file = section.extensions.get("json_file")
    return MetricLogger(
        level=section.level,
        file=section.file if outputs else None,
        json_file=json_file if outputs and isinstance(json_file, str) else None,
        every_steps=section.every_steps,
        echo=outputs,
    )


def save_run_config(config: SpeedtronicConfig, output_dir: Path) -> Path:
    """Write the resolved, redacted config to ``<output_dir>/config.yaml``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    return config.save(output_dir / "config.yaml")


def train_from_config(
    config: ConfigSource,
    *,
    resume: bool = False,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Build the runtime, write the resolved config to the run directory, and fit. The run
    directory is locked meanwhile; an earlier run's files there need ``resume`` (continue)
    or ``overwrite`` (replace), see ``speedtronic.run_lock``."""
    cfg = as_config(config)
    with claim_run_directory(cfg.run.output_dir):
        trainer, _ = build_runtime(
            cfg, resume=resume, device=device, max_steps=max_steps, overwrite=overwrite
        )
        try:
            assert trainer.config is not None
            if _writes_run_files(trainer.distributed):
                save_run_config(trainer.config, trainer.output_dir)
            return trainer.fit()
        finally:
            teardown_distributed(trainer.distributed)


def _writes_run_files(distributed: DistributedContext | None) -> bool:
    """Run-level files (the resolved config) are written once, by rank 0."""
    return distributed is None or distributed.is_main


run = train_from_config
train = train_from_config
