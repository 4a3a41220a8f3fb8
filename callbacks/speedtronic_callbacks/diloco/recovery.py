"""What a master can recover from its hub: the published versions it may continue from.

``MasterLoop.reconcile`` decides at start-up between the master's checkpoint and the hub
(the pointer is the source of truth unless the checkpoint is ahead of it); ``HubVersions``
reads what the hub offers for that decision, never trusting a file:

* a published version (``read``): its global model and outer state, checked against the
  hashes the pointer names. When the outer state is unreadable the momentum restarts at
  zero and every delta already on the hub counts as applied (its hash prefix, from its
  name, joins the ledger): without the ledger nothing tells which were, and applying one
  twice is worse than losing one;
* the newest *complete* version (``newest_complete_step``: a model and an outer file of
  one step), newer than the pointer when an old pointer was put back;
* a hub speedtronic 2.0 wrote (``read_v2``, ``v2_deltas``): its global model and outer step.
"""

from __future__ import annotations

import logging

from speedtronic_callbacks.diloco.hub_files import OuterState, global_file_step, parse_delta_path
from speedtronic_callbacks.diloco.legacy_hub import V2Pointer, decode_v2_global, is_v2_delta
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.pointer import model_file_name, outer_file_name
from speedtronic_callbacks.diloco.transport_base import Transport, UnreadableFileError
from speedtronic_callbacks.diloco.wire import (
    Ledger,
    Rejected,
    RejectionReason,
    decode_global,
    decode_outer,
)

__all__ = ["HubVersions"]

logger = logging.getLogger("speedtronic.diloco")


class HubVersions:
    """The published versions on one hub, as the master ``node_id`` reads them."""

    def __init__(
        self, transport: Transport, layout: ModelLayout, node_id: str, secret: bytes | None
    ) -> None:
        self.transport = transport
        self.layout = layout
        self.node_id = node_id
        self.secret = secret

    def read(
        self, outer_step: int, model_sha256: str | None = None, outer_sha256: str | None = None
    ) -> OuterState:
        """The global and outer state files of ``outer_step`` (with the content hashes a
        pointer names, when adopting a pointer); ``Rejected`` when the global model is
        missing or invalid."""
        model_file, outer_file = model_file_name(outer_step), outer_file_name(outer_step)
        model_bytes = self.transport.get(model_file)
        if model_bytes is None:
            raise Rejected(RejectionReason.CORRUPT, f"{model_file} is missing")
        global_state = decode_global(
            model_bytes,
            self.layout,
            secret=self.secret,
            outer_step=outer_step,
            expected_sha256=model_sha256,
        )
        try:
            outer_bytes = self.transport.get(outer_file)
            if outer_bytes is None:
                raise Rejected(RejectionReason.CORRUPT, f"{outer_file} is missing")
            momentum, ledger = decode_outer(
                outer_bytes,
                self.layout,
                secret=self.secret,
                outer_step=outer_step,
                expected_sha256=outer_sha256,
            )
        except (Rejected, UnreadableFileError) as exc:
            logger.warning(
                "diloco outer state for step %d unreadable (%s); momentum restarts at zero "
                "and deltas already on the hub are skipped",
                outer_step,
                exc,
            )
            momentum, ledger = {}, self._everything_applied()
        logger.info(
            "diloco master %s adopted published outer step %d from %s",
            self.node_id,
            outer_step,
            self.transport.location,
        )
        return OuterState(global_state, momentum, outer_step, ledger)

    def _everything_applied(self) -> Ledger:
        """A ledger that counts every delta on the hub as applied (by its name's hash)."""
        ledger = Ledger()
        for entry in self.transport.list_files("nodes"):
            name = parse_delta_path(entry.path)
            if name is not None:
                ledger.applied.add(name.hash_prefix)
        return ledger

    def newest_complete_step(self) -> int:
        """The highest outer step with both a model and an outer file on the hub, or -1."""
        models: set[int] = set()
        outers: set[int] = set()
        for entry in self.transport.list_files("global"):
            step = global_file_step(entry.path)
            if step is not None:
                (models if "/model_" in entry.path else outers).add(step)
        return max(models & outers, default=-1)

    def read_v2(self, legacy: V2Pointer) -> OuterState:
        """The version a speedtronic 2.0 hub's pointer names: its global model at its outer
        step, with no momentum (2.0 kept it on its master's disk) and an empty ledger."""
        data = self.transport.get(legacy.model_file)
        if data is None:
            raise Rejected(RejectionReason.CORRUPT, f"2.0 hub: {legacy.model_file} is missing")
        global_state = decode_v2_global(data, self.layout)
        return OuterState(global_state, {}, legacy.outer_step, Ledger())

    def v2_deltas(self) -> int:
        """How many 2.0 delta files wait under ``nodes/`` (never applied: their names and
        headers carry no content hash or signature)."""
        return sum(1 for entry in self.transport.list_files("nodes") if is_v2_delta(entry.path))
