"""The 2.0 import path; the code lives in ``speedtronic.systems.distributed``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedtronic.engine.rank_metrics import RankMetricReducer as RankMetricReducer
from speedtronic.systems.distributed import TORCHRUN_VARIABLES as TORCHRUN_VARIABLES
from speedtronic.systems.distributed import CollectiveError as CollectiveError
from speedtronic.systems.distributed import DistributedContext as DistributedContext
from speedtronic.systems.distributed import DistributedSetupError as DistributedSetupError
from speedtronic.systems.distributed import LaunchEnvironment as LaunchEnvironment
from speedtronic.systems.distributed import ReplicaGroups as ReplicaGroups
from speedtronic.systems.distributed import ReplicaSync as ReplicaSync
from speedtronic.systems.distributed import agree_on_stop as agree_on_stop
from speedtronic.systems.distributed import arm_gradient_sync as arm_gradient_sync
from speedtronic.systems.distributed import choose_backend as choose_backend
from speedtronic.systems.distributed import collective_failure as collective_failure
from speedtronic.systems.distributed import read_launch_environment as read_launch_environment
from speedtronic.systems.distributed import reduce_run_totals as reduce_run_totals
from speedtronic.systems.distributed import replica_groups as replica_groups
from speedtronic.systems.distributed import setup_distributed as setup_distributed
from speedtronic.systems.distributed import teardown_distributed as teardown_distributed
from speedtronic.systems.distributed import wrap_data_parallel as wrap_data_parallel

if TYPE_CHECKING:
    from speedtronic_callbacks.diloco.original_api import DeltaUploadJob as DeltaUploadJob
    from speedtronic_callbacks.diloco.original_api import DumbDiLoCo as DumbDiLoCo
    from speedtronic_callbacks.diloco.original_api import (
        DumbDiLoCoCoordinator as DumbDiLoCoCoordinator,
    )
    from speedtronic_callbacks.diloco.original_api import GlobalMetadata as GlobalMetadata
    from speedtronic_callbacks.diloco.original_api import HubClient as HubClient
    from speedtronic_callbacks.diloco.original_api import HubError as HubError
    from speedtronic_callbacks.diloco.original_api import HubTransport as HubTransport
    from speedtronic_callbacks.diloco.original_api import HubUnavailable as HubUnavailable
    from speedtronic_callbacks.diloco.original_api import MasterOuterLoop as MasterOuterLoop
    from speedtronic_callbacks.diloco.original_api import (
        NesterovOuterOptimizer as NesterovOuterOptimizer,
    )
    from speedtronic_callbacks.diloco.original_api import SyncResult as SyncResult
    from speedtronic_callbacks.diloco.original_api import average_deltas as average_deltas
    from speedtronic_callbacks.diloco.original_api import (
        compute_pseudo_gradient as compute_pseudo_gradient,
    )
    from speedtronic_callbacks.diloco.original_api import load_delta as load_delta
    from speedtronic_callbacks.diloco.original_api import load_safetensors as load_safetensors
    from speedtronic_callbacks.diloco.original_api import save_safetensors as save_safetensors

__all__ = [
    "arm_gradient_sync",
    "CollectiveError",
    "DistributedContext",
    "DistributedSetupError",
    "LaunchEnvironment",
    "RankMetricReducer",
    "ReplicaGroups",
    "ReplicaSync",
    "TORCHRUN_VARIABLES",
    "agree_on_stop",
    "choose_backend",
    "collective_failure",
    "read_launch_environment",
    "reduce_run_totals",
    "replica_groups",
    "setup_distributed",
    "teardown_distributed",
    "wrap_data_parallel",
]


def __getattr__(name: str) -> object:
    """2.0's asynchronous-training names of this path (``HubClient``, ``GlobalMetadata``,
    ``DumbDiLoCoCoordinator``, ``load_delta``, ...; the plugin module's ``__all__``, declared
    for type checkers above). They are a plugin's now and resolve through its entry point at
    first use (``speedtronic.compat.plugin_exports``), so importing this module imports no
    plugin."""
    if name.startswith("__"):
        raise AttributeError(name)
    from speedtronic.compat.plugin_exports import plugin_attribute

    module = plugin_attribute("diloco", "original_api", "speedtronic.distributed")
    if name not in getattr(module, "__all__", ()):
        raise AttributeError(f"module 'speedtronic.distributed' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value
