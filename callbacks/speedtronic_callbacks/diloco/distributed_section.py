"""The 2.0 ``distributed:`` section (aliases ``hub:`` and ``diloco:``), which belongs to
the ``diloco`` plugin: ``DistributedSectionKeys`` declares its keys (each once),
``distributed_section_problems`` its cross-field rules, and
``options_from_distributed_section`` rewrites it into ``DiLoCoOptions`` values -- the one
place that mapping lives. ``normalise_distributed_section`` redacts the token before a
config is saved."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal, Protocol

from speedtronic.config.declare import Opt, default_of, defaults_of, object_schema
from speedtronic.plugins import JSONSchema
from speedtronic_callbacks.diloco.options import (
    DiLoCoOptions,
    HubRequestOptions,
    OuterLoopOptions,
    is_number,
)

__all__ = [
    "DISTRIBUTED_SECTION_SCHEMA",
    "REDACTED",
    "DistributedSection",
    "DistributedSectionKeys",
    "distributed_section_problems",
    "normalise_distributed_section",
    "options_from_distributed_section",
]


@dataclass(frozen=True)
class DistributedSectionKeys(HubRequestOptions, OuterLoopOptions):
    """The keys the plugin adds to the 2.0 ``distributed:`` section (aliases ``hub:`` and
    ``diloco:``), each declared once (the core declares ``timeout_s``, the torch.distributed
    collective timeout, which every distributed run uses)."""

    enabled: Annotated[
        bool,
        Opt(
            "take part in DiLoCo; needs exactly one of `repo_id` / `hub_dir`, and "
            "`mode: dumb_diloco`"
        ),
    ] = False
    mode: Annotated[Literal["dumb_diloco", "single"], Opt("the 2.0 coordination mode")] = (
        "dumb_diloco"
    )
    role: Annotated[
        Literal["single", "master", "worker"],
        Opt(
            "left `single` on an enabled node it becomes `master` (an enabled node always names "
            "a hub), so workers must say `role: worker`"
        ),
    ] = "single"
    node_id: Annotated[
        str | None,
        Opt(
            "this node's id, stripped; not blank, not `.`/`..`, no `/` or `\\`; `null`: "
            "`HF_USERNAME`, then `USER`, then `local`"
        ),
    ] = None
    collaborators: Annotated[
        list[str],
        Opt(
            "2.0: hub users the master granted write access. Not supported: a non-empty list on "
            "an enabled section is a validation error (grant access on the Hub itself)",
            items={"minLength": 1},
        ),
    ] = field(default_factory=list)
    repo_id: Annotated[str | None, Opt("the Hugging Face repository of the hub", min_length=1)] = (
        None
    )
    hub_dir: Annotated[
        str | None, Opt("a shared directory used as the hub instead", min_length=1)
    ] = None
    token: Annotated[
        str | None,
        Opt(
            "hub token, used instead of `$HF_TOKEN` -- a secret (redacted when saved); prefer "
            "the environment variable"
        ),
    ] = None
    cache_dir: Annotated[
        str,
        Opt(
            "2.0's download cache; downloads now stay in memory, so another value on an "
            "enabled section is a validation error",
            min_length=1,
        ),
    ] = ".speedtronic/hub"
    state_dir: Annotated[
        str,
        Opt(
            "2.0's coordinator state directory; the state is now in the trainer checkpoint, so "
            "another value on an enabled section is a validation error (set "
            "`checkpoint.directory`)",
            min_length=1,
        ),
    ] = ".speedtronic/diloco"
    reset_inner_optimizer: Annotated[
        bool, Opt("clear the inner optimizer state after adopting new global weights")
    ] = DiLoCoOptions.reset_optimizer
    async_delta_upload: Annotated[
        bool,
        Opt(
            "upload deltas on a background lane (always; `false` on an enabled section is a "
            "validation error -- synchronous DiLoCo is `mode: collective`)"
        ),
    ] = True
    delta_upload_queue_size: Annotated[Literal[1], Opt("pending uploads (only 1 is supported)")] = 1
    delta_upload_overflow: Annotated[
        Literal["skip"], Opt("a delta produced while one is pending is skipped")
    ] = "skip"
    delta_upload_shutdown_timeout: Annotated[
        float, Opt("seconds to wait for each background lane at stop", exclusive_minimum=0)
    ] = DiLoCoOptions.shutdown_timeout
    async_global_poll: Annotated[
        bool,
        Opt(
            "poll for global weights on a background lane (always; `false` on an enabled "
            "section is a validation error)"
        ),
    ] = True


DISTRIBUTED_SECTION_SCHEMA: JSONSchema = {
    "title": "distributed",
    "description": "2.0 asynchronous DiLoCo through a shared hub (read by the diloco plugin; "
    "'hub' and 'diloco' are aliases of this section).",
    **object_schema(DistributedSectionKeys),
}
"""The keys the plugin adds to the 2.0 ``distributed:`` section."""


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
_UNSUPPORTED_2_0_KEYS: dict[str, tuple[object, str]] = {
    "collaborators": (
        default_of(DistributedSectionKeys, "collaborators"),
        "the master does not grant access: add the nodes' accounts as members of the "
        "repository's organization (or give them a write token) on the Hub itself",
    ),
    "cache_dir": (
        DistributedSectionKeys.cache_dir,
        "there is no download cache: global models and deltas are read into memory; remove the key",
    ),
    "state_dir": (
        DistributedSectionKeys.state_dir,
        "the node's state (baseline, unsent work, the master's outer state) is saved in the "
        "trainer checkpoint; set checkpoint.directory instead",
    ),
    "async_delta_upload": (
        DistributedSectionKeys.async_delta_upload,
        "uploads always run on a bounded background lane and never block training; remove "
        "the key (" + _SYNC_INSTEAD + ")",
    ),
    "async_global_poll": (
        DistributedSectionKeys.async_global_poll,
        "polls always run on a background lane; remove the key (" + _SYNC_INSTEAD + ")",
    ),
}
"""2.0 ``distributed:`` keys with no counterpart: ``(the value that means what this plugin
does anyway, what to use instead)``. Any other value is refused when the section is enabled."""


def _unsupported_keys(section: Mapping[str, object]) -> Iterator[str]:
    for key, (accepted, instead) in _UNSUPPORTED_2_0_KEYS.items():
        value = section.get(key, accepted)
        if value != accepted:
            yield f"distributed.{key}: {value!r} is not supported: {instead}"


def _section_defaults() -> dict[str, object]:
    return defaults_of(DistributedSectionKeys)


def distributed_section_problems(section: Mapping[str, object]) -> Iterator[str]:
    """Cross-field rules of the 2.0 ``distributed:`` section (defaults filled in)."""
    initial, maximum = section.get("retry_initial"), section.get("retry_max")
    if is_number(initial) and is_number(maximum):
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
