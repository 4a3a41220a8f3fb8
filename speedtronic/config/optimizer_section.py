"""The ``optimizer:`` section (with its parameter routing rules) and
the ``scheduler:`` section."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, cast

from speedtronic.config import declare
from speedtronic.config.declare import Opt
from speedtronic.config.section_base import STEPS_MAX, JSONValue, Section


@dataclass(frozen=True)
class RoutingRule:
    """Send matching parameters to one optimizer. Rules are tried in order; the first match
    wins; unmatched parameters follow the built-in heuristic.

    Every given criterion must match; a rule with none matches everything. This is the
    config record only: ``speedtronic.optimizers.RoutingRule`` does the matching.
    """

    to: Annotated[Literal["muon", "adamw"], Opt("Target optimizer.")]
    name: Annotated[
        str | None,
        Opt(
            "Glob matched against the full parameter name (e.g. 'blocks.*.attn.*').",
            schema={"type": "string"},
            min_length=1,
        ),
    ] = None
    module: Annotated[
        str | None,
        Opt(
            "Class name of the module that owns the parameter (e.g. 'Linear').",
            schema={"type": "string"},
            min_length=1,
        ),
    ] = None
    ndim: Annotated[
        int | None,
        Opt(
            "Number of dimensions of the parameter.",
            schema={"type": "integer"},
            minimum=0,
            maximum=64,
        ),
    ] = None

    def to_dict(self) -> dict[str, JSONValue]:
        """The rule as config data (unset criteria omitted)."""
        values: dict[str, JSONValue] = {"to": self.to}
        for key in ("name", "module", "ndim"):
            value = getattr(self, key)
            if value is not None:
                values[key] = value
        return values

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> RoutingRule | Mapping[str, object]:
        """The rule, or ``values`` unchanged when they do not fit (validation reports it)."""
        return cast("RoutingRule | Mapping[str, object]", declare.coerce(cls, values))


@dataclass
class OptimizerConfig(Section):
    """``optimizer:`` -- AdamW, or hybrid Muon (matrices) + AdamW (the rest); optionally
    cautious. ``muon_lr``/``muon_weight_decay`` default to ``lr``/``weight_decay``."""

    section_name: ClassVar[str] = "optimizer"
    bare_value: ClassVar[str | None] = "name"
    section_doc: ClassVar[str] = (
        "Optimizer: AdamW or hybrid Muon/AdamW, optionally cautious. A bare string "
        "(optimizer: muon) is a shorthand for {name: muon}."
    )

    name: Annotated[
        Literal["adamw", "muon"],
        Opt("`muon`: hidden matrices with Muon, everything else with AdamW", fold="lower"),
    ] = "adamw"
    lr: Annotated[
        float,
        Opt(
            "AdamW learning rate; also Muon's unless `muon_lr` is set",
            exclusive_minimum=0,
            maximum=1000,
            default_text="`3e-4`",
        ),
    ] = 3e-4
    betas: Annotated[
        tuple[float, float],
        Opt(
            "AdamW betas",
            items={"minimum": 0, "exclusiveMaximum": 1},
            type_text="two numbers in [0, 1)",
        ),
    ] = (0.9, 0.95)
    eps: Annotated[
        float,
        Opt(
            "AdamW epsilon",
            exclusive_minimum=0,
            maximum=1,
            type_text="number > 0",
            default_text="`1e-8`",
        ),
    ] = 1e-8
    weight_decay: Annotated[
        float,
        Opt(
            "decoupled weight decay; also Muon's unless `muon_weight_decay` is set",
            minimum=0,
            maximum=1000,
        ),
    ] = 0.1
    fused: Annotated[bool | None, Opt("fused AdamW; `null` probes support on CUDA")] = None
    grad_clip: Annotated[
        float | None,
        Opt("clip the global gradient norm (after unscaling)", exclusive_minimum=0, maximum=1e9),
    ] = None
    muon_plus: Annotated[
        bool,
        Opt(
            "normalise Muon updates after orthogonalisation (Muon+); requires `name: muon`",
            shorthand=True,
        ),
    ] = False
    muon_plus_mode: Annotated[
        Literal["row_col", "col_row"], Opt("order of the Muon+ normalisation", fold="lower")
    ] = "row_col"
    cautious: Annotated[
        bool,
        Opt("mask update entries whose sign disagrees with the gradient", shorthand=True),
    ] = False
    cautious_rescale: Annotated[
        bool, Opt("rescale cautious updates by the fraction of entries kept")
    ] = False
    muon_momentum: Annotated[float, Opt("Muon momentum", minimum=0, exclusive_maximum=1)] = 0.95
    muon_nesterov: Annotated[bool, Opt("Nesterov momentum for Muon")] = True
    muon_ns_steps: Annotated[int, Opt("Newton–Schulz iterations", minimum=1, maximum=100)] = 5
    muon_ns_coefficients: Annotated[
        tuple[float, float, float],
        Opt(
            "quintic Newton–Schulz coefficients (a, b, c)",
            items={"minimum": -1000, "maximum": 1000},
        ),
    ] = (3.4445, -4.775, 2.0315)
    muon_norm_eps: Annotated[
        float,
        Opt(
            "epsilon of the Muon+ normalisation",
            exclusive_minimum=0,
            maximum=1,
            type_text="number > 0",
            default_text="`1e-8`",
        ),
    ] = 1e-8
    muon_lr: Annotated[
        float | None,
        Opt(
            "learning rate of the Muon group",
            exclusive_minimum=0,
            maximum=1000,
            default_text="`null` → `lr`",
        ),
    ] = None
    muon_lr_scale: Annotated[
        Literal["original", "rms"],
        Opt(
            "`rms` scales Muon updates to AdamW's update RMS (so `lr` means the same for both "
            "branches); `original` is √max(1, rows/cols) (set `muon_lr` explicitly, e.g. 0.02)",
            fold="lower",
        ),
    ] = "rms"
    muon_weight_decay: Annotated[
        float | None,
        Opt(
            "weight decay of the Muon group",
            minimum=0,
            maximum=1000,
            default_text="`null` → `weight_decay`",
        ),
    ] = None
    decay_norms_and_biases: Annotated[
        bool | None,
        Opt(
            "`false`: 1-D and scalar parameters (biases, norm gains) get weight decay 0 in "
            "AdamW; see [optimizers](optimizers.md#weight-decay-on-norms-and-biases)",
            default_text="`null` → `true`, or a callback's proposal",
        ),
    ] = None
    """``null``: ``true`` unless a callback of the run proposes otherwise
    (``Callback.optimizer_decay_norms_and_biases``)."""
    routing: Annotated[
        list[RoutingRule],
        Opt(
            "with `name: muon` only: `{to: muon|adamw, name: <glob>, module: <class name>, "
            "ndim: <int>}`; every criterion given must match, the first matching rule wins, "
            "unmatched parameters follow the heuristic; a rule sending `ndim` ≠ 2 to `muon` "
            "is an error",
            type_text="list of rules",
        ),
    ] = field(default_factory=list)

    @property
    def resolved_muon_lr(self) -> float:
        """The Muon group's learning rate (``muon_lr``, else ``lr``)."""
        return self.lr if self.muon_lr is None else self.muon_lr

    @property
    def resolved_muon_weight_decay(self) -> float:
        """The Muon group's weight decay (``muon_weight_decay``, else ``weight_decay``)."""
        return self.weight_decay if self.muon_weight_decay is None else self.muon_weight_decay


@dataclass
class SchedulerConfig(Section):
    """``scheduler:`` -- warmup then cosine or constant. ``max_steps: None`` follows the
    training target; read the resolved horizon from ``SpeedtronicConfig.scheduler_steps``."""

    section_name: ClassVar[str] = "scheduler"
    section_doc: ClassVar[str] = "Learning-rate schedule, advanced once per optimizer step."

    name: Annotated[
        Literal["cosine", "constant"],
        Opt(
            "`cosine` decays from 1 to `min_lr_ratio` at the horizon and holds there; "
            "`constant` stays at 1",
            fold="lower",
        ),
    ] = "cosine"
    warmup_steps: Annotated[
        int,
        Opt(
            "linear warmup steps (the 2.0 default); `validate` and `fit` warn when it covers "
            "more than half of the schedule's horizon (below; `--max-steps` does not change "
            "it) — scale it with the schedule (about 10% of its steps)",
            minimum=0,
            maximum=STEPS_MAX,
        ),
    ] = 100
    max_steps: Annotated[
        int | None,
        Opt(
            "the horizon. Absent or `null`: the training target (`data.max_steps`, else "
            "`run.max_steps`). A value you give is used as given, never overwritten — "
            "including `1000`",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None
    min_lr_ratio: Annotated[
        float, Opt("cosine floor as a fraction of `lr`", minimum=0, maximum=1)
    ] = 0.1
