"""2.0's Trainer: ``speedtronic.Trainer`` given 2.0's constructor arguments, and 2.0's members
of every trainer.

``speedtronic.Trainer`` is the engine's Trainer (``speedtronic.engine.trainer``). Given one of
2.0's arguments it builds ``V2Trainer`` instead (``speedtronic.engine.compat_route``), which
resolves them as 2.0 did:

* ``config=`` fills every setting left out (explicit > the config's sections > default,
  ``speedtronic.composition.trainer_settings``) and becomes ``trainer.config``, what
  checkpoints and sinks record;
* ``logger=``, ``coordinator=`` and ``checkpoint_manager=`` become callbacks on the same
  events, in that order, after the run's own (``legacy_callbacks``);
* ``shape_report=`` is ``trainer.shape_report``, where 2.0's ``shape_profile`` and
  ``shape_warning`` events come from.

2.0's members -- ``trainer.logger``, ``provide_logger``, ``train``, ``resume`` -- are
``V2Trainer``'s own, and on any other trainer ``V2_LAYER.member`` gives them at first read.
A trainer that holds a run config (the runtime's: ``trainer.config``) offers a hooks-only
``MetricLogger`` for 2.0 hooks (``trainer.logger.hooks.append(hook)``), built -- and its
callback attached -- at the first read of ``trainer.logger``, so a run that never reads it
pays nothing per step and never loads this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from speedtronic.compat.coordinator import CoordinatorCallback, SyncCoordinator
from speedtronic.compat.metric_logger import MetricLogger, MetricLoggerCallback, build_logger
from speedtronic.composition.trainer_settings import configured_settings
from speedtronic.config import SpeedtronicConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.keywords import resolve_evaluation, resolve_settings
from speedtronic.engine.state import LRScheduler
from speedtronic.engine.trainer import Trainer
from speedtronic.plugins import callback_registry
from speedtronic.systems.precision import PrecisionPlan

if TYPE_CHECKING:
    from speedtronic.engine.notes import Notes
    from speedtronic.state.checkpoint import CheckpointManager
    from speedtronic.systems.distributed import DistributedContext
    from speedtronic.systems.shapes import ShapeReport

__all__ = [
    "V2_LAYER",
    "LRScheduler",
    "SpeedtronicTrainer",
    "Trainer",
    "TrainingEngine",
    "V2Trainer",
    "legacy_callbacks",
]

TrainingEngine = Trainer
SpeedtronicTrainer = Trainer
"""2.0's other names of ``speedtronic.Trainer``."""

_LOGGER_FACTORY = "_v2_logger_factory"
"""Where ``provide_logger`` leaves its factory on a trainer that is not a ``V2Trainer``."""


class V2Trainer(Trainer):
    """``speedtronic.Trainer`` given 2.0's arguments (the module docstring says which).
    Every setting left out comes from ``config`` when one is given, else from its default
    (``speedtronic.engine.settings.TrainerSettings``); ``max_steps`` from ``run.max_steps``."""

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
        shape_report: ShapeReport | None = None,
        distributed: DistributedContext | None = None,
        logger: MetricLogger | None = None,
        checkpoint_manager: CheckpointManager | None = None,
        max_epochs: int | None = None,
        eval_data: Iterable[object] | None = None,
        eval_every: int | None = None,
        eval_max_batches: int | None = None,
        parallel: Mapping[str, object] | object | None = None,
    ) -> None:
        held_out = {"eval_every": eval_every, "eval_max_batches": eval_max_batches}
        evaluation = resolve_evaluation(None, {"eval_data": eval_data, **held_out})
        resolved = _coerce_config(config)
        explicit = {
            "device": device,
            "precision": precision,
            "accumulation_steps": accumulation_steps,
            "grad_clip": grad_clip,
            "metrics_every": metrics_every,
            "allow_optimizer_reset": allow_optimizer_reset,
            "output_dir": output_dir,
            "compile": compile,
            "max_epochs": max_epochs,
            "parallel": parallel,
        }
        if resolved is None:
            settings = resolve_settings(None, distributed, explicit)
        else:
            settings = configured_settings(resolved, distributed=distributed, **explicit)  # type: ignore[arg-type]  # each value has its keyword's type (the signature above)
            if max_steps is None:
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
        self._logger = logger
        self._logger_factory: Callable[[], MetricLogger] | None = None
        adapted = legacy_callbacks(coordinator, logger, checkpoint_manager, self.notes)
        if adapted:
            self.add_callbacks(adapted)

    @property
    def logger(self) -> MetricLogger | None:
        """The 2.0 ``MetricLogger``: the one given as ``logger=``, else the one
        ``provide_logger`` builds at this first read, else ``None``. 2.0 code attaches hooks
        with ``trainer.logger.hooks.append(hook)``."""
        factory = self._logger_factory
        if self._logger is None and factory is not None:
            self._logger_factory = None
            self._logger = _attach(self, factory())
        return self._logger

    @logger.setter
    def logger(self, logger: MetricLogger | None) -> None:
        self._logger = logger

    def provide_logger(self, factory: Callable[[], MetricLogger]) -> None:
        """Make ``trainer.logger`` a logger that ``factory`` builds at its first read; its
        callback joins the run then (from the next event on when that is during a fit). A
        run whose ``logger`` is never read has no logger callback."""
        self._logger_factory = factory

    train = Trainer.fit

    def resume(self, state: Mapping[str, object]) -> None:
        """Original API: restore a checkpoint's state."""
        self.load_state_dict(state)


def _attach(trainer: Trainer, logger: MetricLogger) -> MetricLogger:
    """``logger``, its callback now one of ``trainer``'s."""
    trainer.add_callbacks([MetricLoggerCallback(logger, notes=trainer.notes)])
    return logger


def _logger_of(trainer: Trainer) -> MetricLogger | None:
    """``trainer.logger`` of a trainer built without 2.0's arguments: the one its
    ``provide_logger`` factory builds, else the hooks-only logger of the run config it
    holds (the runtime's), else ``None``. Built at this first read and kept as the
    trainer's ``logger`` attribute, so later reads do not come here."""
    factory = cast("Callable[[], MetricLogger] | None", trainer.__dict__.pop(_LOGGER_FACTORY, None))
    if factory is None:
        config = trainer.config
        if not isinstance(config, SpeedtronicConfig):
            return None
        factory = functools.partial(build_logger, config, outputs=False)
    logger = trainer.__dict__["logger"] = _attach(trainer, factory())
    return logger


def _provide_logger(trainer: Trainer, factory: Callable[[], MetricLogger]) -> None:
    trainer.__dict__[_LOGGER_FACTORY] = factory


def _resume(trainer: Trainer, state: Mapping[str, object]) -> None:
    trainer.load_state_dict(state)


class _V2Layer:
    """What the engine asks of the 2.0 layer (``speedtronic.engine.compat_route.V2Layer``)."""

    trainer_class = V2Trainer

    def member(self, trainer: object, name: str) -> object:
        assert isinstance(trainer, Trainer)
        if name == "logger":
            return _logger_of(trainer)
        if name == "train":
            return trainer.fit
        members: dict[str, Callable[..., None]] = {
            "provide_logger": _provide_logger,
            "resume": _resume,
        }
        return functools.partial(members[name], trainer)


V2_LAYER = _V2Layer()
"""The 2.0 layer, as the package root installs it (``compat_route.install``)."""


def _coerce_config(
    config: SpeedtronicConfig | Mapping[str, object] | None,
) -> SpeedtronicConfig | None:
    """A ``SpeedtronicConfig`` from a config object or a plain mapping (validated)."""
    if config is None:
        return None
    if isinstance(config, SpeedtronicConfig):
        return config
    return SpeedtronicConfig.from_dict(config)


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
