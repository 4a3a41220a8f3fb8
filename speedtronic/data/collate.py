"""Collators for the built-in data, and the samples/tokens count of a batch.

``collate_causal`` emits ``attention_mask`` only when it had to pad (items of different
lengths) or when the items bring their own mask. Fixed-length blocks -- the synthetic
sources and all full text blocks -- therefore reach the model without a mask, and the
reference transformer takes its ``is_causal`` attention fast path with no host sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["IGNORE_INDEX", "batch_size_and_tokens", "collate_batch", "collate_causal"]

IGNORE_INDEX = -100
"""Label value the loss ignores; padded label positions get it."""

_CAUSAL_KEYS = frozenset({"input_ids", "labels", "attention_mask"})


def _as_tensor(index: int, key: str, value: object) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if tensor.dim() == 0:
        raise ValueError(f"batch item {index}: {key!r} must be a sequence, got a scalar")
    return tensor


def _causal_fields(
    index: int, item: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if not isinstance(item, Mapping):
        raise ValueError(f"batch item {index} is {type(item).__name__}, expected a mapping")
    missing = sorted({"input_ids", "labels"} - set(item))
    if missing:
        raise ValueError(f"batch item {index} lacks {missing}; causal LM records need both")
    extra = sorted(set(item) - _CAUSAL_KEYS)
    if extra:
        raise ValueError(
            f"batch item {index} has keys {extra} that collate_causal does not handle "
            "(it collates input_ids, labels and attention_mask); pass your own collate_fn"
        )
    input_ids = _as_tensor(index, "input_ids", item["input_ids"])
    labels = _as_tensor(index, "labels", item["labels"])
    raw_mask = item.get("attention_mask")
    if raw_mask is None:
        return input_ids, labels, None
    mask = _as_tensor(index, "attention_mask", raw_mask).to(torch.bool)
    if mask.shape != input_ids.shape:
        raise ValueError(
            f"batch item {index}: attention_mask shape {tuple(mask.shape)} does not match "
            f"input_ids shape {tuple(input_ids.shape)}"
        )
    return input_ids, labels, mask


def collate_causal(batch: Sequence[Mapping[str, object]]) -> dict[str, torch.Tensor]:
    """Stack causal LM records, padding to the longest ``input_ids``.

    ``input_ids`` pad with 0 and ``labels`` with -100. Labels must be as long as their
    ``input_ids`` or one shorter, the same way for every item. ``attention_mask`` (True on
    real positions) is returned only when padding happened or the items carry one.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    fields = [_causal_fields(index, item) for index, item in enumerate(batch)]
    inputs = [ids for ids, _, _ in fields]
    labels = [lab for _, lab, _ in fields]
    offsets = {ids.shape[0] - lab.shape[0] for ids, lab, _ in fields}
    if len(offsets) != 1 or not offsets <= {0, 1}:
        raise ValueError(
            "labels must be as long as input_ids (already shifted) or one shorter, the same "
            f"for every item; got length differences {sorted(offsets)}"
        )
    lengths = [ids.shape[0] for ids in inputs]
    item_masks = [mask for _, _, mask in fields]
    has_masks = any(mask is not None for mask in item_masks)
    if len(set(lengths)) == 1 and not has_masks:
        return {"input_ids": torch.stack(inputs), "labels": torch.stack(labels)}
    masks = [
        torch.ones(length, dtype=torch.bool) if mask is None else mask
        for length, mask in zip(lengths, item_masks, strict=True)
    ]
    return {
        "input_ids": pad_sequence(inputs, batch_first=True, padding_value=0),
        "labels": pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX),
        "attention_mask": pad_sequence(masks, batch_first=True, padding_value=False),
    }


def _collate_column(values: Sequence[object]) -> object:
    """Stack a column of equal-shaped tensors; leave anything else as a list."""
    first = values[0]
    if isinstance(first, torch.Tensor) and all(
        isinstance(value, torch.Tensor) and value.shape == first.shape for value in values
    ):
        return torch.stack([value for value in values if isinstance(value, torch.Tensor)])
    return list(values)


def collate_batch(batch: Sequence[object]) -> object:
    """The built-in loader's collate_fn.

    Mappings are causal LM records (``collate_causal``); tuples/lists are transposed and each
    column of equal-shaped tensors stacked (a tuple stays a tuple); tensors are stacked;
    anything else is returned as a list.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    first = batch[0]
    if isinstance(first, Mapping):
        records: list[Mapping[str, object]] = []
        for index, item in enumerate(batch):
            if not isinstance(item, Mapping):
                raise ValueError(f"batch item {index} is {type(item).__name__}, not a mapping")
            records.append(item)
        return collate_causal(records)
    if isinstance(first, (tuple, list)):
        width = len(first)
        rows: list[Sequence[object]] = []
        for index, item in enumerate(batch):
            if not isinstance(item, (tuple, list)) or len(item) != width:
                raise ValueError(
                    f"batch item {index} does not have the {width} fields of the first item"
                )
            rows.append(item)
        columns = [_collate_column([row[col] for row in rows]) for col in range(width)]
        return tuple(columns) if isinstance(first, tuple) else columns
    if isinstance(first, torch.Tensor):
        tensors: list[torch.Tensor] = []
        for index, item in enumerate(batch):
            if not isinstance(item, torch.Tensor):
                raise ValueError(f"batch item {index} is {type(item).__name__}, not a tensor")
            tensors.append(item)
        return torch.stack(tensors)
    return list(batch)


def batch_size_and_tokens(batch: object) -> tuple[int, int]:
    """``(samples, tokens)`` of a batch, without a device sync.

    The counted tensor is ``input_ids`` (or ``inputs``) of a mapping, the first element of a
    tuple/list, or the batch itself; samples are its first dimension and tokens its element
    count. A mapping with an ``attention_mask`` -- which the built-in collator emits only when
    it padded -- counts the real tokens (the mask sum) when the mask is still on the CPU,
    where reading it costs no device sync; a mask already on an accelerator is not read
    (padding is then counted), so count before moving the batch for exact numbers.
    Anything else counts as one sample of one token.
    """
    # Runs once per microbatch: concrete types first, the (slower) abstract Mapping last.
    source: object = None
    mapping: Mapping[str, object] | None = None
    if isinstance(batch, (tuple, list)):
        source = batch[0] if batch else None
    elif isinstance(batch, torch.Tensor):
        source = batch
    elif isinstance(batch, Mapping):
        mapping = batch
        source = batch.get("input_ids", batch.get("inputs"))
    if not isinstance(source, torch.Tensor) or source.dim() == 0:
        return 1, 1
    samples, tokens = source.shape[0], source.numel()
    if mapping is not None and source.dim() > 1:
        mask = mapping.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.device.type == "cpu":
            tokens = int(mask.sum())
    return samples, tokens
