"""``HybridOptimizer``: Muon for hidden matrices and an auxiliary AdamW for the rest, as one
``torch.optim.Optimizer`` (one ``state_dict``, param groups a scheduler can drive)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from speedtronic.optimizers.adamw import AdamWOptions, make_adamw
from speedtronic.optimizers.muon import LrScale, Muon, check_muon_group
from speedtronic.optimizers.orthogonalize import DEFAULT_NS_COEFFICIENTS, NsDtype, PostPolarMode
from speedtronic.optimizers.routing import NamedParameter
from speedtronic.optimizers.stepping import reject_sparse_gradients, run_closure

__all__ = ["HybridOptimizer", "MuonOptions"]


@dataclass(frozen=True)
class MuonOptions:
    """Hyper-parameters of the Muon branch of a ``HybridOptimizer``."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS
    ns_eps: float = 1e-7
    ns_dtype: NsDtype = "auto"
    weight_decay: float = 0.0
    lr_scale: LrScale = "original"
    muon_plus: bool = False
    muon_plus_mode: PostPolarMode = "row_col"
    norm_eps: float = 1e-8


def _make_muon(params: Sequence[NamedParameter], options: MuonOptions) -> Muon:
    """A ``Muon`` over ``params`` with ``options``."""
    return Muon(
        list(params),
        lr=options.lr,
        momentum=options.momentum,
        nesterov=options.nesterov,
        ns_steps=options.ns_steps,
        ns_coefficients=options.ns_coefficients,
        ns_eps=options.ns_eps,
        ns_dtype=options.ns_dtype,
        weight_decay=options.weight_decay,
        lr_scale=options.lr_scale,
        muon_plus=options.muon_plus,
        muon_plus_mode=options.muon_plus_mode,
        norm_eps=options.norm_eps,
    )


class HybridOptimizer(torch.optim.Optimizer):
    """Muon for ``muon_params`` and AdamW for ``adamw_params``, as one optimizer.

    Its ``param_groups`` are the Muon group (``algorithm: "muon"``) then the AdamW group
    (``algorithm: "adamw"``); a scheduler that scales ``group["lr"]`` drives both branches.
    ``state`` holds both branches' per-parameter state (Muon ``momentum_buffer``, AdamW
    ``step``/``exp_avg``/``exp_avg_sq``), so ``state_dict`` / ``load_state_dict`` round-trip
    the whole optimizer and ``state.clear()`` resets both. Internally a ``Muon`` and a
    ``torch.optim.AdamW`` step the groups; they share this object's group dicts and state.
    """

    def __init__(
        self,
        muon_params: Sequence[NamedParameter],
        adamw_params: Sequence[NamedParameter],
        *,
        muon: MuonOptions | None = None,
        adamw: AdamWOptions | None = None,
    ) -> None:
        if not muon_params and not adamw_params:
            raise ValueError("HybridOptimizer needs at least one parameter")
        self._muon = _make_muon(muon_params, muon or MuonOptions()) if muon_params else None
        self._adamw = make_adamw(adamw_params, adamw or AdamWOptions()) if adamw_params else None
        groups = [g for child in self._children() for g in child.param_groups]
        super().__init__(groups, {"algorithm": "hybrid"})
        self._bind_children()

    def _children(self) -> list[torch.optim.Optimizer]:
        return [child for child in (self._muon, self._adamw) if child is not None]

    def _bind_children(self) -> None:
        """Point the branches at this object's groups and state again (after a load, or after
        someone replaced ``state`` instead of clearing it)."""
        for algorithm, child in (("muon", self._muon), ("adamw", self._adamw)):
            if child is not None:
                child.param_groups = [g for g in self.param_groups if g["algorithm"] == algorithm]
                child.state = self.state

    def add_param_group(self, param_group: dict[str, object]) -> None:
        """Add a group with ``algorithm`` "muon" or "adamw"; missing options come from that
        branch's defaults."""
        algorithm = param_group.get("algorithm")
        child = {"muon": self._muon, "adamw": self._adamw}.get(str(algorithm))
        if child is None:
            raise ValueError(
                f"a HybridOptimizer param group needs algorithm 'muon' or 'adamw' matching an "
                f"existing branch, got {algorithm!r}"
            )
        for key, value in child.defaults.items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)
        if algorithm == "muon":
            check_muon_group(param_group)
        if hasattr(self, "state"):
            self._bind_children()

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Run ``closure`` once, then the Muon step, then the AdamW step."""
        loss = run_closure(closure)
        self._bind_children()
        reject_sparse_gradients(self.param_groups)
        for child in self._children():
            child.step()
        return loss

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        super().load_state_dict(dict(state_dict))
        self._bind_children()
