"""Old import path of ``on_event``; it lives in ``speedtronic.compat.hooks``."""

from speedtronic.compat.hooks import on_event as on_event

__all__ = ["on_event"]
