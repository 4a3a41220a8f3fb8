"""``diloco``: asynchronous low-communication training (DiLoCo) as a callback.

    callbacks:
      - {name: diloco, role: worker, node_id: gpu-box-2, hub_dir: /mnt/shared/run-7,
         inner_steps: 500}

Every node trains its own full copy of the model. Every ``inner_steps`` optimizer steps it
sends its *pseudo-gradient* (weights at the last sync minus weights now, float32 or
bf16/fp16) to a shared hub -- a directory (``hub_dir``) or a Hugging Face Hub repository
(``repo_id``) -- and installs a newer global model whenever the master has published one.
The single master (``role: master``) also trains, and on a background lane collects the
deltas, weights them by staleness, applies one outer Nesterov-SGD step (lr 0.7, momentum
0.9 by default) and publishes the new global model. Nobody waits for anybody: uploads,
polls and outer rounds never block the training thread.

The callback acts on the ``coordinate`` event (after the optimizer and scheduler step),
asks for an ``optimizer_reset`` only when a newer global was installed and
``reset_optimizer`` is on, adds ``diloco/*`` metrics at the ``metrics`` event, and keeps
its full state -- baseline, unsent work, counters and, for the master, the global model,
outer momentum and ledger -- in the trainer checkpoint under ``state_key = "diloco"``.

The original ``distributed:`` config section still works: when it is enabled the runtime
adds this callback with no options, and ``from_options`` maps the section onto the
options (``options_from_distributed_section``); explicit options win.

Per-node data: ``data_seed_offset`` (the ``node_index`` option, else a stable hash of the
node id) is meant to be added to the data seed, and ``data_shard`` (``node_index``,
``num_nodes``) to pick a shard, so that workers do not all train on identical batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, cast

from typing_extensions import Self

from speedtronic.callback import Callback, JSONSchema
from speedtronic.contexts import (
    CoordinateContext,
    FitContext,
    MetricsContext,
    TeardownContext,
)
from speedtronic.filters import METRICS_ON_LOGGING_STEPS
from speedtronic_callbacks.diloco.collective import (
    COLLECTIVE_OPTIONS_SCHEMA,
    CollectiveDiLoCo,
    CollectiveDiLoCoOptions,
)
from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.hub_transport import HubTransport
from speedtronic_callbacks.diloco.lanes import ErrorReporter
from speedtronic_callbacks.diloco.master import NODE_ID_PATTERN, MasterLoop, MasterSettings
from speedtronic_callbacks.diloco.model_layout import ModelLayout, build_layout
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.transport_base import RetryingTransport, RetryPolicy, Transport
from speedtronic_callbacks.diloco.wire import Compression

if TYPE_CHECKING:
    from speedtronic.plugins import PluginContext
    from speedtronic.view import TrainerView

__all__ = [
    "DiLoCoCallback",
    "DiLoCoOptions",
    "DistributedSection",
    "options_from_distributed_section",
]

logger = logging.getLogger("speedtronic.diloco")

_positive = {"type": "number", "exclusiveMinimum": 0}

HUB_OPTIONS_SCHEMA: JSONSchema = {
    "type": "object",
    "additionalProperties": False,
    "not": {"required": ["hub_dir", "repo_id"]},
    "properties": {
        "role": {
            "enum": ["master", "worker"],
            "default": "worker",
            "description": "master: trains and runs the outer loop (one per hub); worker: "
            "trains and syncs.",
        },
        "node_id": {
            "type": "string",
            "pattern": NODE_ID_PATTERN.pattern,
            "description": "Unique node name (letters, digits, '.', '_', '-'; default: "
            "$SPEEDTRONIC_NODE_ID, else '<host>-<pid>').",
        },
        "inner_steps": {
            "type": "integer",
            "minimum": 1,
            "default": 500,
            "description": "Local optimizer steps between uploads (H).",
        },
        "outer_lr": {**_positive, "default": 0.7, "description": "Outer Nesterov learning rate."},
        "outer_momentum": {
            "type": "number",
            "minimum": 0,
            "exclusiveMaximum": 1,
            "default": 0.9,
            "description": "Outer Nesterov momentum.",
        },
        "hub_dir": {
            "type": "string",
            "minLength": 1,
            "description": "Shared directory used as the hub (local disk or network FS).",
        },
        "repo_id": {
            "type": "string",
            "pattern": "^[^/\\s]+/[^/\\s]+$",
            "description": "Hugging Face Hub model repository used as the hub "
            "(needs the 'hub' extra).",
        },
        "token_env": {
            "type": "string",
            "minLength": 1,
            "default": "HF_TOKEN",
            "description": "Environment variable holding the Hub token (never put tokens "
            "in config files).",
        },
        "private_repo": {
            "type": "boolean",
            "default": True,
            "description": "Create the Hub repository as private (master).",
        },
        "poll_interval": {
            **_positive,
            "default": 60.0,
            "description": "Seconds between polls for a new global (workers) and between "
            "outer rounds (master).",
        },
        "retry_attempts": {
            "type": "integer",
            "minimum": 1,
            "default": 6,
            "description": "Tries per hub request, the first included.",
        },
        "retry_initial": {**_positive, "default": 1.0, "description": "First backoff (s)."},
        "retry_max": {**_positive, "default": 60.0, "description": "Longest backoff (s)."},
        "request_timeout": {
            **_positive,
            "default": 600.0,
            "description": "Give up waiting for one hub request after this many seconds "
            "(longer than the slowest full-model transfer).",
        },
        "reset_optimizer": {
            "type": "boolean",
            "default": True,
            "description": "Clear the inner optimizer state when a newer global is installed.",
        },
        "compression": {
            "enum": ["none", "bf16", "fp16"],
            "default": "none",
            "description": "Delta precision on the wire (bf16/fp16 halve the bytes).",
        },
        "staleness_power": {
            "type": "number",
            "minimum": 0,
            "default": 0.5,
            "description": "A delta s outer steps stale counts (1 + s) ** -power (0: equal).",
        },
        "max_staleness": {
            "type": ["integer", "null"],
            "minimum": 0,
            "default": None,
            "description": "Reject deltas more than this many outer steps stale (null: never).",
        },
        "signing_secret_env": {
            "type": ["string", "null"],
            "minLength": 1,
            "default": None,
            "description": "Environment variable with a shared secret: files are signed "
            "(HMAC-SHA256) and unsigned or wrongly signed files are rejected.",
        },
        "delete_applied_deltas": {
            "type": "boolean",
            "default": True,
            "description": "Master removes deltas from the hub once applied.",
        },
        "keep_global_versions": {
            "type": "integer",
            "minimum": 1,
            "default": 2,
            "description": "Global model versions kept on the hub.",
        },
        "shutdown_timeout": {
            **_positive,
            "default": 5.0,
            "description": "Seconds an upload in flight may take to finish at the end of a fit.",
        },
        "node_index": {
            "type": ["integer", "null"],
            "minimum": 0,
            "default": None,
            "description": "This node's index for data seeding/sharding.",
        },
        "num_nodes": {
            "type": ["integer", "null"],
            "minimum": 1,
            "default": None,
            "description": "Number of data shards (with node_index).",
        },
        "audit_log": {
            "type": "boolean",
            "default": True,
            "description": "Master appends every round to <output_dir>/diloco/rounds.jsonl.",
        },
    },
}


def _plugin_schema() -> JSONSchema:
    """One ``diloco`` schema for both modes: ``mode: hub`` (default; asynchronous, through a
    shared directory or the Hugging Face Hub) and ``mode: collective`` (synchronous, over
    torch.distributed). Each mode accepts only its own keys; ``propertyNames`` (not nested
    closed schemas) keeps the ``name`` key that the config loader adds valid."""
    hub = cast(dict[str, object], HUB_OPTIONS_SCHEMA["properties"])
    collective = cast(dict[str, object], COLLECTIVE_OPTIONS_SCHEMA["properties"])
    collective_keys = [key for key in collective if key != "mode"]
    mode = {
        "enum": ["hub", "collective"],
        "default": "hub",
        "description": "hub: asynchronous DiLoCo over a shared hub (this page's options); "
        "collective: synchronous DiLoCo over torch.distributed all-reduce.",
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {**collective, **hub, "mode": mode},
        "if": {"required": ["mode"], "properties": {"mode": {"const": "collective"}}},
        "then": {"propertyNames": {"enum": [*collective_keys, "mode", "name"]}},
        "else": {
            "propertyNames": {"enum": [*hub, "mode", "name"]},
            "not": HUB_OPTIONS_SCHEMA["not"],
        },
    }


OPTIONS_SCHEMA: JSONSchema = _plugin_schema()


@dataclass(frozen=True)
class DiLoCoOptions:
    """Validated options of the ``diloco`` callback (see ``OPTIONS_SCHEMA``)."""

    role: Literal["master", "worker"] = "worker"
    node_id: str | None = None
    inner_steps: int = 500
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    hub_dir: str | None = None
    repo_id: str | None = None
    token_env: str = "HF_TOKEN"
    private_repo: bool = True
    poll_interval: float = 60.0
    retry_attempts: int = 6
    retry_initial: float = 1.0
    retry_max: float = 60.0
    request_timeout: float = 600.0
    reset_optimizer: bool = True
    compression: Literal["none", "bf16", "fp16"] = "none"
    staleness_power: float = 0.5
    max_staleness: int | None = None
    signing_secret_env: str | None = None
    delete_applied_deltas: bool = True
    keep_global_versions: int = 2
    shutdown_timeout: float = 5.0
    node_index: int | None = None
    num_nodes: int | None = None
    audit_log: bool = True

    def __post_init__(self) -> None:
        problems = _type_problems(self)
        if problems:
            raise ValueError("diloco: " + "; ".join(problems))
        if self.role not in ("master", "worker"):
            problems.append(f"role must be 'master' or 'worker', got {self.role!r}")
        if (self.hub_dir is None) == (self.repo_id is None):
            problems.append("set exactly one of hub_dir (shared directory) or repo_id (HF Hub)")
        if self.node_id is not None and not NODE_ID_PATTERN.match(self.node_id):
            problems.append(f"node_id {self.node_id!r} must match {NODE_ID_PATTERN.pattern}")
        if self.inner_steps < 1:
            problems.append(f"inner_steps must be >= 1, got {self.inner_steps}")
        if self.outer_lr <= 0:
            problems.append(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            problems.append(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.retry_attempts < 1:
            problems.append("retry_attempts must be >= 1")
        if not 0 < self.retry_initial <= self.retry_max:
            problems.append("retry delays need 0 < retry_initial <= retry_max")
        if min(self.poll_interval, self.request_timeout, self.shutdown_timeout) <= 0:
            problems.append("poll_interval, request_timeout and shutdown_timeout must be > 0")
        if self.compression not in ("none", "bf16", "fp16"):
            problems.append(f"compression must be none, bf16 or fp16, got {self.compression!r}")
        if self.staleness_power < 0:
            problems.append("staleness_power must be >= 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            problems.append("max_staleness must be >= 0")
        if self.keep_global_versions < 1:
            problems.append("keep_global_versions must be >= 1")
        if self.node_index is not None and self.node_index < 0:
            problems.append("node_index must be >= 0")
        if self.num_nodes is not None and self.node_index is None:
            problems.append("num_nodes needs node_index")
        if (
            self.num_nodes is not None
            and self.node_index is not None
            and not 0 <= self.node_index < self.num_nodes
        ):
            problems.append(f"node_index {self.node_index} is not below num_nodes {self.num_nodes}")
        if problems:
            raise ValueError("diloco: " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, options: Mapping[str, object]) -> DiLoCoOptions:
        """Build from a (schema-validated) mapping; unknown keys are a ``ValueError``."""
        names = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"diloco: unknown option(s) {unknown}")
        return cls(**dict(options))  # type: ignore[arg-type]  # types are checked by __post_init__


def _accepts(hint: object, value: object) -> bool:
    """Whether ``value`` fits a field annotation (``int``, ``float``, ``str``, ``bool``,
    ``Literal[...]`` and unions of those with ``None``)."""
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(hint))
    return True


def _type_problems(options: DiLoCoOptions) -> list[str]:
    hints = typing.get_type_hints(type(options))
    return [
        f"{item.name}: {getattr(options, item.name)!r} is not a valid value"
        for item in dataclasses.fields(options)
        if not _accepts(hints[item.name], getattr(options, item.name))
    ]


# -- the original ``distributed:`` section --------------------------------------------


class DistributedSection(Protocol):
    """The attributes of the original ``distributed:`` config section (plus ``hub_dir``)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def mode(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def node_id(self) -> str | None: ...
    @property
    def collaborators(self) -> list[str]: ...
    @property
    def inner_steps(self) -> int: ...
    @property
    def poll_interval(self) -> float: ...
    @property
    def outer_lr(self) -> float: ...
    @property
    def outer_momentum(self) -> float: ...
    @property
    def repo_id(self) -> str | None: ...
    @property
    def hub_dir(self) -> str | None: ...
    @property
    def token(self) -> str | None: ...
    @property
    def cache_dir(self) -> str: ...
    @property
    def state_dir(self) -> str: ...
    @property
    def retry_initial(self) -> float: ...
    @property
    def retry_max(self) -> float: ...
    @property
    def retry_attempts(self) -> int: ...
    @property
    def reset_inner_optimizer(self) -> bool: ...
    @property
    def async_delta_upload(self) -> bool: ...
    @property
    def async_global_poll(self) -> bool: ...
    @property
    def delta_upload_queue_size(self) -> int: ...
    @property
    def delta_upload_overflow(self) -> str: ...
    @property
    def delta_upload_shutdown_timeout(self) -> float: ...


def options_from_distributed_section(section: DistributedSection) -> dict[str, object]:
    """Map an enabled original ``distributed:`` section onto ``diloco`` options.

    * ``role: single`` becomes ``master`` (what the original inferred for an enabled
      section with a hub); ``reset_inner_optimizer`` becomes ``reset_optimizer`` and
      ``delta_upload_shutdown_timeout`` becomes ``shutdown_timeout``.
    * ``cache_dir``/``state_dir`` are dropped: downloads stay in memory and the state lives
      in the trainer checkpoint. The async flags and queue settings are dropped: I/O is
      always on bounded background lanes (the original's only supported queue size, 1).
    * ``collaborators`` are dropped with a warning: grant access on the Hub itself.
    * A ``token`` in the section is refused: tokens come only from the environment
      (``HF_TOKEN``), so they never end up in config files, checkpoints or logs.
    """
    if not section.enabled:
        raise ValueError("distributed.enabled is false: there is nothing to map")
    if section.mode != "dumb_diloco":
        raise ValueError(f"distributed.mode must be 'dumb_diloco', got {section.mode!r}")
    if section.token:
        raise ValueError(
            "distributed.token is not supported: put the Hub token in the HF_TOKEN "
            "environment variable instead of the config file"
        )
    if section.collaborators:
        logger.warning(
            "distributed.collaborators %s ignored: grant write access on the Hub instead",
            list(section.collaborators),
        )
    options: dict[str, object] = {
        "role": "master" if section.role in ("single", "master") else "worker",
        "inner_steps": section.inner_steps,
        "poll_interval": section.poll_interval,
        "outer_lr": section.outer_lr,
        "outer_momentum": section.outer_momentum,
        "retry_initial": section.retry_initial,
        "retry_max": section.retry_max,
        "retry_attempts": section.retry_attempts,
        "reset_optimizer": section.reset_inner_optimizer,
        "shutdown_timeout": section.delta_upload_shutdown_timeout,
    }
    if section.node_id is not None:
        options["node_id"] = section.node_id
    if section.hub_dir is not None:
        options["hub_dir"] = section.hub_dir
    if section.repo_id is not None:
        options["repo_id"] = section.repo_id
    return options


def default_node_id() -> str:
    """``$SPEEDTRONIC_NODE_ID``, else ``<hostname>-<pid>``, made a valid node id."""
    raw = os.environ.get("SPEEDTRONIC_NODE_ID") or f"{socket.gethostname()}-{os.getpid()}"
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).strip(".-_")[:64] or "node"
    return cleaned if NODE_ID_PATTERN.match(cleaned) else f"n{cleaned}"[:64]


# -- the callback -----------------------------------------------------------------------


class DiLoCoCallback(Callback):
    """DiLoCo synchronisation through a shared hub (see the module docstring).

    ``transport`` lets Python code supply its own ``Transport`` (tests, custom stores);
    otherwise ``hub_dir`` or ``repo_id`` chooses one.
    """

    plugin_name: ClassVar[str | None] = "diloco"
    options_schema: ClassVar[JSONSchema] = OPTIONS_SCHEMA
    state_key = "diloco"
    due_when = METRICS_ON_LOGGING_STEPS  # on_metrics only on logging steps

    def __init__(
        self,
        options: DiLoCoOptions | None = None,
        *,
        transport: Transport | None = None,
        **values: object,
    ) -> None:
        if options is not None and values:
            raise TypeError("pass DiLoCoOptions or keyword options, not both")
        self.options = options or DiLoCoOptions.from_mapping(values)
        self.node_id = self.options.node_id or default_node_id()
        self._transport = transport
        self.node: DiLoCoNode | None = None
        self._model_id: int | None = None
        self._staged: Mapping[str, object] | None = None
        self.reporter = ErrorReporter()

    @classmethod
    def from_options(cls, options: Mapping[str, object], context: PluginContext) -> Self:
        """Options not given come from an enabled ``distributed:`` section."""
        merged: dict[str, object] = {}
        section = getattr(context.config, "distributed", None)
        if section is not None and getattr(section, "enabled", False):
            merged.update(options_from_distributed_section(cast(DistributedSection, section)))
        if options.get("mode") == "collective":
            # Synchronous mode is its own callback class behind the same plugin name; the
            # cast only widens what ``from_options`` may return to that sibling class.
            return cast(Self, CollectiveDiLoCo(CollectiveDiLoCoOptions.from_mapping(options)))
        merged.update((key, value) for key, value in options.items() if key != "mode")
        return cls(DiLoCoOptions.from_mapping(merged))

    # -- data seeding -------------------------------------------------------------------

    @property
    def data_seed_offset(self) -> int:
        """Add this to the data seed so that every node sees different batches:
        ``node_index`` when set, else a stable number derived from the node id."""
        if self.options.node_index is not None:
            return self.options.node_index
        return int(hashlib.sha256(self.node_id.encode()).hexdigest()[:8], 16) % 1_000_003

    @property
    def data_shard(self) -> tuple[int, int] | None:
        """``(index, count)`` of this node's data shard, when both options are set."""
        if self.options.node_index is None or self.options.num_nodes is None:
            return None
        return self.options.node_index, self.options.num_nodes

    # -- construction of the node -------------------------------------------------------

    def _secret(self) -> bytes | None:
        name = self.options.signing_secret_env
        if name is None:
            return None
        value = os.environ.get(name)
        if not value:
            raise ValueError(
                f"diloco: signing_secret_env names ${name}, which is not set in this "
                "process's environment"
            )
        return value.encode()

    def _build_transport(self) -> RetryingTransport:
        options = self.options
        inner = self._transport
        if inner is None:
            if options.hub_dir is not None:
                inner = DirectoryTransport(options.hub_dir)
            else:
                assert options.repo_id is not None  # checked by DiLoCoOptions
                inner = HubTransport(
                    options.repo_id, token_env=options.token_env, private=options.private_repo
                )
        policy = RetryPolicy(
            attempts=options.retry_attempts,
            initial=options.retry_initial,
            maximum=options.retry_max,
            timeout=options.request_timeout,
        )
        return RetryingTransport(inner, policy)

    @staticmethod
    def _config_fingerprint(trainer: TrainerView) -> str:
        """The model section of the run config (minus settings that do not change the
        weights), so that nodes with another model configuration are told apart."""
        run_config = trainer.run_config
        model_section = run_config.get("model") if run_config is not None else None
        if not isinstance(model_section, Mapping):
            return ""
        values = dict(model_section)
        values.pop("gradient_checkpointing", None)
        return json.dumps(values, sort_keys=True, default=str)

    def _build_node(self, trainer: TrainerView) -> DiLoCoNode:
        options = self.options
        secret = self._secret()
        layout: ModelLayout = build_layout(
            trainer.model.state_dict(), self._config_fingerprint(trainer)
        )
        transport = self._build_transport()
        master = None
        if options.role == "master":
            audit = None
            if options.audit_log:
                audit = Path(trainer.output_dir) / "diloco" / f"rounds-{self.node_id}.jsonl"
            master = MasterLoop(
                transport,
                layout,
                MasterSettings(
                    node_id=self.node_id,
                    outer_lr=options.outer_lr,
                    outer_momentum=options.outer_momentum,
                    staleness_power=options.staleness_power,
                    max_staleness=options.max_staleness,
                    delete_applied=options.delete_applied_deltas,
                    keep_global_versions=options.keep_global_versions,
                    secret=secret,
                ),
                audit_path=audit,
            )
        settings = NodeSettings(
            node_id=self.node_id,
            role=options.role,
            inner_steps=options.inner_steps,
            poll_interval=options.poll_interval,
            compression=Compression(options.compression),
            shutdown_timeout=options.shutdown_timeout,
            secret=secret,
        )
        return DiLoCoNode(
            trainer.model, transport, layout, settings, master=master, reporter=self.reporter
        )

    # -- hooks --------------------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        if trainer.multi_rank:
            # Every rank would act as a separate hub node with diverging weights.
            raise RuntimeError(
                "diloco mode 'hub' runs one node per process and is not supported under "
                "torchrun with several ranks; use mode: collective (synchronous DiLoCo over "
                "torch.distributed), or start one single-process node per machine"
            )
        if self.node is None or self._model_id != id(trainer.model):
            self.node = self._build_node(trainer)
            self._model_id = id(trainer.model)
            logger.info(
                "diloco %s %r on %s: inner_steps=%d, compression=%s",
                self.options.role,
                self.node_id,
                self.node.transport.location,
                self.options.inner_steps,
                self.options.compression,
            )
        if self._staged is not None:
            self.node.load_state_dict(self._staged)
            self._staged = None

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        if self.node is not None and ctx.start_step < ctx.target_step:
            self.node.start(ctx.start_step)

    def on_coordinate(self, trainer: TrainerView, ctx: CoordinateContext) -> None:
        if self.node is None:
            return
        outcome = self.node.on_step(ctx.step)
        if outcome.installed is not None and self.options.reset_optimizer:
            trainer.request_optimizer_reset("diloco")

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if self.node is None:
            return
        for key, value in self.node.metrics().items():
            ctx.record.set(key, value)

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        if self.node is not None:
            self.node.stop()

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        if self.node is not None:
            return self.node.state_dict()
        return dict(self._staged or {})

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        if self.node is not None and not self.node.started:
            self.node.load_state_dict(state)
        else:
            self._staged = state
