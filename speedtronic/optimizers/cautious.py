"""``CautiousOptimizer``: wrap any optimizer and drop the update coordinates whose sign
disagrees with the gradient (Liang et al., "Cautious Optimizers")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast, overload

import torch

from speedtronic.optimizers.stepping import run_closure

__all__ = ["CautiousOptimizer"]


class CautiousOptimizer(torch.optim.Optimizer):
    """Wrap any optimizer so that update coordinates whose sign disagrees with the gradient
    are not applied (Liang et al., "Cautious Optimizers").

    After the wrapped optimizer steps, each coordinate whose applied change does not point
    along ``-grad`` is put back to its old value. With ``rescale=True`` the kept updates are
    multiplied by ``numel / (kept + 1)`` per tensor, the paper's normalisation. The change
    observed includes decoupled weight decay, so decay is masked too; the wrapped optimizer's
    moments advance as usual. ``param_groups``, ``state`` and ``defaults`` are the wrapped
    optimizer's own objects, and ``state_dict`` is its state dict.
    """

    def __init__(self, base: torch.optim.Optimizer, *, rescale: bool = False) -> None:
        self.base = base
        self.rescale = rescale
        self._wrapping = False
        super().__init__(base.param_groups, base.defaults)
        self._share_base()
        self._wrapping = True

    def _share_base(self) -> None:
        self.param_groups = self.base.param_groups
        self.state = self.base.state
        self.defaults = self.base.defaults

    def add_param_group(self, param_group: dict[str, object]) -> None:
        if self._wrapping:
            self.base.add_param_group(param_group)
            self._share_base()
        else:
            super().add_param_group(param_group)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Run ``closure`` once, step the wrapped optimizer, then mask its update."""
        loss = run_closure(closure)
        # Someone may have replaced (not cleared) our state or groups: the base uses ours.
        self.base.param_groups = self.param_groups
        self.base.state = self.state
        with torch.no_grad():
            tracked = [
                (p, p.detach().clone(), p.grad)
                for group in self.param_groups
                for p in cast(list[torch.Tensor], group["params"])
                if p.grad is not None
            ]
            self.base.step()
            for param, old, grad in tracked:
                self._mask(param, old, grad)
        return loss

    def _mask(self, param: torch.Tensor, old: torch.Tensor, grad: torch.Tensor) -> None:
        descent = old - param  # points along +grad where the update agrees with the gradient
        keep = descent * grad.to(descent.dtype) > 0
        if self.rescale:
            alpha = keep.numel() / (int(keep.sum()) + 1)
            param.copy_(torch.where(keep, old - descent * alpha, old))
        else:
            param.copy_(torch.where(keep, param, old))  # exact: kept entries are untouched

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        self.base.load_state_dict(dict(state_dict))
        self._share_base()
