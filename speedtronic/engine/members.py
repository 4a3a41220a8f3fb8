"""The Trainer's members that live in its parts: what plugins and users read as
``trainer.step``, ``trainer.metrics_every``, ``trainer.notes``, ``trainer.config``, ...

``TrainerMembers`` is the Trainer's base: the members of its training state, settings and
evaluation under the names plugins and users always had (``trainer.step`` is
``trainer.state.step``), the ``TrainerView`` members derived from them, the run's config, and
2.0's members (``speedtronic.engine.compat_route``), which type checkers do not see.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar, overload

import torch
from torch import nn

from speedtronic.data import BatchStream
from speedtronic.engine.callback import Callback
from speedtronic.engine.compat_route import V2_MEMBERS, v2_layer
from speedtronic.engine.evaluation import Evaluation
from speedtronic.engine.notes import Notes
from speedtronic.engine.settings import RunConfigSource, TrainerSettings
from speedtronic.engine.state import LRScheduler, TrainingState
from speedtronic.systems.distributed import DistributedContext
from speedtronic.systems.precision import PrecisionPlan

__all__ = ["TrainerMembers"]

T = TypeVar("T")


class _Member(Generic[T]):
    """A Trainer attribute that lives in one of its parts, read and written there:
    ``step = _Member[int]("state")`` makes ``trainer.step`` ``trainer.state.step``. Plugins
    and users keep the names they always had; the engine itself uses the parts.

    Hooks read these every step (``trainer.step``), so the class holds a ``property`` whose
    getter is ``operator.attrgetter`` in its place: a read runs no Python frame (about a
    third of the cost of this ``__get__``). This class is what mypy sees: the member's type."""

    __slots__ = ("part", "name")

    def __init__(self, part: str, name: str = "") -> None:
        self.part = part
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name
        setattr(owner, name, property(attrgetter(f"{self.part}.{self.name}"), self.__set__))

    @overload
    def __get__(self, trainer: None, owner: type | None = None) -> _Member[T]: ...
    @overload
    def __get__(self, trainer: object, owner: type | None = None) -> T: ...
    def __get__(self, trainer: object, owner: type | None = None) -> T | _Member[T]:
        if trainer is None:
            return self
        value: T = getattr(getattr(trainer, self.part), self.name)
        return value

    def __set__(self, trainer: object, value: T) -> None:
        setattr(getattr(trainer, self.part), self.name, value)


class _V2Member:
    """One of 2.0's members (``compat_route.V2_MEMBERS``), from the 2.0 layer at its read.
    A non-data descriptor rather than a ``__getattr__``: a class with ``__getattr__`` pays a
    slower lookup on every attribute read, and hooks read the trainer's every step. What the
    2.0 layer stores on the instance (``trainer.logger`` once built) is read directly."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        assert name in V2_MEMBERS
        self.name = name

    def __get__(self, trainer: object, owner: type | None = None) -> object:
        if trainer is None:
            return self
        return v2_layer().member(trainer, self.name)


class TrainerMembers:
    """The members of a Trainer read from its parts (the module docstring says which)."""

    state: TrainingState
    settings: TrainerSettings
    evaluation: Evaluation
    _notes: Notes
    _config: RunConfigSource | None = None

    model = _Member[nn.Module]("state")
    optimizer = _Member[torch.optim.Optimizer]("state")
    scheduler = _Member[LRScheduler | None]("state")
    scaler = _Member[torch.amp.GradScaler | None]("state")
    stream = _Member[BatchStream[object]]("state")
    callbacks = _Member[list[Callback]]("state")
    trainable_parameters = _Member[list[torch.Tensor]]("state")
    precision = _Member[PrecisionPlan]("state")
    device = _Member[torch.device]("state")
    output_dir = _Member[Path]("state")
    distributed = _Member[DistributedContext | None]("state")
    multi_rank = _Member[bool]("state")
    run_id = _Member[str | None]("state")
    step = _Member[int]("state")
    samples = _Member[int]("state")
    tokens = _Member[int]("state")
    skipped_steps = _Member[int]("state")
    step_loss = _Member[torch.Tensor | None]("state")
    target_step = _Member[int]("state")
    sharded_state = _Member[bool]("state", "sharded")
    accumulation_steps = _Member[int]("settings")
    grad_clip = _Member[float | None]("settings")
    metrics_every = _Member[int]("settings")
    allow_optimizer_reset = _Member[bool]("settings")
    parallel_strategy = _Member[str]("settings", "parallel")
    eval_data = _Member[Iterable[object] | None]("evaluation", "data")
    eval_every = _Member[int]("evaluation", "every")
    eval_max_batches = _Member[int | None]("evaluation", "max_batches")

    # -- the TrainerView members that are not plain attributes ---------------------------

    @property
    def notes(self) -> Notes:
        """The run's board of optional named notes (``speedtronic.engine.notes``)."""
        return self._notes

    @property
    def param_groups(self) -> list[dict[str, object]]:
        """The optimizer's parameter groups."""
        return self.state.optimizer.param_groups

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """Every tensor in the optimizer's per-parameter state."""
        return [
            value
            for per_param in self.state.optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        ]

    @property
    def precision_mode(self) -> str:
        return self.state.precision.mode

    @property
    def uses_grad_scaler(self) -> bool:
        return self.state.scaler is not None

    @property
    def config(self) -> RunConfigSource | None:
        """The run's config (the runtime's ``SpeedtronicConfig``), else ``None``. Setting one
        also sets what checkpoints and sinks record as the run's config (``run_config``)."""
        return self._config

    @config.setter
    def config(self, config: RunConfigSource | None) -> None:
        self._config = config
        self.state.run_config = config.to_dict(redact_secrets=True) if config is not None else None

    if not TYPE_CHECKING:  # 2.0's members: type checkers flag them as any unknown member
        logger = _V2Member("logger")
        provide_logger = _V2Member("provide_logger")
        train = _V2Member("train")
        resume = _V2Member("resume")

    @property
    def run_config(self) -> Mapping[str, object] | None:
        """The config as plain data, secrets redacted (``None`` without a config); a copy
        of its own for each reader."""
        config = self.state.run_config
        return copy.deepcopy(dict(config)) if config is not None else None

    def data_position(self) -> Mapping[str, int]:
        return self.state.stream.state_dict()

    def skip_update(self) -> None:
        """Drop this step's gradients: the optimizer step that follows is a no-op."""
        self.state.optimizer.zero_grad(set_to_none=True)
