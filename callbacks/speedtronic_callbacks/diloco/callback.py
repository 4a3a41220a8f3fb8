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

Evaluation: when the run evaluates (``eval_every`` set), every node's ``eval/loss`` and
``eval/ppl`` are its *local* model's, as in any run. The master additionally evaluates each
new global model right after installing it (at that moment its weights are exactly the
global model) through ``trainer.evaluate()``, which leaves the RNG and the data position
alone, and puts the result into the next metric record as ``diloco/eval_global/loss``,
``diloco/eval_global/ppl`` and ``diloco/eval_global/outer_step`` (the outer step evaluated).

The original ``distributed:`` config section still works: the plugin's spec declares it
(``Sections``) and, when it is enabled, ``options_from_section`` rewrites it into options
(``options.options_from_distributed_section``); explicit options win. The plugin's builder
picks the callback class for the ``mode`` option (``build_diloco`` from a mapping given in
Python), so ``DiLoCoCallback.from_options`` only ever builds a ``DiLoCoCallback``.

A worker node may be a multi-rank torchrun job (DDP inside the node): only rank 0 builds
the ``DiLoCoNode`` and talks to the hub; after every optimizer step it broadcasts whether it
installed a global model, and on an install broadcasts the model's state, so every rank
installs at the same step (``_agree_on_install``; docs/scale-out.md "DiLoCo nodes that are
torchrun jobs"). A master, or FSDP inside a node, under several ranks is refused at setup.

Per-node data: ``data_seed_offset`` (the ``node_index`` option, else a stable hash of the
node id) is meant to be added to the data seed, and ``data_shard`` (``node_index``,
``num_nodes``) to pick a shard, so that workers do not all train on identical batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import Self

from speedtronic.config.declare import attach, build
from speedtronic.config.system_sections import DistributedConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    CoordinateContext,
    FitContext,
    MetricsContext,
    TeardownContext,
)
from speedtronic.engine.evaluation import EVAL_LOSS, EVAL_PPL
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS
from speedtronic.plugins import (
    PluginContext,
    PluginOptions,
    PluginSpec,
    SectionData,
    Sections,
    keys_of,
    section_of,
)
from speedtronic.systems.distributed import DistributedContext, SameOnEveryRankError
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo
from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.distributed_section import (
    DISTRIBUTED_SECTION_SCHEMA,
    DistributedSection,
    DistributedSectionKeys,
    distributed_section_problems,
    normalise_distributed_section,
    options_from_distributed_section,
)
from speedtronic_callbacks.diloco.eval_keys import (
    GLOBAL_EVAL_LOSS,
    GLOBAL_EVAL_OUTER_STEP,
    GLOBAL_EVAL_PPL,
)
from speedtronic_callbacks.diloco.hub_transport import HubTransport
from speedtronic_callbacks.diloco.lanes import ErrorReporter
from speedtronic_callbacks.diloco.master import NODE_ID_PATTERN, MasterLoop, MasterSettings
from speedtronic_callbacks.diloco.model_layout import ModelLayout, build_layout
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.options import (
    OPTIONS_SCHEMA,
    CollectiveDiLoCoOptions,
    DiLoCoOptions,
    delta_encoding,
    encoding_problems,
    hub_option_problems,
    robust_settings,
    streaming_problems,
)
from speedtronic_callbacks.diloco.transport_base import RetryingTransport, RetryPolicy, Transport

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = [
    "GLOBAL_EVAL_LOSS",
    "GLOBAL_EVAL_OUTER_STEP",
    "GLOBAL_EVAL_PPL",
    "DiLoCoCallback",
    "DiLoCoOptions",
    "DistributedSection",
    "build_diloco",
    "options_from_distributed_section",
]

logger = logging.getLogger("speedtronic.diloco")

_GLOBAL_EVAL_STATE = "eval_global"


def default_node_id() -> str:
    """``$SPEEDTRONIC_NODE_ID``, else ``<hostname>-<pid>``, made a valid node id."""
    raw = os.environ.get("SPEEDTRONIC_NODE_ID") or f"{socket.gethostname()}-{os.getpid()}"
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).strip(".-_")[:64] or "node"
    return cleaned if NODE_ID_PATTERN.match(cleaned) else f"n{cleaned}"[:64]


def build_diloco(options: Mapping[str, object]) -> DiLoCoCallback | CollectiveDiLoCo:
    """The ``diloco`` plugin's callback for options given from Python (checked here):
    ``CollectiveDiLoCo`` for ``mode: collective``, else a hub-mode ``DiLoCoCallback``."""
    if options.get("mode") == "collective":
        return CollectiveDiLoCo(CollectiveDiLoCoOptions.from_mapping(options))
    return DiLoCoCallback(DiLoCoOptions.from_mapping(options))


def _parse_options(options: Mapping[str, object]) -> DiLoCoOptions | CollectiveDiLoCoOptions:
    """The typed options of a validated ``callbacks:`` entry (not checked again): the
    ``mode`` option picks the dataclass."""
    if options.get("mode") == "collective":
        return build(CollectiveDiLoCoOptions, options)
    return build(DiLoCoOptions, {key: value for key, value in options.items() if key != "mode"})


def _create(options: object, context: PluginContext) -> Callback:
    """The plugin's builder: each mode is its own callback class."""
    del context
    if isinstance(options, CollectiveDiLoCoOptions):
        return CollectiveDiLoCo(options)
    assert isinstance(options, DiLoCoOptions)
    return DiLoCoCallback(options)


def options_from_section(
    sections: SectionData, options: Mapping[str, object] | None
) -> PluginOptions | None:
    """An enabled 2.0 ``distributed:`` section adds the plugin in hub mode; under a
    configured hub-mode entry its keys are defaults (explicit options win)."""
    section = section_of(sections, "distributed")
    enabled = keys_of(sections, "distributed", DistributedSectionKeys).enabled is True
    if options is None:
        return options_from_distributed_section(section) if enabled else None
    if not enabled or options.get("mode") == "collective":
        return dict(options)
    return {**options_from_distributed_section(section), **options}


def _normalise_section(data: dict[str, object]) -> None:
    section = data.get("distributed")
    if isinstance(section, dict):
        normalise_distributed_section(section)


def _section_errors(sections: SectionData) -> Iterator[str]:
    return distributed_section_problems(section_of(sections, "distributed"))


def options_errors(
    entry: str, options: Mapping[str, object], sections: SectionData
) -> Iterator[str]:
    """The cross-field rules of a ``callbacks:`` entry (after the schema pass, the one check
    of its options): the collective timeout and encoding rules, or hub mode's rules on the
    entry as it will be built, with the 2.0 section's keys beneath it."""
    step_timeout = keys_of(sections, "distributed", DistributedConfig).timeout_s
    if options.get("mode") == "collective":
        yield from _collective_timeout_problems(entry, options, step_timeout)
        yield from (f"{entry}.{problem}" for problem in encoding_problems(options))
        for problem in streaming_problems(options):
            yield f"{entry}.{problem}"
        return
    if "overlap_steps" in options:
        yield (
            f"{entry}.overlap_steps: is an option of mode: collective; hub mode never waits "
            "for the hub (uploads and polls run on background lanes), so it has no overlap "
            "to set"
        )
    try:
        merged = options_from_section(sections, options) or dict(options)
    except ValueError:
        return  # a section that cannot be mapped fails when the plugin is built
    values = {key: value for key, value in merged.items() if key != "mode"}
    for problem in hub_option_problems(values, cross_field_only=True):
        yield f"{entry}.{problem}"


def _collective_timeout_problems(
    entry: str, options: Mapping[str, object], step_timeout: object
) -> Iterator[str]:
    """The outer-round timeout (``sync_timeout_s``) may not be shorter than the per-step
    collective timeout ``distributed.timeout_s``: a round all-reduces the whole model and
    waits for the slowest replica, so it is the longest collective of a run."""
    round_timeout = options.get("sync_timeout_s")
    if not (_is_number(round_timeout) and _is_number(step_timeout)):
        return
    assert isinstance(round_timeout, (int, float)) and isinstance(step_timeout, (int, float))
    if round_timeout < step_timeout:
        yield (
            f"{entry}.sync_timeout_s: {round_timeout:g} s is shorter than "
            f"distributed.timeout_s ({step_timeout:g} s); an outer round all-reduces the "
            "whole model and waits for the slowest replica, so give it at least the "
            "per-step collective timeout"
        )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_transport(options: DiLoCoOptions, inner: Transport | None = None) -> RetryingTransport:
    """The hub of ``options`` (``hub_dir`` or ``repo_id``; ``inner`` when given) with the
    options' retries and timeout."""
    if inner is None:
        if options.hub_dir is not None:
            inner = DirectoryTransport(options.hub_dir)
        else:
            assert options.repo_id is not None  # checked by DiLoCoOptions
            inner = HubTransport(
                options.repo_id,
                token_env=options.token_env,
                private=options.private_repo,
                token=options.token,
            )
    policy = RetryPolicy(
        attempts=options.retry_attempts,
        initial=options.retry_initial,
        maximum=options.retry_max,
        timeout=options.request_timeout,
    )
    return RetryingTransport(inner, policy)


def make_node(
    model: nn.Module,
    options: DiLoCoOptions,
    *,
    node_id: str,
    transport: RetryingTransport,
    secret: bytes | None,
    config_fingerprint: str = "",
    audit_path: Path | None = None,
    reporter: ErrorReporter | None = None,
    publish: Callable[[str, Mapping[str, object]], None] | None = None,
) -> DiLoCoNode:
    """The ``DiLoCoNode`` (with its ``MasterLoop`` for ``role: master``) for ``model`` and
    hub-mode ``options`` -- what the callback builds at ``setup``, and what 2.0's
    ``DumbDiLoCoCoordinator`` builds for ``Trainer(coordinator=...)``."""
    layout: ModelLayout = build_layout(model.state_dict(), config_fingerprint)
    master = None
    if options.role == "master":
        master = MasterLoop(
            transport,
            layout,
            MasterSettings(
                node_id=node_id,
                outer_lr=options.outer_lr,
                outer_momentum=options.outer_momentum,
                staleness_power=options.staleness_power,
                max_staleness=options.max_staleness,
                delete_applied=options.delete_applied_deltas,
                keep_global_versions=options.keep_global_versions,
                secret=secret,
                robust=robust_settings(options),
                weight_by_work=options.weight_by_work,
                inner_steps=options.inner_steps,
                max_step_tokens=options.max_step_tokens,
                max_step_samples=options.max_step_samples,
            ),
            audit_path=audit_path,
        )
    settings = NodeSettings(
        node_id=node_id,
        role=options.role,
        inner_steps=options.inner_steps,
        poll_interval=options.poll_interval,
        shutdown_timeout=options.shutdown_timeout,
        secret=secret,
        delta_dtype=delta_encoding(options),
        error_feedback=options.error_feedback,
        fragments=options.fragments,
    )
    return DiLoCoNode(
        model, transport, layout, settings, master=master, reporter=reporter, publish=publish
    )


# -- the callback -----------------------------------------------------------------------


class DiLoCoCallback(Callback):
    """DiLoCo synchronisation through a shared hub (see the module docstring).

    ``transport`` lets Python code supply its own ``Transport`` (tests, custom stores);
    otherwise ``hub_dir`` or ``repo_id`` chooses one.
    """

    state_key = "diloco"
    optimizer_decay_norms_and_biases: ClassVar[bool | None] = False  # docs/distributed.md
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
        self.global_eval: dict[str, int | float] | None = None
        """The master's evaluation of its newest global model, until a record takes it."""
        self._job: DistributedContext | None = None
        """The node's torchrun job when it has several ranks (rank 0 talks to the hub)."""

    @classmethod
    def build(cls, options: Mapping[str, object], context: PluginContext) -> Callback:
        """The plugin-level builder: the ``mode`` option picks the callback class."""
        return _DILOCO.create(options, context)

    @classmethod
    def from_options(cls, options: Mapping[str, object], context: PluginContext) -> Self:
        """Build from validated hub-mode options (``mode: hub`` allowed)."""
        del context
        if options.get("mode", "hub") != "hub":
            raise ValueError(
                "DiLoCoCallback is diloco's hub mode; build other modes with build_diloco"
            )
        parsed = _parse_options(options)
        assert isinstance(parsed, DiLoCoOptions)
        return cls(parsed)

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
        return make_transport(self.options, self._transport)

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
        audit = None
        if self.options.audit_log:
            audit = Path(trainer.output_dir) / "diloco" / f"rounds-{self.node_id}.jsonl"
        return make_node(
            trainer.model,
            self.options,
            node_id=self.node_id,
            transport=self._build_transport(),
            secret=self._secret(),
            config_fingerprint=self._config_fingerprint(trainer),
            audit_path=audit,
            reporter=self.reporter,
            publish=trainer.notes.publish,
        )

    # -- hooks --------------------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        if trainer.multi_rank and self.options.role == "master":
            # The master's rounds and its global-model evaluation are not split across
            # ranks. Every rank refuses alike; the CLI prints the refusal once (rank 0).
            raise SameOnEveryRankError(
                "diloco mode 'hub' with role: master runs as one process and is not supported "
                "under torchrun with several ranks; start the master without torchrun (worker "
                "nodes may be multi-rank torchrun jobs), or use mode: collective"
            )
        if trainer.multi_rank and trainer.sharded_state:
            # Rank 0 would hold only its shards of the weights the node exchanges.
            raise SameOnEveryRankError(
                "diloco mode 'hub' inside a torchrun job needs parallel.strategy: ddp (every "
                "rank holds the whole model); parallel.strategy: fsdp is not supported there"
            )
        self._job = trainer.distributed if trainer.multi_rank else None
        if self._job is not None and not self._job.is_main:
            # Only rank 0 talks to the hub; the others receive every install from it
            # (on_coordinate). The checkpointed node state is rank 0's business.
            self._staged = None
            return
        if self.node is None or self._model_id != id(trainer.model):
            self.node = self._build_node(trainer)
            self._model_id = id(trainer.model)
            logger.info(
                "diloco %s %r on %s: inner_steps=%d, fragments=%d, compression=%s",
                self.options.role,
                self.node_id,
                self.node.transport.location,
                self.options.inner_steps,
                self.options.fragments,
                self.options.compression,
            )
        if self._staged is not None:
            self.node.load_state_dict(self._staged)
            self._staged = None

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        if self.node is not None and ctx.start_step < ctx.target_step:
            self.node.start(ctx.start_step)

    def on_coordinate(self, trainer: TrainerView, ctx: CoordinateContext) -> None:
        installed: int | None = None
        if self.node is not None:
            # The node's work is its ranks' together; DDP gives each rank an equal share.
            ranks = self._job.world_size if self._job is not None else 1
            self.node.record_work(trainer.tokens * ranks, trainer.samples * ranks)
            installed = self.node.on_step(ctx.step).installed
        if self._job is not None:
            installed = _agree_on_install(self._job, trainer.model, installed)
        elif self.node is None:
            return
        if installed is None:
            return
        if self.node is not None and self.node.master is not None and trainer.eval_every > 0:
            self._evaluate_global(trainer, installed)
        if self.options.reset_optimizer:
            trainer.request_optimizer_reset("diloco")

    def _evaluate_global(self, trainer: TrainerView, outer_step: int) -> None:
        """Evaluate the global model of ``outer_step``, just installed into the model (plus
        the master's own unsent progress, set aside for the evaluation)."""
        assert self.node is not None  # only the master evaluates
        with self.node.holding_global():
            metrics = trainer.evaluate()
        self.global_eval = {
            GLOBAL_EVAL_LOSS: metrics[EVAL_LOSS],
            GLOBAL_EVAL_PPL: metrics[EVAL_PPL],
            GLOBAL_EVAL_OUTER_STEP: outer_step,
        }

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if self.node is None:
            return
        for key, value in self.node.metrics().items():
            ctx.record.set(key, value)
        pending, self.global_eval = self.global_eval, None
        if pending is not None:
            for key, value in pending.items():
                ctx.record.set(key, value)

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        if self.node is not None:
            self.node.stop()

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        state = self.node.state_dict() if self.node is not None else dict(self._staged or {})
        if self.global_eval is not None:  # evaluated, not yet in a record: resume keeps it
            state[_GLOBAL_EVAL_STATE] = dict(self.global_eval)
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        pending = state.get(_GLOBAL_EVAL_STATE)
        self.global_eval = _global_eval_from_state(pending)
        state = {key: value for key, value in state.items() if key != _GLOBAL_EVAL_STATE}
        if self.node is not None and not self.node.started:
            self.node.load_state_dict(state)
        else:
            self._staged = state


def _agree_on_install(
    job: DistributedContext, model: nn.Module, installed: int | None
) -> int | None:
    """Every step of a multi-rank node: rank 0 (the only rank with a hub connection) says
    whether it installed a global model at this step -- one tiny broadcast -- and, when it
    did, broadcasts the installed weights to every rank before any of them continues. All
    ranks return the same answer, so all of them install at the same step (and reset
    their optimizers alike). A dead or silent peer fails the broadcast after the job's
    collective timeout (``distributed.timeout_s``) instead of hanging."""
    device = job.collective_device
    flag = torch.tensor([-1 if installed is None else installed], dtype=torch.int64, device=device)
    dist.broadcast(flag, src=0)
    step = int(flag.item())
    if step < 0:
        return None
    with torch.no_grad():
        for value in model.state_dict().values():
            direct = value.device == device and value.is_contiguous()
            buffer = value if direct else value.to(device).contiguous()
            dist.broadcast(buffer, src=0)
            if not direct:
                value.copy_(buffer)
    return step


def _global_eval_from_state(value: object) -> dict[str, int | float] | None:
    """A checkpointed, not yet logged global-model evaluation (``None`` when absent)."""
    if value is None:
        return None
    keys = (GLOBAL_EVAL_LOSS, GLOBAL_EVAL_PPL, GLOBAL_EVAL_OUTER_STEP)
    if not isinstance(value, Mapping) or set(value) != set(keys):
        raise ValueError(
            f"diloco state: {_GLOBAL_EVAL_STATE!r} must map exactly {list(keys)} to numbers, "
            f"got {value!r}"
        )
    result: dict[str, int | float] = {}
    for key in keys:
        number = value[key]
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"diloco state: {_GLOBAL_EVAL_STATE}[{key!r}] is not a number")
        result[key] = number
    return result


_DILOCO = PluginSpec(
    name="diloco",
    callback=DiLoCoCallback,
    options_schema=OPTIONS_SCHEMA,
    options_type=DiLoCoOptions,
    parse=_parse_options,
    build=_create,
    sections=Sections(
        keys=("distributed",),
        schema={"distributed": DISTRIBUTED_SECTION_SCHEMA},
        declared={"distributed": DistributedSectionKeys},
        aliases={"hub": "distributed", "diloco": "distributed"},
        to_options=options_from_section,
        normalise=_normalise_section,
        errors=_section_errors,
    ),
    options_errors=options_errors,
    implied_order=20,
)
"""The ``diloco`` plugin: two modes, one name; its options schema covers both."""

attach(DiLoCoCallback, _DILOCO)
