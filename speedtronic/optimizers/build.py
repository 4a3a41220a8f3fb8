"""``build_optimizer``: the optimizer the ``optimizer`` config section describes."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from speedtronic.optimizers.adamw import AdamWOptions, make_adamw
from speedtronic.optimizers.cautious import CautiousOptimizer
from speedtronic.optimizers.hybrid import HybridOptimizer, MuonOptions
from speedtronic.optimizers.muon import LR_SCALES, LrScale
from speedtronic.optimizers.orthogonalize import PostPolarMode, check_coefficients
from speedtronic.optimizers.routing import ParameterRouting, route_parameters
from speedtronic.optimizers.settings import OptimizerSettings, RunSettings
from speedtronic.systems.precision import supports_fused_adamw
from speedtronic.user_warnings import warn

__all__ = ["build_optimizer", "build_v2_optimizer"]


def _muon_options(settings: OptimizerSettings) -> MuonOptions:
    # Checked here (not only by Muon) so the message names the config key, and so a bad
    # value fails even when no parameter is routed to Muon.
    coefficients = tuple(float(c) for c in settings.muon_ns_coefficients)
    check_coefficients(coefficients)
    lr_scale = settings.muon_lr_scale.strip().lower()
    if lr_scale not in LR_SCALES:
        raise ValueError(f"optimizer.muon_lr_scale must be one of {LR_SCALES}")
    mode = settings.muon_plus_mode.strip().lower()
    if mode not in ("row_col", "col_row"):
        raise ValueError("optimizer.muon_plus_mode must be 'row_col' or 'col_row'")
    decay = settings.muon_weight_decay
    return MuonOptions(
        lr=settings.muon_lr if settings.muon_lr is not None else settings.lr,
        momentum=settings.muon_momentum,
        nesterov=settings.muon_nesterov,
        ns_steps=settings.muon_ns_steps,
        ns_coefficients=cast(tuple[float, float, float], coefficients),
        weight_decay=decay if decay is not None else settings.weight_decay,
        lr_scale=cast(LrScale, lr_scale),
        muon_plus=settings.muon_plus,
        muon_plus_mode=cast(PostPolarMode, mode),
        norm_eps=settings.muon_norm_eps,
    )


def _adamw_options(settings: OptimizerSettings, device: torch.device) -> AdamWOptions:
    betas = tuple(float(b) for b in settings.betas)
    if len(betas) != 2:
        raise ValueError(f"optimizer.betas needs exactly two values, got {settings.betas!r}")
    # ``fused: null`` probes the device; an explicit true still falls back in make_adamw.
    fused = settings.fused if settings.fused is not None else supports_fused_adamw(device)
    return AdamWOptions(
        lr=settings.lr,
        betas=(betas[0], betas[1]),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        fused=fused,
        decay_norms_and_biases=getattr(settings, "decay_norms_and_biases", None) is not False,
    )


def _checked_name(settings: OptimizerSettings) -> str:
    name = settings.name.strip().lower()
    if name not in ("adamw", "muon"):
        raise ValueError(f"optimizer.name must be 'adamw' or 'muon', got {settings.name!r}")
    if settings.muon_plus and name != "muon":
        raise ValueError("optimizer.muon_plus needs optimizer.name: muon")
    return name


def _hybrid(
    routing: ParameterRouting, settings: OptimizerSettings, adamw: AdamWOptions
) -> HybridOptimizer:
    if not routing.muon:
        warn(
            "optimizer.name is muon but no parameter was routed to Muon (see "
            "`speedtronic validate`); training with AdamW only",
        )
    return HybridOptimizer(routing.muon, routing.adamw, muon=_muon_options(settings), adamw=adamw)


def _section(config: OptimizerSettings | RunSettings) -> OptimizerSettings:
    """The ``optimizer`` section of a whole config (2.0's argument), or the section itself."""
    section = getattr(config, "optimizer", None)
    if section is not None and not isinstance(section, str):
        return cast(OptimizerSettings, section)
    return cast(OptimizerSettings, config)


def _model_device(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def build_optimizer(
    model: nn.Module,
    settings: OptimizerSettings | RunSettings,
    device: torch.device | str | None = None,
) -> torch.optim.Optimizer:
    """The optimizer the ``optimizer`` section describes, for ``model`` on ``device``.

    ``settings`` is the section or, as in 2.0, the whole config. ``device`` (where the
    model lives; it decides whether fused AdamW is used) defaults to the device of the
    model's first parameter.

    ``adamw``: one ``torch.optim.AdamW`` over every trainable parameter (fused where the
    device supports it, unless ``fused`` says otherwise). ``muon``: a ``HybridOptimizer``
    over the routed parameters. ``cautious`` wraps either in ``CautiousOptimizer``.
    """
    section = _section(settings)
    resolved = torch.device(device) if device is not None else _model_device(model)
    name = _checked_name(section)
    routing = route_parameters(model, section.routing, optimizer=name)
    if not routing.muon and not routing.adamw:
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    adamw = _adamw_options(section, resolved)
    optimizer: torch.optim.Optimizer
    if name == "adamw":
        optimizer = make_adamw(routing.adamw, adamw)
    else:
        optimizer = _hybrid(routing, section, adamw)
    if section.cautious:
        optimizer = CautiousOptimizer(optimizer, rescale=section.cautious_rescale)
    return optimizer


def build_v2_optimizer(
    model: nn.Module,
    config: OptimizerSettings | RunSettings,
    device: torch.device | str | None = None,
) -> torch.optim.Optimizer:
    """2.0's name of ``build_optimizer`` (AdamW, the Muon hybrid, the cautious wrapper)."""
    return build_optimizer(model, config, device)
