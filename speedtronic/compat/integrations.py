"""Hooks of the original API for W&B and TensorBoard (``MetricLogger(hooks=[...])``).

    logger = MetricLogger(hooks=[WandbHook(project="demo"), TensorboardHook("runs/tb")])

Both need the ``logging`` extra (``pip install 'speedtronic[logging]'``). Unlike the
original, ``WandbHook`` can be finished (``finish()``/``close()``), and both work as context
managers. New code should prefer the ``wandb`` and ``tensorboard`` sink callbacks, which
also resume runs and close themselves at teardown.

Neither hook writes on its own: each drives the sink callback of the same client, looked up
by name in the callback registry as any plugin is (``speedtronic`` never imports the
built-in callbacks), so W&B and TensorBoard are written in one place. A hook is the callback
set up once, outside a fit, in the working directory; each event becomes one record:
``WandbHook`` logs ``{**payload, "event": event}`` (W&B counts the steps: events share none),
``TensorboardHook`` writes every numeric value as the scalar ``<event>/<key>``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, cast

from typing_extensions import Self

from speedtronic.compat.metric_logger import Payload
from speedtronic.engine.contexts import FitContext, TeardownContext
from speedtronic.engine.metrics import MetricValue

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

    from speedtronic.engine.view import TrainerView

__all__ = ["TensorboardHook", "WandbHook"]

_INSTALL_HINT = "pip install 'speedtronic[logging]'"


class _Sink(Protocol):
    """What a hook uses of a metric sink callback (``speedtronic_callbacks.sink.MetricSink``)."""

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None: ...

    def write_record(self, trainer: TrainerView, record: Mapping[str, MetricValue]) -> None: ...

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None: ...


@dataclass
class _HookView:
    """The little of a trainer a sink reads at setup: paths resolve against the working
    directory, and there is no run config to log."""

    output_dir: Path = field(default_factory=Path.cwd)
    run_config: Mapping[str, object] | None = None


def _sink(plugin: str, /, **options: object) -> _Sink:
    """The sink callback ``plugin`` of the callback registry, built with ``options``."""
    from speedtronic.plugins import callback_registry

    build = cast(Callable[..., _Sink], callback_registry.get(plugin))
    return build(**options)


class _SinkHook:
    """A sink callback set up at construction and torn down by ``close``."""

    def __init__(self, sink: _Sink) -> None:
        self._view = cast("TrainerView", _HookView())
        self._sink: _Sink | None = sink
        sink.on_setup(self._view, FitContext(start_step=0, target_step=0))

    def _write(self, record: Mapping[str, MetricValue], what: str) -> None:
        if self._sink is None:
            raise RuntimeError(f"{type(self).__name__}.on_event after {what}()")
        self._sink.write_record(self._view, record)

    def close(self) -> None:
        """Release the client (idempotent)."""
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.on_teardown(self._view, TeardownContext(step=0, error=None))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


_WANDB_OPTIONS = {"name": "name", "entity": "entity", "group": "group", "notes": "notes"}
"""``wandb.init`` keywords that are the ``wandb`` callback's options of the same meaning."""


class WandbHook(_SinkHook):
    """Logs every event to a W&B run: ``run.log({**payload, "event": event})``.

    ``settings`` are passed to ``wandb.init`` unchanged (``mode``, ``dir``, ``name``, ...).
    """

    def __init__(self, project: str | None = None, **settings: object) -> None:
        try:
            import wandb  # noqa: F401 - the hint names the hook, not the callback
        except ImportError as exc:
            raise ImportError(f"WandbHook needs wandb: {_INSTALL_HINT}") from exc
        options = {
            key: settings.pop(given) for given, key in _WANDB_OPTIONS.items() if given in settings
        }
        sink = _sink("wandb", project=project, log_config=False, background=False, **options)
        # Exactly the original's wandb.init call: W&B's own defaults for what is not given.
        init = {"dir": None, "tags": None, "mode": None, "id": None, "resume": None}
        cast(_WandbSink, sink).init_settings.update({**init, "settings": None, **settings})
        cast(_WandbSink, sink).step_from_record = False
        super().__init__(sink)

    @property
    def run(self) -> Run | None:
        """The W&B run (``None`` once finished)."""
        return None if self._sink is None else cast(_WandbSink, self._sink).run

    def on_event(self, event: str, payload: Payload) -> None:
        self._write(cast(Mapping[str, MetricValue], {**payload, "event": event}), "finish")

    def finish(self) -> None:
        """Finish the W&B run (idempotent)."""
        self.close()


class _WandbSink(_Sink, Protocol):
    init_settings: dict[str, object]
    step_from_record: bool
    run: Run | None


class TensorboardHook(_SinkHook):
    """Writes every numeric payload value as the scalar ``<event>/<key>``.

    The TensorBoard step is the payload's integer ``step`` when it has one, else a per-event
    counter (so ``train_start``, ``train_end`` ... still get distinct points).
    """

    def __init__(self, log_dir: str | Path = "runs") -> None:
        try:
            import torch.utils.tensorboard  # noqa: F401 - the hint names the hook
        except ImportError as exc:
            raise ImportError(f"TensorboardHook needs tensorboard: {_INSTALL_HINT}") from exc
        self.log_dir = Path(log_dir)
        self._counters: dict[str, int] = {}
        super().__init__(_sink("tensorboard", log_dir=self.log_dir, log_config=False))

    def on_event(self, event: str, payload: Payload) -> None:
        step = payload.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            step = self._counters.get(event, 0)
            self._counters[event] = step + 1
        record: dict[str, MetricValue] = {"step": step}
        for key, value in payload.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                record[f"{event}/{key}"] = float(value)
        self._write(record, "close")

    def flush(self) -> None:
        if self._sink is not None:
            cast(_TensorBoardSink, self._sink).flush()


class _TensorBoardSink(_Sink, Protocol):
    def flush(self) -> None: ...
