"""The ``checkpoint`` plugin's options (``CheckpointOptions``, each declared once) and its
``checkpoint:`` section: which keys it has, how they become the options, and the checks of
the credentials they must not hold."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated

from speedtronic.config.declare import Opt, object_schema
from speedtronic.plugins import JSONSchema, PluginOptions, SectionData, section_of
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic_callbacks.checkpoint_remote import credential_errors, url_credential_errors
from speedtronic_callbacks.monitor import Mode

__all__ = ["CheckpointOptions", "options_errors", "options_from_section", "section_errors"]

DEFAULT_DIRECTORY = "checkpoints"
"""The checkpoint directory, under the run's output directory, when none is given."""

_MANAGER = inspect.signature(CheckpointManager).parameters
"""``CheckpointManager``'s own defaults (its 2.0 signature, ``every_steps=500,
keep_last=3``): the options of the same names take them, so each value is written once."""


@dataclass(frozen=True)
class CheckpointOptions:
    """The ``checkpoint`` plugin's options, one field each. The ``checkpoint:`` section holds
    the same keys (all but ``save_final``); its values are the defaults of a ``callbacks:``
    entry's options."""

    directory: Annotated[
        str,
        Opt("where checkpoints go; a relative path is under `run.output_dir`", min_length=1),
    ] = DEFAULT_DIRECTORY
    every_steps: Annotated[
        int,
        Opt(
            "save after every step that is a multiple of this (and at the end of a successful fit)",
            minimum=1,
        ),
    ] = _MANAGER["every_steps"].default
    keep_last: Annotated[
        int | None, Opt("keep the newest N checkpoints; `null` keeps all", minimum=1)
    ] = _MANAGER["keep_last"].default
    enabled: Annotated[
        bool,
        Opt(
            "`false` saves nothing (the callback stays inert); in the `checkpoint:` section "
            "it also leaves the plugin out unless `callbacks:` names it"
        ),
    ] = _MANAGER["enabled"].default
    save_final: Annotated[
        bool,
        Opt(
            "save at the end of a successful fit unless the last step was just saved "
            "(an option only, not a key of the `checkpoint:` section)"
        ),
    ] = True
    save_on_exception: Annotated[bool, Opt("best-effort save when the fit fails (see below)")] = (
        False
    )
    save_on_signal: Annotated[
        bool,
        Opt("SIGTERM/SIGINT: stop after the current step, save, exit for requeue"),
    ] = True
    async_save: Annotated[
        bool,
        Opt("snapshot to CPU memory, write on a background thread (see below)"),
    ] = False
    resume: Annotated[
        bool,
        Opt(
            "resume from the newest checkpoint before the fit, like `--resume`; warns and "
            "starts fresh when there is none"
        ),
    ] = False
    load_callback_state: Annotated[bool, Opt("on resume, restore every callback's saved state")] = (
        True
    )
    monitor: Annotated[
        str | None,
        Opt(
            "a metric key (`eval/loss`, `loss`, ...): save a checkpoint whenever it improves "
            "and name the best in `best.json` (see "
            "[evaluation](evaluation.md#the-best-checkpoint)); an `eval/*` key needs "
            "`eval.every_steps`",
            min_length=1,
        ),
    ] = None
    mode: Annotated[
        Mode, Opt("whether lower (`min`) or higher (`max`) monitored values are better")
    ] = "min"
    every_minutes: Annotated[
        float | None,
        Opt(
            "also save when this many minutes passed since the last save (wall clock; see "
            "[cluster runs](cluster-runs.md)); `null`: by steps only",
            exclusive_minimum=0,
            maximum=527040,
        ),
    ] = None
    remote: Annotated[
        str | None,
        Opt(
            "fsspec URL (`s3://bucket/run1`, `gs://...`, `file://...`) every committed "
            "checkpoint is uploaded to in the background; `--resume` downloads a newer one "
            "from it; needs the `remote` extra; `null`: local only",
            min_length=1,
        ),
    ] = None
    remote_options: Annotated[
        dict[str, object],
        Opt(
            "fsspec storage options for `remote` (s3fs: `endpoint_url`, `client_kwargs`, "
            "`config_kwargs`, ...); credentials come from the environment, never from here",
            schema={"type": "object"},
        ),
    ] = field(default_factory=dict)
    remote_attempts: Annotated[
        int,
        Opt(
            "tries per store operation (exponential backoff with jitter: up to 1 s, 2 s, "
            "4 s, ... at most 30 s apart) before an upload counts as failed",
            minimum=1,
            maximum=100,
        ),
    ] = 5
    remote_final_wait_s: Annotated[
        float,
        Opt(
            "seconds the end of a fit waits for the last uploads to `remote` before it "
            "gives up (the checkpoints stay local); a SIGTERM ends the wait at once",
            minimum=0,
            maximum=86400,
        ),
    ] = 600.0


_OPTIONS_ONLY = ("save_final",)
"""Options that are not keys of the ``checkpoint:`` section."""

CHECKPOINT_SECTION_SCHEMA: JSONSchema = {
    "title": "checkpoint",
    "description": "Checkpointing (read by the checkpoint plugin: the defaults of its options).",
    **object_schema(CheckpointOptions, exclude=_OPTIONS_ONLY),
}
"""The ``checkpoint:`` section, which this plugin reads (``options_from_section``)."""

SECTION_KEYS = tuple(
    key for key in CheckpointOptions.__dataclass_fields__ if key not in _OPTIONS_ONLY
)
"""Keys of the ``checkpoint:`` section (each an option of this plugin too)."""


def options_from_section(
    sections: SectionData, options: Mapping[str, object] | None
) -> PluginOptions | None:
    """The ``checkpoint:`` section's keys are the defaults of the options; a disabled
    section leaves the plugin out unless ``callbacks:`` names it."""
    values = section_of(sections, "checkpoint")
    if options is None and values.get("enabled", True) is False:
        return None
    merged: PluginOptions = {key: values[key] for key in SECTION_KEYS if key in values}
    merged.update(options or {})
    return merged


def section_errors(sections: SectionData) -> Iterator[str]:
    """No credentials in ``checkpoint.remote_options`` or ``checkpoint.remote``'s URL
    (``checkpoint_remote.credential_errors``, ``url_credential_errors``)."""
    section = section_of(sections, "checkpoint")
    yield from url_credential_errors("checkpoint.remote", section.get("remote"))
    yield from credential_errors("checkpoint.remote_options", section.get("remote_options"))


def options_errors(
    entry: str, options: Mapping[str, object], sections: SectionData
) -> Iterator[str]:
    """No credentials in a ``callbacks:`` entry's ``remote_options`` or ``remote`` URL."""
    del sections
    yield from url_credential_errors(f"{entry}.remote", options.get("remote"))
    yield from credential_errors(f"{entry}.remote_options", options.get("remote_options"))


NO_REMOTE_OPTIONS: Mapping[str, object] = MappingProxyType({})
"""The constructor's default ``remote_options`` (read-only: a default is shared)."""
