"""Weights a callback publishes in the checkpoint, in place of the model's own.

A callback whose ``state_dict()`` holds an entry ``"weights"`` (``WEIGHTS_ENTRY``) -- a
mapping from the model's parameter names (``model.named_parameters()``) to tensors of their
shapes -- publishes those weights under its ``state_key``. The ``ema`` callback does (its
shadow weights, ``state_key: ema``); an SWA or a "best weights" callback of your own may do
the same. ``speedtronic export --weights <state_key>`` and ``speedtronic evaluate --weights
<state_key>`` then use them instead of the trained weights: the model is loaded from the
checkpoint as usual, and every parameter the mapping names is overwritten with its value
(buffers, and parameters it leaves out, keep the checkpoint's). ``--weights model`` (the
default) is the model's own. The core never names the callback: the state key is all it
goes by.

In a sharded checkpoint written by several ranks the published tensors are ``DTensor``
shards stored through DCP (``speedtronic.state.callback_shards``); they are read back whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from speedtronic.state.callback_shards import with_callback_shards
from speedtronic.state.checkpoint import CheckpointError, LoadedCheckpoint
from speedtronic.state.model_fit import weights_mismatch

__all__ = [
    "MODEL_WEIGHTS",
    "WEIGHTS_ENTRY",
    "PublishedWeightsError",
    "apply_weights",
    "published_weights",
]

WEIGHTS_ENTRY = "weights"
"""The key of a callback's state under which it publishes weights (module docstring)."""
MODEL_WEIGHTS = "model"
"""The name of the model's own weights (``--weights model``, the default)."""


class PublishedWeightsError(CheckpointError):
    """A checkpoint has no weights under the name asked for, or they do not fit the model
    (a user mistake: the CLI reports it with exit 2)."""


def _weight_sources(callbacks: Mapping[str, object]) -> list[str]:
    """The state keys of the callbacks in ``callbacks`` that publish weights, sorted."""
    return sorted(
        key
        for key, value in callbacks.items()
        if isinstance(value, Mapping) and isinstance(value.get(WEIGHTS_ENTRY), Mapping)
    )


def published_weights(loaded: LoadedCheckpoint, source: str) -> dict[str, torch.Tensor]:
    """The weights the callback with state key ``source`` kept in ``loaded``, whole and on
    the CPU. ``PublishedWeightsError`` naming what the checkpoint holds when it has none
    under that name."""
    callbacks = with_callback_shards(loaded.state)
    entry = callbacks.get(source)
    weights = entry.get(WEIGHTS_ENTRY) if isinstance(entry, Mapping) else None
    if not isinstance(weights, Mapping):
        others = ", ".join([MODEL_WEIGHTS, *_weight_sources(callbacks)])
        reason = (
            f"it has no state for a callback with state_key {source!r}"
            if entry is None
            else f"the state of callback {source!r} has no {WEIGHTS_ENTRY!r} entry"
        )
        raise PublishedWeightsError(
            f"--weights {source}: checkpoint {loaded.path} holds no {source!r} weights "
            f"({reason}; the run did not keep them). Weights it holds: {others}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise PublishedWeightsError(
                f"--weights {source}: checkpoint {loaded.path}: {source}.{WEIGHTS_ENTRY}"
                f"[{name!r}] is not a tensor"
            )
        tensors[str(name)] = value.detach().to("cpu")
    return tensors


def apply_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], source: str) -> None:
    """Overwrite ``model``'s parameters named in ``weights`` with their values (a tied
    parameter, named once, changes everywhere it is used). ``PublishedWeightsError`` naming
    the names that are not parameters of the model and the shapes that differ; nothing is
    changed then."""
    parameters = dict(model.named_parameters())
    problem = weights_mismatch(parameters, weights, all_needed=False)
    if problem is not None:
        raise PublishedWeightsError(f"--weights {source}: the weights do not fit: {problem}")
    with torch.no_grad():
        for name, value in weights.items():
            target = parameters[name]
            target.copy_(value.to(device=target.device, dtype=target.dtype))
