"""``speedtronic.Trainer``: the engine's Trainer behind the keywords users and 2.0 code pass.

The engine's ``Trainer`` (``speedtronic.engine.trainer``) is built from resolved values: a
``TrainerSettings``, an ``Evaluation``, the run's config as plain data. This subclass is the
one adapter in front of it. It takes the flat keywords (``Trainer(model, opt, data,
callbacks=[...], max_steps=500, metrics_every=10)``) and the 2.0 constructor's arguments,
resolves them (explicit > ``config=``'s sections > default, as 2.0 did) and builds the engine's
Trainer from the result:

* ``config=`` fills every setting left out (``_resolve_settings``) and is what checkpoints and
  sinks record (``run_config``);
* ``logger=``, ``coordinator=`` and ``checkpoint_manager=`` become callbacks on the same
  events, in that order, after the run's own (``legacy_callbacks``);
* ``trainer.logger``, ``trainer.config``, ``trainer.shape_report``, ``train`` and ``resume``
  are 2.0's members.

Nothing of this runs per step: a trainer that uses no 2.0 object has no 2.0 callback. The
hooks-only ``MetricLogger`` a runtime-built trainer offers for 2.0 hooks
(``trainer.logger.hooks.append(hook)``) is built -- and its callback attached -- at the first
read of ``trainer.logger`` (``provide_logger``), so a run that never reads it pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from speedtronic.compat.coordinator import CoordinatorCallback, SyncCoordinator
from speedtronic.compat.metric_logger import MetricLogger, MetricLoggerCallback
from speedtronic.engine.callback import Callback
from speedtronic.engine.evaluation import Evaluation, check_eval_settings
from speedtronic.engine.settings import ParallelStrategy, TrainerSettings
from speedtronic.engine.state import LRScheduler
from speedtronic.engine.trainer import Trainer as EngineTrainer
from speedtronic.plugins import callback_registry
from speedtronic.systems.precision import PrecisionPlan, resolve_device, resolve_precision

if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.config.sections import ParallelConfig
    from speedtronic.engine.notes import Notes
    from speedtronic.state.checkpoint import CheckpointManager
    from speedtronic.systems.distributed import DistributedContext

__all__ = ["LRScheduler", "SpeedtronicTrainer", "Trainer", "TrainingEngine"]


class Trainer(EngineTrainer):
    """Trains ``model`` with ``optimizer`` on batches from ``dataloader``.

    ``dataloader`` is any iterable of batches (a ``DataLoader``, a list); it is re-iterated
    forever and its position is part of the training state, so resume is exact.
    ``max_steps`` is an absolute target: a resumed trainer continues up to it.
    ``max_epochs`` (default ``run.max_epochs`` of the config) also ends the fit when the
    data stream would start that epoch; a global step the last epoch cannot fill is not
    taken. Every setting left out comes from ``config`` when one is given (2.0), else from
    its default (``speedtronic.engine.settings.TrainerSettings``).
    ``stop_grace_s`` bounds how long a requested stop waits for a batch that does not come
    (``speedtronic.engine.stop_watch``; set it on an instance or on the class).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataloader: Iterable[object],
        *,
        device: str | torch.device | None = None,
        config: SpeedtronicConfig | Mapping[str, object] | None = None,
        scheduler: LRScheduler | None = None,
        precision: PrecisionPlan | None = None,
        callbacks: Sequence[Callback] = (),
        coordinator: SyncCoordinator | None = None,
        max_steps: int | None = None,
        start_step: int = 0,
        accumulation_steps: int | None = None,
        grad_clip: float | None = None,
        compile: bool | None = None,
        metrics_every: int | None = None,
        allow_optimizer_reset: bool | None = None,
        output_dir: str | Path | None = None,
        shape_report: object | None = None,
        distributed: DistributedContext | None = None,
        logger: MetricLogger | None = None,
        checkpoint_manager: CheckpointManager | None = None,
        max_epochs: int | None = None,
        eval_data: Iterable[object] | None = None,
        eval_every: int | None = None,
        eval_max_batches: int | None = None,
        parallel: ParallelConfig | Mapping[str, object] | None = None,
    ) -> None:
        check_eval_settings(eval_every, eval_max_batches)
        evaluation = Evaluation(eval_data, eval_every or 0, eval_max_batches)
        resolved = _coerce_config(config)
        settings = _resolve_settings(
            resolved,
            device=device,
            precision=precision,
            accumulation_steps=accumulation_steps,
            grad_clip=grad_clip,
            metrics_every=metrics_every,
            allow_optimizer_reset=allow_optimizer_reset,
            output_dir=output_dir,
            compile=compile,
            distributed=distributed,
            max_epochs=max_epochs,
            parallel=parallel,
        )
        if max_steps is None and resolved is not None:
            max_steps = resolved.target_steps
        super().__init__(
            model,
            optimizer,
            dataloader,
            callbacks=callbacks,
            max_steps=max_steps,
            start_step=start_step,
            scheduler=scheduler,
            settings=settings,
            evaluation=evaluation,
            distributed=distributed,
        )
        self.config = resolved
        self.shape_report = shape_report
        """The startup shape report (``validate_startup_shapes``) the runtime gave: 2.0's
        ``shape_profile`` and ``shape_warning`` events come from it."""
        self._logger = logger
        self._logger_factory: Callable[[], MetricLogger] | None = None
        adapted = legacy_callbacks(coordinator, logger, checkpoint_manager, self.notes)
        if adapted:
            self.add_callbacks(adapted)

    @property
    def config(self) -> SpeedtronicConfig | None:
        """The validated ``config=`` (2.0), else ``None``. Assigning one also changes what
        checkpoints and sinks record as the run's config (``run_config``)."""
        return self._config

    @config.setter
    def config(self, config: SpeedtronicConfig | None) -> None:
        self._config = config
        self.state.run_config = config.to_dict(redact_secrets=True) if config else None

    @property
    def logger(self) -> MetricLogger | None:
        """The 2.0 ``MetricLogger``: the one given as ``logger=``, else the one
        ``provide_logger`` builds at this first read (a runtime-built trainer's), else
        ``None``. 2.0 code attaches hooks with ``trainer.logger.hooks.append(hook)``."""
        factory = self._logger_factory
        if self._logger is None and factory is not None:
            self._logger_factory = None
            self._logger = factory()
            self.add_callbacks([MetricLoggerCallback(self._logger, notes=self.notes)])
        return self._logger

    @logger.setter
    def logger(self, logger: MetricLogger | None) -> None:
        self._logger = logger

    def provide_logger(self, factory: Callable[[], MetricLogger]) -> None:
        """Make ``trainer.logger`` a logger that ``factory`` builds at its first read; its
        callback joins the run then (from the next event on when that is during a fit). A
        run whose ``logger`` is never read has no logger callback."""
        self._logger_factory = factory

    train = EngineTrainer.fit

    def resume(self, state: Mapping[str, object]) -> None:
        """Original API: restore a checkpoint's state."""
        self.load_state_dict(state)


TrainingEngine = Trainer
SpeedtronicTrainer = Trainer


def _coerce_config(
    config: SpeedtronicConfig | Mapping[str, object] | None,
) -> SpeedtronicConfig | None:
    """A ``SpeedtronicConfig`` from a config object or a plain mapping (validated)."""
    if config is None:
        return None
    from speedtronic.config import SpeedtronicConfig

    if isinstance(config, SpeedtronicConfig):
        return config
    return SpeedtronicConfig.from_dict(config)


def _pick(explicit: int | bool | None, configured: int | bool | None, default: int) -> int:
    if explicit is not None:
        return int(explicit)
    if configured is not None:
        return int(configured)
    return default


def _parallel(
    given: ParallelConfig | Mapping[str, object] | None, config: SpeedtronicConfig | None
) -> tuple[ParallelStrategy, bool, int]:
    """``(strategy, reshard_after_forward, tensor)`` of ``parallel=`` as given (a mapping is
    validated), else of the config, else ddp -- without building a section for the default
    (validating one costs a plugin scan on first use)."""
    section = config.parallel if given is None and config is not None else given
    if section is None:
        return "ddp", True, 1
    # Imported here: the config machinery (jsonschema) loads when a section is validated,
    # never on ``import speedtronic; speedtronic.Trainer``.
    from speedtronic.config.sections import ParallelConfig

    if not isinstance(section, ParallelConfig):
        section = ParallelConfig.from_dict(section)
    return section.strategy, section.reshard_after_forward, section.tensor


def _resolve_settings(
    config: SpeedtronicConfig | None,
    *,
    device: str | torch.device | None,
    precision: PrecisionPlan | None,
    accumulation_steps: int | None,
    grad_clip: float | None,
    metrics_every: int | None,
    allow_optimizer_reset: bool | None,
    output_dir: str | Path | None,
    compile: bool | None,
    distributed: DistributedContext | None,
    max_epochs: int | None = None,
    parallel: ParallelConfig | Mapping[str, object] | None = None,
) -> TrainerSettings:
    """Fill every argument left out from ``config`` (the 2.0 behaviour), else a default."""
    cfg = config
    if grad_clip is None and cfg is not None:
        grad_clip = cfg.optimizer.grad_clip
    if device is None:  # a distributed run uses the device of this rank
        device = distributed.device if distributed else (cfg.run.device if cfg else "cpu")
    resolved_device = resolve_device(device)
    if max_epochs is None and cfg is not None:
        max_epochs = cfg.run.max_epochs
    strategy, reshard_after_forward, tensor = _parallel(parallel, cfg)
    return TrainerSettings(
        device=resolved_device,
        precision=precision or resolve_precision(cfg.precision if cfg else None, resolved_device),
        accumulation_steps=_pick(accumulation_steps, cfg.accumulation_steps if cfg else None, 1),
        auto_micro_batch=cfg is not None and cfg.data.micro_batch_size == "auto",
        grad_clip=grad_clip,
        metrics_every=_pick(metrics_every, cfg.logging.every_steps if cfg else None, 1),
        # 2.0's ``distributed.reset_inner_optimizer`` (a DiLoCo key, read here only for the
        # original ``Trainer(config=...)``; the plugin's own option is ``reset_optimizer``).
        allow_optimizer_reset=bool(
            _pick(
                allow_optimizer_reset,
                (cfg.distributed.reset_inner_optimizer is not False) if cfg else None,
                1,
            )
        ),
        compile=bool(_pick(compile, cfg.compile if cfg else None, 0)),
        max_epochs=max_epochs,
        parallel=strategy,
        reshard_after_forward=reshard_after_forward,
        tensor=tensor,
        output_dir=Path(
            output_dir if output_dir is not None else (cfg.run.output_dir if cfg else "runs")
        ),
    )


def legacy_callbacks(
    coordinator: SyncCoordinator | None,
    logger: MetricLogger | None,
    checkpoint_manager: CheckpointManager | None,
    notes: Notes | None = None,
) -> list[Callback]:
    """The original constructor arguments, adapted to callbacks (same events, same order).
    The logger listens to ``notes`` (the trainer's board) from now on, so it also gets the
    notes published before the first fit's ``setup`` (``compile``)."""
    adapted: list[Callback] = []
    if coordinator is not None:
        adapted.append(CoordinatorCallback(coordinator))
    if logger is not None:
        adapted.append(MetricLoggerCallback(logger, notes=notes))
    if checkpoint_manager is not None:
        # The checkpoint feature is a plugin: found through the registry, never imported.
        factory = cast("Callable[..., Callback]", callback_registry.get("checkpoint"))
        adapted.append(factory(manager=checkpoint_manager))
    return adapted
