"""The ``diloco`` plugin's options: declared once, validated once, by the schema.

Both modes share one plugin name and one options schema (``OPTIONS_SCHEMA``): ``mode: hub``
(the default; asynchronous, through a shared directory or the Hugging Face Hub, options
``DiLoCoOptions``) and ``mode: collective`` (synchronous over torch.distributed, options
``CollectiveDiLoCoOptions``). Config validation checks a ``callbacks:`` entry against that
schema plus ``hub_option_problems``' cross-field rules; building ``DiLoCoOptions`` directly
in Python runs the same checks, so nothing is validated twice by different code.

The 2.0 ``distributed:`` section (aliases ``hub:`` and ``diloco:``) belongs to this plugin
as well: ``DISTRIBUTED_SECTION_SCHEMA`` declares its keys, ``distributed_section_problems``
its cross-field rules, and ``options_from_distributed_section`` rewrites it into options --
the one place that mapping lives.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, cast

from jsonschema import Draft202012Validator

from speedtronic.engine.callback import JSONSchema
from speedtronic_callbacks.diloco.aggregation import RobustSettings
from speedtronic_callbacks.diloco.encoding import Encoding
from speedtronic_callbacks.diloco.master import NODE_ID_PATTERN

__all__ = [
    "COLLECTIVE_OPTIONS_SCHEMA",
    "DISTRIBUTED_SECTION_SCHEMA",
    "HUB_OPTIONS_SCHEMA",
    "OPTIONS_SCHEMA",
    "CollectiveDiLoCoOptions",
    "collective_option_problems",
    "delta_encoding",
    "encoding_problems",
    "streaming_problems",
    "DiLoCoOptions",
    "DistributedSection",
    "distributed_section_problems",
    "hub_option_problems",
    "normalise_distributed_section",
    "options_from_distributed_section",
    "robust_settings",
]

logger = logging.getLogger("speedtronic.diloco")

DeltaDtype = Literal["fp32", "bf16", "fp16", "int8", "fp4"]
OutlierPolicy = Literal["clip", "reject", "off"]

_positive = {"type": "number", "exclusiveMinimum": 0}
# The outer Nesterov optimizer's options: the same in hub and collective mode.
_OUTER_OPTIMIZER: dict[str, object] = {
    "outer_lr": {**_positive, "default": 0.7, "description": "Outer Nesterov learning rate."},
    "outer_momentum": {
        "type": "number",
        "minimum": 0,
        "exclusiveMaximum": 1,
        "default": 0.9,
        "description": "Outer Nesterov momentum.",
    },
}

# How pseudo-gradients travel and how they are combined: the same in both modes
# (docs/distributed.md, "Delta encodings" and "Robust aggregation").
_ENCODING_AND_AGGREGATION: dict[str, object] = {
    "delta_dtype": {
        "enum": ["fp32", "bf16", "fp16", "int8", "fp4", None],
        "default": None,
        "description": "Pseudo-gradient encoding on the wire and in hub files: fp32, "
        "bf16/fp16 (1/2 the bytes), int8 (per-block scale, ~1/4), fp4 (e2m1 with a "
        "per-block scale, ~1/7); null: what 'compression' says. The outer step is float32.",
    },
    "error_feedback": {
        "type": "boolean",
        "default": True,
        "description": "Carry what a lossy delta_dtype dropped into the next round's "
        "pseudo-gradient (kept in the checkpoint).",
    },
    "outlier_policy": {
        "enum": ["clip", "reject", "off"],
        "default": "clip",
        "description": "A pseudo-gradient whose norm exceeds outlier_factor x the median of "
        "recent norms is scaled down to that bound (clip) or left out (reject).",
    },
    "outlier_factor": {
        "type": "number",
        "exclusiveMinimum": 1,
        "default": 10.0,
        "description": "How many times the recent median norm a pseudo-gradient may reach.",
    },
    "outlier_window": {
        "type": "integer",
        "minimum": 1,
        "default": 16,
        "description": "How many recent pseudo-gradient norms the median is taken over.",
    },
    "weight_by_work": {
        "type": "boolean",
        "default": True,
        "description": "Weight each pseudo-gradient by the tokens (else samples) trained "
        "for it, relative to the round's mean (with the staleness weight in hub mode).",
    },
}

# Streaming DiLoCo (docs/distributed.md, "Streaming"): fragments and overlap.
_STREAMING: dict[str, object] = {
    "fragments": {
        "type": "integer",
        "minimum": 1,
        "default": 1,
        "description": "P: the model's blocks are split into P strided fragments, each "
        "synchronised every inner_steps steps at its own offset (1: the whole model at once, "
        "plain DiLoCo). At most the number of blocks.",
    },
    "overlap_steps": {
        "type": "integer",
        "minimum": 0,
        "default": 0,
        "description": "tau: a fragment's exchange runs in the background and is applied this "
        "many inner steps after it started, keeping the local progress made meanwhile (0: "
        "blocking). Must be below inner_steps / fragments.",
    },
}

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
        **_OUTER_OPTIMIZER,
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
        **_ENCODING_AND_AGGREGATION,
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
        "max_step_tokens": {
            "type": ["integer", "null"],
            "minimum": 1,
            "default": None,
            "description": "Master, weight_by_work: the most tokens one optimizer step of any "
            "node trains; a delta's claimed tokens count at most inner_steps (and its own "
            "steps) times this (null: the master's own tokens per step, measured).",
        },
        "max_step_samples": {
            "type": ["integer", "null"],
            "minimum": 1,
            "default": None,
            "description": "The same cap in samples, for deltas that report no tokens (null: "
            "the master's own samples per step).",
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
        "token": {
            "type": ["string", "null"],
            "minLength": 1,
            "default": None,
            "description": "Hub token (2.0's distributed.token; redacted in saved configs). "
            "Prefer token_env: a token in a config file is easy to leak.",
        },
        "fragments": _STREAMING["fragments"],
    },
}


COLLECTIVE_OPTIONS_SCHEMA: JSONSchema = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "mode": {
            "const": "collective",
            "description": "Synchronous DiLoCo over torch.distributed collectives.",
        },
        "inner_steps": {
            "type": "integer",
            "minimum": 1,
            "default": 500,
            "description": "Inner optimizer steps between two outer rounds (H).",
        },
        **_OUTER_OPTIMIZER,
        "compression": {
            "enum": ["none", "bf16", "fp16"],
            "default": "none",
            "description": "Precision of the pseudo-gradient all-reduce (bf16/fp16 halve "
            "the bytes; the outer step itself is float32).",
        },
        **_ENCODING_AND_AGGREGATION,
        "reset_optimizer": {
            "type": "boolean",
            "default": True,
            "description": "Clear the inner optimizer state after every outer round.",
        },
        "ranks_per_replica": {
            "type": "integer",
            "minimum": 1,
            "default": 1,
            "description": "Consecutive ranks forming one model replica (DDP inside it); "
            "must divide the world size.",
        },
        "sync_timeout_s": {
            "type": ["number", "null"],
            "exclusiveMinimum": 0,
            "default": None,
            "description": "Timeout of the outer all-reduce (null: distributed.timeout_s). "
            "Give slow links or large models more time than the per-step collectives.",
        },
        **_STREAMING,
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


DISTRIBUTED_SECTION_SCHEMA: JSONSchema = {
    "title": "distributed",
    "description": "2.0 asynchronous DiLoCo through a shared hub (read by the diloco plugin; "
    "'hub' and 'diloco' are aliases of this section).",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "enabled": {
            "type": "boolean",
            "default": False,
            "description": "Take part in DiLoCo synchronisation.",
        },
        "mode": {
            "type": "string",
            "default": "dumb_diloco",
            "description": "Synchronisation mode; must be 'dumb_diloco' when enabled.",
            "enum": ["dumb_diloco", "single"],
        },
        "role": {
            "type": "string",
            "default": "single",
            "description": "'master', 'worker', or 'single' (inferred when enabled: master when "
            "a hub is given).",
            "enum": ["single", "master", "worker"],
        },
        "node_id": {
            "type": ["string", "null"],
            "default": None,
            "description": "This node's id (no '/', '\\\\', '.' or '..'). Null: HF_USERNAME, "
            "USER, then 'local'.",
        },
        "collaborators": {
            "type": "array",
            "default": [],
            "description": "Hub user names the master grants write access.",
            "items": {"type": "string", "minLength": 1},
        },
        "inner_steps": {
            "type": "integer",
            "default": 500,
            "description": "Local optimizer steps between delta uploads.",
            "minimum": 1,
        },
        "poll_interval": {
            "type": "number",
            "default": 60.0,
            "description": "Seconds between hub polls (and between master rounds).",
            "exclusiveMinimum": 0,
        },
        "outer_lr": {
            "type": "number",
            "default": 0.7,
            "description": "Outer (Nesterov) learning rate.",
            "exclusiveMinimum": 0,
        },
        "outer_momentum": {
            "type": "number",
            "default": 0.9,
            "description": "Outer momentum in [0, 1).",
            "minimum": 0,
            "exclusiveMaximum": 1,
        },
        "repo_id": {
            "type": ["string", "null"],
            "default": None,
            "description": "Hugging Face repository id of the hub.",
            "minLength": 1,
        },
        "hub_dir": {
            "type": ["string", "null"],
            "default": None,
            "description": "Shared directory used as the hub instead of a Hugging Face repository.",
            "minLength": 1,
        },
        "token": {
            "type": ["string", "null"],
            "default": None,
            "description": "Hub token. Prefer the HF_TOKEN environment variable; never written "
            "to disk or logs.",
        },
        "cache_dir": {
            "type": "string",
            "default": ".speedtronic/hub",
            "description": "Hub download cache (relative to the working directory).",
            "minLength": 1,
        },
        "state_dir": {
            "type": "string",
            "default": ".speedtronic/diloco",
            "description": "Coordinator state; relative paths are under run.output_dir/<node_id>.",
            "minLength": 1,
        },
        "retry_initial": {
            "type": "number",
            "default": 1.0,
            "description": "First retry delay in seconds.",
            "exclusiveMinimum": 0,
        },
        "retry_max": {
            "type": "number",
            "default": 60.0,
            "description": "Largest retry delay in seconds (>= retry_initial).",
            "exclusiveMinimum": 0,
        },
        "retry_attempts": {
            "type": "integer",
            "default": 6,
            "description": "Total attempts per hub operation.",
            "minimum": 1,
        },
        "reset_inner_optimizer": {
            "type": "boolean",
            "default": True,
            "description": "Clear the inner optimizer state after adopting new global weights.",
        },
        "async_delta_upload": {
            "type": "boolean",
            "default": True,
            "description": "Upload deltas on a background lane.",
        },
        "delta_upload_queue_size": {
            "type": "integer",
            "default": 1,
            "description": "Pending delta uploads (must be 1).",
            "enum": [1],
        },
        "delta_upload_overflow": {
            "type": "string",
            "default": "skip",
            "description": "What to do with a delta while one is pending (must be 'skip').",
            "enum": ["skip"],
        },
        "delta_upload_shutdown_timeout": {
            "type": "number",
            "default": 5.0,
            "description": "Seconds to wait for each background lane at stop.",
            "exclusiveMinimum": 0,
        },
        "async_global_poll": {
            "type": "boolean",
            "default": True,
            "description": "Poll for global weights on a background lane.",
        },
    },
}
"""The keys the plugin adds to the 2.0 ``distributed:`` section (the core declares
``timeout_s``, the torch.distributed collective timeout, which every distributed run uses)."""


@dataclass(frozen=True)
class DiLoCoOptions:
    """Options of the ``diloco`` callback in ``mode: hub`` (see ``HUB_OPTIONS_SCHEMA``, where
    each is documented). ``None`` means "not set". Construction checks the values against
    the schema and ``hub_option_problems``; a problem is a ``ValueError``."""

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
    delta_dtype: DeltaDtype | None = None
    error_feedback: bool = True
    outlier_policy: OutlierPolicy = "clip"
    outlier_factor: float = 10.0
    outlier_window: int = 16
    weight_by_work: bool = True
    staleness_power: float = 0.5
    max_staleness: int | None = None
    max_step_tokens: int | None = None
    max_step_samples: int | None = None
    signing_secret_env: str | None = None
    delete_applied_deltas: bool = True
    keep_global_versions: int = 2
    shutdown_timeout: float = 5.0
    node_index: int | None = None
    num_nodes: int | None = None
    audit_log: bool = True
    token: str | None = dataclasses.field(default=None, repr=False)
    fragments: int = 1

    def __post_init__(self) -> None:
        values = {
            item.name: getattr(self, item.name)
            for item in dataclasses.fields(self)
            if getattr(self, item.name) is not None
        }
        problems = hub_option_problems(values)
        if problems:
            raise ValueError("diloco: " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, options: Mapping[str, object]) -> DiLoCoOptions:
        """Build from a mapping of options (``mode: hub`` allowed); a ``ValueError`` lists
        every problem, unknown keys included."""
        values = {key: value for key, value in options.items() if key != "mode"}
        names = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"diloco: unknown option(s) {unknown}")
        problems = hub_option_problems(values)
        if problems:
            raise ValueError("diloco: " + "; ".join(problems))
        # The schema has just checked every value's type.
        return cls(**values)  # type: ignore[arg-type]  # checked by hub_option_problems


_HUB_VALIDATOR = Draft202012Validator(HUB_OPTIONS_SCHEMA)


def hub_option_problems(
    values: Mapping[str, object], *, cross_field_only: bool = False
) -> list[str]:
    """Every problem of hub-mode options, each starting with its key: the JSON Schema
    first (skipped with ``cross_field_only``, when config validation has already run it),
    then the rules that relate several keys."""
    problems = []
    if not cross_field_only:
        problems = [
            f"{'.'.join(str(part) for part in error.absolute_path) or 'options'}: " + error.message
            for error in sorted(_HUB_VALIDATOR.iter_errors(dict(values)), key=str)
        ]
    problems.extend(_hub_cross_field_problems(values))
    problems.extend(encoding_problems(values))
    return problems


def encoding_problems(values: Mapping[str, object]) -> Iterator[str]:
    """``delta_dtype`` and its older spelling ``compression`` may not both be set."""
    compression = values.get("compression", "none")
    if values.get("delta_dtype") is not None and compression not in ("none", None):
        yield (
            f"delta_dtype: set delta_dtype or compression ({compression!r}), not both "
            "(compression is delta_dtype's older name)"
        )


def delta_encoding(options: DiLoCoOptions | CollectiveDiLoCoOptions) -> Encoding:
    """The encoding ``options`` choose: ``delta_dtype``, else ``compression``."""
    return Encoding.parse(options.delta_dtype or options.compression)


def robust_settings(options: DiLoCoOptions | CollectiveDiLoCoOptions) -> RobustSettings:
    """The outlier rule ``options`` choose."""
    return RobustSettings(options.outlier_policy, options.outlier_factor, options.outlier_window)


def _hub_cross_field_problems(values: Mapping[str, object]) -> Iterator[str]:
    if ("hub_dir" in values) == ("repo_id" in values):
        yield "hub_dir: set exactly one of hub_dir (shared directory) or repo_id (HF Hub)"
    initial, maximum = values.get("retry_initial", 1.0), values.get("retry_max", 60.0)
    if isinstance(initial, (int, float)) and isinstance(maximum, (int, float)):
        if _is_number(initial) and _is_number(maximum) and maximum < initial:
            yield f"retry_max: {maximum:g} is less than retry_initial ({initial:g})"
    index, count = values.get("node_index"), values.get("num_nodes")
    if count is not None and index is None:
        yield "num_nodes: needs node_index"
    if isinstance(index, int) and isinstance(count, int) and _is_int(index) and _is_int(count):
        if not index < count:
            yield f"node_index: {index} is not below num_nodes {count}"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CollectiveDiLoCoOptions:
    """Options of the ``diloco`` callback in ``mode: collective`` (synchronous DiLoCo; see
    ``COLLECTIVE_OPTIONS_SCHEMA``, where each is documented). Construction checks the values
    against that schema; a problem is a ``ValueError``."""

    mode: Literal["collective"] = "collective"
    inner_steps: int = 500
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: Literal["none", "bf16", "fp16"] = "none"
    delta_dtype: DeltaDtype | None = None
    error_feedback: bool = True
    outlier_policy: OutlierPolicy = "clip"
    outlier_factor: float = 10.0
    outlier_window: int = 16
    weight_by_work: bool = True
    reset_optimizer: bool = True
    ranks_per_replica: int = 1
    sync_timeout_s: float | None = None
    fragments: int = 1
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        problems = collective_option_problems(dataclasses.asdict(self))
        if problems:
            raise ValueError("diloco (collective): " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, options: Mapping[str, object]) -> CollectiveDiLoCoOptions:
        """Build from a mapping of options; a ``ValueError`` lists every problem, unknown
        keys included."""
        unknown = sorted(set(options) - {item.name for item in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"diloco (collective): unknown option(s) {unknown}")
        problems = collective_option_problems(options)
        if problems:
            raise ValueError("diloco (collective): " + "; ".join(problems))
        return cls(**dict(options))  # type: ignore[arg-type]  # checked by the schema just now


_COLLECTIVE_VALIDATOR = Draft202012Validator(COLLECTIVE_OPTIONS_SCHEMA)


def collective_option_problems(values: Mapping[str, object]) -> list[str]:
    """Every problem of collective-mode options, each starting with its key: the schema's,
    then the encoding rules (``encoding_problems``) and the streaming rule
    (``streaming_problems``)."""
    problems = [*_schema_problems(_COLLECTIVE_VALIDATOR, values), *encoding_problems(values)]
    if not problems:
        problems.extend(streaming_problems(values))
    return problems


def streaming_problems(values: Mapping[str, object]) -> Iterator[str]:
    """``overlap_steps`` must be below ``inner_steps / fragments``: a fragment's exchange
    has to be applied before the next fragment's starts. (``fragments`` larger than the
    model's number of blocks is refused when the model is known, at setup.)"""
    inner = values.get("inner_steps", 500)
    count = values.get("fragments", 1)
    overlap = values.get("overlap_steps", 0)
    if not (_is_int(inner) and _is_int(count) and _is_int(overlap)):
        return
    assert isinstance(inner, int) and isinstance(count, int) and isinstance(overlap, int)
    if count >= 1 and overlap > 0 and overlap * count >= inner:
        yield (
            f"overlap_steps: {overlap} is not below inner_steps / fragments "
            f"({inner} / {count} = {inner / count:g}); a fragment's exchange must be applied "
            "before the next fragment's starts"
        )


def _schema_problems(validator: Draft202012Validator, values: Mapping[str, object]) -> list[str]:
    return [
        f"{'.'.join(str(part) for part in error.absolute_path) or 'options'}: {error.message}"
        for error in sorted(validator.iter_errors(dict(values)), key=str)
    ]


# -- the 2.0 ``distributed:`` section ----------------------------------------------------


class DistributedSection(Protocol):
    """A typed 2.0 ``distributed:`` section (anything with ``to_dict``)."""

    def to_dict(self) -> Mapping[str, object]: ...


def options_from_distributed_section(
    section: Mapping[str, object] | DistributedSection,
) -> dict[str, object]:
    """Map an enabled 2.0 ``distributed:`` section onto ``diloco`` options.

    * ``role: single`` becomes ``master`` (what the original inferred for an enabled
      section with a hub); ``reset_inner_optimizer`` becomes ``reset_optimizer`` and
      ``delta_upload_shutdown_timeout`` becomes ``shutdown_timeout``.
    * ``token`` becomes the ``token`` option (used instead of ``$HF_TOKEN``; redacted
      wherever the config is saved).
    * ``cache_dir``, ``state_dir``, ``collaborators`` and the async/queue keys are checked
      at validation (``distributed_section_problems``): their defaults (and ``async_*:
      true``) are what this plugin does anyway; other values are refused there with what
      to use instead, so nothing is silently ignored.
    """
    values = {
        **_section_defaults(),
        **(section if isinstance(section, Mapping) else section.to_dict()),
    }
    get = values.get
    if get("enabled") is not True:
        raise ValueError("distributed.enabled is false: there is nothing to map")
    if get("mode") != "dumb_diloco":
        raise ValueError(f"distributed.mode must be 'dumb_diloco', got {get('mode')!r}")
    problems = list(_unsupported_keys(values))
    if problems:
        raise ValueError("; ".join(problems))
    options: dict[str, object] = {
        "role": "worker" if get("role") == "worker" else "master",
        "inner_steps": get("inner_steps"),
        "poll_interval": get("poll_interval"),
        "outer_lr": get("outer_lr"),
        "outer_momentum": get("outer_momentum"),
        "retry_initial": get("retry_initial"),
        "retry_max": get("retry_max"),
        "retry_attempts": get("retry_attempts"),
        "reset_optimizer": get("reset_inner_optimizer"),
        "shutdown_timeout": get("delta_upload_shutdown_timeout"),
    }
    for key in ("node_id", "hub_dir", "repo_id", "token"):
        if get(key) is not None:
            options[key] = get(key)
    return options


_SYNC_INSTEAD = (
    "for synchronous DiLoCo use callbacks: [{name: diloco, mode: collective}] under torchrun"
)
UNSUPPORTED_2_0_KEYS: dict[str, tuple[object, str]] = {
    "collaborators": (
        [],
        "the master does not grant access: add the nodes' accounts as members of the "
        "repository's organization (or give them a write token) on the Hub itself",
    ),
    "cache_dir": (
        ".speedtronic/hub",
        "there is no download cache: global models and deltas are read into memory; remove the key",
    ),
    "state_dir": (
        ".speedtronic/diloco",
        "the node's state (baseline, unsent work, the master's outer state) is saved in the "
        "trainer checkpoint; set checkpoint.directory instead",
    ),
    "async_delta_upload": (
        True,
        "uploads always run on a bounded background lane and never block training; remove "
        "the key (" + _SYNC_INSTEAD + ")",
    ),
    "async_global_poll": (
        True,
        "polls always run on a background lane; remove the key (" + _SYNC_INSTEAD + ")",
    ),
}
"""2.0 ``distributed:`` keys with no counterpart: ``(the value that means what this plugin
does anyway, what to use instead)``. Any other value is refused when the section is enabled."""


def _unsupported_keys(section: Mapping[str, object]) -> Iterator[str]:
    for key, (accepted, instead) in UNSUPPORTED_2_0_KEYS.items():
        value = section.get(key, accepted)
        if value != accepted:
            yield f"distributed.{key}: {value!r} is not supported: {instead}"


def _section_defaults() -> dict[str, object]:
    properties = cast(
        "Mapping[str, Mapping[str, object]]", DISTRIBUTED_SECTION_SCHEMA["properties"]
    )
    return {key: spec.get("default") for key, spec in properties.items()}


def distributed_section_problems(section: Mapping[str, object]) -> Iterator[str]:
    """Cross-field rules of the 2.0 ``distributed:`` section (defaults filled in)."""
    initial, maximum = section.get("retry_initial"), section.get("retry_max")
    if _is_number(initial) and _is_number(maximum):
        assert isinstance(initial, (int, float)) and isinstance(maximum, (int, float))
        if maximum < initial:
            yield (
                f"distributed.retry_max: {maximum:g} is less than "
                f"distributed.retry_initial ({initial:g})"
            )
    yield from _node_problems(section)
    if section.get("enabled") is not True:
        return
    mode = section.get("mode")
    if isinstance(mode, str) and mode != "dumb_diloco":
        yield (
            "distributed.mode: must be 'dumb_diloco' when distributed.enabled is true "
            f"(got {mode!r})"
        )
    repo_id, hub_dir = section.get("repo_id"), section.get("hub_dir")
    if repo_id is None and hub_dir is None:
        yield (
            "distributed.repo_id: required when distributed.enabled is true "
            "(or set distributed.hub_dir for a shared-directory hub)"
        )
    elif repo_id is not None and hub_dir is not None:
        yield "distributed.hub_dir: set distributed.repo_id or distributed.hub_dir, not both"
    yield from _unsupported_keys(section)


def _node_problems(section: Mapping[str, object]) -> Iterator[str]:
    node_id = section.get("node_id")
    if isinstance(node_id, str):
        stripped = node_id.strip()
        if not stripped:
            yield "distributed.node_id: must not be blank"
        elif stripped in (".", ".."):
            yield f"distributed.node_id: {node_id!r} is not a valid node id"
        elif "/" in stripped or "\\" in stripped:
            yield f"distributed.node_id: {node_id!r} must not contain '/' or '\\'"
    collaborators = section.get("collaborators")
    for index, name in enumerate(collaborators if isinstance(collaborators, list) else []):
        if isinstance(name, str) and name and not name.strip():
            yield f"distributed.collaborators[{index}]: must not be blank"


REDACTED = "<redacted>"
"""How a saved config writes a secret (``speedtronic.config``): never a real token."""


def normalise_distributed_section(section: dict[str, object]) -> None:
    """Before validation: enumerated strings are case-insensitive, ``node_id`` is stripped,
    a redacted token means none, and an enabled section's ``role: single`` becomes
    ``master`` with a hub (``repo_id``/``hub_dir``), else ``worker`` (the 2.0 inference)."""
    for key in ("mode", "role", "delta_upload_overflow"):
        value = section.get(key)
        if isinstance(value, str):
            section[key] = value.strip().lower()
    node_id = section.get("node_id")
    if isinstance(node_id, str):
        section["node_id"] = node_id.strip()
    if section.get("token") == REDACTED:
        section["token"] = None
    if section.get("enabled") is True and section.get("role", "single") == "single":
        has_hub = section.get("repo_id") is not None or section.get("hub_dir") is not None
        section["role"] = "master" if has_hub else "worker"
