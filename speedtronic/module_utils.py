"""Small helpers on ``nn.Module`` that are part of the original public API."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

__all__ = ["set_gradient_checkpointing"]

_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


def set_gradient_checkpointing(module: _ModuleT, enabled: bool = True) -> _ModuleT:
    """Call ``module.set_gradient_checkpointing(enabled)`` and return ``module``.

    Raises ``AttributeError`` when the module has no such hook, as the original documented.
    (The ``gradient_checkpointing`` callback is the lenient alternative: it can wrap chosen
    submodules of any model and only warns when it cannot.)
    """
    hook = getattr(module, "set_gradient_checkpointing", None)
    if not callable(hook):
        raise AttributeError(
            f"{type(module).__name__} has no set_gradient_checkpointing(enabled) method; "
            "use the gradient_checkpointing callback with `modules: [<class names>]` to "
            "checkpoint chosen submodules of any model"
        )
    hook(enabled)
    return module
