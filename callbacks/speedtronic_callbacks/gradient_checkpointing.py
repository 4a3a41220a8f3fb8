"""``gradient_checkpointing``: trade compute for activation memory, on any model.

At ``setup`` the callback calls the model's own ``set_gradient_checkpointing(True)`` when
the model has one (the reference transformer does). Otherwise it wraps every submodule
whose class name is listed in ``modules`` so that its forward runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: activations inside are
dropped after the forward and recomputed in backward, with the RNG state restored so dropout
masks match. Losses and gradients are the same as without it.

When neither is possible (no hook, no ``modules`` listed, or no submodule of those classes)
the callback warns and training continues unchanged. ``teardown`` undoes what ``setup`` did.

    callbacks:
      - {name: gradient_checkpointing, modules: [TransformerBlock]}
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from speedtronic.config.declare import Opt, field_of, plugin, property_schema
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import FitContext, TeardownContext
from speedtronic.plugins import PluginOptions, SectionData, Sections
from speedtronic.user_warnings import warn

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["CheckpointedForward", "GradientCheckpointing"]


class CheckpointedForward:
    """A module's bound ``forward``, run under non-reentrant activation checkpointing
    whenever autograd is recording (plain call otherwise, e.g. in evaluation)."""

    def __init__(self, forward: Callable[..., object]) -> None:
        self.forward = forward

    def __call__(self, *args: object, **kwargs: object) -> object:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        function = functools.partial(self.forward, **kwargs) if kwargs else self.forward
        return checkpoint(function, *args, use_reentrant=False)


@dataclass(frozen=True)
class GradientCheckpointingOptions:
    """The ``gradient_checkpointing`` plugin's options."""

    modules: Annotated[
        list[str],
        Opt(
            "class names of submodules to checkpoint when the model has no "
            "`set_gradient_checkpointing` hook",
            items={"minLength": 1},
            extra={"uniqueItems": True},
        ),
    ] = field(default_factory=list)
    enabled: Annotated[bool, Opt("turn checkpointing on (`false`: the callback does nothing)")] = (
        True
    )


@dataclass(frozen=True)
class _RootFlag:
    """The 2.0 root key this plugin reads."""

    gradient_checkpointing: Annotated[
        bool, Opt("Enable gradient checkpointing (same as model.gradient_checkpointing).")
    ] = False


@dataclass(frozen=True)
class _ModelFlag:
    """The key this plugin adds to the ``model:`` section."""

    gradient_checkpointing: Annotated[
        bool,
        Opt(
            "Recompute activations in backward; kept in sync with the root "
            "gradient_checkpointing flag."
        ),
    ] = False


def _normalise_flags(data: dict[str, object]) -> None:
    """The root flag and ``model.gradient_checkpointing`` are one setting (2.0): when either
    is true both become true."""
    model = data.get("model")
    root = data.get("gradient_checkpointing")
    in_model = model.get("gradient_checkpointing") if isinstance(model, dict) else None
    if root is True or in_model is True:
        data["gradient_checkpointing"] = True
        if isinstance(model, dict):
            model["gradient_checkpointing"] = True
        elif model is None:
            data["model"] = {"gradient_checkpointing": True}


def _options_from_flag(
    sections: SectionData, options: Mapping[str, object] | None
) -> PluginOptions | None:
    """The 2.0 root flag ``gradient_checkpointing: true`` (or ``model.gradient_checkpointing``,
    which the config keeps in step with it) adds the plugin with no options."""
    if options is not None:
        return dict(options)
    return {} if sections.get("gradient_checkpointing") is True else None


@plugin(
    "gradient_checkpointing",
    options=GradientCheckpointingOptions,
    sections=Sections(
        keys=("gradient_checkpointing", "model"),
        schema={
            "gradient_checkpointing": property_schema(field_of(_RootFlag, "gradient_checkpointing"))
        },
        declared={"model": _ModelFlag},
        to_options=_options_from_flag,
        normalise=_normalise_flags,
    ),
    implied_order=10,
)
class GradientCheckpointing(Callback):
    """Activation checkpointing through the model's hook, or by wrapping named module
    classes (``modules``); see the module docstring."""

    def __init__(
        self, modules: Sequence[str] = (), enabled: bool = GradientCheckpointingOptions.enabled
    ) -> None:
        self.modules = tuple(modules)
        self.enabled = enabled
        self._hooked_model: nn.Module | None = None
        # (module, the instance-level ``forward`` it had before, if any)
        self._wrapped: list[tuple[nn.Module, Callable[..., object] | None]] = []

    @property
    def wrapped_modules(self) -> list[nn.Module]:
        """The submodules currently running under checkpointing (wrapping mode only)."""
        return [module for module, _ in self._wrapped]

    @property
    def uses_model_hook(self) -> bool:
        """Whether the model's own ``set_gradient_checkpointing`` is in use."""
        return self._hooked_model is not None

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        del ctx
        self.apply(trainer.model)

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        del trainer, ctx
        self.remove()

    # -- the work, usable without a trainer ---------------------------------------------

    def apply(self, model: nn.Module) -> None:
        """Turn checkpointing on for ``model`` (idempotent; warns when it cannot)."""
        if not self.enabled:
            return
        self.remove()
        hook = getattr(model, "set_gradient_checkpointing", None)
        if callable(hook):
            try:
                hook(True)
            except Exception as exc:  # a broken optional hook: try wrapping, else warn
                self._warn(f"{type(model).__name__}.set_gradient_checkpointing failed: {exc}")
            else:
                self._hooked_model = model
                if self.modules:
                    self._warn(
                        f"{type(model).__name__} has its own set_gradient_checkpointing hook, "
                        f"which was used; `modules: {list(self.modules)}` is ignored"
                    )
                return
        if not self.modules:
            self._warn(
                f"{type(model).__name__} has no set_gradient_checkpointing hook and no "
                "`modules` were named; training without gradient checkpointing"
            )
            return
        self._wrap_matching(model)
        if not self._wrapped:
            self._warn(
                f"no submodule of {type(model).__name__} has a class named in "
                f"{list(self.modules)}; training without gradient checkpointing"
            )

    def remove(self) -> None:
        """Undo ``apply``: hook off again, or the original forwards back."""
        if self._hooked_model is not None:
            hook = getattr(self._hooked_model, "set_gradient_checkpointing", None)
            if callable(hook):
                hook(False)
            self._hooked_model = None
        for module, previous in reversed(self._wrapped):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._wrapped.clear()

    def _wrap_matching(self, model: nn.Module) -> None:
        wanted = set(self.modules)
        wrapped_prefixes: list[str] = []
        for name, module in model.named_modules():
            if name == "" or type(module).__name__ not in wanted:
                continue  # the root itself is never wrapped: that would save nothing
            if any(name.startswith(prefix + ".") for prefix in wrapped_prefixes):
                continue  # already inside a checkpointed ancestor: nothing to gain
            previous = module.__dict__.get("forward")
            module.forward = CheckpointedForward(module.forward)
            self._wrapped.append((module, previous))
            wrapped_prefixes.append(name)

    def _warn(self, message: str) -> None:
        warn(f"{self.display_name} callback: {message}", UserWarning)
