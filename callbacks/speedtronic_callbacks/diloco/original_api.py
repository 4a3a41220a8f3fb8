"""The original (2.0) DiLoCo Python API, on top of this package's transports and node.

2.0 code imports these names from ``speedtronic.distributed`` (which resolves them here
lazily, so the engine never imports the plugin): ``DumbDiLoCoCoordinator`` (alias
``DumbDiLoCo``), ``HubClient`` (alias ``HubTransport``), ``GlobalMetadata``, ``HubError``,
``HubUnavailable``, ``SyncResult``, ``DeltaUploadJob``, ``MasterOuterLoop``,
``NesterovOuterOptimizer``, ``average_deltas``, ``compute_pseudo_gradient``, ``load_delta``,
``load_safetensors`` and ``save_safetensors``.

* ``HubClient(repo_id, *, token=None, ...)`` keeps 2.0's signature and methods and reads
  and writes 2.0's file layout (``global/latest.safetensors``, ``global/step_count.json``,
  ``nodes/<node>/delta_<step>.safetensors``) through a ``Transport`` (the Hub by default,
  any transport -- a ``DirectoryTransport`` -- with ``transport=``), with its retries.
* ``DumbDiLoCoCoordinator(config, model, *, hub=None, state_dir=None, logger=None)`` is the
  ``SyncCoordinator`` for ``Trainer(coordinator=...)``; it runs this package's node, so it
  speaks this version's hub layout (signed, fingerprinted files), not 2.0's.

What changed on purpose is listed in ``docs/compatibility.md``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol, TypeVar

import safetensors
import safetensors.torch
import torch
from torch import nn

from speedtronic.state.atomic_io import atomic_write_bytes
from speedtronic_callbacks.diloco.callback import default_node_id, make_node, make_transport
from speedtronic_callbacks.diloco.distributed_section import options_from_distributed_section
from speedtronic_callbacks.diloco.hub_transport import HubApi
from speedtronic_callbacks.diloco.hub_transport import HubTransport as _HubStore
from speedtronic_callbacks.diloco.legacy_hub import V2_MODEL_FILE, is_v2_delta
from speedtronic_callbacks.diloco.master import MasterLoop
from speedtronic_callbacks.diloco.math import NesterovOuterOptimizer as _Nesterov
from speedtronic_callbacks.diloco.math import StateDict, average_deltas, pseudo_gradient
from speedtronic_callbacks.diloco.node import DiLoCoNode, UploadJob
from speedtronic_callbacks.diloco.options import DiLoCoOptions
from speedtronic_callbacks.diloco.transport_base import (
    RemoteFile,
    RetryingTransport,
    RetryPolicy,
    Transport,
    TransportError,
    check_remote_path,
)

__all__ = [
    "DeltaUploadJob",
    "DumbDiLoCo",
    "DumbDiLoCoCoordinator",
    "GlobalMetadata",
    "HubClient",
    "HubError",
    "HubTransport",
    "HubUnavailable",
    "MasterOuterLoop",
    "NesterovOuterOptimizer",
    "SyncResult",
    "average_deltas",
    "compute_pseudo_gradient",
    "load_delta",
    "load_safetensors",
    "save_safetensors",
]

_POINTER_FILE = "global/step_count.json"

T = TypeVar("T")

DeltaUploadJob = UploadJob
"""2.0's queued upload; here the node's ``UploadJob`` (delta, local step, base outer step)."""

MasterOuterLoop = MasterLoop
"""2.0's master loop name; here ``MasterLoop`` (its constructor differs, see the docs)."""

compute_pseudo_gradient = pseudo_gradient


class HubError(RuntimeError):
    """A hub operation failed for good (bad token, missing repository, bad argument)."""


class HubUnavailable(HubError):
    """The hub could not be reached after every retry (or the SDK is not installed)."""


@dataclass(frozen=True)
class SyncResult:
    """2.0's per-step outcome record (2.0 defined it but never returned it)."""

    pushed: bool
    loaded_global: bool
    outer_step: int


@dataclass(frozen=True)
class GlobalMetadata:
    """``global/step_count.json``: the outer step and the global model's file."""

    outer_step: int
    updated_at: str
    model_file: str = V2_MODEL_FILE

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> GlobalMetadata:
        """Accepts 2.0's legacy key ``step``, fills missing fields and coerces types (a
        pointer of this version, whose values are strings, reads too)."""
        step = values.get("outer_step", values.get("step", 0))
        return cls(
            outer_step=int(str(step)),
            updated_at=str(values.get("updated_at", "")),
            model_file=str(values.get("model_file", V2_MODEL_FILE)),
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "outer_step": self.outer_step,
            "updated_at": self.updated_at,
            "model_file": self.model_file,
        }


class NesterovOuterOptimizer(_Nesterov):
    """2.0's constructor ``(state, lr, momentum=0.9)``: momentum buffers start as float32
    zeros for the floating keys of ``state``; ``step(state, delta)`` as before."""

    def __init__(self, state: StateDict, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__(lr, momentum)
        for key, value in state.items():
            if value.is_floating_point() or value.is_complex():
                shape = torch.view_as_real(value).shape if value.is_complex() else value.shape
                self.buffers[key] = torch.zeros(shape, dtype=torch.float32)


# -- safetensors helpers ----------------------------------------------------------------------


def _cpu_clones(state: StateDict) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU clones (cloning unties shared storage, which safetensors
    refuses)."""
    return {str(k): v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def save_safetensors(
    state: StateDict, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``state`` (CPU clones) with string ``metadata`` in its header."""
    target = Path(path)
    # Through the shared atomic writer: a reader never sees half a file, and a symlink
    # planted at the name (or its temp name) is replaced, never written through.
    atomic_write_bytes(target, safetensors.torch.save(_cpu_clones(state), dict(metadata or {})))
    return target


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU."""
    return safetensors.torch.load_file(str(path), device="cpu")


def load_delta(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A delta file's tensors and header metadata; a file that cannot be read is a
    ``ValueError`` (as in 2.0)."""
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
        return load_safetensors(path), metadata
    except Exception as exc:  # the library raises several types for damaged files
        raise ValueError(f"unreadable delta file {os.fspath(path)}: {exc}") from None


# -- HubClient ----------------------------------------------------------------------------------


class HubClient:
    """2.0's hub client: its signature and methods, on top of a ``Transport``.

    ``transport`` replaces the Hugging Face repository (``HubTransport(repo_id,
    token=token, api=api)``) by any store, e.g. a ``DirectoryTransport``; either way calls
    are retried as ``retry_*`` say (sleeping through ``sleeper``), and failures raise
    ``HubUnavailable`` (transient, after the retries) or ``HubError`` (permanent).
    """

    def __init__(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        api: HubApi | None = None,
        retry_initial: float = 1.0,
        retry_max: float = 60.0,
        retry_attempts: int = 6,
        sleeper: Callable[[float], None] = time.sleep,
        transport: Transport | None = None,
    ) -> None:
        if not repo_id:
            raise ValueError("repo_id must not be empty")
        self.repo_id = repo_id
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "speedtronic" / "hub")
        self._store: Transport = transport or _HubStore(repo_id, token=token, api=api)
        policy = RetryPolicy(attempts=retry_attempts, initial=retry_initial, maximum=retry_max)
        self.transport = RetryingTransport(self._store, policy, sleep=sleeper)

    @property
    def api(self) -> HubApi:
        """The ``huggingface_hub.HfApi`` client (``HubError`` without the SDK)."""
        store = self._store
        if not isinstance(store, _HubStore):
            raise HubError(f"{self.transport.location} is not a Hugging Face repository")
        return self._call(lambda: store.api)

    def _call(self, function: Callable[[], T]) -> T:
        try:
            return function()
        except TransportError as exc:
            if exc.transient:
                raise HubUnavailable(str(exc)) from exc
            raise HubError(str(exc)) from exc

    # -- repository ---------------------------------------------------------------------

    def create_repo(self, private: bool = True) -> None:
        """Create the repository (or directory) if it does not exist."""
        if isinstance(self._store, _HubStore):
            self._store.private = private
        self._call(lambda: self.transport.prepare(create=True))

    def add_collaborator(self, username: str, permission: str = "write") -> None:
        """Not supported: grant access on the Hub itself (an organization, or a token)."""
        if permission not in ("read", "write", "admin"):
            raise ValueError(f"permission must be read, write or admin, got {permission!r}")
        raise HubError(
            f"cannot grant {username!r} access from speedtronic: add the account to the "
            "repository's organization on the Hub, or give the node a write token"
        )

    def list_files(self) -> list[str]:
        """Every file under ``global/`` and ``nodes/``, sorted."""
        found: list[str] = []
        for prefix in ("global", "nodes"):
            found += [entry.path for entry in self._list(prefix)]
        return sorted(found)

    def _list(self, prefix: str) -> list[RemoteFile]:
        return self._call(lambda: self.transport.list_files(prefix))

    def file_exists(self, path: str) -> bool:
        return path in self.list_files()

    # -- files --------------------------------------------------------------------------

    def upload(self, local: str | os.PathLike[str], remote: str) -> None:
        data = Path(local).read_bytes()  # FileNotFoundError before any retry
        self._call(lambda: self.transport.put(remote, data))

    def download(self, remote: str, local: str | os.PathLike[str] | None = None) -> Path:
        """Fetch ``remote`` to ``local`` (default ``<cache_dir>/downloads/<remote>``).
        ``remote`` is a relative hub path (no ``..``, no leading ``/``, no odd characters):
        anything else is a ``HubError`` before any request, so no name (one read from a hub
        file, say) leads out of the cache, whatever the transport checks itself."""
        try:
            check_remote_path(remote)
        except ValueError as exc:
            raise HubError(f"cannot download {remote!r}: {exc}") from None
        data = self._call(lambda: self.transport.get(remote))
        if data is None:
            raise HubError(f"{remote} does not exist in {self.transport.location}")
        target = Path(local) if local is not None else self.cache_dir / "downloads" / remote
        atomic_write_bytes(target, data)  # never through a link planted at the name
        return target

    def read_json(self, remote: str, default: object = None) -> object:
        data = self._call(lambda: self.transport.get(remote))
        return default if data is None else json.loads(data)

    def write_json(self, remote: str, value: object) -> None:
        text = json.dumps(value, indent=2, sort_keys=True) + "\n"
        self._call(lambda: self.transport.put(remote, text.encode()))

    # -- the 2.0 layout -----------------------------------------------------------------

    def global_metadata(self) -> GlobalMetadata | None:
        """The hub's pointer (``None`` when there is none); ``HubError`` when it is not a
        pointer at all (not JSON, a step that is no integer)."""
        try:
            value = self.read_json(_POINTER_FILE)
            return GlobalMetadata.from_dict(value) if isinstance(value, Mapping) else None
        except ValueError as exc:  # json's errors, int()'s (its digit limit too)
            raise HubError(
                f"{_POINTER_FILE} in {self.transport.location} is unusable: {exc}"
            ) from None

    def download_global(
        self, local: str | os.PathLike[str], metadata: GlobalMetadata | None = None
    ) -> Path:
        return self.download(metadata.model_file if metadata else V2_MODEL_FILE, local)

    def publish_global(
        self,
        state: StateDict,
        *,
        outer_step: int,
        work_dir: str | os.PathLike[str] | None = None,
        updated_at: str | None = None,
        metadata_extra: Mapping[str, object] | None = None,
    ) -> GlobalMetadata:
        """Weights first (``global/latest.safetensors``), then ``global/step_count.json``."""
        staging = Path(work_dir) if work_dir is not None else self.cache_dir / "outgoing"
        local = save_safetensors(state, staging / "latest.safetensors")
        self.upload(local, V2_MODEL_FILE)
        metadata = GlobalMetadata(
            outer_step=int(outer_step),
            updated_at=updated_at or datetime.now(timezone.utc).isoformat(),
        )
        values = metadata.to_dict()
        values.update({str(k): str(v) for k, v in (metadata_extra or {}).items()})
        self.write_json(_POINTER_FILE, values)
        return metadata

    def upload_delta(
        self,
        state: StateDict,
        *,
        node_id: str,
        local_step: int,
        base_outer_step: int,
        work_dir: str | os.PathLike[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """``nodes/<node_id>/delta_<local_step>.safetensors`` with 2.0's header fields."""
        header = {
            "node_id": node_id,
            "local_step": str(local_step),
            "base_outer_step": str(base_outer_step),
            "algorithm": "dumb_diloco",
            **dict(metadata or {}),
        }
        staging = Path(work_dir) if work_dir is not None else self.cache_dir / "outgoing"
        local = save_safetensors(
            state, staging / f"{node_id}_delta_{local_step}.safetensors", header
        )
        remote = f"nodes/{node_id}/delta_{local_step}.safetensors"
        self.upload(local, remote)
        return remote

    def delta_paths(self) -> list[str]:
        """The 2.0 delta files on the hub."""
        return sorted(entry.path for entry in self._list("nodes") if is_v2_delta(entry.path))


HubTransport = HubClient
"""2.0's alias of ``HubClient``."""


# -- the coordinator ----------------------------------------------------------------------------


class _Emits(Protocol):
    def emit(self, event: str, payload: Mapping[str, object] | None = None) -> None: ...


def _section(config: object) -> Mapping[str, object]:
    """The ``distributed`` section of a ``DistributedConfig``, a whole config or a dict."""
    whole = getattr(config, "distributed", None)
    if whole is not None:
        config = whole
    if isinstance(config, Mapping):
        inner = config.get("distributed")
        return inner if isinstance(inner, Mapping) else config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        values = to_dict()
        if isinstance(values, Mapping):
            return values
    raise TypeError(f"expected a distributed config section, got {type(config).__name__}")


class DumbDiLoCoCoordinator:
    """2.0's DiLoCo coordinator for ``Trainer(coordinator=...)`` (a ``SyncCoordinator``).

    ``config`` is an enabled 2.0 ``distributed`` section (a ``DistributedConfig``, a whole
    config or a dict). ``hub`` may be a ``HubClient`` or any ``Transport``; by default the
    section's ``hub_dir``/``repo_id`` decide. ``state_dir`` is where the master appends its
    round log (``rounds-<node>.jsonl``); ``logger`` (anything with ``emit``, a
    ``MetricLogger``) receives the 2.0 events ``outer_step`` and ``delta_upload_*``.
    """

    def __init__(
        self,
        config: object,
        model: nn.Module,
        *,
        hub: HubClient | Transport | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        logger: _Emits | None = None,
    ) -> None:
        section = dict(_section(config))
        section.setdefault("enabled", True)
        store = hub.transport.inner if isinstance(hub, HubClient) else hub
        if store is not None and section.get("repo_id") is None:
            section["hub_dir"] = store.location  # the injected hub is the store
        self.options = DiLoCoOptions.from_mapping(options_from_distributed_section(section))
        self.model = model
        self.node_id = self.options.node_id or default_node_id()
        audit = None
        if state_dir is not None and self.options.audit_log:
            audit = Path(state_dir) / f"rounds-{self.node_id}.jsonl"
        secret = None
        if self.options.signing_secret_env is not None:
            secret = os.environ.get(self.options.signing_secret_env, "").encode() or None
        self.node: DiLoCoNode = make_node(
            model,
            self.options,
            node_id=self.node_id,
            transport=make_transport(self.options, store),
            secret=secret,
            audit_path=audit,
            publish=logger.emit if logger is not None else None,
        )
        self._local_step = 0

    # -- SyncCoordinator ------------------------------------------------------------------

    def start(self) -> None:
        self.node.start(self._local_step)

    def after_optimizer_step(self, model: nn.Module, step: int) -> bool:
        """Sync at the step; true when a newer global was installed (reset the inner
        optimizer)."""
        if model is not self.model:
            raise ValueError("DumbDiLoCoCoordinator was built for another model")
        self._local_step = step
        return self.node.on_step(step).installed is not None

    def stop(self) -> None:
        self.node.stop()

    def state_dict(self) -> dict[str, object]:
        return {"local_step": self._local_step, **self.node.state_dict()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        values = dict(state)
        step = values.pop("local_step", 0)
        self._local_step = step if isinstance(step, int) else 0
        if not self.node.started:
            self.node.load_state_dict(values)

    prepare_state = load_state_dict

    # -- 2.0 properties -------------------------------------------------------------------

    @property
    def local_step(self) -> int:
        return self._local_step

    @property
    def last_global_step(self) -> int:
        """The outer step of the global installed last (-1: none yet)."""
        return self.node.installed_step

    @property
    def outer_step(self) -> int:
        master = self.node.master
        if master is not None and master.outer_step >= 0:
            return master.outer_step
        return max(self.node.installed_step, 0)


DumbDiLoCo = DumbDiLoCoCoordinator
"""2.0's alias."""
