"""The hub pointer, ``global/step_count.json``: which files hold the current global model,
and the names those files may have.

A small signed JSON object (same format, fingerprint and HMAC signing as the tensor files
in ``wire``), written last in a publication. ``decode_pointer`` never trusts it: size,
nesting, signature, fingerprint and the allow-listed file names are checked, and any
failure is ``Rejected``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from speedtronic_callbacks.diloco.wire import (
    FORMAT,
    Covered,
    Rejected,
    RejectionReason,
    check_signature,
    covered_from_json,
    covered_to_json,
    load_json,
    metadata_fields,
    progress_from_json,
    progress_to_json,
    require_fields,
    sign,
)

POINTER_PATH = "global/step_count.json"

MAX_POINTER_BYTES = 16 * 1024 * 1024
"""Refuse pointer files larger than this (a real one is a few kilobytes per node)."""

MODEL_FILE_PATTERN = re.compile(r"^global/model_(\d{8,13})\.safetensors$", re.ASCII)
OUTER_FILE_PATTERN = re.compile(r"^global/outer_(\d{8,13})\.safetensors$", re.ASCII)


@dataclass(frozen=True)
class Pointer:
    """``global/step_count.json``: which files hold the current global, and who wrote it.

    Written last in a publication, after the files it names, so a reader never follows it
    to a file that is not there yet. Only ``outer_step`` drives synchronisation.
    """

    outer_step: int
    model_file: str
    model_sha256: str
    outer_file: str
    outer_sha256: str
    fingerprint: str
    master: str
    updated_at: str
    applied: tuple[str, ...] = ()
    progress: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    covered: Covered = field(default_factory=dict)
    """The ledger's ``covered``: what a resumed node reads to skip the steps it sent."""

    def fields(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "algorithm": "diloco",
            "optimizer": "nesterov_sgd",
            "outer_step": str(self.outer_step),
            "model_file": self.model_file,
            "model_sha256": self.model_sha256,
            "outer_file": self.outer_file,
            "outer_sha256": self.outer_sha256,
            "fingerprint": self.fingerprint,
            "master": self.master,
            "updated_at": self.updated_at,
            "applied": ",".join(self.applied),
            "progress": json.dumps(progress_to_json(self.progress), separators=(",", ":")),
            "covered": json.dumps(covered_to_json(self.covered), separators=(",", ":")),
        }


def encode_pointer(pointer: Pointer, *, secret: bytes | None) -> bytes:
    """Pretty, sorted JSON with a trailing newline (signed like the tensor files)."""
    fields = pointer.fields()
    if secret is not None:
        fields["signature"] = sign(fields, secret)
    return (json.dumps(fields, indent=2, sort_keys=True) + "\n").encode()


def decode_pointer(data: bytes, *, fingerprint: str, secret: bytes | None) -> Pointer:
    """Validate the pointer: format, signature, every field's type and bounds
    (``fields.FIELDS``), fingerprint and file names on the allow-list
    (``global/model_<step>.safetensors``), so a writer cannot point nodes at an arbitrary
    file."""
    if len(data) > MAX_POINTER_BYTES:
        raise Rejected(RejectionReason.TOO_LARGE, f"pointer is {len(data)} bytes")
    raw = load_json(data, "pointer")
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise Rejected(RejectionReason.BAD_METADATA, "pointer must map strings to strings")
    names = ("format", "outer_step", "model_file", "model_sha256", "outer_file", "outer_sha256")
    required = (*names, "fingerprint", "master", "updated_at")
    require_fields(raw, required, "pointer")
    if raw["format"] != FORMAT:
        raise Rejected(RejectionReason.BAD_METADATA, f"pointer has format {raw['format']!r:.60}")
    check_signature(raw, secret, "pointer")
    fields = metadata_fields(raw, "pointer")
    if raw["fingerprint"] != fingerprint:
        raise Rejected(
            RejectionReason.FOREIGN_FINGERPRINT,
            f"hub holds model {raw['fingerprint']!r}, this run is {fingerprint!r}",
        )
    outer_step = fields.integer("outer_step")
    model_match = MODEL_FILE_PATTERN.match(raw["model_file"])
    outer_match = OUTER_FILE_PATTERN.match(raw["outer_file"])
    if model_match is None or outer_match is None:
        raise Rejected(RejectionReason.BAD_METADATA, "pointer names files off the allow-list")
    if int(model_match.group(1)) != outer_step or int(outer_match.group(1)) != outer_step:
        raise Rejected(RejectionReason.BAD_METADATA, "pointer file names disagree on the step")
    applied = tuple(h for h in fields.text("applied", "").split(",") if h)
    try:
        progress = progress_from_json(load_json(fields.text("progress", "{}"), "progress"))
        covered = covered_from_json(load_json(fields.text("covered", "{}"), "covered"))
    except (ValueError, Rejected) as exc:
        detail = exc.detail if isinstance(exc, Rejected) else str(exc)
        raise Rejected(RejectionReason.BAD_METADATA, f"pointer progress: {detail}") from None
    return Pointer(
        outer_step=outer_step,
        model_file=raw["model_file"],
        model_sha256=raw["model_sha256"],
        outer_file=raw["outer_file"],
        outer_sha256=raw["outer_sha256"],
        fingerprint=raw["fingerprint"],
        master=raw["master"],
        updated_at=raw["updated_at"],
        applied=applied,
        progress=progress,
        covered=covered,
    )


def model_file_name(outer_step: int) -> str:
    return f"global/model_{outer_step:08d}.safetensors"


def outer_file_name(outer_step: int) -> str:
    return f"global/outer_{outer_step:08d}.safetensors"
