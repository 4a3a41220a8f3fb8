"""The callbacks of a run: which plugins a config turns on, in which order and with which
options (``callback_specs``; each plugin rewrites its own sections into its options, and no
plugin is named here), building them (``build_callbacks``), and what they ask of the rest of
the run: the data shard a node reads (``data_shard``), the optimizer's decay of norms and
biases (``optimizer_section``) and the checkpoints to resume from (``resume_source``).
``speedtronic.runtime`` composes the run from them (and re-exports these names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol, cast, runtime_checkable

from speedtronic.config import CallbackSpec, JSONValue, SpeedtronicConfig
from speedtronic.config.sections import OptimizerConfig
from speedtronic.engine.callback import Callback
from speedtronic.plugins import (
    PluginContext,
    build_callback,
    configurable_specs,
    plugin_spec,
    sections_of,
)
from speedtronic.state.resume import ResumeSource
from speedtronic.systems.distributed import DistributedContext
from speedtronic.systems.tensor_parallel import data_parallel_share

__all__ = [
    "ShardsData",
    "build_callbacks",
    "callback_classes",
    "callback_specs",
    "data_shard",
    "optimizer_section",
    "resume_source",
]


def callback_specs(config: SpeedtronicConfig) -> list[CallbackSpec]:
    """The callbacks a run uses, in order: the plugins the config turns on without naming
    them (on by default, or through a section they read) with a negative ``implied_order``,
    the configured list, then the other implied plugins. Each plugin rewrites its own
    sections into its options (``Sections.to_options``); the runtime knows no plugin by
    name."""
    data = config.to_dict()
    configured = [_with_sections(entry, data) for entry in config.callbacks]
    named = {entry.name for entry in config.callbacks}
    implied: list[tuple[int, str, CallbackSpec]] = []
    for plugin in configurable_specs():
        if plugin.name in named or named.intersection(plugin.default_replaced_by):
            continue
        options = plugin.options_for(sections_of(plugin, data), None)
        if options is not None:
            implied.append((plugin.implied_order, plugin.name, _spec(plugin.name, options)))
    implied.sort(key=lambda item: (item[0], item[1]))
    before = [entry for order, _, entry in implied if order < 0]
    after = [entry for order, _, entry in implied if order >= 0]
    return before + configured + after


def _with_sections(entry: CallbackSpec, data: Mapping[str, object]) -> CallbackSpec:
    """A configured entry with what its plugin takes from the sections it reads."""
    plugin = plugin_spec(entry.name)
    if not plugin.sections.keys:
        return entry
    options = plugin.options_for(sections_of(plugin, data), entry.options)
    return entry if options is None else _spec(entry.name, options)


def _spec(name: str, options: Mapping[str, object]) -> CallbackSpec:
    return CallbackSpec(name=name, options=cast("dict[str, JSONValue]", dict(options)))


def build_callbacks(config: SpeedtronicConfig, context: PluginContext) -> list[Callback]:
    """Instantiate every callback of ``callback_specs`` (options already validated)."""
    return [build_callback(spec.name, spec.options, context) for spec in callback_specs(config)]


def callback_classes(config: SpeedtronicConfig) -> list[tuple[str, type[Callback]]]:
    """The callback classes of a run, without building them (for ``validate``)."""
    return [(entry.name, plugin_spec(entry.name).callback) for entry in callback_specs(config)]


@runtime_checkable
class ShardsData(Protocol):
    """A callback that trains on one shard of the data (a node of a hub-synchronised run, say)."""

    @property
    def data_shard(self) -> tuple[int, int] | None: ...


def data_shard(
    callbacks: Sequence[Callback], distributed: DistributedContext | None, tensor: int = 1
) -> tuple[int, int]:
    """``(index, count)`` of the data this process reads: the shard a callback (a node of a
    hub-synchronised run) asks for, split once more by the torch.distributed rank when the
    node itself has several ranks; else the rank's share, or all of it. The ``tensor``
    ranks of one tensor-parallel group read the same share (their data rank's)."""
    ranks = (
        data_parallel_share(distributed.rank, distributed.world_size, tensor)
        if distributed is not None and distributed.world_size > 1
        else (0, 1)
    )
    for callback in callbacks:
        if isinstance(callback, ShardsData) and callback.data_shard is not None:
            index, count = callback.data_shard
            return index * ranks[1] + ranks[0], count * ranks[1]
    return ranks


def optimizer_section(section: OptimizerConfig, callbacks: Sequence[Callback]) -> OptimizerConfig:
    """``section`` with ``decay_norms_and_biases: null`` resolved: the first callback's
    proposal (``Callback.optimizer_decay_norms_and_biases``), else left null (= true)."""
    if section.decay_norms_and_biases is not None:
        return section
    for callback in callbacks:
        proposal = callback.optimizer_decay_norms_and_biases
        if proposal is not None:
            return dataclasses.replace(section, decay_norms_and_biases=proposal)
    return section


def resume_source(callbacks: Sequence[Callback]) -> ResumeSource | None:
    """The first callback that knows the run's checkpoints (the checkpoint plugin)."""
    for callback in callbacks:
        if isinstance(callback, ResumeSource):
            return callback
    return None
