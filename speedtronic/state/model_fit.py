"""Whether saved weights fit a model: one report of what differs, for every loader.

Every path that loads a checkpoint's weights into a model -- a resume
(``Trainer.load_state_dict``), a sharded checkpoint's load, ``speedtronic evaluate`` --
compares the names and shapes first, before anything is loaded, and says what differs in
the same words::

    checkpoint does not match the model: missing keys: head.bias | unexpected keys: out.weight
    | shape mismatch: transformer.wte.weight: checkpoint (128, 64) vs model (128, 32); ...

Every missing key, every unexpected key and every shape difference is listed: a model
changed in one dimension differs in many tensors, and the first few rarely say which
setting it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["MODEL_MISMATCH", "Shape", "model_mismatch", "tensor_shapes", "weights_mismatch"]

MODEL_MISMATCH = "checkpoint does not match the model"
"""How every report of weights that do not fit begins."""

Shape = tuple[int, ...] | None
"""A tensor's shape, or ``None`` for an entry that is not a tensor (its key still counts)."""


def tensor_shapes(state: Mapping[str, object]) -> dict[str, Shape]:
    """Key -> shape of every entry of a state dict (``None`` for a non-tensor entry)."""
    shapes: dict[str, Shape] = {}
    for key, value in state.items():
        shape = getattr(value, "shape", None)
        shapes[key] = tuple(int(size) for size in shape) if isinstance(shape, Iterable) else None
    return shapes


def model_mismatch(
    model: Mapping[str, Shape], checkpoint: Mapping[str, Shape], *, all_needed: bool = True
) -> str | None:
    """What differs between the ``model``'s entries and the ``checkpoint``'s (key -> shape,
    ``tensor_shapes``), as one line beginning with ``MODEL_MISMATCH``; ``None`` when every
    key is in both and every tensor has the same shape. Keys are in the model's order
    (missing, shapes) and the checkpoint's (unexpected). With ``all_needed=False`` the
    checkpoint may hold a subset of the model's keys (weights that overwrite some of them)."""
    missing = [key for key in model if key not in checkpoint] if all_needed else []
    unexpected = [key for key in checkpoint if key not in model]
    mismatched = [
        f"{key}: checkpoint {checkpoint[key]} vs model {shape}"
        for key, shape in model.items()
        if key in checkpoint and None not in (shape, checkpoint[key]) and shape != checkpoint[key]
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch: {'; '.join(mismatched)}")
    return f"{MODEL_MISMATCH}: {' | '.join(problems)}" if problems else None


def weights_mismatch(
    model: Mapping[str, object], weights: Mapping[str, object], *, all_needed: bool = True
) -> str | None:
    """``model_mismatch`` of two state dicts (name -> tensor)."""
    return model_mismatch(tensor_shapes(model), tensor_shapes(weights), all_needed=all_needed)
