"""``wandb``: the run in Weights & Biases, through the real ``wandb`` client.

* ``mode`` unset leaves the choice to W&B, so ``WANDB_MODE=offline`` / ``disabled`` in the
  environment is respected; set it in config to force one.
* Files go to ``<output_dir>/wandb/`` (``dir``, relative to the output directory).
* The run id is part of this callback's checkpoint state (``state_key: wandb``). A resumed
  fit calls ``wandb.init(id=<saved id>, resume="allow")`` and continues the same W&B run.
  W&B keeps a run's steps increasing: if the run had already logged steps past the resume
  point, W&B ignores the repeated steps until the run passes them.
* Each due record becomes one ``run.log(record, step=step)``; its text values (the
  ``text_samples`` callback's generations, ``text_samples/0``, ...) become one
  ``wandb.Table`` per key group (``text_samples``: columns ``step``, ``key``, ``text``).
  ``wandb.log`` waits for its service round trip (~0.2 ms), so by default the calls happen
  on a background thread and training only pays for a queue put; the queue is drained
  before ``finish()``.
* ``finish()`` always runs at teardown (exit code 1 when the fit failed).

Needs the ``logging`` extra (``pip install 'speedtronic[logging]'``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.contexts import FitContext, FitEndContext, TeardownContext
from speedtronic.plugins import PluginContext
from speedtronic.util.worker import BackgroundWorker
from speedtronic_callbacks.sink import MetricSink, Record, resolve_path

if TYPE_CHECKING:
    from types import ModuleType

    from wandb.sdk.wandb_run import Run

    from speedtronic.engine.view import TrainerView
    from speedtronic.plugins import PluginContext

_WandbMode = Literal["online", "offline", "disabled"]
_INSTALL_HINT = "the wandb sink needs wandb: pip install 'speedtronic[logging]'"


def _import_wandb() -> ModuleType:
    """``import wandb`` with an install hint when it is missing."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return wandb


_LOGIN_HINT = (
    "W&B is not logged in: run `wandb login` (or set WANDB_API_KEY), or log locally with "
    "WANDB_MODE=offline (or wandb mode: offline in the callback options)"
)


def _is_login_error(error: BaseException) -> bool:
    """Whether ``wandb.init`` failed for want of credentials (wandb's error classes differ
    between versions, so the message is what is checked)."""
    text = str(error).lower()
    return any(hint in text for hint in ("api_key", "api key", "wandb login", "not logged in"))


@dataclass(frozen=True)
class WandbOptions:
    """The ``wandb`` sink's options (``dir`` and ``id`` are the constructor's ``directory``
    and ``run_id``)."""

    project: Annotated[str | None, Opt("the W&B project (passed to `wandb.init`)")] = None
    entity: Annotated[str | None, Opt("the W&B team or user")] = None
    name: Annotated[str | None, Opt("display name of the run")] = None
    group: Annotated[str | None, Opt("the W&B run group")] = None
    tags: Annotated[list[str], Opt("run tags")] = field(default_factory=list)
    notes: Annotated[str | None, Opt("notes of the run")] = None
    mode: Annotated[
        _WandbMode | None,
        Opt(
            "`online`, `offline` or `disabled`; `null` leaves it to W&B (`WANDB_MODE` is respected)"
        ),
    ] = None
    dir: Annotated[
        str,
        Opt("parent of W&B's `wandb/` folder, relative to the output directory", min_length=1),
    ] = "."
    id: Annotated[
        str | None,
        Opt("run id of a new run; a resumed fit uses the id stored in its checkpoint instead"),
    ] = None
    log_config: Annotated[
        bool, Opt("the run's config (secrets redacted) becomes the W&B run config")
    ] = True
    background: Annotated[bool, Opt("call `wandb.log` on a background thread")] = True


def _build(
    cls: type[WandbCallback], options: WandbOptions, context: PluginContext
) -> WandbCallback:
    return cls(
        project=options.project,
        entity=options.entity,
        name=options.name,
        group=options.group,
        tags=options.tags,
        notes=options.notes,
        mode=options.mode,
        directory=resolve_path(options.dir, context.output_dir),
        run_id=options.id,
        log_config=options.log_config,
        background=options.background,
    )


@plugin("wandb", options=WandbOptions, build=_build)
class WandbCallback(MetricSink):
    """Logs due records to a W&B run; the run id survives checkpoints and resumes."""

    state_key: str | None = "wandb"

    def __init__(
        self,
        *,
        project: str | None = WandbOptions.project,
        entity: str | None = WandbOptions.entity,
        name: str | None = WandbOptions.name,
        group: str | None = WandbOptions.group,
        tags: Sequence[str] = (),
        notes: str | None = WandbOptions.notes,
        mode: _WandbMode | None = WandbOptions.mode,
        directory: str | Path = WandbOptions.dir,
        run_id: str | None = WandbOptions.id,
        log_config: bool = WandbOptions.log_config,
        background: bool = WandbOptions.background,
    ) -> None:
        _import_wandb()  # fail at construction, with the install hint, not mid-setup
        self.project = project
        self.entity = entity
        self.name = name
        self.group = group
        self.tags = tuple(tags)
        self.notes = notes
        self.mode: _WandbMode | None = mode
        self.directory = Path(directory)
        self.run_id = run_id
        self.log_config = log_config
        self.background = background
        self.run: Run | None = None
        self.finished = False
        self._worker: BackgroundWorker[Record] | None = None
        self._setup_failed = False
        self.init_settings: dict[str, object] = {}
        """``wandb.init`` keywords over the ones above (what the 2.0 ``WandbHook`` passes)."""
        self.step_from_record = True
        """``False``: a record's ``step`` is logged as a value and W&B counts the steps (the
        2.0 ``WandbHook``, whose events share no step)."""

    @property
    def closed(self) -> bool:
        return self.run is None

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        return {"run_id": self.run_id} if self.run_id is not None else {}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        run_id = state.get("run_id")
        if isinstance(run_id, str) and run_id:
            self.run_id = run_id

    # -- hooks --------------------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        import wandb  # present: __init__ checked it (with the install hint)

        directory = resolve_path(self.directory, trainer.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        run_config = trainer.run_config if self.log_config else None
        config = dict(run_config) if run_config is not None else None
        self._setup_failed = True  # until init returns: records are then dropped quietly
        try:
            run = self._init(wandb, directory, config)
        except Exception as exc:
            if _is_login_error(exc):
                raise RuntimeError(_LOGIN_HINT) from exc
            raise
        self._setup_failed = False
        self.run = run
        self.run_id = run.id
        self.finished = False
        if self.background:
            self._worker = BackgroundWorker("speedtronic-wandb", self._log, interval_s=0.1)

    def _init(self, wandb: ModuleType, directory: Path, config: dict[str, object] | None) -> Run:
        settings: dict[str, object] = dict(
            project=self.project,
            entity=self.entity,
            name=self.name,
            group=self.group,
            tags=list(self.tags) or None,
            notes=self.notes,
            mode=self.mode,
            dir=str(directory),
            id=self.run_id,
            resume="allow",
            config=config,
            # W&B's console capture wraps sys.stdout; the console/progress sinks own it.
            settings=wandb.Settings(console="off"),
        )
        settings.update(self.init_settings)
        run: Run = wandb.init(**settings)
        return run

    def _log(self, record: Record) -> None:
        run = self.run
        if run is None:
            raise RuntimeError("the wandb sink received a record before setup")
        if not self.step_from_record:
            run.log(dict(record))
            return
        step = int(record["step"])
        values: dict[str, object] = {}
        texts: dict[str, list[list[object]]] = {}
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, str):  # text (text_samples/0, ...): rows of a table per group
                group, _, name = key.rpartition("/")
                texts.setdefault(group or key, []).append([step, name or key, value])
            else:
                values[key] = value
        for group, rows in texts.items():
            values[group] = _import_wandb().Table(columns=["step", "key", "text"], data=rows)
        run.log(values, step=step)

    def write_record(self, trainer: TrainerView, record: Record) -> None:
        if self._setup_failed:
            return  # setup already reported why there is no W&B run
        if self._worker is not None:
            self._worker.submit(record)
        else:
            self._log(record)

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        if self._worker is not None:
            self._worker.drain()
        if self.run is not None and ctx.stop_reason is not None:
            self.run.summary["stop_reason"] = ctx.stop_reason

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        worker, self._worker = self._worker, None
        try:
            if worker is not None:
                worker.close()  # logs what is still queued (the run must be open for it)
        finally:
            run, self.run = self.run, None
            if run is not None:
                run.finish(exit_code=0 if ctx.error is None else 1)
                self.finished = True
