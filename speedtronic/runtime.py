"""The composition root: config -> model, data, optimizer, callbacks, Trainer.

``build_runtime`` follows the original construction order (seed, device, model, precision
and shape checks, data, optimizer, scheduler, checkpoint manager, callbacks, trainer,
resume) and returns ``(trainer, checkpoint_manager)``; ``train_from_config`` also fits.

Under ``torchrun`` the device step also joins the process group (``setup_distributed``):
the device becomes the local rank's, the data loader shards by rank, and the trainer gets
the ``DistributedContext`` (``trainer.distributed``). The group is destroyed by
``train_from_config`` when it returns, or at interpreter exit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from speedtronic.callback import Callback
from speedtronic.checkpoint import CheckpointManager
from speedtronic.config import CallbackSpec, JSONValue, SpeedtronicConfig
from speedtronic.data import build_dataloader
from speedtronic.distributed import DistributedContext, setup_distributed, teardown_distributed
from speedtronic.model_registry import build_model
from speedtronic.optimizers import build_optimizer, build_scheduler
from speedtronic.plugins import PluginContext, build_callback, callback_registry, import_modules
from speedtronic.precision import resolve_device, resolve_precision
from speedtronic.result import TrainResult
from speedtronic.resume import resume_from
from speedtronic.rng import seed_everything
from speedtronic.run_lock import claim_run_directory
from speedtronic.shapes import validate_startup_shapes
from speedtronic.stage_streams import StageStreamCallback, StageStreamScheduler
from speedtronic.trainer import Trainer

ConfigSource = SpeedtronicConfig | Mapping[str, object] | str | Path


def as_config(config: ConfigSource) -> SpeedtronicConfig:
    """A validated ``SpeedtronicConfig`` from any supported source."""
    if isinstance(config, SpeedtronicConfig):
        return config.validate()
    return SpeedtronicConfig.load(config)


def callback_specs(config: SpeedtronicConfig) -> list[CallbackSpec]:
    """The callbacks a run uses, in order: default sinks, the configured list, then the
    features implied by config sections (gradient checkpointing, DiLoCo, checkpoints)."""
    configured = list(config.callbacks)
    names = {spec.name for spec in configured}
    head: list[CallbackSpec] = []
    if config.logging.console and not names & {"console", "progress"}:
        head.append(CallbackSpec(name="console", options={}))
    if config.logging.jsonl and "jsonl" not in names:
        jsonl_options: dict[str, JSONValue] = {}
        if config.logging.json_file:
            jsonl_options["path"] = config.logging.json_file
        head.append(CallbackSpec(name="jsonl", options=jsonl_options))
    tail: list[CallbackSpec] = []
    if config.gradient_checkpointing and "gradient_checkpointing" not in names:
        tail.append(CallbackSpec(name="gradient_checkpointing", options={}))
    if config.distributed.enabled and "diloco" not in names:
        tail.append(CallbackSpec(name="diloco", options={}))
    if config.checkpoint.enabled and "checkpoint" not in names:
        tail.append(CallbackSpec(name="checkpoint", options={}))
    return head + configured + tail


def build_callbacks(config: SpeedtronicConfig, context: PluginContext) -> list[Callback]:
    """Instantiate every callback of ``callback_specs`` (options already validated)."""
    return [build_callback(spec.name, spec.options, context) for spec in callback_specs(config)]


def callback_classes(config: SpeedtronicConfig) -> list[tuple[str, type[Callback]]]:
    """The callback classes of a run, without building them (for ``validate``)."""
    return [(spec.name, callback_registry.get(spec.name)) for spec in callback_specs(config)]


@runtime_checkable
class ShardsData(Protocol):
    """A callback that trains on one shard of the data (a DiLoCo node, say)."""

    @property
    def data_shard(self) -> tuple[int, int] | None: ...


def data_shard(
    callbacks: Sequence[Callback], distributed: DistributedContext | None
) -> tuple[int, int]:
    """``(index, count)`` of the data this process reads: its torch.distributed rank, or the
    shard a callback such as a DiLoCo node asks for, or all of it."""
    if distributed is not None and distributed.world_size > 1:
        return distributed.rank, distributed.world_size
    for callback in callbacks:
        if isinstance(callback, ShardsData) and callback.data_shard is not None:
            return callback.data_shard
    return 0, 1


def _checkpoint_manager(
    config: SpeedtronicConfig, callbacks: Sequence[Callback]
) -> CheckpointManager:
    for callback in callbacks:
        manager = getattr(callback, "manager", None)
        if isinstance(manager, CheckpointManager):
            return manager
    section = config.checkpoint
    directory = Path(config.run.output_dir) / section.directory
    return CheckpointManager(
        directory, every_steps=section.every_steps, keep_last=section.keep_last, enabled=False
    )


def build_runtime(
    config: ConfigSource,
    *,
    resume: bool = False,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    model: torch.nn.Module | None = None,
    dataloader: Iterable[object] | None = None,
    extra_callbacks: Sequence[Callback] = (),
) -> tuple[Trainer, CheckpointManager]:
    """Build everything a run needs. ``max_steps`` is the absolute step to stop at (it does
    not change the LR schedule's horizon, so a stopped run resumes on the same schedule)."""
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
    manager = _checkpoint_manager(cfg, callbacks)
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
    )
    if resume or cfg.checkpoint.resume:
        # resume_from warns (and the run starts fresh) when there is no checkpoint.
        resume_from(trainer, manager, load_callback_state=cfg.checkpoint.load_callback_state)
    return trainer, manager


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
    with claim_run_directory(cfg, resume=resume, overwrite=overwrite):
        trainer, _ = build_runtime(cfg, resume=resume, device=device, max_steps=max_steps)
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
