"""What the optimizer package reads from the config sections.

Typed structurally (``Protocol``) so the config dataclasses and tests' simple stand-in
objects both fit, and so this package does not import the config package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "OptimizerSettings",
    "RoutingRuleSettings",
    "RoutingSettings",
    "RunSettings",
    "SchedulerSettings",
]


class RoutingRuleSettings(Protocol):
    """One ``optimizer.routing`` entry: route matching parameters ``to`` muon or adamw."""

    @property
    def to(self) -> str: ...

    @property
    def name(self) -> str | None: ...

    @property
    def module(self) -> str | None: ...

    @property
    def ndim(self) -> int | None: ...


class RoutingSettings(Protocol):
    """The part of the ``optimizer`` section that routing reads."""

    @property
    def name(self) -> str: ...

    @property
    def routing(self) -> Sequence[RoutingRuleSettings]: ...


class OptimizerSettings(RoutingSettings, Protocol):
    """The ``optimizer`` config section (the attributes ``build_optimizer`` reads)."""

    @property
    def lr(self) -> float: ...

    @property
    def betas(self) -> Sequence[float]: ...

    @property
    def eps(self) -> float: ...

    @property
    def weight_decay(self) -> float: ...

    @property
    def fused(self) -> bool | None: ...

    @property
    def muon_plus(self) -> bool: ...

    @property
    def muon_plus_mode(self) -> str: ...

    @property
    def cautious(self) -> bool: ...

    @property
    def cautious_rescale(self) -> bool: ...

    @property
    def muon_momentum(self) -> float: ...

    @property
    def muon_nesterov(self) -> bool: ...

    @property
    def muon_ns_steps(self) -> int: ...

    @property
    def muon_ns_coefficients(self) -> Sequence[float]: ...

    @property
    def muon_norm_eps(self) -> float: ...

    @property
    def muon_lr(self) -> float | None: ...

    @property
    def muon_lr_scale(self) -> str: ...

    @property
    def muon_weight_decay(self) -> float | None: ...


class SchedulerSettings(Protocol):
    """The ``scheduler`` config section (the horizon is passed to ``build_scheduler``)."""

    @property
    def name(self) -> str: ...

    @property
    def warmup_steps(self) -> int: ...

    @property
    def min_lr_ratio(self) -> float: ...


class RunSettings(Protocol):
    """A whole run configuration, as 2.0's ``build_optimizer(model, config)`` and
    ``build_scheduler(optimizer, config)`` took it (``SpeedtronicConfig`` fits)."""

    @property
    def optimizer(self) -> OptimizerSettings: ...

    @property
    def scheduler(self) -> SchedulerSettings: ...

    @property
    def scheduler_steps(self) -> int: ...
