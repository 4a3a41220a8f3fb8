"""The keywords ``Trainer(model, optimizer, data, ...)`` takes beside its parts, resolved.

Calling the Trainer class resolves them (its metaclass, ``TrainerType``); its ``__init__``
then runs on resolved values only (``settings=``, ``evaluation=``). Given one of 2.0's
arguments (``compat_route.V2_KEYWORDS``), the call builds 2.0's trainer instead.

A user writes ``Trainer(model, opt, data, metrics_every=10, grad_clip=1.0, eval_data=held_out)``
as a Lightning user would; the Trainer itself runs on a ``TrainerSettings`` and an
``Evaluation``. This module turns the one into the other: a keyword given replaces the value
of ``settings=`` (default: ``TrainerSettings()``), one left out keeps it. ``parallel=`` is a
mapping (``{"strategy": "fsdp", "tensor": 2}``) or any object with the ``parallel:``
section's attributes (a ``ParallelConfig``), read without importing the config layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TypedDict, cast, get_args

import torch

from speedtronic.engine.compat_route import V2_KEYWORDS, v2_layer
from speedtronic.engine.evaluation import Evaluation, check_eval_settings
from speedtronic.engine.settings import ParallelStrategy, TrainerSettings
from speedtronic.systems.distributed import DistributedContext
from speedtronic.systems.precision import PrecisionPlan, resolve_device

__all__ = [
    "TrainerKeywords",
    "TrainerType",
    "parallel_fields",
    "resolve_evaluation",
    "resolve_settings",
]


class _SettingKeywords(TypedDict, total=False):
    """The settings a ``Trainer`` takes as keywords (``TrainerSettings`` says what each does)."""

    device: str | torch.device | None
    precision: PrecisionPlan | None
    accumulation_steps: int | None
    grad_clip: float | None
    compile: bool | None
    metrics_every: int | None
    allow_optimizer_reset: bool | None
    output_dir: str | Path | None
    max_epochs: int | None
    parallel: Mapping[str, object] | object | None
    eval_data: Iterable[object] | None
    """Held-out batches evaluated during the fit (``Evaluation.data``)."""
    eval_every: int | None
    eval_max_batches: int | None


class _V2Keywords(TypedDict, total=False):
    """2.0's constructor arguments: given one, ``Trainer(...)`` builds the 2.0 trainer
    (``speedtronic.engine.compat_route``), which says what each means."""

    config: object
    coordinator: object
    logger: object
    checkpoint_manager: object
    shape_report: object


class TrainerKeywords(_SettingKeywords, _V2Keywords, total=False):
    """Every keyword of ``Trainer(...)`` beyond its parts."""


_EVALUATION = ("eval_data", "eval_every", "eval_max_batches")
_KEYWORDS = frozenset(_SettingKeywords.__annotations__)
_SETTINGS = _KEYWORDS - set(_EVALUATION)
_COERCED: dict[str, type] = {
    "accumulation_steps": int,
    "metrics_every": int,
    "compile": bool,
    "allow_optimizer_reset": bool,
}
_PARALLEL = ("strategy", "reshard_after_forward", "tensor")


def resolve_settings(
    settings: TrainerSettings | None,
    distributed: DistributedContext | None,
    keywords: Mapping[str, object],
) -> TrainerSettings:
    """``settings`` (default: a distributed run's device, else the CPU) with the setting
    ``keywords`` given in place of its values (other keywords are not read)."""
    if settings is None:
        device = distributed.device if distributed is not None else torch.device("cpu")
        settings = TrainerSettings(device=device)
    given = {name: value for name, value in keywords.items() if name in _SETTINGS}
    if given.get("device") is not None:
        given["device"] = resolve_device(cast("str | torch.device", given["device"]))
    if given.get("output_dir") is not None:
        given["output_dir"] = Path(cast("str | Path", given["output_dir"]))
    for name, kind in _COERCED.items():  # as 2.0's Trainer did: int(accumulation_steps), ...
        if given.get(name) is not None:
            given[name] = kind(given[name])
    parallel = given.pop("parallel", None)
    if parallel is not None:
        strategy, reshard, tensor = parallel_fields(parallel)
        given.update(parallel=strategy, reshard_after_forward=reshard, tensor=tensor)
    changes = {name: value for name, value in given.items() if value is not None}
    return dataclasses.replace(settings, **changes) if changes else settings  # type: ignore[arg-type]  # checked by TrainerKeywords and __post_init__


def resolve_evaluation(evaluation: Evaluation | None, keywords: Mapping[str, object]) -> Evaluation:
    """``evaluation``, or the one the ``eval_*`` keywords describe (not both)."""
    given = [name for name in _EVALUATION if keywords.get(name) is not None]
    if evaluation is not None:
        if given:
            raise TypeError(f"Trainer() takes evaluation= or {given[0]}=, not both")
        return evaluation
    every = cast("int | None", keywords.get("eval_every"))
    max_batches = cast("int | None", keywords.get("eval_max_batches"))
    check_eval_settings(every, max_batches)
    data = cast("Iterable[object] | None", keywords.get("eval_data"))
    return Evaluation(data, every or 0, max_batches)


def parallel_fields(parallel: Mapping[str, object] | object) -> tuple[ParallelStrategy, bool, int]:
    """``(strategy, reshard_after_forward, tensor)`` of a ``parallel=`` mapping or section
    (missing keys: the defaults); ``ValueError`` naming a key or value that is not one."""
    default = TrainerSettings()
    if isinstance(parallel, Mapping):
        unknown = sorted(set(parallel) - set(_PARALLEL))
        if unknown:
            raise ValueError(f"parallel: unknown key {unknown[0]!r} (keys: {', '.join(_PARALLEL)})")
        values = dict(parallel)
    else:
        values = {name: getattr(parallel, name) for name in _PARALLEL if hasattr(parallel, name)}
    strategy = values.get("strategy", default.parallel)
    if isinstance(strategy, str):
        strategy = strategy.lower()
    if strategy not in get_args(ParallelStrategy):
        raise ValueError(f"parallel.strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    reshard = values.get("reshard_after_forward", default.reshard_after_forward)
    if not isinstance(reshard, bool):
        raise ValueError(f"parallel.reshard_after_forward must be true or false, got {reshard!r}")
    tensor = values.get("tensor", default.tensor)
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
        raise ValueError(f"parallel.tensor must be a positive integer, got {tensor!r}")
    return cast("ParallelStrategy", strategy), reshard, tensor


class TrainerType(type):
    """The Trainer's metaclass: calling a Trainer class whose ``__init__`` is the engine's
    resolves the keywords into ``settings=`` and ``evaluation=`` first, and builds 2.0's
    trainer when given 2.0's arguments. A subclass with an ``__init__`` of its own is called
    as any class is (2.0's trainer takes its keywords itself)."""

    def __call__(cls, *args: object, **keywords: object) -> object:
        engine = next(kind for kind in reversed(cls.__mro__) if isinstance(kind, TrainerType))
        if cls.__init__ is engine.__init__:  # type: ignore[misc]  # compared, not called
            v2 = sorted(V2_KEYWORDS.intersection(keywords))
            if v2 and cls is engine:
                return v2_layer().trainer_class(*args, **keywords)
            if v2:
                raise TypeError(f"{v2[0]}= is 2.0's, taken by speedtronic.Trainer itself only")
            given = {name: keywords.pop(name) for name in _KEYWORDS.intersection(keywords)}
            if given:
                distributed = cast("DistributedContext | None", keywords.get("distributed"))
                settings = cast("TrainerSettings | None", keywords.get("settings"))
                evaluation = cast("Evaluation | None", keywords.get("evaluation"))
                keywords["settings"] = resolve_settings(settings, distributed, given)
                keywords["evaluation"] = resolve_evaluation(evaluation, given)
        return super().__call__(*args, **keywords)
