"""Optimizers: AdamW, Muon (with Muon+), the Muon/AdamW hybrid, the cautious wrapper,
declared parameter routing and the learning-rate schedule.

``build_optimizer`` is what the runtime calls. With ``optimizer.name: adamw`` every trainable
parameter goes to one ``torch.optim.AdamW``. With ``muon`` the parameters are *routed*: hidden
2-D weight matrices go to Muon, everything else (embeddings, output heads, norm gains, biases,
scalars) to an auxiliary AdamW, and both live in one ``HybridOptimizer`` whose ``state_dict``
and param groups behave like any other optimizer's (LR schedulers drive both branches).

One concept per module:

- ``routing``: which parameter goes to Muon or AdamW, and the table that explains it;
- ``orthogonalize``: Newton–Schulz, its working precision, the Muon+ normalisation;
- ``muon``: the ``Muon`` optimizer;
- ``adamw``: AdamW options and construction (fused, with a fallback);
- ``hybrid``: ``HybridOptimizer`` and ``MuonOptions``;
- ``cautious``: ``CautiousOptimizer``;
- ``schedules``: the learning-rate schedule;
- ``build``: ``build_optimizer`` from the config section;
- ``settings``: the config attributes this package reads (structural types);
- ``stepping``: what every ``step`` here does around its update.
"""

from __future__ import annotations

from speedtronic.optimizers.adamw import AdamWOptions
from speedtronic.optimizers.build import build_optimizer, build_v2_optimizer
from speedtronic.optimizers.cautious import CautiousOptimizer
from speedtronic.optimizers.hybrid import HybridOptimizer, MuonOptions
from speedtronic.optimizers.muon import LrScale, Muon, ParamsInput
from speedtronic.optimizers.orthogonalize import (
    CPU_BF16_MIN_SIDE,
    DEFAULT_NS_COEFFICIENTS,
    NsDtype,
    PostPolarMode,
    newton_schulz,
    ns_work_dtype,
    post_polar_normalize,
)
from speedtronic.optimizers.routing import (
    DEFAULT_RULES,
    ROLE_ATTRIBUTE,
    Assignment,
    DefaultRule,
    NamedParameter,
    ParameterFacts,
    ParameterRouting,
    Route,
    RoutingRow,
    RoutingRule,
    describe_routing,
    format_routing_table,
    route_parameters,
)
from speedtronic.optimizers.schedules import build_scheduler, lr_multiplier
from speedtronic.optimizers.settings import (
    OptimizerSettings,
    RoutingRuleSettings,
    RoutingSettings,
    RunSettings,
    SchedulerSettings,
)

__all__ = [
    "CPU_BF16_MIN_SIDE",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_RULES",
    "ROLE_ATTRIBUTE",
    "AdamWOptions",
    "Assignment",
    "CautiousOptimizer",
    "DefaultRule",
    "HybridOptimizer",
    "LrScale",
    "Muon",
    "MuonOptions",
    "NamedParameter",
    "NsDtype",
    "OptimizerSettings",
    "ParameterFacts",
    "ParameterRouting",
    "ParamsInput",
    "PostPolarMode",
    "Route",
    "RoutingRow",
    "RoutingRule",
    "RoutingRuleSettings",
    "RoutingSettings",
    "RunSettings",
    "SchedulerSettings",
    "build_optimizer",
    "build_v2_optimizer",
    "build_scheduler",
    "describe_routing",
    "format_routing_table",
    "lr_multiplier",
    "newton_schulz",
    "ns_work_dtype",
    "post_polar_normalize",
    "route_parameters",
]
