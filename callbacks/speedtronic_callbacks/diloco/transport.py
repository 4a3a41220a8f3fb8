"""The former home of the transports, kept so that ``...diloco.transport`` imports work.

New code imports from ``transport_base`` (interface, errors, retries),
``directory_transport`` and ``hub_transport``.
"""

from __future__ import annotations

from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.hub_transport import (
    HubApi,
    HubTransport,
    classify_hub_error,
    hub_status_code,
    redact,
)
from speedtronic_callbacks.diloco.transport_base import (
    Cancelled,
    PermanentTransportError,
    RemoteFile,
    RetryingTransport,
    RetryPolicy,
    TransientTransportError,
    Transport,
    TransportError,
    call_with_timeout,
    check_remote_path,
)

__all__ = [
    "Cancelled",
    "DirectoryTransport",
    "HubApi",
    "HubTransport",
    "PermanentTransportError",
    "RemoteFile",
    "RetryPolicy",
    "RetryingTransport",
    "TransientTransportError",
    "Transport",
    "TransportError",
    "call_with_timeout",
    "check_remote_path",
    "classify_hub_error",
    "hub_status_code",
    "redact",
]
