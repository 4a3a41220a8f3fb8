"""Declared parameter routing: which trainable parameter goes to Muon and which to AdamW,
and why.

Routing is a list of declared rules, checked in this order: the user's ``optimizer.routing``
rules (first match wins), a module's ``_speedtronic_optimizer_role`` attribute (the nearest
enclosing module that sets one), then ``DEFAULT_RULES``. ``describe_routing`` returns the
"which parameter goes where and why" table that ``speedtronic validate`` prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal, TypeAlias, cast

import torch
from torch import nn

from speedtronic.optimizers.muon import muon_ineligibility
from speedtronic.optimizers.settings import RoutingRuleSettings, RoutingSettings

__all__ = [
    "DEFAULT_RULES",
    "ROLE_ATTRIBUTE",
    "Assignment",
    "DefaultRule",
    "NamedParameter",
    "ParameterFacts",
    "ParameterRouting",
    "Route",
    "RoutingRow",
    "RoutingRule",
    "describe_routing",
    "format_routing_table",
    "route_parameters",
]

NamedParameter: TypeAlias = tuple[str, nn.Parameter]
Route = Literal["muon", "adamw"]
Assignment = Literal["muon", "adamw", "frozen"]

ROLE_ATTRIBUTE = "_speedtronic_optimizer_role"
"""Set this attribute on a module to ``"muon"`` or ``"adamw"`` to route its parameters (and
those of its submodules that do not set one themselves)."""


@dataclass(frozen=True)
class ParameterFacts:
    """What routing rules look at: every name a (possibly tied) parameter is reachable by,
    the class name of the module owning it under each name, its shape and dtype."""

    names: tuple[str, ...]
    owner_classes: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def name(self) -> str:
        """The primary name (the first registration, as ``model.named_parameters()``)."""
        return self.names[0]

    @property
    def components(self) -> frozenset[str]:
        """Every dotted component of every name (``transformer.wte.weight`` -> wte, ...)."""
        return frozenset(part for name in self.names for part in name.split("."))


# -- declared rules -------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingRule:
    """A declared routing rule. Unset criteria match anything; set ones must all match.

    ``name`` is an ``fnmatch`` glob on the dotted parameter name (any alias of a tied
    weight), ``module`` a glob on the owning module's class name (case-insensitive),
    ``ndim`` the exact number of dimensions.
    """

    to: Route
    name: str | None = None
    module: str | None = None
    ndim: int | None = None

    def matches(self, facts: ParameterFacts) -> bool:
        if self.ndim is not None and len(facts.shape) != self.ndim:
            return False
        if self.name is not None and not any(fnmatchcase(n, self.name) for n in facts.names):
            return False
        if self.module is not None:
            pattern = self.module.lower()
            if not any(fnmatchcase(c.lower(), pattern) for c in facts.owner_classes):
                return False
        return True

    def describe(self) -> str:
        parts = [
            f"{key}={value!r}"
            for key, value in (("name", self.name), ("module", self.module), ("ndim", self.ndim))
            if value is not None
        ]
        return ", ".join(parts) or "any parameter"

    @classmethod
    def from_settings(cls, rule: RoutingRuleSettings) -> RoutingRule:
        target = rule.to.strip().lower()
        if target not in ("muon", "adamw"):
            raise ValueError(f"routing rule 'to' must be 'muon' or 'adamw', got {rule.to!r}")
        return cls(to=cast(Route, target), name=rule.name, module=rule.module, ndim=rule.ndim)


# -- built-in rules -------------------------------------------------------------------------


@dataclass(frozen=True)
class DefaultRule:
    """One of the built-in routing rules, applied after user rules and module roles."""

    label: str
    to: Route
    description: str
    applies: Callable[[ParameterFacts], bool]


_EMBEDDING_COMPONENTS = frozenset({"wte", "wpe"})
_HEAD_COMPONENTS = frozenset({"lm_head", "head", "classifier", "score"})


def _is_embedding_name(facts: ParameterFacts) -> bool:
    return any("embed" in part or part in _EMBEDDING_COMPONENTS for part in facts.components)


def _is_head_name(facts: ParameterFacts) -> bool:
    # ``output`` only at the top level (Llama's ``output`` head): deeper ``output`` modules
    # are usually hidden projections (attention ``output``, BERT's ``layer.N.output``).
    top_level_output = any(name.split(".")[0] == "output" for name in facts.names)
    return top_level_output or bool(facts.components & _HEAD_COMPONENTS)


DEFAULT_RULES: tuple[DefaultRule, ...] = (
    DefaultRule(
        "not-a-matrix",
        "adamw",
        "not 2-D (scalar, vector, conv filter)",
        lambda f: len(f.shape) != 2,
    ),
    DefaultRule(
        "not-real-float",
        "adamw",
        "not a real floating-point tensor",
        lambda f: not f.dtype.is_floating_point,
    ),
    DefaultRule("bias", "adamw", "bias", lambda f: any(n.endswith("bias") for n in f.names)),
    DefaultRule(
        "embedding-module",
        "adamw",
        "embedding module",
        lambda f: any("embedding" in c.lower() for c in f.owner_classes),
    ),
    DefaultRule(
        "norm-module",
        "adamw",
        "normalisation module",
        lambda f: any("norm" in c.lower() for c in f.owner_classes),
    ),
    DefaultRule(
        "embedding-name",
        "adamw",
        "embedding by name (*embed*, wte, wpe)",
        _is_embedding_name,
    ),
    DefaultRule(
        "head-name",
        "adamw",
        "output head by name (lm_head, head, classifier, score, top-level output)",
        _is_head_name,
    ),
    DefaultRule(
        "vector-shaped",
        "adamw",
        "1xN or Nx1 matrix (a vector in disguise)",
        lambda f: min(f.shape) < 2,
    ),
    DefaultRule(
        "hidden-matrix",
        "muon",
        "hidden 2-D matrix",
        lambda f: True,
    ),
)
"""The built-in routing policy, first match wins. Muon gets hidden 2-D matrices, including
bare 2-D ``nn.Parameter``s that no ``nn.Linear`` owns; everything else goes to AdamW."""


# -- the result -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingRow:
    """One line of the routing table: where a parameter goes and which rule sent it there.
    ``aliases`` lists the other names of a tied parameter (it is optimised once)."""

    name: str
    shape: tuple[int, ...]
    optimizer: Assignment
    reason: str
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParameterRouting:
    """Every trainable parameter exactly once, in ``muon`` or ``adamw``; frozen ones in
    ``skipped``; ``rows`` explains each decision."""

    muon: tuple[NamedParameter, ...]
    adamw: tuple[NamedParameter, ...]
    skipped: tuple[NamedParameter, ...]
    rows: tuple[RoutingRow, ...]


# -- deciding -------------------------------------------------------------------------------


@dataclass
class _Entry:
    param: nn.Parameter
    names: list[str]
    owners: list[nn.Module]

    def facts(self) -> ParameterFacts:
        return ParameterFacts(
            names=tuple(self.names),
            owner_classes=tuple(type(owner).__name__ for owner in self.owners),
            shape=tuple(self.param.shape),
            dtype=self.param.dtype,
            requires_grad=self.param.requires_grad,
        )


def _collect_parameters(model: nn.Module) -> list[_Entry]:
    """Each distinct parameter once (by identity), with every name and owner it has, in
    ``named_parameters`` order so the primary name is the usual one."""
    entries: dict[int, _Entry] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for local, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{module_name}.{local}" if module_name else local
            entry = entries.setdefault(id(param), _Entry(param, [], []))
            if full not in entry.names:
                entry.names.append(full)
                entry.owners.append(module)
    return list(entries.values())


def _module_role(modules: Mapping[str, nn.Module], name: str) -> tuple[str, Route] | None:
    """``(module path, role)`` declared by the nearest enclosing module of parameter
    ``name`` (the owner first, then its parents up to the root), or ``None``."""
    parts = name.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        path = ".".join(parts[:depth])
        module = modules.get(path)
        role = getattr(module, ROLE_ATTRIBUTE, None) if module is not None else None
        if role is None:
            continue
        if role not in ("muon", "adamw"):
            raise ValueError(
                f"{path or '<root module>'}.{ROLE_ATTRIBUTE} = {role!r}; "
                "expected 'muon', 'adamw' or None"
            )
        return path or "<root>", cast(Route, role)
    return None


def _resolve(to: Route, why: str, facts: ParameterFacts) -> tuple[Route, str]:
    """``to``, unless that is Muon and Muon cannot take the parameter: then AdamW, saying so."""
    if to == "muon":
        problem = muon_ineligibility(facts.shape, facts.dtype)
        if problem is not None:
            return "adamw", f"{why}; but {problem}, so AdamW"
    return to, why


def _decide(
    facts: ParameterFacts, rules: Sequence[RoutingRule], role: tuple[str, Route] | None
) -> tuple[Route, str]:
    for index, rule in enumerate(rules):
        if rule.matches(facts):
            return _resolve(rule.to, f"optimizer.routing[{index}] ({rule.describe()})", facts)
    if role is not None:
        path, target = role
        return _resolve(target, f"module role: {path}.{ROLE_ATTRIBUTE}", facts)
    for default in DEFAULT_RULES:
        if default.applies(facts):
            return default.to, f"default: {default.description}"
    raise AssertionError("the last default rule matches every parameter")


def _assign(
    facts: ParameterFacts,
    optimizer: str,
    rules: Sequence[RoutingRule],
    modules: Mapping[str, nn.Module],
) -> tuple[Assignment, str]:
    if not facts.requires_grad:
        return "frozen", "requires_grad=False: not optimised"
    if optimizer == "adamw":
        return "adamw", "optimizer.name is adamw: AdamW trains every parameter"
    return _decide(facts, rules, _module_role(modules, facts.name))


def route_parameters(
    model: nn.Module,
    rules: Sequence[RoutingRule | RoutingRuleSettings] = (),
    *,
    optimizer: str = "muon",
) -> ParameterRouting:
    """Assign every trainable parameter of ``model`` to Muon or AdamW, exactly once.

    With ``optimizer="adamw"`` everything trainable goes to AdamW (routing only matters for
    the hybrid). Tied parameters are routed once, under their first name.
    """
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    declared = [r if isinstance(r, RoutingRule) else RoutingRule.from_settings(r) for r in rules]
    modules = dict(model.named_modules(remove_duplicate=False))
    buckets: dict[Assignment, list[NamedParameter]] = {"muon": [], "adamw": [], "frozen": []}
    rows: list[RoutingRow] = []
    for entry in _collect_parameters(model):
        facts = entry.facts()
        target, why = _assign(facts, optimizer, declared, modules)
        buckets[target].append((facts.name, entry.param))
        rows.append(RoutingRow(facts.name, facts.shape, target, why, facts.names[1:]))
    return ParameterRouting(
        tuple(buckets["muon"]), tuple(buckets["adamw"]), tuple(buckets["frozen"]), tuple(rows)
    )


# -- the table ------------------------------------------------------------------------------


def describe_routing(model: nn.Module, settings: RoutingSettings) -> list[RoutingRow]:
    """The routing table for ``model`` under ``settings`` (what ``validate`` prints)."""
    name = settings.name.strip().lower()
    return list(route_parameters(model, settings.routing, optimizer=name).rows)


def _summary(rows: Sequence[RoutingRow]) -> str:
    parts = []
    for kind in ("muon", "adamw", "frozen"):
        chosen = [row for row in rows if row.optimizer == kind]
        if chosen:
            values = sum(row.numel for row in chosen)
            parts.append(f"{kind}: {len(chosen)} tensors, {values:,} values")
    return "; ".join(parts) if parts else "no parameters"


def format_routing_table(rows: Sequence[RoutingRow]) -> str:
    """A fixed-width text table of ``rows`` followed by a per-optimizer summary."""
    header = ("parameter", "shape", "optimizer", "rule")
    lines = [
        (
            row.name + "".join(f" (= {alias})" for alias in row.aliases),
            "x".join(str(d) for d in row.shape) or "scalar",
            row.optimizer,
            row.reason,
        )
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(3)]

    def render(cells: Sequence[str]) -> str:
        padded = [cells[i].ljust(widths[i]) for i in range(3)]
        return "  ".join([*padded, cells[3]]).rstrip()

    out = [render(header), render(["-" * w for w in (*widths, 4)])]
    out.extend(render(cells) for cells in lines)
    out.append(_summary(rows))
    return "\n".join(out)
