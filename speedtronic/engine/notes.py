"""Notes: named, optional events that any part of a run publishes for whoever listens.

The callback events (``speedtronic.engine.events``) are the engine's contract with plugins. Some
things worth telling an observer fit none of them: ``torch.compile`` fell back to eager, the
out-of-order backprop scheduler is off and why, a DiLoCo master finished an outer round, a
delta upload was queued or failed. Whoever knows publishes a *note* -- an event name and a
payload of plain values -- on the trainer's board (``trainer.notes.publish(...)``); whoever
wants them subscribes. The 2.0 ``MetricLogger`` subscribes and hands the notes to its hooks
under the 2.0 event names (``compile``, ``ooo_backprop``, ``outer_step``, ``delta_upload_*``).

Publishing is cheap when nobody listens (one tuple check), may happen on any thread (a
DiLoCo background lane publishes), and never fails the publisher: a listener that raises is
logged once per listener and event and otherwise ignored. The board names no publisher and
no listener.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

__all__ = ["NoteListener", "Notes"]

NoteListener = Callable[[str, dict[str, object]], None]
"""A subscriber: called with the note's name and a fresh copy of its payload."""

_LOGGER = logging.getLogger("speedtronic.notes")


class Notes:
    """A board of named notes (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._listeners: tuple[NoteListener, ...] = ()
        self._lock = threading.Lock()
        self._failed: set[tuple[int, str]] = set()

    def publish(self, event: str, payload: Mapping[str, object] | None = None) -> None:
        """Hand ``event`` with ``payload`` to every listener (none: nothing happens)."""
        listeners = self._listeners
        for listener in listeners:
            try:
                listener(event, dict(payload or {}))
            except Exception as exc:  # an observer must never break the publisher
                key = (id(listener), event)
                if key not in self._failed:
                    self._failed.add(key)
                    _LOGGER.warning(
                        "note listener failed on %s: %s: %s", event, type(exc).__name__, exc
                    )

    def subscribe(self, listener: NoteListener) -> Callable[[], None]:
        """Add ``listener``; returns the function that removes it again."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = tuple(item for item in self._listeners if item is not listener)

        return unsubscribe

    @property
    def listening(self) -> bool:
        """Whether anybody listens (a publisher may skip building an expensive payload)."""
        return bool(self._listeners)
