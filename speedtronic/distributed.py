"""The 2.0 import path; the code lives in ``speedtronic.systems.distributed``."""

from speedtronic.systems.distributed import TORCHRUN_VARIABLES as TORCHRUN_VARIABLES
from speedtronic.systems.distributed import CollectiveError as CollectiveError
from speedtronic.systems.distributed import DistributedContext as DistributedContext
from speedtronic.systems.distributed import DistributedSetupError as DistributedSetupError
from speedtronic.systems.distributed import LaunchEnvironment as LaunchEnvironment
from speedtronic.systems.distributed import RankMetricReducer as RankMetricReducer
from speedtronic.systems.distributed import ReplicaGroups as ReplicaGroups
from speedtronic.systems.distributed import ReplicaSync as ReplicaSync
from speedtronic.systems.distributed import agree_on_stop as agree_on_stop
from speedtronic.systems.distributed import choose_backend as choose_backend
from speedtronic.systems.distributed import collective_failure as collective_failure
from speedtronic.systems.distributed import read_launch_environment as read_launch_environment
from speedtronic.systems.distributed import reduce_run_totals as reduce_run_totals
from speedtronic.systems.distributed import replica_groups as replica_groups
from speedtronic.systems.distributed import setup_distributed as setup_distributed
from speedtronic.systems.distributed import teardown_distributed as teardown_distributed
from speedtronic.systems.distributed import wrap_data_parallel as wrap_data_parallel

__all__ = [
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
