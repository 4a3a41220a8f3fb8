"""Collators for the built-in data, the collate registry, and the samples/tokens count of a
batch.

``data.collate`` picks the collate function by name: ``auto`` (``collate_batch``),
``causal`` (``collate_causal``), ``default`` (torch's ``default_collate``), or a name
registered with ``register_collate`` in a module listed under ``imports:``.

``collate_causal`` emits ``attention_mask`` only when it had to pad (items of different
lengths) or when the items bring their own mask. Fixed-length blocks -- the synthetic
sources and all full text blocks -- therefore reach the model without a mask, and the
reference transformer takes its ``is_causal`` attention fast path with no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

from speedtronic.plugins import PluginRegistry

__all__ = [
    "IGNORE_INDEX",
    "CollateFn",
    "batch_size_and_tokens",
    "collate_batch",
    "collate_causal",
    "collate_registry",
    "register_collate",
]

CollateFn = Callable[[list[Any]], object]
"""Turns a list of dataset items into one batch (a ``DataLoader`` ``collate_fn``)."""

IGNORE_INDEX = -100
"""Label value the loss ignores; padded label positions get it."""

_CAUSAL_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})


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
            "(it collates input_ids, labels, attention_mask and position_ids); pass your own "
            "collate_fn"
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
    ``position_ids`` (document masks), when every item has them, pad with 0.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    collated = _collate_causal_fields(batch)
    if all("position_ids" in item for item in batch):
        positions = [
            _as_tensor(index, "position_ids", item["position_ids"])
            for index, item in enumerate(batch)
        ]
        collated["position_ids"] = pad_sequence(positions, batch_first=True, padding_value=0)
    return collated


def _collate_causal_fields(batch: Sequence[Mapping[str, object]]) -> dict[str, torch.Tensor]:
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
    """Stack a column of equal-shaped tensors, make a column of numbers a tensor; leave
    anything else as a list."""
    first = values[0]
    if isinstance(first, torch.Tensor) and all(
        isinstance(value, torch.Tensor) and value.shape == first.shape for value in values
    ):
        return torch.stack([value for value in values if isinstance(value, torch.Tensor)])
    if all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
        return torch.tensor(values)
    return list(values)


def _is_causal_record(item: Mapping[str, object]) -> bool:
    return "input_ids" in item and "labels" in item and set(item) <= _CAUSAL_KEYS


def collate_batch(batch: Sequence[object]) -> object:
    """The built-in loader's collate_fn.

    Causal LM records (``input_ids`` and ``labels``, optionally ``attention_mask``) are
    padded by ``collate_causal``; other mappings are collated key by key and tuples/lists
    column by column (equal-shaped tensors stacked, numbers made a tensor, anything else
    kept as a list; a tuple stays a tuple); tensors are stacked; anything else is returned
    as a list.
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
        if _is_causal_record(first):
            return collate_causal(records)
        keys = list(first)
        for index, record in enumerate(records):
            if set(record) != set(keys):
                raise ValueError(
                    f"batch item {index} has keys {sorted(record)}, the first item {sorted(keys)}"
                )
        return {key: _collate_column([record[key] for record in records]) for key in keys}
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


collate_registry: PluginRegistry[CollateFn] = PluginRegistry("collate", None)
"""Collate functions by the name used in ``data.collate``."""


def register_collate(name: str) -> Callable[[CollateFn], CollateFn]:
    """Decorator: make ``fn(items) -> batch`` usable as ``data.collate: <name>``."""
    return collate_registry.register(name)


collate_registry.register("auto", collate_batch)
collate_registry.register("causal", collate_causal)
collate_registry.register("default", default_collate)


def batch_size_and_tokens(batch: object) -> tuple[int, int]:
    """``(samples, tokens)`` of a batch, without a device sync.

    The counted tensor is ``input_ids`` (or ``inputs``, else the first tensor) of a mapping,
    the first element of a tuple/list, or the batch itself; samples are its first dimension
    and tokens its element count. A mapping with an ``attention_mask`` -- which the built-in
    collator emits only when it padded -- counts the real tokens (the mask sum) when the mask
    is still on the CPU, where reading it costs no device sync; a mask already on an
    accelerator is not read (padding is then counted), so count before moving the batch for
    exact numbers.
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
        if source is None:  # another record layout: its first tensor
            source = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    if not isinstance(source, torch.Tensor):
        return 1, 1
    shape = source.shape  # one call; ``dim()``/``numel()`` would each go through dispatch
    if not shape:
        return 1, 1
    samples, tokens = shape[0], math.prod(shape)
    if mapping is not None and len(shape) > 1:
        mask = mapping.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.device.type == "cpu":
            tokens = int(mask.sum())
    return samples, tokens
