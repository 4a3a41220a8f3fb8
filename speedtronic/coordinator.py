"""Old import path of the original ``SyncCoordinator`` protocol and its adapter; they live in
``speedtronic.compat.coordinator``."""

from speedtronic.compat.coordinator import CoordinatorCallback as CoordinatorCallback
from speedtronic.compat.coordinator import SyncCoordinator as SyncCoordinator

__all__ = ["CoordinatorCallback", "SyncCoordinator"]
