"""What a DiLoCo node (``node``) keeps in the trainer checkpoint -- the fields' checks,
its unsent work's part (``unsent_state``, ``restore_unsent``) -- and its metrics."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.node_messages import NodeStats, UploadJob
from speedtronic_callbacks.diloco.node_pending import PendingWork, merge_held
from speedtronic_callbacks.diloco.transport_base import RetryingTransport
from speedtronic_callbacks.diloco.wire import (
    Rejected,
    fragment_shapes,
)

if TYPE_CHECKING:
    pass

STATE_FORMAT = 1
"""Version of ``DiLoCoNode.state_dict``'s layout."""

logger = logging.getLogger("speedtronic.diloco")


def text_field(state: Mapping[str, object], key: str) -> str:
    value = state.get(key)
    if not isinstance(value, str):
        raise ValueError(f"diloco state: {key!r} must be a string")
    return value


def integer_field(state: Mapping[str, object], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"diloco state: {key!r} must be an integer")
    return value


def _steps(state: Mapping[str, object], key: str, count: int, default: int) -> list[int]:
    """``count`` step numbers under ``key`` (``default`` each when absent or when the
    checkpoint was taken with another number of fragments)."""
    value = state.get(key)
    if value is None:
        return [default] * count
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        raise ValueError(f"diloco state: {key!r} must be a list of step numbers")
    return [int(item) for item in value] if len(value) == count else [default] * count


def _work(state: Mapping[str, object], *keys: str) -> tuple[int, int]:
    """Tokens and samples: ``[tokens, samples]`` under one key, or one key each; (0, 0)
    when absent (a checkpoint of an earlier version)."""
    if len(keys) == 1:
        value = state.get(keys[0], [0, 0])
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise ValueError(f"diloco state: {keys[0]!r} must be [tokens, samples]")
        items = list(value)
    else:
        items = [state.get(key, 0) for key in keys]
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        raise ValueError(f"diloco state: {keys} must be integers")
    return (int(items[0]), int(items[1]))


def optional_tensors(
    state: Mapping[str, object],
    key: str,
    layout: ModelLayout,
    keys: tuple[str, ...] | None = None,
) -> dict[str, torch.Tensor] | None:
    """``state[key]``: tensors of exactly ``keys`` (default: every synchronised key)."""
    value = state.get(key)
    if value is None:
        return None
    expected = set(layout.sync_keys if keys is None else keys)
    if not isinstance(value, Mapping) or set(value) != expected:
        raise ValueError(f"diloco state: {key!r} does not match this model's layout")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in value.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"diloco state: {key!r}[{name!r}] is not a tensor")
        tensors[str(name)] = tensor.detach().to("cpu")
    return tensors


def unsent_state(unsent: PendingWork) -> dict[str, object]:
    """The checkpoint fields of a node's unsent work (``DiLoCoNode.state_dict``)."""
    job = unsent.unconfirmed
    return {
        "pending": unsent.pending,
        "pending_base": unsent.pending_base,
        "held_pending": unsent.held_pending,
        "held_base": unsent.held_base,
        "pending_work": list(unsent.pending_work) if unsent.pending is not None else [0, 0],
        "held_work": list(unsent.held_work),
        "work_mark": list(unsent.work_mark),
        "range_starts": list(unsent.range_starts or []),
        "dispatched_through": unsent.dispatched_through,
        "unconfirmed": None
        if job is None
        else {
            "delta": job.delta,
            "local_step": job.local_step,
            "base_outer_step": job.base_outer_step,
            "tokens": job.tokens,
            "samples": job.samples,
            "fragment": job.fragment,
            "first_step": job.first_step,
        },
    }


def restore_unsent(
    unsent: PendingWork, state: Mapping[str, object], layout: ModelLayout, fragments: int
) -> int:
    """Restore the unsent work from a node checkpoint; the checkpoint's step. The pending
    work is held until the hub confirms it was not sent after the checkpoint; an
    unconfirmed upload is re-sent as is (the master dedupes it by content hash)."""
    unsent.pending = None
    unsent.held_pending = merge_held(
        optional_tensors(state, "pending", layout),
        optional_tensors(state, "held_pending", layout),
    )
    bases = [
        integer_field(state, base)
        for base, tensors in (("pending_base", "pending"), ("held_base", "held_pending"))
        if state.get(tensors) is not None
    ]
    unsent.held_base = min(bases, default=-1)
    pending_work, held_work = _work(state, "pending_work"), _work(state, "held_work")
    unsent.held_work = (pending_work[0] + held_work[0], pending_work[1] + held_work[1])
    unsent.work_mark = unsent.work_now = _work(state, "work_mark")
    unconfirmed = state.get("unconfirmed")
    if isinstance(unconfirmed, Mapping):
        fragment = unconfirmed.get("fragment", "")
        if not isinstance(fragment, str):
            raise ValueError("diloco state: 'unconfirmed.fragment' must be a string")
        try:
            keys = tuple(fragment_shapes(layout, fragment))
        except Rejected as exc:
            raise ValueError(f"diloco state: 'unconfirmed': {exc.detail}") from None
        delta = optional_tensors(unconfirmed, "delta", layout, keys)
        if delta is not None:
            first = unconfirmed.get("first_step")
            unsent.unconfirmed = UploadJob(
                delta,
                integer_field(unconfirmed, "local_step"),
                integer_field(unconfirmed, "base_outer_step"),
                *_work(unconfirmed, "tokens", "samples"),
                fragment,
                None if first is None else integer_field(unconfirmed, "first_step"),
            )
    checkpoint_step = integer_field(state, "checkpoint_step")
    # Checkpoints of earlier versions do not record these: every range then starts at
    # the checkpoint, and what the hub has of this node up to it is this node's.
    unsent.range_starts = _steps(state, "range_starts", fragments, checkpoint_step)
    through = state.get("dispatched_through", checkpoint_step)
    unsent.dispatched_through = integer_field({"dispatched_through": through}, "dispatched_through")
    unsent.work_step = None  # the work mark's step is not recorded: measure afresh
    unsent.skip = None
    return checkpoint_step


def node_metrics(
    stats: NodeStats,
    installed_step: int,
    transport: RetryingTransport,
    errors: int,
    master: bool,
) -> dict[str, int | float]:
    """A node's cumulative counters plus, on the master's node, the last round's figures
    (``diloco/`` keys; ``DiLoCoNode.metrics``)."""
    values: dict[str, int | float] = {
        "diloco/outer_step": installed_step,
        "diloco/hub_outer_step": stats.hub_outer_step,
        "diloco/uploads": stats.uploads,
        "diloco/upload_failures": stats.upload_failures,
        "diloco/boundaries_skipped": stats.boundaries_skipped,
        "diloco/installs": stats.installs,
        "diloco/resyncs": stats.resyncs,
        "diloco/bytes_up": transport.bytes_up,
        "diloco/bytes_down": transport.bytes_down,
        "diloco/sync_latency_s": stats.sync_latency_s,
        "diloco/errors": errors,
    }
    if master:
        values["diloco/rounds"] = stats.rounds
        values["diloco/deltas_found"] = stats.deltas_found
        values["diloco/deltas_included"] = stats.deltas_included
        values["diloco/deltas_rejected"] = stats.deltas_rejected
        values["diloco/deltas_duplicate"] = stats.deltas_duplicate
        last = stats.last_round
        if last is not None:
            staleness = last.staleness
            values["diloco/round_included"] = last.included
            values["diloco/round_latency_s"] = last.latency_s
            values["diloco/staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
            values["diloco/staleness_max"] = max(staleness, default=0)
    return values
