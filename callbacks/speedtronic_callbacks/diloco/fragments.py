"""Streaming DiLoCo's fragments: which entries of the model each fragment holds, and when
each fragment synchronises.

Blocks: the model's *blocks* are the items of its longest numbered container -- the module
path ``<container>.<index>.`` (an ``nn.ModuleList`` or ``nn.Sequential``) with the most
distinct indices in the ``state_dict``; ties go to the container that appears first. For the
reference transformer that is ``transformer.h.<i>``.

Assignment (``P`` fragments, ``L`` blocks, ``P <= L``):

* block ``b`` belongs to fragment ``b % P`` (strided: fragment ``p`` holds blocks
  ``p, p + P, p + 2P, ...``);
* every other entry (embeddings, final norm, head, ...) joins the fragment of the nearest
  block *before* it in ``state_dict`` order, or fragment 0 when it comes before every block.
  Tied weights count once, at their first appearance (a tied embedding/head is placed where
  the embedding is).

Schedule (``H`` inner steps): fragment ``p`` synchronises at every step ``s >= 1`` with
``s % H == offset(p)``, ``offset(p) = (p * H) // P`` -- fragment 0 at ``H, 2H, ...``,
the others evenly in between. With ``P = 1`` that is every multiple of ``H``: plain DiLoCo.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from speedtronic_callbacks.diloco.math import aggregate_deltas
from speedtronic_callbacks.diloco.model_layout import ModelLayout

__all__ = [
    "FragmentPlan",
    "aggregate_by_key",
    "find_blocks",
    "fragment_name",
    "layout_plan",
    "plan_fragments",
]

_NUMBERED = re.compile(r"^(?:(?P<container>.*?)\.)?(?P<index>\d+)\.")


@dataclass(frozen=True)
class Blocks:
    """The model's list of blocks: ``container`` (``""`` for a top-level ``Sequential``)
    and, per ``state_dict`` key inside it, the block index."""

    container: str
    count: int
    block_of: Mapping[str, int]


def find_blocks(keys: Sequence[str]) -> Blocks | None:
    """The longest numbered container among ``keys`` (in ``state_dict`` order), or
    ``None`` when no key has a numbered path component."""
    indices: dict[str, set[int]] = {}
    members: dict[str, dict[str, int]] = {}
    for key in keys:
        match = _NUMBERED.match(key)
        if match is None:
            continue
        container = match["container"] or ""
        indices.setdefault(container, set()).add(int(match["index"]))
        members.setdefault(container, {})[key] = int(match["index"])
    if not indices:
        return None
    best = max(indices, key=lambda name: len(indices[name]))  # first wins a tie
    order = sorted(indices[best])
    rank = {index: position for position, index in enumerate(order)}
    return Blocks(best, len(order), {key: rank[i] for key, i in members[best].items()})


@dataclass(frozen=True)
class FragmentPlan:
    """``fragments[p]`` are fragment ``p``'s synchronised keys (in ``sync_keys`` order);
    ``offsets[p]`` is its step offset within each ``inner_steps`` window."""

    inner_steps: int
    fragments: tuple[tuple[str, ...], ...]
    offsets: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.fragments)

    def name(self, fragment: int) -> str:
        """Fragment ``fragment``'s name in files, histories and ledgers (``fragment_name``)."""
        return fragment_name(fragment, self.count)

    def due(self, step: int) -> list[int]:
        """The fragments that synchronise at ``step`` (ascending)."""
        phase = step % self.inner_steps
        return [p for p, offset in enumerate(self.offsets) if offset == phase]


def fragment_name(fragment: int, fragments: int) -> str:
    """``"p/P"``: how a delta file, a norm history and the ledger name fragment ``p`` of
    ``P``; ``""`` (the whole model) when there is one fragment."""
    return "" if fragments == 1 else f"{fragment}/{fragments}"


def _sync_offset(fragment: int, fragments: int, inner_steps: int) -> int:
    """Fragment ``fragment``'s synchronisation step within each window of ``inner_steps``."""
    return (fragment * inner_steps) // fragments


def plan_fragments(
    order: Sequence[str],
    sync_keys: Sequence[str],
    aliases: Mapping[str, str],
    *,
    fragments: int,
    inner_steps: int,
) -> FragmentPlan:
    """Split ``sync_keys`` into ``fragments`` strided fragments; ``order`` is every key of
    the model's ``state_dict`` in module order, ``aliases`` maps a tied duplicate key to the
    key that is synchronised. A ``ValueError`` names the problem when the model has fewer
    blocks than fragments."""
    if fragments < 1:
        raise ValueError(f"diloco: fragments must be >= 1, got {fragments}")
    offsets = tuple(_sync_offset(p, fragments, inner_steps) for p in range(fragments))
    if fragments == 1:
        return FragmentPlan(inner_steps, (tuple(sync_keys),), offsets)
    blocks = find_blocks(order)
    if blocks is None:
        raise ValueError(
            f"diloco.fragments: {fragments} fragments need a model with at least that many "
            "blocks, but its state_dict has no numbered list of blocks (no entry named "
            "'<container>.<index>.<...>'); use fragments: 1"
        )
    if blocks.count < fragments:
        where = f"{blocks.container}.<i>" if blocks.container else "<i>"
        raise ValueError(
            f"diloco.fragments: {fragments} is more than the model's {blocks.count} blocks "
            f"({where}); use at most {blocks.count}"
        )
    assigned: dict[str, int] = {}
    current = 0
    for key in order:
        block = blocks.block_of.get(key)
        if block is not None:
            current = block % fragments
        target = aliases.get(key, key)
        assigned.setdefault(target, current)
    groups: list[list[str]] = [[] for _ in range(fragments)]
    for key in sync_keys:
        groups[assigned[key]].append(key)
    return FragmentPlan(inner_steps, tuple(tuple(group) for group in groups), offsets)


def layout_plan(layout: ModelLayout, fragments: int, inner_steps: int = 1) -> FragmentPlan:
    """``plan_fragments`` for a ``ModelLayout`` (which records the module order)."""
    return plan_fragments(
        layout.key_order or layout.sync_keys,
        layout.sync_keys,
        layout.aliases,
        fragments=fragments,
        inner_steps=inner_steps,
    )


def aggregate_by_key(
    deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """``aggregate_deltas`` for deltas that may hold different fragments: each key is the
    weighted mean (``sum w_i d_i / n``) over the ``n`` deltas that hold it. Deltas that all
    hold the same keys give exactly ``aggregate_deltas``."""
    keysets = {frozenset(delta) for delta in deltas}
    if len(keysets) == 1:
        return aggregate_deltas(deltas, weights)
    result: dict[str, torch.Tensor] = {}
    for key in sorted({key for delta in deltas for key in delta}):
        holders = [(d, w) for d, w in zip(deltas, weights, strict=True) if key in d]
        part = aggregate_deltas([{key: d[key]} for d, _ in holders], [w for _, w in holders])
        result[key] = part[key]
    return result
