"""The master's ledger: which deltas it applied and which local steps of each node
incarnation they covered, published with every outer step (in the outer-state file)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from speedtronic_callbacks.diloco.delta_file import DeltaInfo
from speedtronic_callbacks.diloco.fields import FRAGMENT_PATTERN, check_integer
from speedtronic_callbacks.diloco.signed_file import Rejected, load_json, metadata_fields

Progress = dict[str, tuple[str, int]]
"""node id -> (incarnation, highest local step applied from that incarnation)."""

Covered = dict[str, dict[str, dict[str, int]]]
"""node id -> incarnation -> streaming fragment -> highest local step applied from that
incarnation (fragment ``""``: whole-model deltas), for the ``MAX_INCARNATIONS`` newest
incarnations of each node. What the master checks a delta's step range against
(``Ledger.overlap``), and what a resumed node reads to skip what it sent."""

MAX_INCARNATIONS = 4
"""Incarnations per node whose applied step ranges the ledger keeps (a node restarted
from scratch while deltas of its earlier life still wait has two)."""


def progress_to_json(progress: Mapping[str, tuple[str, int]]) -> dict[str, dict[str, object]]:
    return {
        node: {"incarnation": incarnation, "step": step}
        for node, (incarnation, step) in sorted(progress.items())
    }


def _check_ids(node: object, incarnation: object) -> tuple[str, str]:
    """A node id and an incarnation from parsed JSON, checked like the metadata fields
    they come from; ``ValueError`` otherwise."""
    if not isinstance(node, str) or not isinstance(incarnation, str):
        raise ValueError(f"bad entry for node {node!r:.70}")
    try:
        metadata_fields({"node_id": node, "incarnation": incarnation}, "a node entry")
    except Rejected as exc:
        raise ValueError(exc.detail) from None
    return node, incarnation


def progress_from_json(raw: object) -> Progress:
    """Parse ``progress_to_json`` output (node ids, incarnations and steps checked like the
    metadata fields they come from); ``ValueError`` on anything else."""
    if not isinstance(raw, dict):
        raise ValueError("progress must be a JSON object")
    progress: Progress = {}
    for key, entry in raw.items():
        if not isinstance(entry, dict):
            raise ValueError(f"bad progress entry for {key!r:.70}")
        node, incarnation = _check_ids(key, entry.get("incarnation"))
        progress[node] = (incarnation, check_integer(entry.get("step"), "local_step"))
    return progress


def covered_to_json(covered: Covered) -> dict[str, dict[str, dict[str, int]]]:
    return {
        node: {incarnation: dict(sorted(steps.items())) for incarnation, steps in lives.items()}
        for node, lives in sorted(covered.items())
    }


def covered_from_json(raw: object) -> Covered:
    """Parse ``covered_to_json`` output (ids, fragments and steps checked, at most
    ``MAX_INCARNATIONS`` per node); ``ValueError`` on anything else."""
    if not isinstance(raw, dict):
        raise ValueError("covered must be a JSON object")
    covered: Covered = {}
    for key, lives in raw.items():
        if not isinstance(lives, dict) or len(lives) > MAX_INCARNATIONS:
            raise ValueError(f"bad covered entry for node {key!r:.70}")
        for life, steps in lives.items():
            node, incarnation = _check_ids(key, life)
            if not isinstance(steps, dict):
                raise ValueError(f"bad steps of node {node!r}")
            for fragment in steps:
                if fragment and not FRAGMENT_PATTERN.match(fragment):
                    raise ValueError(f"bad fragment {fragment!r:.20} of node {node!r}")
            checked = {f: check_integer(step, "local_step") for f, step in steps.items()}
            covered.setdefault(node, {})[incarnation] = checked
    return covered


def covered_through(steps: Mapping[str, int], fragment: str) -> int:
    """The highest local step applied that a delta of ``fragment`` would overlap: the
    fragment's own and whole-model deltas' for a fragment, every fragment's for a
    whole-model delta (-1: none)."""
    if fragment:
        return max(steps.get(fragment, -1), steps.get("", -1))
    return max(steps.values(), default=-1)


@dataclass
class Ledger:
    """The master's memory of what it has done, published with every outer step.

    ``applied`` holds the content hash of every delta ever applied (so a re-uploaded or
    renamed copy is never applied twice); ``progress`` the highest local step applied per
    node incarnation (what earlier versions' nodes read); ``covered`` the same per
    incarnation and streaming fragment, which the step range of every new delta of that
    incarnation must start at or after (``overlap``) and which a resumed node reads to
    skip what it sent.
    """

    applied: set[str] = field(default_factory=set)
    progress: Progress = field(default_factory=dict)
    covered: Covered = field(default_factory=dict)

    def copy(self) -> Ledger:
        covered = {
            node: {life: dict(steps) for life, steps in lives.items()}
            for node, lives in self.covered.items()
        }
        return Ledger(set(self.applied), dict(self.progress), covered)

    def overlap(self, info: DeltaInfo) -> int | None:
        """The highest local step already applied from ``info``'s node incarnation that
        ``info``'s range reaches back to, or ``None`` when it does not overlap. A delta of
        an earlier version (no range) overlaps when it ends there or before."""
        steps = self.covered.get(info.node_id, {}).get(info.incarnation)
        if steps is None:
            return None
        through = covered_through(steps, info.fragment)
        start = info.local_step - 1 if info.first_step is None else info.first_step
        return through if start < through else None

    def record(self, info: DeltaInfo) -> None:
        """Note that ``info``'s delta was applied (its incarnation becomes the node's
        newest; beyond ``MAX_INCARNATIONS`` the oldest is forgotten)."""
        node, incarnation = info.node_id, info.incarnation
        lives = self.covered.setdefault(node, {})
        steps = lives.pop(incarnation, {})
        steps[info.fragment] = max(steps.get(info.fragment, -1), info.local_step)
        lives[incarnation] = steps
        while len(lives) > MAX_INCARNATIONS:
            del lives[next(iter(lives))]
        previous = self.progress.get(node)
        step = info.local_step
        if previous is not None and previous[0] == incarnation:
            step = max(step, previous[1])
        self.progress[node] = (incarnation, step)

    def to_json(self) -> str:
        return json.dumps(
            {
                "applied": sorted(self.applied),
                "progress": progress_to_json(self.progress),
                "covered": covered_to_json(self.covered),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        """Parse ``to_json`` output; ``ValueError`` on anything else."""
        try:
            raw = load_json(text, "ledger")
        except Rejected as exc:
            raise ValueError(exc.detail) from None
        if not isinstance(raw, dict):
            raise ValueError("ledger is not a JSON object")
        applied = raw.get("applied", [])
        if not isinstance(applied, list) or not all(
            isinstance(h, str) and _APPLIED_HASH.match(h) for h in applied
        ):
            raise ValueError("ledger 'applied' must be a list of content hashes")
        return cls(
            applied=set(applied),
            progress=progress_from_json(raw.get("progress", {})),
            covered=covered_from_json(raw.get("covered", {})),
        )


_APPLIED_HASH = re.compile(r"^[0-9a-f]{16,64}$")
"""A ledger's hash: a full sha256, or the 16-character prefix of a file name."""
