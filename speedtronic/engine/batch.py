"""The batch and model-output protocol of the loop.

Batches: a mapping is passed to the model as keyword arguments; a tuple/list is
``(inputs, labels)``; anything else is passed as the single argument.

Outputs: a tensor is the loss; a mapping gives ``"loss"``, or ``"logits"`` plus the batch
labels (causal cross-entropy, ``-100`` ignored); a tuple/list gives its first element.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

# The loss of logits is the models' own (a model computes it without the engine); the loop
# uses the same function and names.
from speedtronic.models.loss import IGNORE_INDEX as IGNORE_INDEX
from speedtronic.models.loss import ModelOutputError as ModelOutputError
from speedtronic.models.loss import loss_from_logits as loss_from_logits


def move_to_device(batch: object, device: torch.device) -> object:
    """Move every tensor inside ``batch`` (dicts, tuples, lists) to ``device``."""
    if isinstance(batch, torch.Tensor):
        # Already there (CPU training, a loader that pins to the GPU): no .to() call at all.
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    # Tuples and lists first: they skip the (slower) abstract Mapping check.
    if isinstance(batch, tuple):
        return tuple(move_to_device(value, device) for value in batch)
    if isinstance(batch, list):
        return [move_to_device(value, device) for value in batch]
    if isinstance(batch, Mapping):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    return batch


def run_model(model: nn.Module, batch: object) -> object:
    """Call ``model`` on a batch following the batch protocol."""
    if isinstance(batch, (tuple, list)):  # before the (slower) abstract Mapping check
        if len(batch) >= 2:
            return model(batch[0], batch[1])
        if len(batch) == 1:
            return model(batch[0])
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


def batch_labels(batch: object) -> torch.Tensor | None:
    """``batch["labels"]`` or the second element of a tuple batch."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        return labels if isinstance(labels, torch.Tensor) else None
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    return None


def _tensor_loss(value: object, batch: object) -> torch.Tensor | None:
    if not isinstance(value, torch.Tensor):
        return None
    labels = batch_labels(batch)
    if value.dim() == 3 and labels is not None and labels.shape[:1] == value.shape[:1]:
        return loss_from_logits(value, labels)
    return value


def resolve_loss(output: object, batch: object) -> torch.Tensor:
    """The scalar training loss of a model output (see module docstring)."""
    loss: torch.Tensor | None
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping):
        if isinstance(output.get("loss"), torch.Tensor):
            loss = output["loss"]
        elif isinstance(output.get("logits"), torch.Tensor):
            labels = batch_labels(batch)
            if labels is None:
                raise ModelOutputError("model returned logits but the batch has no labels")
            loss = loss_from_logits(output["logits"], labels)
        else:
            raise ModelOutputError(
                f"model output mapping needs 'loss' or 'logits', got keys {sorted(output)}"
            )
    elif isinstance(output, Sequence) and not isinstance(output, str) and output:
        loss = _tensor_loss(output[0], batch)
    else:
        loss = None
    if loss is None:
        raise ModelOutputError(
            f"cannot get a loss from a model output of type {type(output).__name__}; return a "
            "tensor, a mapping with 'loss' or 'logits', or a tuple whose first item is the loss"
        )
    return loss if loss.ndim == 0 else loss.mean()
