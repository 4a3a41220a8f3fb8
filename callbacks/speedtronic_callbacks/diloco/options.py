"""The ``diloco`` plugin's options: declared once, validated once.

Both modes share one plugin name and one options schema (``OPTIONS_SCHEMA``): ``mode: hub``
(the default; asynchronous, through a shared directory or the Hugging Face Hub, options
``DiLoCoOptions``) and ``mode: collective`` (synchronous over torch.distributed, options
``CollectiveDiLoCoOptions``). Each option is one annotated field
(``speedtronic.config.declare``); options both modes have are declared once in the groups
they inherit (``OuterLoopOptions``, ``_DeltaOptions``), and the schemas are derived from the
dataclasses. Config validation checks a ``callbacks:`` entry against that schema plus the
cross-field rules (``hub_option_problems``), once; the options object is then built from the
validated data without another check. Options built in Python (``DiLoCoOptions(...)``,
``from_mapping``) are checked by the same schema and rules, once.

The 2.0 ``distributed:`` section (aliases ``hub:`` and ``diloco:``) belongs to this plugin
as well; its keys and their mapping onto these options are in ``distributed_section``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal, cast

from jsonschema import Draft202012Validator

from speedtronic.config.declare import Opt, build, object_schema
from speedtronic.plugins import JSONSchema
from speedtronic_callbacks.diloco.aggregation import RobustSettings
from speedtronic_callbacks.diloco.codec import Codec
from speedtronic_callbacks.diloco.codecs import CodecName, codec_named
from speedtronic_callbacks.diloco.master import NODE_ID_PATTERN

__all__ = [
    "COLLECTIVE_OPTIONS_SCHEMA",
    "HUB_OPTIONS_SCHEMA",
    "OPTIONS_SCHEMA",
    "CollectiveDiLoCoOptions",
    "HubRequestOptions",
    "OuterLoopOptions",
    "delta_encoding",
    "encoding_problems",
    "streaming_problems",
    "DiLoCoOptions",
    "hub_option_problems",
    "is_number",
    "robust_settings",
]

logger = logging.getLogger("speedtronic.diloco")

_OutlierPolicy = Literal["clip", "reject", "off"]


# -- the options, each declared once -----------------------------------------------------
# Groups of options that several declarations share are base dataclasses: the hub mode,
# the collective mode and the 2.0 section each inherit the groups they have.


@dataclass(frozen=True)
class OuterLoopOptions:
    """The outer loop: how often the nodes synchronise, and the outer Nesterov step (the
    same in hub mode, collective mode and the 2.0 section)."""

    inner_steps: Annotated[
        int, Opt("H: local optimizer steps between two synchronisations", minimum=1)
    ] = 500
    outer_lr: Annotated[float, Opt("the outer Nesterov learning rate", exclusive_minimum=0)] = 0.7
    outer_momentum: Annotated[
        float, Opt("the outer Nesterov momentum", minimum=0, exclusive_maximum=1)
    ] = 0.9


@dataclass(frozen=True)
class HubRequestOptions:
    """How a node talks to its hub (hub mode and the 2.0 section)."""

    poll_interval: Annotated[
        float,
        Opt(
            "workers: seconds between polls for a new global (they also poll at every "
            "upload); master: seconds between rounds",
            exclusive_minimum=0,
        ),
    ] = 60.0
    retry_attempts: Annotated[int, Opt("tries per hub request, the first included", minimum=1)] = 6
    retry_initial: Annotated[
        float, Opt("the first backoff, seconds (jittered, exponential)", exclusive_minimum=0)
    ] = 1.0
    retry_max: Annotated[
        float, Opt("the longest backoff, seconds; at least `retry_initial`", exclusive_minimum=0)
    ] = 60.0


@dataclass(frozen=True)
class _DeltaOptions:
    """How pseudo-gradients travel and are combined (both modes; see docs/distributed.md,
    "Delta encodings", "Robust aggregation" and "Streaming")."""

    reset_optimizer: Annotated[
        bool, Opt("clear the inner optimizer state when a newer global model is installed")
    ] = True
    compression: Annotated[
        Literal["none", "bf16", "fp16"],
        Opt("`delta_dtype`'s older name (`none` = `fp32`, `bf16`, `fp16`); set one of the two"),
    ] = "none"
    delta_dtype: Annotated[
        CodecName | None,
        Opt(
            "pseudo-gradient encoding on the wire and in hub files: `fp32`, `bf16`/`fp16` (1/2 "
            "the bytes), `int8` (per-block scale, ~1/3.8), `fp4` (e2m1 with a per-block scale, "
            "~1/7.1); `null`: what `compression` says. The outer step is float32 (see [delta "
            "encodings](distributed.md#delta-encodings))"
        ),
    ] = None
    error_feedback: Annotated[
        bool,
        Opt(
            "carry what a lossy `delta_dtype` dropped into the next round's pseudo-gradient "
            "(kept in the checkpoint), so nothing is lost over time"
        ),
    ] = True
    outlier_policy: Annotated[
        _OutlierPolicy,
        Opt(
            "a pseudo-gradient whose norm -- or claimed work -- exceeds `outlier_factor` × the "
            "median of the recent ones is scaled down to that bound (`clip`) or left out "
            "(`reject`); `off` disables it (see [robust "
            "aggregation](distributed.md#robust-aggregation-and-work-weighting))"
        ),
    ] = "clip"
    outlier_factor: Annotated[
        float,
        Opt(
            "how many times the recent median norm a pseudo-gradient may reach", exclusive_minimum=1
        ),
    ] = 10.0
    outlier_window: Annotated[
        int, Opt("how many recent pseudo-gradient norms the median is taken over", minimum=1)
    ] = 16
    weight_by_work: Annotated[
        bool,
        Opt(
            "weight each pseudo-gradient by the tokens (else samples) trained for it, relative "
            "to the round's mean (with the staleness weight in hub mode)"
        ),
    ] = True
    fragments: Annotated[
        int,
        Opt(
            "P: the model's blocks are split into P strided fragments, each synchronised every "
            "`inner_steps` steps at its own offset (1: the whole model at once, plain "
            "DiLoCo); at most the number of blocks (see "
            "[streaming](distributed.md#streaming-fragments-and-overlapped-exchanges))",
            minimum=1,
        ),
    ] = 1


@dataclass(frozen=True)
class DiLoCoOptions(_DeltaOptions, HubRequestOptions, OuterLoopOptions):
    """Options of the ``diloco`` callback in ``mode: hub``, each declared once (the schema
    ``HUB_OPTIONS_SCHEMA`` is derived from them). ``None`` means "not set". Built from
    Python, the values are checked against the schema and ``hub_option_problems``; a problem
    is a ``ValueError``. Built from a validated config (``declare.build``) nothing is checked
    again."""

    role: Annotated[
        Literal["master", "worker"],
        Opt("`master`: trains and runs the outer loop (one per hub); `worker`: trains and syncs"),
    ] = "worker"
    node_id: Annotated[
        str | None,
        Opt(
            "unique node name: letters, digits, `.`, `_`, `-` (64 max)",
            schema={"type": "string"},
            pattern=NODE_ID_PATTERN.pattern,
            default_text="`$SPEEDTRONIC_NODE_ID`, else `<host>-<pid>`",
        ),
    ] = None
    hub_dir: Annotated[
        str | None,
        Opt(
            "a shared directory used as the hub (local disk or network file system); exactly "
            "one of `hub_dir` and `repo_id`",
            schema={"type": "string"},
            min_length=1,
        ),
    ] = None
    repo_id: Annotated[
        str | None,
        Opt(
            "a Hugging Face Hub model repository `owner/name` used as the hub (needs the `hub` "
            "extra)",
            schema={"type": "string"},
            pattern=r"^[^/\s]+/[^/\s]+$",
        ),
    ] = None
    token_env: Annotated[
        str,
        Opt(
            "the environment variable holding the Hub token (never put tokens in config files)",
            min_length=1,
        ),
    ] = "HF_TOKEN"
    private_repo: Annotated[bool, Opt("the master creates the Hub repository as private")] = True
    request_timeout: Annotated[
        float,
        Opt(
            "give up waiting for one hub request after this many seconds; keep it above the "
            "slowest full-model transfer",
            exclusive_minimum=0,
        ),
    ] = 600.0
    staleness_power: Annotated[
        float,
        Opt(
            "a delta `s` outer steps stale counts `(1 + s) ** -power`; 0 weighs all equally",
            minimum=0,
        ),
    ] = 0.5
    max_staleness: Annotated[
        int | None,
        Opt("reject deltas more than this many outer steps stale (`null`: never)", minimum=0),
    ] = None
    max_step_tokens: Annotated[
        int | None,
        Opt(
            "master, `weight_by_work`: the most tokens one optimizer step of any node trains; "
            "a delta's claimed tokens count at most `inner_steps` (and its own steps) times "
            "this (`null`: the master's own tokens per step, measured)",
            minimum=1,
        ),
    ] = None
    max_step_samples: Annotated[
        int | None,
        Opt(
            "the same cap in samples, for deltas that report no tokens (`null`: the master's "
            "own samples per step)",
            minimum=1,
        ),
    ] = None
    signing_secret_env: Annotated[
        str | None,
        Opt(
            "an environment variable with a shared secret: files are signed (HMAC-SHA256) and "
            "unsigned or wrongly signed files are rejected (see "
            "[security](distributed.md#security-model))",
            min_length=1,
        ),
    ] = None
    delete_applied_deltas: Annotated[
        bool, Opt("the master removes deltas from the hub once applied")
    ] = True
    keep_global_versions: Annotated[
        int, Opt("global model versions kept on the hub", minimum=1)
    ] = 2
    shutdown_timeout: Annotated[
        float,
        Opt(
            "seconds an upload in flight may take to finish at the end of a fit",
            exclusive_minimum=0,
        ),
    ] = 5.0
    node_index: Annotated[
        int | None,
        Opt(
            "this node's index, for data seeding and sharding (see "
            "[data](distributed.md#each-node-its-own-data))",
            minimum=0,
        ),
    ] = None
    num_nodes: Annotated[
        int | None, Opt("the number of data shards (with `node_index`)", minimum=1)
    ] = None
    audit_log: Annotated[
        bool,
        Opt("the master appends every round to `<output_dir>/diloco/rounds-<node>.jsonl`"),
    ] = True
    token: Annotated[
        str | None,
        Opt(
            "the hub token (2.0's `distributed.token`; redacted in saved configs). Prefer "
            "`token_env`: a token in a config file is easy to leak",
            min_length=1,
        ),
    ] = field(default=None, repr=False)

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
        """Build from a mapping of options given from Python (``mode: hub`` allowed); a
        ``ValueError`` lists every problem, unknown keys included."""
        values = {key: value for key, value in options.items() if key != "mode"}
        names = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"diloco: unknown option(s) {unknown}")
        problems = hub_option_problems(values)
        if problems:
            raise ValueError("diloco: " + "; ".join(problems))
        return build(cls, values)  # checked just now: not again by __post_init__


HUB_OPTIONS_SCHEMA: JSONSchema = object_schema(
    DiLoCoOptions, extra={"not": {"required": ["hub_dir", "repo_id"]}}
)
"""Hub mode's options (a shared directory or the Hugging Face Hub)."""


@dataclass(frozen=True)
class CollectiveDiLoCoOptions(_DeltaOptions, OuterLoopOptions):
    """Options of the ``diloco`` callback in ``mode: collective`` (synchronous DiLoCo), each
    declared once (``COLLECTIVE_OPTIONS_SCHEMA`` is derived from them). Built from Python,
    the values are checked against that schema; a problem is a ``ValueError``."""

    mode: Annotated[
        Literal["collective"],
        Opt(
            "synchronous DiLoCo over torch.distributed collectives", schema={"const": "collective"}
        ),
    ] = "collective"
    ranks_per_replica: Annotated[
        int,
        Opt(
            "consecutive ranks forming one model replica (DDP inside it); must divide the "
            "world size",
            minimum=1,
        ),
    ] = 1
    sync_timeout_s: Annotated[
        float | None,
        Opt(
            "the timeout of the outer all-reduce (`null`: `distributed.timeout_s`); give slow "
            "links or large models more time than the per-step collectives",
            exclusive_minimum=0,
        ),
    ] = None
    overlap_steps: Annotated[
        int,
        Opt(
            "tau: a fragment's exchange runs in the background and is applied this many inner "
            "steps after it started, keeping the local progress made meanwhile (0: blocking); "
            "below `inner_steps / fragments`",
            minimum=0,
        ),
    ] = 0

    def __post_init__(self) -> None:
        problems = _collective_option_problems(dataclasses.asdict(self))
        if problems:
            raise ValueError("diloco (collective): " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, options: Mapping[str, object]) -> CollectiveDiLoCoOptions:
        """Build from a mapping of options given from Python; a ``ValueError`` lists every
        problem, unknown keys included."""
        unknown = sorted(set(options) - {item.name for item in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"diloco (collective): unknown option(s) {unknown}")
        problems = _collective_option_problems(options)
        if problems:
            raise ValueError("diloco (collective): " + "; ".join(problems))
        return build(cls, options)  # checked just now: not again by __post_init__


COLLECTIVE_OPTIONS_SCHEMA: JSONSchema = object_schema(CollectiveDiLoCoOptions)
"""Collective mode's options (torch.distributed all-reduce)."""


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


def delta_encoding(options: DiLoCoOptions | CollectiveDiLoCoOptions) -> Codec:
    """The codec ``options`` choose: ``delta_dtype``, else ``compression``."""
    return codec_named(options.delta_dtype or options.compression)


def robust_settings(options: DiLoCoOptions | CollectiveDiLoCoOptions) -> RobustSettings:
    """The outlier rule ``options`` choose."""
    return RobustSettings(options.outlier_policy, options.outlier_factor, options.outlier_window)


def _hub_cross_field_problems(values: Mapping[str, object]) -> Iterator[str]:
    if ("hub_dir" in values) == ("repo_id" in values):
        yield "hub_dir: set exactly one of hub_dir (shared directory) or repo_id (HF Hub)"
    initial, maximum = values.get("retry_initial", 1.0), values.get("retry_max", 60.0)
    if isinstance(initial, (int, float)) and isinstance(maximum, (int, float)):
        if is_number(initial) and is_number(maximum) and maximum < initial:
            yield f"retry_max: {maximum:g} is less than retry_initial ({initial:g})"
    index, count = values.get("node_index"), values.get("num_nodes")
    if count is not None and index is None:
        yield "num_nodes: needs node_index"
    if isinstance(index, int) and isinstance(count, int) and _is_int(index) and _is_int(count):
        if not index < count:
            yield f"node_index: {index} is not below num_nodes {count}"


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_COLLECTIVE_VALIDATOR = Draft202012Validator(COLLECTIVE_OPTIONS_SCHEMA)


def _collective_option_problems(values: Mapping[str, object]) -> list[str]:
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
