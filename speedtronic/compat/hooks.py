"""``on_event``: adapt a hook object or function to the ``(event, payload)`` signature.

    logger = MetricLogger(hooks=[on_event(my_tracker)])

``my_tracker`` may be an object with ``on_event(event, payload)`` or a plain function of
``(event, payload)``; the result is always a two-argument function.
"""

from __future__ import annotations

from speedtronic.compat.metric_logger import Hook, HookFunction, Payload, call_hook

__all__ = ["on_event"]


def on_event(callback: Hook) -> HookFunction:
    """A two-argument ``(event, payload)`` function that forwards to ``callback``."""

    def hook(event: str, payload: Payload) -> None:
        call_hook(callback, event, payload)

    hook.__qualname__ = (
        f"on_event({getattr(callback, '__qualname__', type(callback).__qualname__)})"
    )
    return hook
