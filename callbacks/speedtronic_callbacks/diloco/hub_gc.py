"""Garbage collection on a hub: the applied deltas and the old global versions.

The master deletes what no one needs any more -- in the commit of the publication that
makes it so, or on its own after a round that publishes nothing: the deltas a round
applied (``delete_applied``; the ledger, not the deletion, is what prevents a second
application, so a failed deletion only leaves a file for the next round to skip) and the
global versions older than the last ``keep_global_versions`` (``stale_globals``: a worker
that read the previous pointer can still download its files). Housekeeping never fails a
round: a failure is logged and the files stay.
"""

from __future__ import annotations

import logging

from speedtronic_callbacks.diloco.hub_files import global_file_step
from speedtronic_callbacks.diloco.transport_base import Transport

__all__ = ["delete_applied", "stale_globals"]

logger = logging.getLogger("speedtronic.diloco")


def stale_globals(transport: Transport, outer_step: int, keep_versions: int) -> list[str]:
    """The global files older than the last ``keep_versions`` versions up to
    ``outer_step`` (none when the hub cannot be listed)."""
    oldest_kept = outer_step - keep_versions + 1
    try:
        return [
            entry.path
            for entry in transport.list_files("global")
            if (step := global_file_step(entry.path)) is not None and step < oldest_kept
        ]
    except Exception as exc:  # pruning is housekeeping: never fail a round for it
        logger.warning("diloco master could not list old global files: %s", exc)
        return []


def delete_applied(transport: Transport, paths: list[str]) -> None:
    """Delete applied delta files (logged, not raised, when the hub refuses)."""
    if not paths:
        return
    try:
        transport.delete(sorted(set(paths)))
    except Exception as exc:  # the ledger already prevents re-application
        logger.warning("diloco master could not delete %d applied delta(s): %s", len(paths), exc)
