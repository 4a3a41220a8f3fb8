"""DiLoCo: asynchronous low-communication training over a shared hub, as a callback.

Registered as the ``diloco`` callback plugin (entry point
``diloco = "speedtronic_callbacks.diloco:DiLoCoCallback"``). See ``docs/distributed.md``.

Modules, one concept each (docs/distributed.md, "Where the code is"):

* the algorithm, shared by every mode: ``math`` -- pseudo-gradients, the delta-carry
  rule, the outer Nesterov optimizer; ``aggregation`` -- outlier screening and work
  weighting; ``outer_round`` -- ``OuterRound``, the round both modes run (judge, weights
  by a named policy, outer step), which the hub master and the collective exchange each
  hold; ``fragments`` --
  streaming fragments; ``codec`` -- the ``Codec`` interface,
  ``codecs`` -- one class per ``delta_dtype`` and their registry (``encoding``: the
  codecs' earlier names, ``Encoding`` and ``Compression``);
* ``model_layout`` -- what a model's files must contain (exchanged keys, shapes, tied
  weights) and its fingerprint;
* ``wire`` and ``fields`` -- the exchanged tensor files (safetensors + signed metadata) and
  their validation (``signed_file``: the common format; ``delta_file``: deltas;
  ``ledger``: what the master applied);
  ``pointer`` -- the hub pointer naming the current global files;
  ``hub_files`` -- the hub's file names and the master state a version holds;
* ``transport_base`` -- the ``Transport`` interface, its errors, retries and timeouts;
  ``directory_transport`` and ``hub_transport`` -- one store per kind;
* ``lanes`` -- bounded background I/O;
* ``master`` -- the outer loop (``master_intake``: the ``DeltaIntake`` it holds,
  validating and screening the deltas;
  ``master_publish``: the pointer and publication; ``master_report``: settings, reports),
  with ``recovery`` (start-up from the hub) and ``hub_gc`` (deleting applied deltas and
  old versions); ``node`` -- the per-step state machine, holding its components
  (``node_pending``: ``PendingWork``, the unsent work; ``node_jobs``: ``NodeJobs``, the
  lanes and their jobs; ``node_results``: ``LaneResults``, taking in their results;
  ``node_state``: checkpoint fields and metrics; ``node_messages``: what the lanes pass);
* ``options`` -- the plugin's options; ``distributed_section`` -- its 2.0
  ``distributed:`` section;
* ``callback`` -- the ``Callback`` itself and the plugin's builder; ``collective`` -- the
  torch.distributed mode (``collective_exchange``: the replicas' exchange;
  ``collective_state``: its checkpoint, ``CollectiveCheckpoint``, and the
  ``CollectiveProgress`` it shares with the callback).

``original_api`` holds 2.0's Python API (``HubClient``, ``DumbDiLoCoCoordinator``, ...) and
``legacy_hub`` reads a hub written by 2.0.
"""

from __future__ import annotations

from speedtronic_callbacks.diloco.callback import DiLoCoCallback, build_diloco
from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.distributed_section import (
    DistributedSection,
    options_from_distributed_section,
)
from speedtronic_callbacks.diloco.hub_transport import HubTransport
from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings, RoundReport
from speedtronic_callbacks.diloco.math import (
    NesterovOuterOptimizer,
    aggregate_deltas,
    average_deltas,
    pseudo_gradient,
    staleness_weight,
)
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.options import DiLoCoOptions
from speedtronic_callbacks.diloco.original_api import (
    DumbDiLoCo,
    DumbDiLoCoCoordinator,
    GlobalMetadata,
    HubClient,
    HubError,
    HubUnavailable,
)
from speedtronic_callbacks.diloco.transport_base import (
    PermanentTransportError,
    RetryingTransport,
    RetryPolicy,
    TransientTransportError,
    Transport,
    TransportError,
)
from speedtronic_callbacks.diloco.wire import Compression, Rejected, RejectionReason

# Names of the original implementation's public API, for code that imported them (2.0's
# ``speedtronic.distributed`` names are in ``original_api``; see docs/compatibility.md).
MasterOuterLoop = MasterLoop
compute_pseudo_gradient = pseudo_gradient

__all__ = [
    "Compression",
    "DiLoCoCallback",
    "DiLoCoNode",
    "DiLoCoOptions",
    "DirectoryTransport",
    "DumbDiLoCo",
    "DumbDiLoCoCoordinator",
    "GlobalMetadata",
    "DistributedSection",
    "HubClient",
    "HubError",
    "HubUnavailable",
    "HubTransport",
    "MasterLoop",
    "MasterOuterLoop",
    "MasterSettings",
    "NesterovOuterOptimizer",
    "NodeSettings",
    "PermanentTransportError",
    "Rejected",
    "RejectionReason",
    "RetryPolicy",
    "RetryingTransport",
    "RoundReport",
    "TransientTransportError",
    "Transport",
    "TransportError",
    "aggregate_deltas",
    "average_deltas",
    "build_diloco",
    "compute_pseudo_gradient",
    "options_from_distributed_section",
    "pseudo_gradient",
    "staleness_weight",
]
