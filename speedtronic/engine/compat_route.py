"""The one way from the engine's Trainer to the 2.0 layer, without importing it.

``speedtronic.Trainer`` is the engine's Trainer. 2.0 code also passes 2.0's constructor
arguments (``config=`` as the source of every setting left out, ``logger=``,
``coordinator=``, ``checkpoint_manager=``, ``shape_report=``) and reads 2.0's members
(``trainer.logger``, ``provide_logger``, ``train``, ``resume``). Both live in
``speedtronic.compat``, which the engine never imports (``pyproject.toml``'s contracts): the
package root installs a ``V2Layer`` loader here (``install``), and the Trainer asks it
(``v2_layer``) only when such a keyword is given or such a member is read -- a run that
uses neither never loads ``speedtronic.compat``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["V2_KEYWORDS", "V2_MEMBERS", "V2Layer", "install", "v2_layer"]

V2_KEYWORDS = frozenset({"config", "coordinator", "logger", "checkpoint_manager", "shape_report"})
"""The constructor arguments only 2.0's trainer takes: given one, ``Trainer(...)`` is it."""

V2_MEMBERS = frozenset({"logger", "provide_logger", "train", "resume"})
"""2.0's members of every trainer, resolved by the 2.0 layer on first read."""


class V2Layer(Protocol):
    """What the 2.0 layer gives the engine (``speedtronic.compat.trainer``)."""

    @property
    def trainer_class(self) -> type:
        """The Trainer subclass that takes 2.0's constructor arguments."""
        ...

    def member(self, trainer: object, name: str) -> object:
        """The 2.0 member ``name`` (one of ``V2_MEMBERS``) of ``trainer``."""
        ...


_loader: Callable[[], V2Layer] | None = None


def install(loader: Callable[[], V2Layer]) -> None:
    """Make ``loader`` the way to the 2.0 layer (the package root calls this)."""
    global _loader
    _loader = loader


def v2_layer() -> V2Layer:
    """The 2.0 layer, loaded now if it was not."""
    if _loader is None:  # the package root installs it on import; nothing else can
        raise RuntimeError("the 2.0 layer is not installed (speedtronic/__init__.py installs it)")
    return _loader()
