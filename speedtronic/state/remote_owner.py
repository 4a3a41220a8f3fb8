"""Which run a ``checkpoint.remote`` prefix belongs to: ``owner.json`` in the store.

A prefix belongs to one run, as its local checkpoint directory does (the run lock): two
runs uploading to one prefix would rewrite each other's remote ``latest.json``, resume from
each other's weights and delete each other's checkpoints by retention. So the store holds
an ownership record next to the pointer::

    s3://bucket/run1/owner.json     {"run_id": "20261202T090000Z-1a2b3c4d", "output_dir": ...}

``claim`` makes this run the owner before its first upload: a prefix without a record is
claimed with a conditional create (``RemoteStore.create_small``: a link on a local store,
``If-None-Match: *`` on S3), then read back -- whoever's record is there after that is the
owner, so two runs starting at once cannot both believe they own it. A record naming
another run is ``RemoteOwnerError`` (naming the prefix and both runs) unless the run was
asked to take the prefix over (``--resume-from-other-run``), which rewrites the record; the
other run then finds the record changed at its next upload (``check``, before the files and
again before the pointer write) and stops uploading. A record that cannot be read as one is
refused too: the store was tampered with, and guessing an owner would hand its checkpoints
to the wrong run.

A run without an id (a ``Trainer`` built in Python without ``run_id``) claims nothing: its
uploads carry no id, and it shares the prefix at its own risk (documented).
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass

from speedtronic.state.pointer import decode_pointer_bytes
from speedtronic.state.remote_store import RemoteError, RemoteStore, Retry
from speedtronic.state.run_identity import OTHER_RUN_FLAG, is_run_id

__all__ = [
    "OWNER_NAME",
    "RemoteOwner",
    "RemoteOwnerError",
    "check",
    "claim",
    "parse_owner",
    "read_owner",
    "this_run",
]

logger = logging.getLogger("speedtronic.checkpoint")

OWNER_NAME = "owner.json"
_MAX_OWNER_BYTES = 64 * 1024
"""An ownership record is a few hundred bytes; anything larger is not one (read no more)."""


class RemoteOwnerError(RemoteError):
    """The prefix belongs to another run (or its ownership record cannot be read)."""


@dataclass(frozen=True)
class RemoteOwner:
    """The run a prefix belongs to: its id, and where it ran (for the messages)."""

    run_id: str
    output_dir: str | None = None
    host: str | None = None

    def to_bytes(self) -> bytes:
        content = {"run_id": self.run_id, "output_dir": self.output_dir, "host": self.host}
        return (json.dumps(content, indent=2, sort_keys=True) + "\n").encode("utf-8")

    def describe(self) -> str:
        where = f", run directory {self.output_dir}" if self.output_dir else ""
        host = f" on {self.host}" if self.host else ""
        return f"run id {self.run_id}{where}{host}"


def parse_owner(data: bytes) -> tuple[RemoteOwner | None, str | None]:
    """Decode ``owner.json`` bytes: ``(owner, None)`` or ``(None, problem)``. Never raises
    for any input (size-capped, bounded nesting)."""
    if len(data) > _MAX_OWNER_BYTES:
        return None, f"it is more than {_MAX_OWNER_BYTES} bytes"
    content, problem = decode_pointer_bytes(data)
    if problem is not None:
        return None, problem
    if not isinstance(content, dict) or not is_run_id(content.get("run_id")):
        return None, 'it must be a JSON object with a run id in "run_id"'
    extras = [content.get(key) for key in ("output_dir", "host")]
    if any(value is not None and not isinstance(value, str) for value in extras):
        return None, '"output_dir" and "host" must be strings'
    output_dir, host = (None if v is None else str(v)[:4096] for v in extras)
    return RemoteOwner(str(content["run_id"]), output_dir, host), None


def read_owner(store: RemoteStore, run: Retry) -> RemoteOwner | None:
    """The prefix's owner (``None``: no record). ``RemoteOwnerError`` for a record that is
    not one; store errors (after ``run``'s retries) as they are."""
    data = run(lambda: store.read_small(OWNER_NAME, _MAX_OWNER_BYTES))
    if data is None:
        return None
    owner, problem = parse_owner(data)
    if owner is None:
        raise RemoteOwnerError(
            f"cannot tell which run checkpoint.remote {store.url} belongs to: "
            f"{store.where(OWNER_NAME)} is damaged ({problem}); it was not written by this "
            "project. Check the prefix, then delete that file to let this run claim it"
        )
    return owner


def _foreign(store: RemoteStore, owner: RemoteOwner, run_id: str) -> RemoteOwnerError:
    return RemoteOwnerError(
        f"checkpoint.remote {store.url} belongs to another run ({owner.describe()}; "
        f"{store.where(OWNER_NAME)}), not to this one (run id {run_id}): two runs uploading "
        "to one prefix take each other's checkpoints and delete them. Give this run a "
        f"checkpoint.remote of its own, or pass {OTHER_RUN_FLAG} (with --resume) to take "
        "the prefix over"
    )


def claim(
    store: RemoteStore,
    ours: RemoteOwner,
    run: Retry,
    *,
    take_over: bool = False,
) -> None:
    """Make ``ours`` the prefix's owner: create the record when there is none (then read
    it back: a run that created it at the same moment may have won), accept it when it
    names this run, rewrite it when ``take_over``; ``RemoteOwnerError`` otherwise."""
    owner = read_owner(store, run)
    if owner is None:
        run(lambda: store.create_small(OWNER_NAME, ours.to_bytes()))
        owner = read_owner(store, run)
        if owner is None:  # deleted again at once: someone is working on the prefix
            raise RemoteOwnerError(
                f"{store.where(OWNER_NAME)} disappeared right after it was written; "
                "is another process deleting the prefix?"
            )
    if owner.run_id == ours.run_id:
        return
    if not take_over:
        raise _foreign(store, owner, ours.run_id)
    run(lambda: store.write_small(OWNER_NAME, ours.to_bytes()))
    logger.warning(
        "checkpoint.remote: %s belonged to %s; it is this run's now (%s), as asked; its "
        "checkpoints there stay (retention deletes only this run's)",
        store.url,
        owner.describe(),
        OTHER_RUN_FLAG,
    )
    check(store, ours.run_id, run)


def check(store: RemoteStore, run_id: str, run: Retry) -> None:
    """``RemoteOwnerError`` unless the prefix's record still names ``run_id`` (before a
    pointer write: another run may have taken the prefix over meanwhile)."""
    owner = read_owner(store, run)
    if owner is None:
        raise RemoteOwnerError(
            f"{store.where(OWNER_NAME)} is gone: checkpoint.remote {store.url} no longer "
            f"records this run (run id {run_id}) as its owner; uploads stop"
        )
    if owner.run_id != run_id:
        raise RemoteOwnerError(
            f"checkpoint.remote {store.url} was taken over by another run "
            f"({owner.describe()}; {store.where(OWNER_NAME)}), so this run (run id "
            f"{run_id}) stops uploading there; its checkpoints stay in the local directory"
        )


def this_run(run_id: str, output_dir: str | None) -> RemoteOwner:
    """The record this process writes for run ``run_id``."""
    return RemoteOwner(run_id, output_dir, socket.gethostname())
